"""Pallas (Triton lowering) paged attention for decode and verify rows.

Flash-decoding over a paged KV cache (Dao et al., "Flash-Decoding for long-context inference",
2023; online softmax from Milakov & Gimelshein, 2018):

* one program per (request, kv head, key split). Its query block holds all ``T x group`` query
  rows of that kv head (T = 1 for decode, k+1 for verify), zero-padded to a power of two >= 16
  rows for ``jnp.dot``, so each K/V page block is read once per kv head;
* a request's keys are read only up to its largest query position (dynamic loop bound); the
  blocks of that range are cut into ``num_splits`` contiguous chunks, one per program, so that
  batch 1 and long contexts still fill the GPU;
* each program returns its unnormalised partial output with its running row max and sum (base
  2); a small XLA epilogue merges the splits with log-sum-exp weights.

Slots a row cannot see may hold garbage (never written, stale, or the trash page; even NaN or
inf). Their scores are replaced by a finite mask value, and V is zeroed where non-finite in the
blocks that hold any slot beyond the request's smallest query position, as in the reference.
Blocks entirely at or below that position are visible to every row and are taken as they are.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NUM_SMS = 132  # H200 streaming multiprocessors: one wave of programs
MAX_QUERY_ROWS = 128  # T x group after padding; more would not fit the registers of one program
_MASKED = -1e30  # finite, so masked scores never make inf - inf
_LOG2E = math.log2(math.e)


# Launch of the kernel by the page table's width, read when a program is traced (python -m
# mtp_jax.bench ab can set them: @module.NAME=int). Measured on an H100 (session 59, bench
# attention --grid, device time): one pipeline stage beat two at every case (a 64-key K + V
# block at D = 256 is 64 KiB of shared memory a stage, so one stage lets more programs share
# an SM), 4 warps beat 8 at 32 query rows a program, page ids read a step ahead gained 0-2%,
# and two heads per program lost everywhere. Tables of at least LONG_TABLE_KEYS keys (0 =
# never) also run half the splits (two programs per SM, not four): in a 128K-wide table
# (35B-A3B layout) a 128K-key decode went from 145.6 to 107.0 us, 32K from 60.6 to 36.7, 1,100
# from 18.0 to 11.8, a 4-row verify at 128K from 207.7 to 117.0; in tables as wide as the
# context, 2B 2K 15.6 -> 9.2 us, 27B 4K 16.9 -> 13.2, a 35B-A3B 4-row verify at 4K 21.7 ->
# 14.6 (batch 8: 64.7 -> 46.7).
SHORT_NUM_STAGES = 1
SHORT_PREFETCH_PAGES = 1
SHORT_FOUR_WARP_ROWS = 32  # query rows a program up to which it runs 4 warps (else 8)
LONG_TABLE_KEYS = 16384
LONG_NUM_STAGES = 1
LONG_HEADS_PER_PROGRAM = 1  # at most Hkv
LONG_PREFETCH_PAGES = 1
LONG_PROGRAMS_PER_SM = 2
LONG_FOUR_WARP_ROWS = 32


class Launch(NamedTuple):
    """Launch choices of the kernel that depend on the page table's width."""

    num_stages: int
    heads_per_program: int
    prefetch_pages: bool
    programs_per_sm: int  # of :func:`choose_num_splits`
    four_warp_rows: int  # query rows a program up to which it runs 4 warps, else 8


def default_launch(num_kv_heads: int, table_keys: int) -> Launch:
    """The :class:`Launch` for a page table of ``table_keys`` keys: the ``LONG_*`` values from
    ``LONG_TABLE_KEYS`` keys on, else the ``SHORT_*`` ones (one head per program, four
    programs per SM)."""
    if not LONG_TABLE_KEYS or table_keys < LONG_TABLE_KEYS:
        return Launch(SHORT_NUM_STAGES, 1, bool(SHORT_PREFETCH_PAGES), 4, SHORT_FOUR_WARP_ROWS)
    heads = max(1, min(LONG_HEADS_PER_PROGRAM, num_kv_heads))
    while num_kv_heads % heads:
        heads //= 2
    return Launch(LONG_NUM_STAGES, heads, bool(LONG_PREFETCH_PAGES), LONG_PROGRAMS_PER_SM,
                  LONG_FOUR_WARP_ROWS)


def padded_query_rows(t: int, group: int) -> int:
    """Query rows per kv head in the kernel: ``t * group`` padded to a power of two >= 16."""
    return 1 << (max(16, t * group) - 1).bit_length()


def choose_num_splits(batch: int, num_kv_heads: int, max_blocks: int, *,
                      num_sms: int = NUM_SMS, min_blocks_per_split: int | None = None,
                      slack: float = 1.05, programs_per_sm: int = 4) -> int:
    """Key splits per (request, kv head), chosen so that the programs fill whole waves.

    With ``programs_per_sm`` programs resident per SM, ``S`` splits of ``batch * num_kv_heads``
    pairs take ``ceil(pairs * S / (num_sms * programs_per_sm))`` waves of ``ceil(max_blocks /
    S)`` key blocks each (a split reads whole blocks, so 31 splits of 32 blocks take 2 blocks
    each, as 16 would). This returns the smallest ``S`` within ``slack`` of the least such
    time (waves x blocks), so that e.g. 192 programs (1.45 waves) are not chosen over 128.

    Args:
      batch, num_kv_heads: the (request, kv head) pairs, each one program per split.
      max_blocks: key blocks in the page table's width (the longest context it can hold).
      num_sms: streaming multiprocessors to fill.
      min_blocks_per_split: at a full table, each split reads at least this many blocks, which
        bounds the partial outputs written and merged relative to the K/V read. Default: 2,
        or 1 where the programs at 2 blocks each would leave SMs idle (``pairs * (max_blocks
        // 2) < num_sms``): there a program's 2 blocks, read one after the other, are the
        kernel's critical path. Measured on the H200 (session 22, ``python -m mtp_jax.bench ab``,
        Qwen3.5-2B decode, a 2,300-token table: 36 blocks of 64 keys, 1,036-2,060 tokens of
        context): batch 1 (2 pairs) 1.275-1.283 ms per step with 1 block per split (36
        splits) against 1.291-1.298 with 2 (18); batch 8 (16 pairs) 1.651-1.666 with 1 (32
        splits) against 1.632-1.647 with 2 (18).
      slack: accepted relative excess over the least time, in exchange for fewer splits.
      programs_per_sm: programs one SM runs at once; one program alone cannot keep enough
        loads in flight to saturate an SM's share of HBM (measured on the H200: one program per
        SM reached 0.45 of 4.2 TB/s at batch 32), so a wave counts this many per SM.
    Returns:
      an int in ``[1, max(1, max_blocks // min_blocks_per_split)]``.
    """
    pairs = batch * num_kv_heads
    if min_blocks_per_split is None:
        min_blocks_per_split = 1 if pairs * (max_blocks // 2) < num_sms else 2
    cap = max(1, max_blocks // min_blocks_per_split)
    slots = num_sms * programs_per_sm
    cost = [-(-pairs * s // slots) * -(-max_blocks // s) for s in range(1, cap + 1)]
    best = min(cost)
    return 1 + next(i for i, c in enumerate(cost) if c <= best * slack)


def _default_block_keys(page_size: int) -> int:
    return max(64, page_size)


def _kernel(q_ref, pos_ref, table_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
            page_size: int, pages_per_block: int, max_pages: int, num_splits: int,
            scale_log2: float, prefetch_pages: bool):
    """One (request, group of kv heads, split). Refs: q ``[G, R, D]``, pos ``[R]`` int32 row
    positions, table ``[W]`` int32 page ids, k/v ``[num_pages, page_size, G, D]``; out o
    ``[G, R, D]``, m/l ``[G, R]`` float32 (row max of the base-2 scores, sum of their exp2);
    with one head per program the head axis is squeezed out of every ref (q ``[R, D]``, k/v
    ``[num_pages, page_size, D]``, ...). The G heads' K/V rows of a block are read one after
    the other in the same step, so each page's bytes are read together (their rows
    interleave in the pool)."""
    split = pl.program_id(2)
    block_keys = page_size * pages_per_block
    one = q_ref.ndim == 2  # one head per program, its axis squeezed out
    heads, (rows, head_dim) = (1, q_ref.shape) if one else (q_ref.shape[0], q_ref.shape[1:])
    at = (lambda h: ...) if one else (lambda h: h)  # a ref's head index
    row_pos = pos_ref[...]
    max_pos = jnp.max(row_pos)
    min_pos = jnp.min(row_pos)
    # Pages that hold positions 0..max_pos (clamped to the table), in blocks of pages.
    num_pages = jnp.clip(max_pos // page_size + 1, 0, max_pages)
    num_blocks = (num_pages + pages_per_block - 1) // pages_per_block
    chunk = (num_blocks + num_splits - 1) // num_splits
    lo = split * chunk
    hi = jnp.maximum(jnp.minimum(lo + chunk, num_blocks), lo)
    # Blocks below `clean_end` hold only slots <= min_pos: visible to every row, never garbage.
    clean_end = jnp.clip((min_pos + 1) // block_keys, lo, hi)
    qs = [q_ref[at(h)] for h in range(heads)]
    last_block = (table_ref.shape[0] // pages_per_block) - 1

    def block_pages(j, clamp: bool = False):
        if clamp:  # a prefetch past the table reads its last block
            j = jnp.minimum(j, last_block)
        return table_ref[pl.ds(pl.multiple_of(j * pages_per_block, pages_per_block),
                               pages_per_block)]

    def body(j, carry, *, sanitize: bool):
        if prefetch_pages:  # this block's page ids came with the previous step
            pages, carry = carry[0], carry[1:]
            next_pages = block_pages(j + 1, clamp=True)
        else:
            pages = block_pages(j)
        out, visible = [], None
        for h in range(heads):
            acc, m_prev, l_prev = carry[3 * h:3 * h + 3]
            kv_at = pages if one else (pages, slice(None), h, slice(None))
            k = k_ref[kv_at].reshape(block_keys, head_dim)
            v = v_ref[kv_at].reshape(block_keys, head_dim)
            s = lax.dot_general(qs[h], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale_log2
            if visible is None:
                key_pos = j * block_keys + lax.broadcasted_iota(jnp.int32, (1, block_keys), 1)
                visible = key_pos <= row_pos[:, None]
            s = jnp.where(visible, s, _MASKED)
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
            alpha = jnp.exp2(m_prev - m_new)
            p = jnp.exp2(s - m_new[:, None])
            l_new = alpha * l_prev + jnp.sum(p, axis=1)
            if sanitize:
                v = jnp.where(jnp.isfinite(v), v, jnp.zeros_like(v))
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            out += [acc * alpha[:, None] + pv, m_new, l_new]
        return (next_pages, *out) if prefetch_pages else tuple(out)

    carry = ()
    for _ in range(heads):
        carry += (jnp.zeros((rows, head_dim), jnp.float32),
                  jnp.full((rows,), _MASKED, jnp.float32),
                  jnp.zeros((rows,), jnp.float32))
    if prefetch_pages:
        carry = (block_pages(lo, clamp=True), *carry)  # an empty split may start past it
    carry = lax.fori_loop(lo, clean_end, functools.partial(body, sanitize=False), carry)
    carry = lax.fori_loop(clean_end, hi, functools.partial(body, sanitize=True), carry)
    if prefetch_pages:
        carry = carry[1:]
    for h in range(heads):
        acc, m, l = carry[3 * h:3 * h + 3]
        o_ref[at(h)] = acc.astype(o_ref.dtype)
        m_ref[at(h)] = m
        l_ref[at(h)] = l


def _check(q, k_pages, v_pages, page_table, q_positions):
    if q.ndim != 4 or k_pages.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D] and k_pages [num_pages, page_size, Hkv, D]; "
                         f"got q {q.shape}, k_pages {k_pages.shape}.")
    b, t, hq, d = q.shape
    _, page_size, hkv, dk = k_pages.shape
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages {v_pages.shape} {v_pages.dtype} must match k_pages "
                         f"{k_pages.shape} {k_pages.dtype}.")
    if dk != d or hq % hkv:
        raise ValueError(f"q {q.shape} does not fit pages {k_pages.shape}: head_dim must match and "
                         f"Hq must be a multiple of Hkv.")
    if page_table.ndim != 2 or page_table.shape[0] != b or q_positions.shape != (b, t):
        raise ValueError(f"page_table must be [B={b}, max_pages] and q_positions [B={b}, T={t}]; "
                         f"got {page_table.shape} and {q_positions.shape}.")
    if d & (d - 1) or page_size & (page_size - 1):
        raise ValueError(f"head_dim {d} and page_size {page_size} must be powers of two for the "
                         f"Triton lowering.")
    rows = padded_query_rows(t, hq // hkv)
    if rows > MAX_QUERY_ROWS:
        raise ValueError(f"T x group = {t} x {hq // hkv} query rows per kv head pad to {rows} > "
                         f"{MAX_QUERY_ROWS}; use the reference (backend 'xla') for long chunks.")


def paged_attention_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, q_positions: jax.Array, *, scale: float,
                           block_keys: int | None = None, num_splits: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           heads_per_program: int | None = None,
                           prefetch_pages: bool | None = None,
                           interpret: bool = False) -> jax.Array:
    """Grouped-query paged attention for a few query rows per request (decode, verify).

    Same contract as :func:`pallas_kernels.paged_attention.reference.paged_attention_reference`:
    each query row attends the keys at positions ``<=`` its own; every row must see at least
    one key (position >= 0).

    Args:
      q: ``[B, T, Hq, D]`` roped queries; ``T x (Hq // Hkv)`` rows pad to at most 128.
      k_pages, v_pages: ``[num_pages, page_size, Hkv, D]`` one layer's pool; page_size and D
        powers of two. ``q`` is cast to their dtype for the matmuls.
      page_table: ``[B, max_pages]`` int32 page ids (each in ``[0, num_pages)``) in position
        order; entries past a request's pages are not read beyond the last key block.
      q_positions: ``[B, T]`` int32 absolute position of each query row.
      scale: softmax scale (``D ** -0.5``).
      block_keys: keys per loop step, a multiple of page_size (default ``max(64, page_size)``).
      num_splits: key splits per (request, group of ``heads_per_program`` kv heads) (default
        :func:`choose_num_splits`).
      num_warps, num_stages: Triton launch parameters (default: :func:`default_launch`).
      heads_per_program: kv heads one program attends (a power of two dividing Hkv): their
        rows of a page are read in the same step, where with 1 each program reads every
        Hkv-th row chunk of a page and the other heads' programs the rest, at other times.
      prefetch_pages: each loop step reads the next block's page ids, so that the K/V loads
        of a step do not wait for a page-id load first.
      interpret: run the kernel in the Pallas interpreter (CPU tests).
    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``; softmax in float32.
    Raises:
      ValueError: shapes that do not match, or sizes the Triton lowering cannot express.
    """
    _check(q, k_pages, v_pages, page_table, q_positions)
    b, t, hq, d = q.shape
    hkv = k_pages.shape[2]
    group = hq // hkv
    n_rows = t * group
    # Query rows of one kv head: row i is (t = i // group, head h * group + i % group).
    qr = q.reshape(b, t, hkv, group, d).transpose(0, 2, 1, 3, 4)
    qr = jnp.pad(qr.reshape(b, hkv, n_rows, d),
                 ((0, 0), (0, 0), (0, padded_query_rows(t, group) - n_rows), (0, 0)))
    return paged_attention_rows(qr, k_pages, v_pages, page_table, q_positions, num_q_heads=hq,
                                scale=scale, block_keys=block_keys, num_splits=num_splits,
                                num_warps=num_warps, num_stages=num_stages,
                                heads_per_program=heads_per_program,
                                prefetch_pages=prefetch_pages,
                                interpret=interpret).astype(q.dtype)


def paged_attention_partials(q_rows: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         page_table: jax.Array, q_positions: jax.Array, *, num_q_heads: int,
                         scale: float, block_keys: int | None = None,
                         num_splits: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, heads_per_program: int | None = None,
                         prefetch_pages: bool | None = None, interpret: bool = False):
    """The attention kernel's per-split partials for queries laid out as the kernel's rows
    (merge them with :func:`combine_splits`, or with the output gate by
    :func:`pallas_kernels.paged_attention.merge.merge_gate`).

    Args:
      q_rows: ``[B, Hkv, rows, D]`` roped queries (cast to the pools' dtype for the matmuls;
        the split partial outputs are kept in ``q_rows.dtype``); row ``t * group + g``
        is query head ``h * group + g`` of row ``t`` (``group = num_q_heads // Hkv``), rows
        past ``T * group`` padding (any finite values), ``rows`` =
        :func:`padded_query_rows` (e.g. written by
        :func:`pallas_kernels.paged_attention.prep.qk_norm_rope_write`).
      q_positions: ``[B, T]`` int32; other arguments as :func:`paged_attention_pallas`
        (``num_stages``, ``heads_per_program`` and ``prefetch_pages`` default to
        :func:`default_launch` of the table's width).
    Returns:
      ``(o, m, l)``: per key split ``S``, ``o [B, Hkv, S, rows, D]`` (``q_rows.dtype``) the
      unnormalised output, ``m`` and ``l [B, Hkv, S, rows]`` (float32) the row max and the
      row sum of the base-2 scores.
    Raises:
      ValueError: shapes that do not match, or sizes the Triton lowering cannot express.
    """
    b, hkv, rows, d = q_rows.shape
    t = q_positions.shape[1]
    group = num_q_heads // hkv
    n_rows = t * group
    _check(jax.ShapeDtypeStruct((b, t, num_q_heads, d), q_rows.dtype), k_pages, v_pages,
           page_table, q_positions)
    if rows != padded_query_rows(t, group):
        raise ValueError(f"q_rows has {rows} rows per kv head; T x group = {t} x {group} pad to "
                         f"{padded_query_rows(t, group)}.")
    num_pages, page_size, _, _ = k_pages.shape
    block_keys = block_keys or _default_block_keys(page_size)
    if block_keys % page_size or block_keys & (block_keys - 1):
        raise ValueError(f"block_keys {block_keys} must be a power of two and a multiple of "
                         f"page_size {page_size}.")
    pages_per_block = block_keys // page_size
    max_pages = page_table.shape[1]
    max_blocks = -(-max_pages // pages_per_block)
    launch = default_launch(hkv, max_pages * page_size)
    num_stages = launch.num_stages if num_stages is None else num_stages
    g = launch.heads_per_program if heads_per_program is None else heads_per_program
    prefetch_pages = launch.prefetch_pages if prefetch_pages is None else prefetch_pages
    if g < 1 or hkv % g or g & (g - 1):
        raise ValueError(f"heads_per_program {g} must be a power of two dividing Hkv = {hkv}.")
    splits = num_splits or choose_num_splits(b, hkv // g, max_blocks,
                                             programs_per_sm=launch.programs_per_sm)
    if num_warps is None:
        num_warps = 4 if rows <= launch.four_warp_rows else 8
    # Padded rows repeat the last real row's position, so they change neither bound.
    row_pos = jnp.pad(jnp.repeat(q_positions.astype(jnp.int32), group, axis=1),
                      ((0, 0), (0, rows - n_rows)), mode="edge")
    table = jnp.pad(page_table.astype(jnp.int32),
                    ((0, 0), (0, max_blocks * pages_per_block - max_pages)))

    kernel = functools.partial(_kernel, page_size=page_size, pages_per_block=pages_per_block,
                               max_pages=max_pages, num_splits=splits,
                               scale_log2=float(scale) * _LOG2E, prefetch_pages=prefetch_pages)
    h1 = None if g == 1 else g  # one head per program: its axis squeezed (the measured form)
    pages_spec = pl.BlockSpec((num_pages, page_size, h1, d), lambda i, h, s: (0, 0, h, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv // g, splits),
        in_specs=[
            pl.BlockSpec((None, h1, rows, d), lambda i, h, s: (i, h, 0, 0)),
            pl.BlockSpec((None, rows), lambda i, h, s: (i, 0)),
            pl.BlockSpec((None, table.shape[1]), lambda i, h, s: (i, 0)),
            pages_spec,
            pages_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, h1, None, rows, d), lambda i, h, s: (i, h, s, 0, 0)),
            pl.BlockSpec((None, h1, None, rows), lambda i, h, s: (i, h, s, 0)),
            pl.BlockSpec((None, h1, None, rows), lambda i, h, s: (i, h, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, splits, rows, d), q_rows.dtype),
            jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_r{rows}_bk{block_keys}",
    )(q_rows.astype(k_pages.dtype), row_pos, table, k_pages, v_pages)
    return o, m, l


def paged_attention_rows(q_rows: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         page_table: jax.Array, q_positions: jax.Array, *, num_q_heads: int,
                         **kwargs) -> jax.Array:
    """:func:`paged_attention_pallas` on queries already laid out as the kernel's rows: the
    partials of :func:`paged_attention_partials` (same arguments) merged by
    :func:`combine_splits`. Returns ``[B, T, num_q_heads, D]`` float32."""
    b, hkv, _, d = q_rows.shape
    t = q_positions.shape[1]
    group = num_q_heads // hkv
    o, m, l = paged_attention_partials(q_rows, k_pages, v_pages, page_table, q_positions,
                                       num_q_heads=num_q_heads, **kwargs)
    n_rows = t * group
    out = combine_splits(o[..., :n_rows, :], m[..., :n_rows], l[..., :n_rows])
    out = out.reshape(b, hkv, t, group, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, num_q_heads, d)


def combine_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge per-split partial softmax results (log-sum-exp weights, base 2).

    Args:
      o: ``[..., S, R, D]`` unnormalised partial outputs ``sum_j exp2(s_j - m) v_j``.
      m: ``[..., S, R]`` float32 row max of the base-2 scores (``-1e30`` for an empty split).
      l: ``[..., S, R]`` float32 ``sum_j exp2(s_j - m)`` (0 for an empty split).
    Returns:
      ``[..., R, D]`` float32 ``sum_s w_s o_s / sum_s w_s l_s`` with ``w_s = exp2(m_s - max m)``.
    """
    w = jnp.exp2(m - jnp.max(m, axis=-2, keepdims=True))
    num = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=-3)
    den = jnp.sum(w * l, axis=-2)
    return num / jnp.maximum(den, 1e-30)[..., None]
