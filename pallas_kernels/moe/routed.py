"""Pallas (Triton lowering) MoE block for few tokens that routes inside its kernels: decode and
verify rows.

The XLA form of a decode step's MoE block runs the router (softmax, top-k) as a kernel of its own,
the chosen experts' gate/up and down as two gather-reduce fusions, the SwiGLU and the
routing-weighted sum as two more: on an H100 (Qwen3.6-35B-A3B shape, docs/benchmarks.md, session
60) the small kernels took about 5 us a layer beside the 20 us of expert reads, which streamed
at 70-74% of the bandwidth. These two kernels take the router logits instead of expert ids:

1. gate/up, grid ``(N S, I / gu_bn)`` with ``S = top_k`` (+1 with the shared expert): program
   ``(p, j)`` routes token ``n = p // S`` from its logits (:func:`_slot_route`: the ``s``-th
   largest softmax probability, ``s = p % S``, ties to the lower id, as
   :func:`~pallas_kernels.moe.router.route_topk`, its weight divided by the top-k's sum with
   ``normalize``; slot ``top_k`` is the shared expert, stored as expert ``E`` and weighted
   ``sigmoid(logits[n, E])``), streams gate rows ``[j gu_bn, (j+1) gu_bn)`` of that expert and
   the matching up rows in ``gu_bk``-wide steps of H against the token row (float32 FMAs into
   ``[gu_bn, gu_bk]`` accumulators, one sum at the end), and writes ``h[p, tile] = silu(gate) *
   up`` rounded to the weights' dtype; the programs ``(p, 0)`` also write the pair's expert id
   and weight;
2. down, grid ``(N, H / dn_bh)``: program ``(n, t)`` sums ``w_s * down_s[rows] . h[n S + s]``
   over token n's S slots (float32, ``dn_bk``-wide steps of I), rounded once to ``x.dtype``.

Routing costs each gate/up program a softmax and ``top_k`` max-scans over E values in registers
(E a power of two, at most :data:`MAX_EXPERTS`) before its weights stream: one row of logits,
no other HBM traffic, and no kernel of its own.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (check_moe_tiles, interpret_mode, pow2_step, whole,
                                    widest_tile)

F32 = jnp.float32
MAX_EXPERTS = 1024
TARGET_PROGRAMS = 256  # default tiles: about two programs per SM where the shape allows
STAGE_BYTES = 8192  # default contraction step: bytes of weights per row block and step


class RoutedTiles(NamedTuple):
    """Static tiling: ``gu_bn`` gate/up output columns per program (of I), ``gu_bk`` its step
    (of H), ``dn_bh`` down output columns per program (of H), ``dn_bk`` its step (of I); all
    powers of two dividing their dimension. ``num_warps`` / ``num_stages``: Triton launch."""
    gu_bn: int
    gu_bk: int
    dn_bh: int
    dn_bk: int
    num_warps: int = 4
    num_stages: int = 3


def routed_supported(num_experts: int, hidden: int, inter: int) -> bool:
    """Whether the kernels serve this shape: E a power of two up to :data:`MAX_EXPERTS` (the
    routing holds the logits in one block), H and I multiples of 8 (the smallest tile)."""
    return (num_experts & (num_experts - 1) == 0 and num_experts <= MAX_EXPERTS
            and hidden % 8 == 0 and inter % 8 == 0)


def default_routed_tiles(tokens: int, slots: int, hidden: int, inter: int,
                         itemsize: int = 2) -> RoutedTiles:
    """Output tiles as wide as :data:`TARGET_PROGRAMS` programs allow (up to 32 gate/up and 16
    down columns), steps of about :data:`STAGE_BYTES`. First guesses, to be retuned on the GPU
    (``python -m mtp_jax.bench ab`` with ``@pallas_kernels.moe.routed.TARGET_PROGRAMS=...``)."""
    gu_bn = widest_tile(inter, tokens * slots, TARGET_PROGRAMS, 8, 32)
    dn_bh = widest_tile(hidden, tokens, TARGET_PROGRAMS, 8, 16)
    step = lambda dim, width: pow2_step(dim, STAGE_BYTES // (width * itemsize), 64, 512, 8)
    return RoutedTiles(gu_bn, step(hidden, gu_bn), dn_bh, step(inter, dn_bh))


def check_routed_tiles(tiles: RoutedTiles, hidden: int, inter: int) -> None:
    """Raises ValueError naming the tile that is not a power of two >= 8 dividing its dim."""
    check_moe_tiles("routed MoE", tiles, hidden, inter, 8)


def _probs(logits_ref, n, num_experts: int):
    """Softmax of token n's first E logits, float32 ``[E]``, as the router computes it."""
    x = logits_ref[n, pl.ds(0, num_experts)].astype(F32)
    p = jnp.exp(x - jnp.max(x))
    return p / jnp.sum(p)


def _top(p, num_experts: int, top_k: int):
    """The ``top_k`` largest of ``p`` in descending order, ties to the lower id: lists of
    ``top_k`` scalar ids (int32) and probabilities (float32)."""
    expert = jax.lax.broadcasted_iota(jnp.int32, p.shape, 0)
    ids, probs = [], []
    for _ in range(top_k):
        best = jnp.max(p)
        pick = jnp.min(jnp.where(p == best, expert, num_experts))
        ids.append(pick)
        probs.append(best)
        p = jnp.where(expert == pick, -1.0, p)  # probabilities are >= 0: never picked again
    return ids, probs


def _slot_route(logits_ref, n, s, *, num_experts: int, top_k: int, normalize: bool,
                shared: bool):
    """Token n's slot s: ``(expert id int32, routing weight float32)`` scalars; slot
    ``top_k`` (with ``shared``) is the shared expert, id ``E``, weight
    ``sigmoid(logits[n, E])``."""
    ids, probs = _top(_probs(logits_ref, n, num_experts), num_experts, top_k)
    total = functools.reduce(jnp.add, probs) if normalize else 1.0
    e, w = jnp.int32(num_experts), jnp.float32(0.0)
    if shared:
        w = 1.0 / (1.0 + jnp.exp(-logits_ref[n, num_experts].astype(F32)))
    for i in range(top_k):
        e = jnp.where(s == i, ids[i], e)
        w = jnp.where(s == i, probs[i] / total, w)
    return e, w


def _gate_up_kernel(logits_ref, x_ref, w_ref, h_ref, ids_ref, wts_ref, *, slots: int,
                    top_k: int, num_experts: int, normalize: bool, inter: int, hidden: int,
                    bn: int, bk: int):
    p, j = pl.program_id(0), pl.program_id(1)
    n, s = jax.lax.div(p, slots), jax.lax.rem(p, slots)  # non-negative: floor = C division
    e, weight = _slot_route(logits_ref, n, s, num_experts=num_experts, top_k=top_k,
                            normalize=normalize, shared=slots > top_k)
    g0 = pl.multiple_of(j * bn, bn)

    @pl.when(j == 0)
    def _():  # the pair's expert and weight, for the down kernel
        ids_ref[p] = e
        wts_ref[p] = weight

    def step(kk, acc):
        acc_g, acc_u = acc
        k0 = pl.multiple_of(kk * bk, bk)
        xb = x_ref[n, pl.ds(k0, bk)].astype(w_ref.dtype).astype(F32)[None, :]
        wg = w_ref[e, pl.ds(g0, bn), pl.ds(k0, bk)].astype(F32)
        wu = w_ref[e, pl.ds(inter + g0, bn), pl.ds(k0, bk)].astype(F32)
        return acc_g + wg * xb, acc_u + wu * xb

    zero = jnp.zeros((bn, bk), F32)
    acc_g, acc_u = jax.lax.fori_loop(0, hidden // bk, step, (zero, zero))
    g, u = jnp.sum(acc_g, axis=1), jnp.sum(acc_u, axis=1)
    h_ref[...] = (g / (1.0 + jnp.exp(-g)) * u).astype(h_ref.dtype)


def _down_kernel(ids_ref, wts_ref, h_ref, w_ref, y_ref, *, slots: int, inter: int, bh: int,
                 bk: int):
    n, t = pl.program_id(0), pl.program_id(1)
    h0 = pl.multiple_of(t * bh, bh)
    out = jnp.zeros((bh,), F32)
    for s in range(slots):
        row = n * slots + s
        e = ids_ref[row]

        def step(kk, acc, e=e, row=row):
            c0 = pl.multiple_of(kk * bk, bk)
            hb = h_ref[row, pl.ds(c0, bk)].astype(F32)[None, :]
            return acc + w_ref[e, pl.ds(h0, bh), pl.ds(c0, bk)].astype(F32) * hb

        acc = jax.lax.fori_loop(0, inter // bk, step, jnp.zeros((bh, bk), F32))
        out = out + wts_ref[row] * jnp.sum(acc, axis=1)
    y_ref[...] = out.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("top_k", "num_experts", "normalize", "shared",
                                             "tiles", "interpret"))
def moe_routed_pallas(x: jax.Array, logits: jax.Array, gate_up: jax.Array, down: jax.Array, *,
                      top_k: int, num_experts: int, normalize: bool, shared: bool,
                      tiles: RoutedTiles | None = None, interpret: bool = False) -> jax.Array:
    """The two kernels; arguments and result as :func:`moe_routed` (no checks)."""
    n, hidden = x.shape
    inter = down.shape[-1]
    slots = top_k + int(shared)
    if tiles is None:
        tiles = default_routed_tiles(n, slots, hidden, inter, jnp.dtype(gate_up.dtype).itemsize)
    check_routed_tiles(tiles, hidden, inter)
    params = plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    pairs = n * slots
    h, ids, wts = pl.pallas_call(
        functools.partial(_gate_up_kernel, slots=slots, top_k=top_k, num_experts=num_experts,
                          normalize=normalize, inter=inter, hidden=hidden, bn=tiles.gu_bn,
                          bk=tiles.gu_bk),
        grid=(pairs, inter // tiles.gu_bn),
        in_specs=[whole(logits.shape), whole(x.shape), whole(gate_up.shape)],
        out_specs=[pl.BlockSpec((None, tiles.gu_bn), lambda i, j: (i, j)),
                   whole((pairs,)), whole((pairs,))],
        out_shape=[jax.ShapeDtypeStruct((pairs, inter), gate_up.dtype),
                   jax.ShapeDtypeStruct((pairs,), jnp.int32),
                   jax.ShapeDtypeStruct((pairs,), F32)],
        compiler_params=params, interpret=interpret, name="moe_routed_gate_up",
    )(logits, x, gate_up)
    return pl.pallas_call(
        functools.partial(_down_kernel, slots=slots, inter=inter, bh=tiles.dn_bh,
                          bk=tiles.dn_bk),
        grid=(n, hidden // tiles.dn_bh),
        in_specs=[whole(ids.shape), whole(wts.shape), whole(h.shape), whole(down.shape)],
        out_specs=pl.BlockSpec((None, tiles.dn_bh), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n, hidden), x.dtype),
        compiler_params=params, interpret=interpret, name="moe_routed_down",
    )(ids, wts, h, down)


def moe_routed(x: jax.Array, logits: jax.Array, gate_up: jax.Array, down: jax.Array, *,
               top_k: int, normalize: bool, shared: bool, tiles: RoutedTiles | None = None,
               interpret: bool | None = None) -> jax.Array:
    """A sparse MoE block's experts from its router logits, for few tokens:
    ``out[n] = sum_j w[n, j] expert_{ids[n, j]}(x[n])`` with ``(w, ids) = route_topk(logits[:,
    :E], top_k, normalize)`` (:mod:`pallas_kernels.moe.router`), plus, with ``shared``,
    ``sigmoid(logits[n, E]) expert_E(x[n])`` (the shared expert stored as expert E, HF
    ``shared_expert_gate``). Each expert is the SwiGLU of
    :func:`~pallas_kernels.moe.reference.moe_experts_reference`.

    Args:
      x: ``[N, H]``; logits: ``[N, W]`` router logits in the first E columns (any float dtype,
        used in float32), the shared gate in column E with ``shared`` (``W >= E + 1``);
        gate_up: ``[E', 2I, H]`` (gate rows first), down: ``[E', H, I]``, ``E' = E + 1`` with
        ``shared``, else ``E``.
      top_k: routed experts per token; normalize: divide their weights by their sum.
      tiles: static tiling (:func:`default_routed_tiles` when None).
      interpret: Pallas interpret mode (None: when the default device is not a GPU).
    Returns:
      ``[N, H]`` in ``x.dtype``: float32 sums, ``h`` rounded to the weights' dtype, the output
      rounded once.
    Raises:
      ValueError: shapes that do not fit together, ``top_k`` out of range, or a shape the
        kernels do not serve (:func:`routed_supported`).
    """
    n, hidden = x.shape
    stored, two_i, h2 = gate_up.shape
    num_experts = stored - int(shared)
    if h2 != hidden or down.shape != (stored, hidden, two_i // 2) or logits.shape[0] != n:
        raise ValueError(f"moe_routed: x {x.shape}, logits {logits.shape}, gate_up "
                         f"{gate_up.shape} and down {down.shape} do not fit together.")
    if logits.shape[1] < num_experts + int(shared):
        raise ValueError(f"moe_routed: logits {logits.shape} need {num_experts + int(shared)} "
                         f"columns ({num_experts} experts{' and the shared gate' * shared}).")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_routed: top_k={top_k} must be in [1, {num_experts}].")
    if not routed_supported(num_experts, hidden, two_i // 2):
        raise ValueError(f"moe_routed: {num_experts} experts, H={hidden}, I={two_i // 2}: the "
                         f"kernels need a power-of-two expert count up to {MAX_EXPERTS} and H, "
                         "I multiples of 8 (use the XLA form).")
    return moe_routed_pallas(x, logits, gate_up, down, top_k=top_k, num_experts=num_experts,
                             normalize=normalize, shared=shared, tiles=tiles,
                             interpret=interpret_mode(interpret))
