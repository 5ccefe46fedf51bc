"""Parameters of an nnx model by canonical name: the abstract model, its expected tensors,
filling it from arrays, and random weights (``--dummy-weight``).

Parameter paths are the canonical tensor names (``layers.3.self_attn.q_proj.weight``), so a
checkpoint reader's ``{name: array}`` fills a model name for name. Family-independent.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["param_name", "abstract_model", "expected_tensors", "fill_state", "random_arrays"]


def param_name(path) -> str:
    """The canonical name of an nnx state path (``("layers", 3, "mlp", ...)`` -> dotted)."""
    return ".".join(str(p) for p in path)


def abstract_model(build: Callable, cfg, dtype, with_mtp: bool):
    """``(graphdef, abstract state)`` of ``build(cfg, dtype, with_mtp)``, no memory allocated
    (``build``: a family's module constructor, :attr:`ModelEntry.build`)."""
    module = nnx.eval_shape(lambda: build(cfg, dtype, with_mtp))
    return nnx.split(module)


def expected_tensors(abstract_state) -> dict[str, tuple[tuple[int, ...], object]]:
    """Canonical name -> (shape, dtype) of every parameter."""
    return {param_name(p): (tuple(v.shape), v.dtype)
            for p, v in nnx.to_flat_state(abstract_state)}


def fill_state(abstract_state, arrays: dict[str, jax.Array]):
    """Replace every abstract parameter by ``arrays[name]``."""
    flat = [(p, v.replace(arrays[param_name(p)])) for p, v in nnx.to_flat_state(abstract_state)]
    return nnx.from_flat_state(flat)


def random_arrays(expected, seed: int = 0) -> dict[str, jax.Array]:
    """Random weights (``--dummy-weight``), drawn on the device one tensor at a time: matrices
    ``N(0, 1/fan_in)`` (embeddings ``N(0, 1)``), zero-centred norms ``N(0, 0.02)``, the GDN
    output norm ones, ``A_log = log U(1, 16)``, ``dt_bias ~ U(-1, 1) / 2``."""
    key = jax.random.key(seed)
    out = {}
    for i, (name, (shape, dtype)) in enumerate(sorted(expected.items())):
        k = jax.random.fold_in(key, i)
        if name.endswith("A_log"):
            a = jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0))
        elif name.endswith("dt_bias"):
            a = jax.random.uniform(k, shape, jnp.float32, -0.5, 0.5)
        elif name.endswith("linear_attn.norm.weight"):
            a = jnp.ones(shape, jnp.float32)
        elif len(shape) == 1:
            a = 0.02 * jax.random.normal(k, shape, jnp.float32)
        else:
            std = 1.0 if "embed_tokens" in name else shape[-1] ** -0.5
            a = std * jax.random.normal(k, shape, dtype)
        out[name] = a.astype(dtype)
    return out
