"""pack/unpack: a batch pytree crosses to the device as one buffer, bit for bit."""

import jax
import numpy as np
import pytest

from mtp_jax.engine.packing import pack, unpack
from mtp_jax.sampling import SamplingTensors


def test_roundtrip_is_bitwise_for_every_leaf_dtype():
    rng = np.random.default_rng(0)
    f = rng.standard_normal(5).astype(np.float32)
    f[:3] = [np.nan, -0.0, np.inf]
    tree = {"f": f, "u": np.array([0, 2**32 - 1, 123456789], np.uint32),
            "i": rng.integers(-2**31, 2**31 - 1, (2, 3), dtype=np.int64).astype(np.int32),
            "b": np.array([True, False, True]), "empty": np.zeros((0, 4), np.int32),
            "s": SamplingTensors(np.float32([0.0, 0.7]), np.int32([-1, 5]),
                                 np.float32([1.0, 0.9]), np.uint32([7, 2**31 + 5]))}
    buf, spec = pack(tree)
    assert buf.dtype == np.int32 and buf.ndim == 1
    out = jax.jit(unpack, static_argnums=1)(buf, spec)
    flat_in = jax.tree_util.tree_leaves(tree)
    flat_out = jax.tree_util.tree_leaves(out)
    assert len(flat_in) == len(flat_out)
    for a, b in zip(flat_in, flat_out):
        b = np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    hash(spec)  # a static jit argument


def test_unsupported_dtype_names_it():
    with pytest.raises(ValueError, match="int64"):
        pack({"x": np.zeros(3, np.int64)})
