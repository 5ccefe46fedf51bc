"""MoE routing: softmax over the experts, the top-k of it, optionally renormalised to sum 1.

``p = softmax(logits)`` in float32; the ``top_k`` largest ``p`` in descending order (equal
values: the lower expert id first, as ``jax.lax.top_k``); with ``normalize`` the weights are
divided by their sum (HF ``Qwen3_5MoeSparseMoeBlock`` / ``Qwen3VLMoeTextTopKRouter``).

``backend="xla"`` is the reference (``jax.nn.softmax`` + ``jax.lax.top_k``, which XLA runs as
a softmax kernel, a copy and a sort per layer); ``"pallas"`` does all of it in one Triton
kernel, one program per token (the experts must be a power of two, at most 1024).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode

BACKENDS = ("xla", "pallas")
MAX_EXPERTS = 1024


def route_topk_reference(logits: jax.Array, top_k: int, normalize: bool):
    """XLA reference: ``logits [N, E]`` -> ``(weights [N, top_k] float32, ids [N, top_k] int32)``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def _router_kernel(logits_ref, w_ref, ids_ref, *, top_k: int, normalize: bool):
    """One token: ``logits [E]`` -> ``w [K]``, ``ids [K]`` (``K`` = top_k padded to a power of
    two; padded entries are weight 0, id 0)."""
    x = logits_ref[...].astype(jnp.float32)
    e = x.shape[0]
    p = jnp.exp(x - jnp.max(x))
    p = p / jnp.sum(p)
    expert = lax.broadcasted_iota(jnp.int32, (e,), 0)
    place = lax.broadcasted_iota(jnp.int32, w_ref.shape, 0)
    w = jnp.zeros(w_ref.shape, jnp.float32)
    ids = jnp.zeros(ids_ref.shape, jnp.int32)
    for i in range(top_k):
        best = jnp.max(p)
        pick = jnp.min(jnp.where(p == best, expert, e))
        w = jnp.where(place == i, best, w)
        ids = jnp.where(place == i, pick, ids)
        p = jnp.where(expert == pick, -1.0, p)  # probabilities are >= 0: never picked again
    if normalize:
        w = w / jnp.sum(w)
    w_ref[...] = w
    ids_ref[...] = ids


@functools.partial(jax.jit, static_argnames=("top_k", "normalize", "num_experts", "interpret"))
def route_topk_pallas(logits: jax.Array, top_k: int, normalize: bool, num_experts: int, *,
                      interpret: bool = False):
    """One-kernel routing; arguments and result as :func:`route_topk` (the kernel reads the
    first ``num_experts`` columns of ``logits`` in place)."""
    n, e = logits.shape[0], num_experts
    kp = 1 << max(top_k - 1, 0).bit_length()
    w, ids = pl.pallas_call(
        functools.partial(_router_kernel, top_k=top_k, normalize=normalize),
        grid=(n,),
        in_specs=[pl.BlockSpec((None, e), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((None, kp), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((n, kp), jnp.float32),
                   jax.ShapeDtypeStruct((n, kp), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=2 if e > 256 else 1, num_stages=1),
        interpret=interpret,
        name="moe_route_topk",
    )(logits)
    return w[:, :top_k], ids[:, :top_k]


def route_topk(logits: jax.Array, top_k: int, *, normalize: bool, backend: str = "xla",
               num_experts: int | None = None, interpret: bool | None = None):
    """Softmax routing of ``N`` tokens over ``E`` experts.

    Args:
      logits: ``[N, W]`` with the router logits in its first ``E`` columns (any float dtype;
        computed in float32). ``W > E`` lets the Pallas kernel read them in place from a merged
        projection's output (a slice passed to a kernel would be copied first).
      top_k: experts per token, ``1 <= top_k <= E``.
      normalize: divide the top-k weights by their sum (``norm_topk_prob``).
      backend: ``"xla"`` or ``"pallas"``.
      num_experts: ``E`` (default ``W``), at most ``W``.
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``(weights [N, top_k] float32, ids [N, top_k] int32)``, descending weights.
    Raises:
      ValueError: unknown backend, ``num_experts`` above ``W``, ``top_k`` out of range, or
        (pallas) ``E`` not a power of two or above :data:`MAX_EXPERTS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"route_topk: backend {backend!r} is unknown; use one of {BACKENDS}.")
    n, w = logits.shape
    e = w if num_experts is None else num_experts
    if not 1 <= e <= w:
        raise ValueError(f"route_topk: num_experts={e} must be in [1, {w}] (the logits' "
                         "columns).")
    if not 1 <= top_k <= e:
        raise ValueError(f"route_topk: top_k={top_k} must be in [1, {e}] (the expert count).")
    if backend == "xla":
        return route_topk_reference(logits[:, :e], top_k, normalize)
    if e & (e - 1) or e > MAX_EXPERTS:
        raise ValueError(f"route_topk: {e} experts; the Pallas router needs a power of two up "
                         f"to {MAX_EXPERTS} (use the XLA backend).")
    return route_topk_pallas(logits, top_k, normalize, e, interpret=interpret_mode(interpret))
