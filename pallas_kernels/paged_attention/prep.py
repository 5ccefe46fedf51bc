"""The steps between a gated-attention layer's merged q/k/v projection and the paged attention
kernel, as one Pallas (Triton lowering) kernel for the calls the attention kernel takes
(decode, verify, the 16-row prefill bucket).

Per row of a request, for each kv head (one program per (request, kv head, head row): the k/v
row or one of the ``group`` query rows):

* ``k = rope(k_norm(k))`` and ``v`` written into the layer's K/V pools at the row's slot
  (page ``page_table[b, pos // page_size]``, offset ``pos % page_size``; the trash page for an
  invalid row), in place;
* ``q = rope(q_norm(q))`` of the kv head's ``group`` query heads, written as the attention
  kernel's query rows ``[B, Hkv, rows, D]`` (row ``t * group + g``; the padded rows zero).

On a GPU XLA ran these as seven small kernels per attention layer (the q/k norms, the rotation
and its concatenation, a slice, another small fusion, the query padding and the two pool
writes; ``docs/benchmarks.md``, session 13). The arithmetic is that of the XLA path it
replaces, row for row: ``RMSNorm`` of HF ``Qwen3_5RMSNorm`` (float32 statistics, ``x / rms(x) *
(1 + w)``, rounded to the model dtype), then NeoX rotate-half RoPE on the first ``rotary_dim``
channels in float32, rounded again (:func:`mtp_jax.models.layers.rotary.apply_rotary`; ``cos``
and ``sin`` come in precomputed, from the caller's inverse frequencies and attention factor when
the model's RoPE is scaled). Sums of squares may be taken in another order than XLA's
(last-bit differences).

The merged projection's columns are ``[q_0 | gate_0 | q_1 | gate_1 | ... | k heads | v heads]``
(each ``D`` wide; HF ``q_proj`` holds the query and its output gate per head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode, whole
from pallas_kernels.paged_attention.pallas import padded_query_rows

F32 = jnp.float32
TRASH_PAGE = 0  # as mtp_jax.cache.paged: the page invalid rows write to


def _kernel(pos_ref, valid_ref, table_ref, qkv_ref, qw_ref, kw_ref, cos_ref, sin_ref,
            k_in_ref, v_in_ref, q_out_ref, k_out_ref, v_out_ref, *, t: int, group: int,
            rows: int, rotary_dim: int, eps: float, page_size: int, k_col: int, v_col: int,
            split_heads: bool):
    """One (request, kv head), or with ``split_heads`` one (request, kv head, head row): row
    ``j < group`` is query head ``h * group + j``, row ``group`` the kv head's K/V writes and
    the padding. ``k_in`` / ``v_in`` alias ``k_out`` / ``v_out`` (not read)."""
    del k_in_ref, v_in_ref
    bi, h = pl.program_id(0), pl.program_id(1)
    d = q_out_ref.shape[-1]
    dtype = q_out_ref.dtype
    max_pages = table_ref.shape[1]
    half = rotary_dim // 2
    col = jnp.arange(d, dtype=jnp.int32)
    in_rot = col < rotary_dim
    # Rotate-half partner of each channel, and the frequency it uses (channels past the
    # rotary ones pass through: partner = itself, cos and sin unused).
    partner = jnp.where(col < half, col + half, jnp.where(in_rot, col - half, col))
    freq = jnp.where(col < half, col, jnp.where(in_rot, col - half, 0))
    sign = jnp.where(col < half, -1.0, 1.0).astype(F32)
    qw, qwp = 1.0 + qw_ref[...].astype(F32), 1.0 + qw_ref[partner].astype(F32)
    kw, kwp = 1.0 + kw_ref[...].astype(F32), 1.0 + kw_ref[partner].astype(F32)
    cos_sin = [(cos_ref[bi, ti, freq], sin_ref[bi, ti, freq]) for ti in range(t)]

    def norm_rope(ti, base, w, wp):
        cos, sin = cos_sin[ti]
        x = qkv_ref[bi, ti, pl.ds(base, d)].astype(F32)
        xp = qkv_ref[bi, ti, base + partner].astype(F32)
        scale = jax.lax.rsqrt(jnp.sum(x * x) / d + eps)
        xn = (x * scale * w).astype(dtype).astype(F32)
        xpn = (xp * scale * wp).astype(dtype).astype(F32)
        return jnp.where(in_rot, xn * cos + sign * xpn * sin, xn).astype(dtype)

    def write_kv(ti):
        pos = pos_ref[bi, ti]
        k = norm_rope(ti, k_col + h * d, kw, kwp)
        v = qkv_ref[bi, ti, pl.ds(v_col + h * d, d)]
        valid = valid_ref[bi, ti] != 0
        page = table_ref[bi, jnp.clip(pos // page_size, 0, max_pages - 1)]
        page = jnp.where(valid, page, TRASH_PAGE)
        off = jnp.where(valid, pos % page_size, 0)
        k_out_ref[page, off, h, :] = k.astype(k_out_ref.dtype)
        v_out_ref[page, off, h, :] = v.astype(v_out_ref.dtype)

    def write_q(ti, g):
        q_col = (h * group + g) * 2 * d  # [query | gate] per head
        q_out_ref[bi, h, ti * group + g, :] = norm_rope(ti, q_col, qw, qwp)

    def write_padding():
        for r in range(t * group, rows):
            q_out_ref[bi, h, r, :] = jnp.zeros((d,), dtype)

    if not split_heads:
        for ti in range(t):
            write_kv(ti)
            for g in range(group):
                write_q(ti, g)
        write_padding()
        return
    j = pl.program_id(2)

    @pl.when(j == group)
    def _():
        for ti in range(t):
            write_kv(ti)
        write_padding()

    @pl.when(j < group)
    def _():
        for ti in range(t):
            write_q(ti, j)


def rope_tables(positions: jax.Array, rotary_dim: int, theta: float,
                inv_freq: jax.Array | None = None, attention_factor: float = 1.0):
    """``cos, sin [B, T, rotary_dim // 2]`` float32 at ``positions [B, T]``, computed as
    :func:`mtp_jax.models.layers.rotary.rope_cos_sin` computes them: from ``inv_freq
    [rotary_dim // 2]`` (float32 radians per position) when given, else plain RoPE's
    ``theta^(-2i / rotary_dim)``; both multiplied by ``attention_factor`` (YaRN's) unless 1."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim))
    angles = positions.astype(F32)[..., None] * inv_freq.astype(F32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def qk_norm_rope_write(qkv: jax.Array, q_norm_weight: jax.Array, k_norm_weight: jax.Array,
                       positions: jax.Array, valid: jax.Array, page_table: jax.Array,
                       k_pages: jax.Array, v_pages: jax.Array, *, num_heads: int,
                       rotary_dim: int, rope_theta: float, eps: float, rows: int,
                       split_heads: bool = True, interpret: bool | None = None,
                       inv_freq: jax.Array | None = None, attention_factor: float = 1.0):
    """q/k norms, RoPE and the K/V pool writes of a gated-attention layer in one kernel.

    Args:
      qkv: ``[B, T, 2 Hq D + 2 Hkv D]`` the merged q/k/v projection's output (model dtype).
      q_norm_weight, k_norm_weight: ``[D]`` zero-centred RMSNorm weights.
      positions: ``[B, T]`` int32 absolute positions; valid: ``[B, T]`` bool (an invalid row
        writes its K/V to the trash page).
      page_table: ``[B, max_pages]`` int32.
      k_pages, v_pages: ``[num_pages, page_size, Hkv, D]`` the layer's pools (updated in place
        when the caller donates them).
      num_heads: ``Hq``; rotary_dim, rope_theta: RoPE on the first ``rotary_dim`` channels;
      inv_freq, attention_factor: a scaled RoPE's ``[rotary_dim // 2]`` float32 inverse
        frequencies (replacing ``rope_theta``'s) and its cos/sin factor (:func:`rope_tables`);
      eps: the epsilon of both norms (the caller checks that q's and k's are equal).
      rows: query rows per kv head in the output, ``>= T * Hq / Hkv`` (the attention kernel's
        :func:`pallas_kernels.paged_attention.pallas.padded_query_rows`).
      split_heads: one program per (request, kv head, head row) (the default), or with
        False one per (request, kv head) doing its ``group + 1`` rows in turn; same results.
        On the H200 (the removed ``bench_small_kernels`` script, 2B layout, batch 1) the
        default took 1.64 us at T = 1 and 3.80 at T = 4, the other 3.79 and 11.54.
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``(q_rows [B, Hkv, rows, D] in qkv.dtype, k_pages, v_pages)``.
    Raises:
      ValueError: shapes that do not fit, or sizes the Triton lowering cannot express.
    """
    b, t, n = qkv.shape
    num_pages, page_size, hkv, d = k_pages.shape
    group = num_heads // max(hkv, 1)
    if (n != 2 * num_heads * d + 2 * hkv * d or num_heads % hkv or v_pages.shape != k_pages.shape
            or q_norm_weight.shape != (d,) or k_norm_weight.shape != (d,)
            or positions.shape != (b, t) or valid.shape != (b, t) or page_table.ndim != 2
            or page_table.shape[0] != b):
        raise ValueError(f"qk_norm_rope_write: qkv {qkv.shape}, pools {k_pages.shape} / "
                         f"{v_pages.shape}, norms {q_norm_weight.shape} / {k_norm_weight.shape}, "
                         f"positions {positions.shape}, valid {valid.shape}, page table "
                         f"{page_table.shape} do not fit Hq={num_heads} (qkv [B, T, 2 Hq D + "
                         "2 Hkv D], pools [P, page, Hkv, D], norms [D], positions and valid "
                         "[B, T], page table [B, W]).")
    if d & (d - 1) or rotary_dim & (rotary_dim - 1) or not 2 <= rotary_dim <= d:
        raise ValueError(f"qk_norm_rope_write: head_dim {d} and rotary_dim {rotary_dim} must be "
                         "powers of two with 2 <= rotary_dim <= head_dim for the Triton "
                         "lowering; use the XLA attention backend.")
    if rows < t * group:
        raise ValueError(f"qk_norm_rope_write: rows {rows} < T x group = {t} x {group}; pass "
                         f"padded_query_rows(T, group) = {padded_query_rows(t, group)}.")
    if inv_freq is not None and inv_freq.shape != (rotary_dim // 2,):
        raise ValueError(f"qk_norm_rope_write: inv_freq {inv_freq.shape} must be "
                         f"[rotary_dim // 2] = [{rotary_dim // 2}].")
    cos, sin = rope_tables(positions, rotary_dim, rope_theta, inv_freq, attention_factor)
    kernel = functools.partial(_kernel, t=t, group=group, rows=rows, rotary_dim=rotary_dim,
                               eps=float(eps), page_size=page_size, k_col=2 * num_heads * d,
                               v_col=2 * num_heads * d + hkv * d, split_heads=split_heads)
    args = (positions.astype(jnp.int32), valid.astype(jnp.int32), page_table.astype(jnp.int32),
            qkv, q_norm_weight, k_norm_weight, cos, sin, k_pages, v_pages)
    out_shape = [jax.ShapeDtypeStruct((b, hkv, rows, d), qkv.dtype),
                 jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)]
    return tuple(pl.pallas_call(
        kernel,
        grid=(b, hkv, group + 1) if split_heads else (b, hkv),
        in_specs=[whole(a.shape) for a in args],
        out_specs=[whole(o.shape) for o in out_shape],
        out_shape=out_shape,
        input_output_aliases={8: 1, 9: 2},
        compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret_mode(interpret),
        name="attention_qk_norm_rope_write",
    )(*args))
