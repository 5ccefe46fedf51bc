"""Pallas (Triton lowering) grouped matmuls for the routed experts of a sparse MoE block.

The (token, expert) pairs are sorted by expert and each expert's group is padded to a multiple of
a row block ``bm`` (:func:`route_blocks`); a table gives each row block its expert (``-1`` for the
blocks past the last used one, which exit at once). Two kernels run over a grid
``(output tile, row block)``, output tiles fastest so that the programs of one row block run
together and share its rows and expert through L2. Each program reads its expert id from the
table and that expert's weight tiles through a dynamic index into the whole ``[E, ...]`` array,
so no weight is copied:

1. gate/up: ``h[r, :] = silu(x[tok(r)] @ gate_e.T) * (x[tok(r)] @ up_e.T)`` (tokens gathered
   straight from ``x``), written in row-block order ``[R, I]``;
2. down: ``y[pair(r), :] = h[r] @ down_e.T`` stored straight back to the pair's own row of a
   ``[P + 1, H]`` output (row ``P`` takes the padding rows' writes and is dropped).

Every matmul accumulates in float32. The Triton lowering has no scalar prefetch, so the tables
are plain operands read inside the kernel. Grouped-GEMM layout as in MegaBlocks (Gale et al.,
2022, "block-sparse" expert computation) and vLLM's ``fused_moe`` (block-aligned sorting).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe.reference import check_moe_shapes


SORT_MIN_PAIRS = 32  # default tiles: one block per pair up to this many pairs, sorted above


class MoeTiles(NamedTuple):
    """Static tiling of the two kernels.

    ``bm``: rows per block (pairs of one expert); ``gu_bn``/``gu_bk``: gate/up output columns
    (of I, each program makes both gate and up) and contraction step (of H);
    ``dn_bn``/``dn_bk``: down output columns (of H) and contraction step (of I). All powers of
    two >= 16; ``gu_bn``, ``gu_bk``, ``dn_bn``, ``dn_bk`` must divide I, H, H, I.
    ``sort_pairs``: group the pairs by expert (:func:`route_blocks`), else one block per pair
    (:func:`route_pairs`, for decode).
    """
    bm: int
    gu_bn: int
    gu_bk: int
    dn_bn: int
    dn_bk: int
    num_warps: int = 4
    num_stages: int = 3
    sort_pairs: bool = True


def _pow2_divisor(dim: int, want: int) -> int:
    """Largest power of two <= ``want`` dividing ``dim`` (>= 16 when ``dim % 16 == 0``)."""
    t = want
    while t > 16 and dim % t:
        t //= 2
    return t


def default_tiles(num_pairs: int, num_experts: int, hidden: int, inter: int) -> MoeTiles:
    """Tiles by the mean rows per expert: few (decode/verify: weight-bandwidth bound, ``bm`` 16,
    narrow output tiles so that many programs stream weights; unsorted up to
    :data:`SORT_MIN_PAIRS` pairs) or many (prefill: compute bound, ``bm`` 64 or 128 with
    MMA-sized tiles). First guesses, to be retuned with ``python -m mtp_jax.bench moe --sweep``."""
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 24:
        return MoeTiles(16, _pow2_divisor(inter, 32), _pow2_divisor(hidden, 256),
                        _pow2_divisor(hidden, 64), _pow2_divisor(inter, 128), 4, 4,
                        sort_pairs=num_pairs > SORT_MIN_PAIRS)
    if rows_per_expert <= 96:
        return MoeTiles(64, _pow2_divisor(inter, 64), _pow2_divisor(hidden, 64),
                        _pow2_divisor(hidden, 128), _pow2_divisor(inter, 64), 4, 3)
    return MoeTiles(128, _pow2_divisor(inter, 64), _pow2_divisor(hidden, 64),
                    _pow2_divisor(hidden, 128), _pow2_divisor(inter, 64), 8, 3)


def num_row_blocks(num_pairs: int, num_experts: int, bm: int) -> int:
    """Static upper bound on the row blocks: with ``m = min(E, P)`` experts hit at most,
    ``sum_e ceil(c_e / bm) <= m + (P - m) // bm`` (each non-empty group wastes < 1 block)."""
    m = min(num_experts, num_pairs)
    return m + (num_pairs - m) // bm


def route_blocks(expert_ids: jax.Array, num_experts: int, bm: int) -> tuple[jax.Array, jax.Array]:
    """Block-aligned sort of the (token, expert) pairs.

    Args:
      expert_ids: ``[N, top_k]`` int, pair ``p = n * top_k + j`` goes to ``expert_ids[n, j]``.
      num_experts: E.
      bm: rows per block.
    Returns:
      ``block_expert [NB]`` int32: the expert of each row block, ``-1`` for unused blocks;
      ``row_pair [NB * bm]`` int32: the pair of each row, ``P`` for padding rows;
      with ``NB = num_row_blocks(P, E, bm)``. Expert e's pairs fill rows
      ``[pstart_e, pstart_e + c_e)`` in pair order, ``pstart`` the exclusive cumsum of the
      counts ``c`` rounded up to ``bm``.
    """
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    p = flat.shape[0]
    nb = num_row_blocks(p, num_experts, bm)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    start = jnp.cumsum(counts) - counts  # first sorted position of expert e
    padded = (counts + bm - 1) // bm * bm
    pend = jnp.cumsum(padded)
    pstart = pend - padded
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted position -> pair
    block_row = jnp.arange(nb, dtype=jnp.int32) * bm
    # searchsorted(pend, block_row, "right") by comparing all: one fusion, no while loop
    block_e = jnp.sum(pend[None, :] <= block_row[:, None], axis=1, dtype=jnp.int32)
    used = block_row < pend[-1]
    block_expert = jnp.where(used, block_e, -1)
    e_c = jnp.minimum(block_e, num_experts - 1)
    row = jnp.arange(nb * bm, dtype=jnp.int32)
    row_e = jnp.repeat(e_c, bm)
    off = row - pstart[row_e]
    real = jnp.repeat(used, bm) & (off < counts[row_e])
    sorted_pos = jnp.clip(start[row_e] + off, 0, p - 1)
    row_pair = jnp.where(real, order[sorted_pos], p)
    return block_expert, row_pair


def route_pairs(expert_ids: jax.Array, bm: int) -> tuple[jax.Array, jax.Array]:
    """One row block per pair, unsorted: ``block_expert [P]`` = the pairs' experts,
    ``row_pair [P * bm]`` = pair ``p`` at row ``p * bm``, ``P`` elsewhere. For very few pairs
    (decode) this skips the sort; an expert hit twice is then read twice (mostly from L2)."""
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    p = flat.shape[0]
    row = jnp.arange(p * bm, dtype=jnp.int32)
    return flat, jnp.where(row % bm == 0, row // bm, p)


def _dot_t(a, b):
    """``a [M, K] @ b[N, K].T`` in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _gate_up_kernel(block_expert_ref, row_pair_ref, x_ref, w_ref, h_ref, *, tiles: MoeTiles,
                    top_k: int, num_pairs: int, inter: int, hidden: int):
    j, b = pl.program_id(0), pl.program_id(1)
    e = block_expert_ref[b]
    bm, bn, bk = tiles.bm, tiles.gu_bn, tiles.gu_bk

    @pl.when(e >= 0)
    def _():
        pairs = row_pair_ref[pl.ds(b * bm, bm)]
        tok = jnp.minimum(pairs, num_pairs - 1) // top_k

        def step(kk, acc):
            acc_g, acc_u = acc
            k0 = pl.multiple_of(kk * bk, bk)
            xb = x_ref[tok, pl.ds(k0, bk)]
            wg = w_ref[e, pl.ds(j * bn, bn), pl.ds(k0, bk)]
            wu = w_ref[e, pl.ds(inter + j * bn, bn), pl.ds(k0, bk)]
            return acc_g + _dot_t(xb, wg), acc_u + _dot_t(xb, wu)

        zero = jnp.zeros((bm, bn), jnp.float32)
        g, u = jax.lax.fori_loop(0, hidden // bk, step, (zero, zero))
        h_ref[...] = (g / (1.0 + jnp.exp(-g)) * u).astype(h_ref.dtype)


def _down_kernel(block_expert_ref, row_pair_ref, h_ref, w_ref, y_ref, *, tiles: MoeTiles,
                 inter: int):
    j, b = pl.program_id(0), pl.program_id(1)
    e = block_expert_ref[b]
    bm, bn, bk = tiles.bm, tiles.dn_bn, tiles.dn_bk

    @pl.when(e >= 0)
    def _():
        pairs = row_pair_ref[pl.ds(b * bm, bm)]

        def step(kk, acc):
            k0 = pl.multiple_of(kk * bk, bk)
            hb = h_ref[pl.ds(b * bm, bm), pl.ds(k0, bk)]
            wd = w_ref[e, pl.ds(j * bn, bn), pl.ds(k0, bk)]
            return acc + _dot_t(hb, wd)

        acc = jax.lax.fori_loop(0, inter // bk, step, jnp.zeros((bm, bn), jnp.float32))
        y_ref[pairs, pl.ds(j * bn, bn)] = acc.astype(y_ref.dtype)


def check_tiles(tiles: MoeTiles, hidden: int, inter: int) -> None:
    """Raises ValueError naming the tile that does not fit ``H``/``I`` (Triton needs power-of-two
    blocks >= 16 that divide the dimension)."""
    for name, t, dim, dim_name in (("gu_bn", tiles.gu_bn, inter, "I"),
                                   ("gu_bk", tiles.gu_bk, hidden, "H"),
                                   ("dn_bn", tiles.dn_bn, hidden, "H"),
                                   ("dn_bk", tiles.dn_bk, inter, "I"),
                                   ("bm", tiles.bm, None, None)):
        if t < 16 or t & (t - 1) or (dim is not None and dim % t):
            where = f" dividing {dim_name}={dim}" if dim is not None else ""
            raise ValueError(f"MoE tile {name}={t} must be a power of two >= 16{where}; the "
                             "Pallas MoE needs H and I to be multiples of 16 (use backend='xla' "
                             "otherwise).")


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def moe_experts_pallas(x: jax.Array, expert_ids: jax.Array, gate_up: jax.Array, down: jax.Array,
                       *, tiles: MoeTiles | None = None, interpret: bool = False) -> jax.Array:
    """Routed SwiGLU experts with two Pallas grouped matmuls; see :func:`moe_experts_reference`.

    Args:
      x: ``[N, H]``; expert_ids: ``[N, top_k]`` int in ``[0, E)``; gate_up: ``[E, 2I, H]``;
      down: ``[E, H, I]``.
      tiles: static tiling, :func:`default_tiles` when None.
      interpret: run the kernels in the Pallas interpreter (CPU tests).
    Returns:
      ``[N, top_k, H]`` in ``x.dtype``.
    Raises:
      ValueError: on operand shapes that do not fit, or tiles that do not divide H and I.
    """
    n, top_k, num_experts, hidden, inter = check_moe_shapes(x, expert_ids, gate_up, down)
    p = n * top_k
    if tiles is None:
        tiles = default_tiles(p, num_experts, hidden, inter)
    check_tiles(tiles, hidden, inter)
    dtype = gate_up.dtype
    if tiles.sort_pairs:
        block_expert, row_pair = route_blocks(expert_ids, num_experts, tiles.bm)
    else:
        block_expert, row_pair = route_pairs(expert_ids, tiles.bm)
    nb = block_expert.shape[0]
    params = plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    whole = lambda a: pl.BlockSpec(a.shape, lambda j, b: (0,) * a.ndim)
    xw = x.astype(dtype)

    h = pl.pallas_call(
        functools.partial(_gate_up_kernel, tiles=tiles, top_k=top_k, num_pairs=p, inter=inter,
                          hidden=hidden),
        grid=(inter // tiles.gu_bn, nb),
        in_specs=[whole(block_expert), whole(row_pair), whole(xw), whole(gate_up)],
        out_specs=pl.BlockSpec((tiles.bm, tiles.gu_bn), lambda j, b: (b, j)),
        out_shape=jax.ShapeDtypeStruct((nb * tiles.bm, inter), dtype),
        compiler_params=params, interpret=interpret, name="moe_gate_up",
    )(block_expert, row_pair, xw, gate_up)

    y_shape = jax.ShapeDtypeStruct((p + 1, hidden), x.dtype)
    y = pl.pallas_call(
        functools.partial(_down_kernel, tiles=tiles, inter=inter),
        grid=(hidden // tiles.dn_bn, nb),
        in_specs=[whole(block_expert), whole(row_pair), whole(h), whole(down)],
        out_specs=pl.BlockSpec(y_shape.shape, lambda j, b: (0, 0)),
        out_shape=y_shape,
        compiler_params=params, interpret=interpret, name="moe_down",
    )(block_expert, row_pair, h, down)
    return y[:p].reshape(n, top_k, hidden)
