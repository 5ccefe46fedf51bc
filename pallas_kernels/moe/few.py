"""Pallas (Triton lowering) routed experts for few (token, expert) pairs: decode and verify rows.

With few pairs each chosen expert serves one or two tokens, so the work is a matrix-vector
product per pair and the time is the expert weights read from HBM (3 H I elements per expert
hit). Two kernels stream them, one program per (pair or token, output tile):

1. gate/up, grid ``(P, I / gu_bn)``: program ``(p, j)`` reads pair p's expert id from a small
   int32 operand, uses it as a dynamic index into the whole ``gate_up [E, 2I, H]`` array (no
   copy, no scalar prefetch: the Triton lowering has none) and streams gate rows
   ``[j gu_bn, (j+1) gu_bn)`` and the matching up rows in ``gu_bk``-wide steps of H against the
   pair's token row; it writes ``h[p, tile] = silu(gate) * up`` rounded to the weights' dtype.
2. down, grid ``(R, H / dn_bh)``: program ``(r, t)`` streams rows ``[t dn_bh, (t+1) dn_bh)`` of
   ``down [E, H, I]`` in ``dn_bk``-wide steps of I against ``h``, for ``group`` pairs in one
   pipelined loop: per pair (``group = 1``, ``R = P``) or per token with the routing weights
   fused (``group = top_k``, ``R = N``: the weighted sum of the MoE block, no extra XLA pass).

Pairs are the fastest grid axis, so the programs that read one weight tile for different
tokens of the same expert run together and the second read comes from L2. Triton's ``dot``
needs operands of >= 16 rows: the one activation row is broadcast to 16 rows and row 0 of the
result kept; the waste is tensor-core work, idle in this bandwidth-bound kernel. Loads feeding a
``dot`` inside a loop are the ones Triton software-pipelines (``num_stages``). All products
accumulate in float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_moe_tiles, pow2_step, widest_tile
from pallas_kernels.moe.reference import check_moe_shapes

ROWS = 16  # rows of a dot operand: Triton's dot needs >= 16; one real row broadcast
TARGET_PROGRAMS = 256  # default tiles: about two programs per H200 SM (132) where possible
STAGE_BYTES = 16384  # default contraction step: bytes of weights per pipeline stage
MIN_STEP = 64  # contraction steps of >= 64 bf16 elements = whole 128-byte lines per row


class FewTiles(NamedTuple):
    """Static tiling of the few-pairs kernels.

    ``gu_bn``: gate/up output columns per program (of I; each program makes both gate and up);
    ``gu_bk``: its contraction step (of H); ``dn_bh``: down output columns per program (of H);
    ``dn_bk``: its contraction step (of I). All powers of two >= 16 dividing I, H, H, I.
    ``num_warps`` / ``num_stages``: Triton launch and software-pipelining depth.
    """
    gu_bn: int
    gu_bk: int
    dn_bh: int
    dn_bk: int
    num_warps: int = 4
    num_stages: int = 4


def few_supported(hidden: int, inter: int) -> bool:
    """Whether the kernels can tile ``H`` and ``I`` (both multiples of 16, else use XLA)."""
    return hidden % 16 == 0 and inter % 16 == 0


def default_few_tiles(num_pairs: int, down_rows: int, hidden: int, inter: int,
                      itemsize: int = 2) -> FewTiles:
    """Output tiles as wide as :data:`TARGET_PROGRAMS` programs allow (more programs than SMs
    keep enough loads in flight; wider tiles write fewer, longer rows), steps of ~16 KB of
    weights per stage. ``down_rows``: programs' rows of the down grid (P per pair, N with the
    weights fused). First guesses, to be retuned with ``python -m mtp_jax.bench moe --sweep``."""
    gu_bn = widest_tile(inter, num_pairs, TARGET_PROGRAMS, 16, 128)
    dn_bh = widest_tile(hidden, down_rows, TARGET_PROGRAMS, 16, 128)
    step = lambda dim, width, operands: pow2_step(  # ~STAGE_BYTES of weights per stage
        dim, STAGE_BYTES // (operands * width * itemsize), MIN_STEP, None, 16)
    return FewTiles(gu_bn, step(hidden, gu_bn, 2), dn_bh, step(inter, dn_bh, 1))


def check_few_tiles(tiles: FewTiles, hidden: int, inter: int) -> None:
    """Raises ValueError naming the tile that is not a power of two >= 16 dividing its dim."""
    check_moe_tiles("few-pairs MoE", tiles, hidden, inter, 16,
                    "; H and I must be multiples of 16 (use backend='xla' otherwise)")


def _dot_t(a, b):
    """``a [M, K] @ b[N, K].T`` in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _rows(v, dtype):
    """``[K]`` -> ``[ROWS, K]`` copies in ``dtype`` (a dot operand)."""
    return jnp.broadcast_to(v.astype(dtype)[None, :], (ROWS, v.shape[0]))


def _row0(acc):
    """Row 0 of ``[ROWS, n]`` as ``[n]`` (exact: the other rows are masked to zero)."""
    row = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    return jnp.sum(jnp.where(row == 0, acc, 0.0), axis=0)


def _gate_up_kernel(ids_ref, x_ref, w_ref, h_ref, *, top_k: int, inter: int, hidden: int,
                    bn: int, bk: int):
    p, j = pl.program_id(0), pl.program_id(1)
    e = ids_ref[p]
    tok = jax.lax.div(p, top_k)  # non-negative: C division = floor division
    g0 = pl.multiple_of(j * bn, bn)

    def step(kk, acc):
        acc_g, acc_u = acc
        k0 = pl.multiple_of(kk * bk, bk)
        xb = _rows(x_ref[tok, pl.ds(k0, bk)], w_ref.dtype)
        wg = w_ref[e, pl.ds(g0, bn), pl.ds(k0, bk)]
        wu = w_ref[e, pl.ds(inter + g0, bn), pl.ds(k0, bk)]
        return acc_g + _dot_t(xb, wg), acc_u + _dot_t(xb, wu)

    zero = jnp.zeros((ROWS, bn), jnp.float32)
    g, u = jax.lax.fori_loop(0, hidden // bk, step, (zero, zero))
    g, u = _row0(g), _row0(u)
    h_ref[...] = (g / (1.0 + jnp.exp(-g)) * u).astype(h_ref.dtype)


def _down_kernel(ids_ref, wts_ref, h_ref, w_ref, y_ref, *, group: int, inter: int, bh: int,
                 bk: int, weighted: bool):
    r, t = pl.program_id(0), pl.program_id(1)
    steps = inter // bk
    h0 = pl.multiple_of(t * bh, bh)

    def step(it, carry):
        acc, acc_p = carry  # the sum so far over pairs, the current pair's sum so far over I
        if steps == 1:
            p, c0, last = r * group + it, 0, True
        else:  # non-negative: C division and remainder = floor ones
            p = r * group + jax.lax.div(it, steps)
            c = jax.lax.rem(it, steps)
            c0, last = pl.multiple_of(c * bk, bk), c == steps - 1
        e = ids_ref[p]
        hb = _rows(h_ref[p, pl.ds(c0, bk)], w_ref.dtype)
        acc_p = acc_p + _dot_t(hb, w_ref[e, pl.ds(h0, bh), pl.ds(c0, bk)])
        # A pair's whole sum over I is weighted once, so the result does not depend on bk.
        done = acc_p * wts_ref[p] if weighted else acc_p
        if steps == 1:
            return acc + done, jnp.zeros_like(acc_p)
        return acc + jnp.where(last, done, 0.0), jnp.where(last, 0.0, acc_p)

    zero = jnp.zeros((ROWS, bh), jnp.float32)
    acc, _ = jax.lax.fori_loop(0, group * steps, step, (zero, zero))
    y_ref[...] = _row0(acc).astype(y_ref.dtype)


def few_gate_up(x: jax.Array, expert_ids: jax.Array, gate_up: jax.Array, tiles: FewTiles, *,
                interpret: bool = False) -> jax.Array:
    """``h [P, I]`` in ``gate_up.dtype``: ``silu(gate_e x) * (up_e x)`` per pair ``p = n top_k +
    j`` (``e = expert_ids[n, j]``), float32 sums rounded once. Shapes as in
    :func:`moe_experts_few`; no checks (callers check)."""
    n, top_k = expert_ids.shape
    hidden, inter = x.shape[1], gate_up.shape[1] // 2
    p = n * top_k
    ids = expert_ids.reshape(p).astype(jnp.int32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    return pl.pallas_call(
        functools.partial(_gate_up_kernel, top_k=top_k, inter=inter, hidden=hidden,
                          bn=tiles.gu_bn, bk=tiles.gu_bk),
        grid=(p, inter // tiles.gu_bn),
        in_specs=[whole(ids), whole(x), whole(gate_up)],
        out_specs=pl.BlockSpec((None, tiles.gu_bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((p, inter), gate_up.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                             num_stages=tiles.num_stages),
        interpret=interpret, name="moe_few_gate_up",
    )(ids, x, gate_up)


def few_down(h: jax.Array, expert_ids: jax.Array, down: jax.Array, weights: jax.Array | None,
             out_dtype, tiles: FewTiles, *, interpret: bool = False) -> jax.Array:
    """``down_e h`` per pair: ``[P, H]`` when ``weights`` is None, else the routing-weighted sum
    over each token's ``top_k`` pairs, ``[N, H]``; float32 sums, ``out_dtype``. ``h [P, I]``
    from :func:`few_gate_up`; ``weights [N, top_k]``. No checks (callers check)."""
    n, top_k = expert_ids.shape
    hidden, inter = down.shape[1], down.shape[2]
    p = n * top_k
    ids = expert_ids.reshape(p).astype(jnp.int32)
    weighted = weights is not None
    wts = (weights.reshape(p) if weighted else jnp.ones((p,), jnp.float32)).astype(jnp.float32)
    group = top_k if weighted else 1
    rows = p // group
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    return pl.pallas_call(
        functools.partial(_down_kernel, group=group, inter=inter, bh=tiles.dn_bh,
                          bk=tiles.dn_bk, weighted=weighted),
        grid=(rows, hidden // tiles.dn_bh),
        in_specs=[whole(ids), whole(wts), whole(h), whole(down)],
        out_specs=pl.BlockSpec((None, tiles.dn_bh), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, hidden), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                             num_stages=tiles.num_stages),
        interpret=interpret, name="moe_few_down",
    )(ids, wts, h, down)


def _prepare(x, expert_ids, gate_up, down, tiles, weighted):
    n, top_k, _, hidden, inter = check_moe_shapes(x, expert_ids, gate_up, down)
    if tiles is None:
        tiles = default_few_tiles(n * top_k, n if weighted else n * top_k, hidden, inter,
                                  jnp.dtype(gate_up.dtype).itemsize)
    check_few_tiles(tiles, hidden, inter)
    return tiles


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def moe_experts_few(x: jax.Array, expert_ids: jax.Array, gate_up: jax.Array, down: jax.Array,
                    *, tiles: FewTiles | None = None, interpret: bool = False) -> jax.Array:
    """Routed SwiGLU experts for few pairs, one output row per pair; see
    :func:`~pallas_kernels.moe.reference.moe_experts_reference`.

    Args:
      x: ``[N, H]``; expert_ids: ``[N, top_k]`` int in ``[0, E)``; gate_up: ``[E, 2I, H]`` (gate
      rows first); down: ``[E, H, I]``. Any N works; the kernels pay off while the pairs
      ``N top_k`` are about E or fewer (each pair's matvec reads its expert's weights).
      tiles: static tiling, :func:`default_few_tiles` when None.
      interpret: run the kernels in the Pallas interpreter (CPU tests).
    Returns:
      ``[N, top_k, H]`` in ``x.dtype`` (float32 accumulation, ``h`` rounded to the weights'
      dtype as in the reference).
    Raises:
      ValueError: operand shapes that do not fit, or tiles that do not divide H and I.
    """
    tiles = _prepare(x, expert_ids, gate_up, down, tiles, weighted=False)
    h = few_gate_up(x, expert_ids, gate_up, tiles, interpret=interpret)
    y = few_down(h, expert_ids, down, None, x.dtype, tiles, interpret=interpret)
    return y.reshape(expert_ids.shape + (x.shape[1],))


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def moe_experts_few_weighted(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                             gate_up: jax.Array, down: jax.Array, *,
                             tiles: FewTiles | None = None, interpret: bool = False) -> jax.Array:
    """The routed-experts output of a sparse MoE block for few pairs:
    ``out[n] = sum_j weights[n, j] * expert_{ids[n, j]}(x[n])``, the sum fused in the down
    kernel (float32, rounded once to ``x.dtype``; the per-pair form rounds each expert's output
    first).

    Args:
      weights: ``[N, top_k]`` routing weights (any float dtype, used in float32); the other
      arguments as in :func:`moe_experts_few`.
    Returns:
      ``[N, H]`` in ``x.dtype``.
    Raises:
      ValueError: operand shapes that do not fit (``weights`` must match ``expert_ids``), or
        tiles that do not divide H and I.
    """
    if weights.shape != expert_ids.shape:
        raise ValueError(f"weights {weights.shape} must have the shape of expert_ids "
                         f"{expert_ids.shape} (one routing weight per (token, expert) pair).")
    tiles = _prepare(x, expert_ids, gate_up, down, tiles, weighted=True)
    h = few_gate_up(x, expert_ids, gate_up, tiles, interpret=interpret)
    return few_down(h, expert_ids, down, weights, x.dtype, tiles, interpret=interpret)
