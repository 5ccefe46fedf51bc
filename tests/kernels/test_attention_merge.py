"""The split merge + output gate kernel (``pallas_kernels.paged_attention.merge``) against the
XLA path it replaces (``combine_splits``, the query-row layout, ``gated_output``'s rounding)
on random partials with an empty split, in interpret mode, by the Triton lowering at the
released head layouts, and compiled on the GPU (``-m gpu``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.merge import merge_gate
from pallas_kernels.paged_attention.pallas import combine_splits
from tests.helpers.triton_lowering import lower_for_cuda


def _case(seed, b, hkv, splits, rows, d, t, hq, dtype):
    rng = np.random.default_rng(seed)
    o = jnp.asarray(rng.standard_normal((b, hkv, splits, rows, d)), dtype)
    m = rng.standard_normal((b, hkv, splits, rows)).astype(np.float32) * 4
    l = (rng.random((b, hkv, splits, rows)) + 0.5).astype(np.float32)
    m[:, :, -1], l[:, :, -1] = -1e30, 0.0  # a split past the request's keys
    y = jnp.asarray(rng.standard_normal((b, t, 2 * hq * d + 2 * hkv * d)), dtype)
    return o, jnp.asarray(m), jnp.asarray(l), y


def _xla(o, m, l, y, t, hq):
    """The XLA path: merge, query rows -> heads, round, times round(sigmoid(gate))."""
    b, hkv, _, _, d = o.shape
    n = t * (hq // hkv)
    out = combine_splits(o[..., :n, :], m[..., :n], l[..., :n])
    out = out.reshape(b, hkv, t, hq // hkv, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq * d)
    gate = y[..., :2 * hq * d].reshape(b, t, hq, 2 * d)[..., d:].reshape(b, t, hq * d)
    out = out.astype(y.dtype)
    return out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(y.dtype)


@pytest.mark.parametrize("t,hq,hkv,dtype", [(1, 8, 2, jnp.bfloat16), (4, 8, 2, jnp.bfloat16),
                                            (3, 4, 4, jnp.float32)])
def test_matches_the_xla_path(t, hq, hkv, dtype):
    case = _case(t + hq, 3, hkv, 5, 16, 32, t, hq, dtype)
    got = np.asarray(merge_gate(*case, t=t, num_q_heads=hq, interpret=True), np.float32)
    want = np.asarray(_xla(*case, t, hq), np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    else:  # one rounding of the merged output may differ in its last bit
        np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=1e-3)
        assert np.mean(got == want) > 0.97


def test_refusals():
    o, m, l, y = _case(0, 1, 2, 3, 16, 32, 1, 8, jnp.float32)
    with pytest.raises(ValueError, match="do not fit t=5"):
        merge_gate(o, m, l, y, t=5, num_q_heads=8)
    with pytest.raises(ValueError, match="do not fit"):
        merge_gate(o, m[:, :, :2], l, y, t=1, num_q_heads=8)


@pytest.mark.parametrize("hq,hkv,t", [(8, 2, 1), (24, 4, 4), (16, 2, 4)])  # 2B, 27B, 35B-A3B
def test_lowers_to_triton(hq, hkv, t):
    case = _case(1, 2, hkv, 12, 16 if t * hq // hkv <= 16 else 32, 256, t, hq, jnp.bfloat16)
    text = lower_for_cuda(lambda *a: merge_gate(*a, t=t, num_q_heads=hq, interpret=False), *case)
    assert "attention_merge_gate" in text


@pytest.mark.gpu
def test_compiled_matches_the_xla_path_on_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    for hq, hkv, t, b in ((8, 2, 1, 1), (24, 4, 4, 8), (16, 2, 4, 32)):
        case = _case(2, b, hkv, 12, 16 if t * hq // hkv <= 16 else 32, 256, t, hq, jnp.bfloat16)
        got = np.asarray(merge_gate(*case, t=t, num_q_heads=hq), np.float32)
        want = np.asarray(jax.jit(_xla, static_argnums=(4, 5))(*case, t, hq), np.float32)
        np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=1e-3)
