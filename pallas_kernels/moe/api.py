"""Routed-experts entry point of the sparse MoE block; picks an implementation.

Backends: ``xla`` (runs anywhere) and ``pallas`` (Triton kernels, NVIDIA GPU; on other
platforms only with ``interpret=True``). Both return what
:func:`~pallas_kernels.moe.reference.moe_experts_reference` returns;
:func:`moe_experts_weighted` also sums each token's pairs with its routing weights.

The ``pallas`` backend has two kernels, split on the pairs ``P = N * top_k``:

* few pairs (decode, verify: ``P <= E * FEW_KERNEL_MAX_PAIRS_PER_EXPERT``): per-pair matvecs
  streaming the chosen experts' weights (:mod:`pallas_kernels.moe.few`); shapes whose H or I
  is not a multiple of 16 take the ``xla`` backend instead (the kernels' tiles are powers of
  two >= 16 dividing H and I);
* many pairs (prefill), or whenever grouped-matmul ``tiles`` are given: grouped matmuls over
  expert-aligned row blocks (:mod:`pallas_kernels.moe.pallas`).

The ``xla`` backend has two forms, split on the number of (token, expert) pairs ``P = N * top_k``:

* few pairs (decode, verify: ``P < E * FEW_PAIRS_PER_EXPERT``): each pair's matvec is written as
  gather-multiply-reduce over the stored weights, which XLA fuses into one reduction that reads
  each chosen expert's weights once, in place (no ``[P, 2I, H]`` gathered copy);
* many pairs (prefill): pairs in expert-aligned row blocks, each block's weights gathered for
  batched matmuls (:func:`moe_experts_xla_blocks`). The alternative
  :func:`moe_experts_xla_ragged` (``jax.lax.ragged_dot_general`` contracting the stored layouts
  directly, no transpose) is kept for comparison: where XLA rewrites ragged dot to a dense
  masked dot it does E times the FLOPs and materialises ``[E, P, H]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.few import (FewTiles, few_supported, moe_experts_few,
                                    moe_experts_few_weighted)
from pallas_kernels.moe.pallas import MoeTiles, default_tiles, moe_experts_pallas, route_blocks
from pallas_kernels.moe.reference import check_moe_shapes

BACKENDS = ("xla", "pallas")
FEW_PAIRS_PER_EXPERT = 1.0  # xla: gather-reduce form below E * this many pairs, blocks above
FEW_KERNEL_MAX_PAIRS_PER_EXPERT = 1.0  # pallas: few-pairs kernels up to E * this many pairs

# Contract lhs dim 1 (H or I) with the weights' last dim; lhs rows ragged over the experts.
_STORED_LAYOUT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def _swiglu(gu: jax.Array, inter: int) -> jax.Array:
    gate, up = gu[..., :inter], gu[..., inter:]
    return gate * jax.nn.sigmoid(gate) * up


def moe_experts_xla_few(x, expert_ids, gate_up, down) -> jax.Array:
    """Per-pair matvecs as fused gather-multiply-reduce; ``[N, top_k, H]`` in ``x.dtype``."""
    inter = down.shape[-1]
    xf = x.astype(gate_up.dtype).astype(jnp.float32)
    gu = jnp.sum(gate_up[expert_ids].astype(jnp.float32) * xf[:, None, None, :], axis=-1)
    h = _swiglu(gu, inter).astype(down.dtype).astype(jnp.float32)  # [N, k, I]
    y = jnp.sum(down[expert_ids].astype(jnp.float32) * h[:, :, None, :], axis=-1)
    return y.astype(x.dtype)


def moe_experts_xla_blocks(x, expert_ids, gate_up, down, bm: int | None = None) -> jax.Array:
    """Pairs in expert-aligned row blocks (:func:`route_blocks`); each block's expert weights are
    gathered (a copy: ``[NB, 2I, H]``) for two batched matmuls. ``[N, top_k, H]`` in
    ``x.dtype``. Its cost does not depend on how XLA lowers ``ragged_dot``."""
    n, top_k = expert_ids.shape
    num_experts, inter, hidden = gate_up.shape[0], down.shape[-1], x.shape[-1]
    p = n * top_k
    bm = bm or default_tiles(p, num_experts, hidden, inter).bm
    block_expert, row_pair = route_blocks(expert_ids, num_experts, bm)
    e = jnp.maximum(block_expert, 0)
    xs = x.astype(gate_up.dtype)[jnp.minimum(row_pair, p - 1) // top_k].reshape(-1, bm, hidden)
    gu = jnp.einsum("bmh,boh->bmo", xs, gate_up[e], preferred_element_type=jnp.float32)
    h = _swiglu(gu, inter).astype(down.dtype)
    y = jnp.einsum("bmi,bhi->bmh", h, down[e], preferred_element_type=jnp.float32)
    y = y.reshape(-1, hidden).astype(x.dtype)
    return jnp.zeros((p + 1, hidden), x.dtype).at[row_pair].set(y)[:p].reshape(n, top_k, hidden)


def moe_experts_xla_ragged(x, expert_ids, gate_up, down) -> jax.Array:
    """Pairs sorted by expert, two ``ragged_dot_general`` on the stored layouts;
    ``[N, top_k, H]`` in ``x.dtype``. Fast only where XLA lowers ragged dot natively (a dense
    rewrite does E times the work and materialises ``[E, P, H]``)."""
    n, top_k = expert_ids.shape
    num_experts, inter = gate_up.shape[0], down.shape[-1]
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    xs = x.astype(gate_up.dtype)[order // top_k]
    gu = jax.lax.ragged_dot_general(xs, gate_up, sizes, _STORED_LAYOUT,
                                    preferred_element_type=jnp.float32)
    h = _swiglu(gu, inter).astype(down.dtype)
    y = jax.lax.ragged_dot_general(h, down, sizes, _STORED_LAYOUT,
                                   preferred_element_type=jnp.float32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return y[inverse].astype(x.dtype).reshape(n, top_k, -1)


def _few_kernel(p: int, num_experts: int, hidden: int, inter: int, tiles) -> bool | None:
    """``pallas`` backend: True for the few-pairs kernels, None for the XLA escape (few pairs
    but H or I not a multiple of 16), False for the grouped kernels."""
    if tiles is not None or p > num_experts * FEW_KERNEL_MAX_PAIRS_PER_EXPERT:
        return False
    return True if few_supported(hidden, inter) else None


def moe_experts(x: jax.Array, expert_ids: jax.Array, gate_up: jax.Array, down: jax.Array, *,
                backend: str = "xla", tiles: MoeTiles | None = None,
                few_tiles: FewTiles | None = None, interpret: bool = False) -> jax.Array:
    """Routed SwiGLU experts, one output row per (token, expert) pair.

    Args:
      x: ``[N, H]``; expert_ids: ``[N, top_k]`` int in ``[0, E)``; gate_up: ``[E, 2I, H]`` (gate
      rows first); down: ``[E, H, I]`` (the HF checkpoint tensors as stored).
      backend: one of :data:`BACKENDS`.
      tiles: ``pallas`` only, grouped-matmul tiling; giving it forces the grouped kernels
        (default: by the pairs per expert).
      few_tiles: ``pallas`` only, tiling of the few-pairs kernels (default: by the pairs).
      interpret: ``pallas`` only, run in the Pallas interpreter (tests without a GPU).
    Returns:
      ``[N, top_k, H]`` in ``x.dtype`` (float32 accumulation).
    Raises:
      ValueError: unknown backend, operand shapes that do not fit together, or (Pallas's own
        error) ``pallas`` on a CPU without ``interpret``.
    """
    n, top_k, num_experts, hidden, inter = check_moe_shapes(x, expert_ids, gate_up, down)
    if backend == "pallas":
        few = _few_kernel(n * top_k, num_experts, hidden, inter, tiles)
        if few:
            return moe_experts_few(x, expert_ids, gate_up, down, tiles=few_tiles,
                                   interpret=interpret)
        if few is False:
            return moe_experts_pallas(x, expert_ids, gate_up, down, tiles=tiles,
                                      interpret=interpret)
        backend = "xla"
    if backend != "xla":
        raise ValueError(f"MoE backend {backend!r} is not available; use one of {BACKENDS}.")
    if expert_ids.size < gate_up.shape[0] * FEW_PAIRS_PER_EXPERT:
        return moe_experts_xla_few(x, expert_ids, gate_up, down)
    return moe_experts_xla_blocks(x, expert_ids, gate_up, down)


def moe_experts_weighted(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                         gate_up: jax.Array, down: jax.Array, *, backend: str = "xla",
                         tiles: MoeTiles | None = None, few_tiles: FewTiles | None = None,
                         interpret: bool = False) -> jax.Array:
    """Routed-experts output of a sparse MoE block: ``out[n] = sum_j weights[n, j] *
    expert_{ids[n, j]}(x[n])`` (HF ``Qwen3_5MoeExperts`` with its routing weights).

    Args:
      weights: ``[N, top_k]`` routing weights (used in float32); the rest as in
        :func:`moe_experts`.
    Returns:
      ``[N, H]`` in ``x.dtype``. The few-pairs kernels fuse the sum (float32, rounded once);
      the other paths round each pair's output to ``x.dtype`` first and sum in float32.
    Raises:
      ValueError: as :func:`moe_experts`, or ``weights`` not shaped like ``expert_ids``.
    """
    n, top_k, num_experts, hidden, inter = check_moe_shapes(x, expert_ids, gate_up, down)
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights {weights.shape} must have the shape of expert_ids "
                         f"{expert_ids.shape} (one routing weight per (token, expert) pair).")
    if backend == "pallas" and _few_kernel(n * top_k, num_experts, hidden, inter, tiles):
        return moe_experts_few_weighted(x, expert_ids, weights, gate_up, down, tiles=few_tiles,
                                        interpret=interpret)
    y = moe_experts(x, expert_ids, gate_up, down, backend=backend, tiles=tiles,
                    few_tiles=few_tiles, interpret=interpret)  # [N, top_k, H]
    out = jnp.sum(y.astype(jnp.float32) * weights.astype(jnp.float32)[..., None], axis=1)
    return out.astype(x.dtype)
