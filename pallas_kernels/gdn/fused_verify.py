"""A GDN layer's verify window (``T`` rows per request) on a ring conv window, from the
in-projection on, as one Pallas (Triton lowering) kernel: causal conv + SiLU, the q/k L2
norms, the gates and the step-form recurrence, the pools only read.

It does what :func:`pallas_kernels.gdn.fused.gdn_conv_rows` (no ``length``) followed by
:func:`~pallas_kernels.gdn.fused.gdn_step` (``mode="verify"``) do, with the same formulas in
the same order (the conv summed tap by tap in float32 and rounded to the model dtype, then
:func:`~pallas_kernels.gdn.fused.l2`, :func:`~pallas_kernels.gdn.fused.gates` and
:func:`pallas_kernels.gdn.pallas.step`), minus one kernel launch per layer. It also returns
the conv rows, which the commit (:func:`~pallas_kernels.gdn.fused.gdn_step` with
``mode="commit"`` and ``ring``) applies without reading the window again, so that kernel can
write the window's new columns while no program reads it.

One program per (request, value head, value block), as in
:mod:`pallas_kernels.gdn.fused_decode`: it computes the conv of the channels it reads (its key
head's q and k, its value block) from the ring's ``K-1`` columns before ``start`` and the
window's earlier rows. Each program writes the conv rows of its value block; one program per
key head (value block 0 of the key head's first value head) writes the q/k rows.

With ``output_norm`` the layer's gated output norm (HF ``Qwen3_5RMSNormGated``) is folded in as
in the decode kernel: the last program of a (request, value head) to finish, counted in an
int32 ``sync`` scratch, reads the head's whole output rows and writes their norm in the model
dtype (:func:`~pallas_kernels.gdn.fused_decode.fold_output_norm`), which saves the norm's XLA
kernels after the verify.

Source of the formulas: HF transformers ``qwen3_5`` (``Qwen3_5GatedDeltaNet``), as in
:mod:`mtp_jax.models.layers.gdn`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import interpret_mode, next_pow2, whole
from pallas_kernels.gdn.fused import gates, l2, ring_ext, rows_out_spec, state_tile_spec
from pallas_kernels.gdn.fused_decode import (OutputNorm, check_output_norm, check_ring_inputs,
                                             fold_output_norm, ring_call)
from pallas_kernels.gdn.pallas import pad_rows, resolve_tiling, step

F32 = jnp.float32


def _conv_rows(qkv_ref, w_ref, win_ref, bi, slot, start, off, n: int, n_rows: int,
               kernel: int, dtype) -> list:
    """Conv + SiLU of channels ``off .. off+n`` for rows ``0 .. n_rows-1`` of request ``bi``
    (row 0 at position ``start``), each rounded to ``dtype``: a list of ``[n]`` arrays."""
    cs = pl.ds(off, n)
    cols = [win_ref[slot, cs, c].astype(F32) for c in range(kernel)]
    ext = ring_ext(cols, start) + [qkv_ref[bi, t, cs].astype(F32) for t in range(n_rows)]
    w = [w_ref[cs, i].astype(F32) for i in range(kernel)]
    out = []
    for t in range(n_rows):
        acc = ext[t] * w[0]
        for i in range(1, kernel):
            acc = acc + ext[t + i] * w[i]
        out.append(jax.nn.silu(acc).astype(dtype))
    return out


def _verify_kernel(slot_ref, keep_ref, start_ref, qkv_ref, w_ref, a_ref, b_ref, alog_ref,
                   dtb_ref, *refs, n_rows: int, n_out: int, hk: int, rep: int, dv: int,
                   kernel: int, a_col: int, b_col: int, norm: OutputNorm | None,
                   barrier: bool):
    """One (request, value head ``h``, value block ``j``); ``s_ref``: ``[S, Dk, bv]`` (this
    head's and block's column of the recurrent pool); ``conv_ref``: the whole ``[B, T, C]``
    conv output. Without ``norm``, ``o_ref`` is this program's ``[T, bv]`` of the output; with
    it, the whole ``[B, n_out, Hv, Dv]`` float32 output, and the last program of a (request,
    head) to finish writes the head's gated norm of the ``n_out`` rows to ``y_ref``
    (:func:`~pallas_kernels.gdn.fused_decode.fold_output_norm`)."""
    if norm is None:
        win_ref, s_ref, o_ref, conv_ref = refs
    else:
        nw_ref, win_ref, s_ref, _, o_ref, conv_ref, y_ref, sync_ref = refs
    bi, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, dk, bv = s_ref.shape
    slot, start = slot_ref[bi], start_ref[bi]
    kh = h // rep
    conv = functools.partial(_conv_rows, qkv_ref, w_ref, win_ref, bi, slot, start,
                             n_rows=n_rows, kernel=kernel, dtype=conv_ref.dtype)
    q_off, k_off = kh * dk, hk * dk + kh * dk
    v_off = pl.multiple_of(2 * hk * dk + h * dv + j * bv, bv)
    qs, ks, vs = conv(q_off, dk), conv(k_off, dk), conv(v_off, bv)
    for t in range(n_rows):
        conv_ref[bi, t, pl.ds(v_off, bv)] = vs[t]

    @pl.when((j == 0) & (h % rep == 0))  # one writer per key head's q/k channels
    def _():
        for t in range(n_rows):
            conv_ref[bi, t, pl.ds(q_off, dk)] = qs[t]
            conv_ref[bi, t, pl.ds(k_off, dk)] = ks[t]

    s = s_ref[slot]
    alog, dtb = alog_ref[h], dtb_ref[h]
    for t in range(n_out):  # the rows after them (padding) change no output
        q = l2(qs[t].astype(F32)) * (dk ** -0.5)
        k = l2(ks[t].astype(F32))
        g, beta = gates(a_ref[bi, t, a_col + h], b_ref[bi, t, b_col + h], alog, dtb,
                        keep_ref[bi, t] != 0)
        s = step(s, k, vs[t].astype(F32), g, beta)
        o = jnp.sum(s * q[:, None], axis=0)
        if norm is None:
            o_ref[t, :] = o
        else:
            o_ref[bi, t, h, pl.ds(pl.multiple_of(j * bv, bv), bv)] = o
    if norm is not None:
        fold_output_norm(o_ref, qkv_ref, nw_ref, y_ref, sync_ref, bi, h, n_rows=n_out,
                         n_blocks=dv // bv, norm=norm, barrier=barrier)


def gdn_verify_ring(qkv: jax.Array, weight: jax.Array, window: jax.Array, a: jax.Array,
                    b: jax.Array, a_log: jax.Array, dt_bias: jax.Array, valid: jax.Array,
                    state: jax.Array, slot: jax.Array, start: jax.Array, *, num_k_heads: int,
                    a_col: int = 0, b_col: int = 0, output_norm: OutputNorm | None = None,
                    norm_weight: jax.Array | None = None, sync: jax.Array | None = None,
                    block_v: int | None = None, num_warps: int | None = None,
                    interpret: bool | None = None):
    """A verify window of ``T`` rows per request: conv, norms, gates and recurrence from the
    slots' states, which it does not change (and optionally the gated output norm).

    Args:
      qkv: ``[B, T, N]``, the raw conv inputs in its first ``C = 2 Hk Dk + Hv Dv`` columns
        (``[q heads | k heads | v heads]``, model dtype); e.g. the merged in-projection's whole
        output, read in place (then also ``z`` at ``output_norm.z_col``).
      weight: ``[C, K]`` conv taps (``conv1d.weight[:, 0, :]``).
      window: ``[S, C, K]`` ring of raw inputs (position p in column p mod K).
      a, b: ``[B, T, N]`` holding the raw ``in_proj_a`` / ``in_proj_b`` outputs in the ``Hv``
        columns from ``a_col`` / ``b_col``.
      a_log, dt_bias: ``[Hv]``.
      valid: ``[B, T]`` bool; rows that are not valid get ``g = beta = 0`` (they leave the
        state as it is for the rows after them).
      state: ``[S, Hv, Dk, Dv]`` float32 recurrent pool.
      slot: ``[B]`` int32 rows of the pools.
      start: ``[B]`` int32 position of row 0 (tokens the slot's state has consumed).
      num_k_heads: ``Hk``; value head ``h`` reads key head ``h // (Hv / Hk)``.
      a_col, b_col: static column offsets of ``a`` and ``b``.
      output_norm: fold the gated output norm of every row in
        (:class:`~pallas_kernels.gdn.fused_decode.OutputNorm`); then ``norm_weight [Dv]`` (the
        norm's weight) and ``sync [B, Hv]`` int32 (zeros; the kernel leaves it zero, so one
        buffer can pass from layer to layer, and from :func:`gdn_decode_ring`'s) are needed.
      block_v, num_warps: tiling (default :func:`pallas_kernels.gdn.pallas.default_tiling`).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``(o [B, T, Hv, Dv] float32, conv [B, T, C] in qkv.dtype)``: the rows' outputs, and
      their conv + SiLU (what :func:`~pallas_kernels.gdn.fused.gdn_conv_rows` returns); with
      ``output_norm``, ``(y [B, T, Hv * Dv] in qkv.dtype, conv, sync)``, ``y`` the gated norm
      of the outputs (``sync`` aliases the input).
    Raises:
      ValueError: shapes that do not fit, sizes Triton cannot take, or (with ``output_norm``)
        a bad ``norm_weight``, ``sync``, ``output_norm.act`` or ``output_norm.z_col``.
    """
    check_ring_inputs("gdn_verify_ring", qkv, weight, window, a, b, a_log, dt_bias, valid,
                      state, slot, start, num_k_heads, a_col, b_col, one_row=False)
    bsz, t, _ = qkv.shape
    c = window.shape[1]
    _, hv, _, dv = state.shape
    block_v, num_warps = resolve_tiling("gdn_verify_ring", bsz, hv, dv, block_v, num_warps)
    if output_norm is not None:
        check_output_norm("gdn_verify_ring", qkv, norm_weight, sync, output_norm, hv, dv)
    tp = next_pow2(t)
    qkv, a, b = (pad_rows(x, tp) for x in (qkv, a, b))
    keep = pad_rows(valid.astype(jnp.int32), tp)
    state_spec = state_tile_spec(state, block_v)
    args = [slot.astype(jnp.int32), keep, start.astype(jnp.int32), qkv, weight, a, b,
            a_log.astype(F32), dt_bias.astype(F32)]
    in_specs = [whole((bsz,)), whole((bsz, tp)), whole((bsz,))]
    in_specs += [whole(x.shape) for x in (qkv, weight, a, b)]
    in_specs += [whole((hv,))] * 2
    conv_shape = jax.ShapeDtypeStruct((bsz, tp, c), qkv.dtype)
    if output_norm is None:
        n_out = tp
        out_specs = [rows_out_spec(tp, block_v), whole(conv_shape.shape)]
        out_shape = [jax.ShapeDtypeStruct((bsz, tp, hv, dv), F32), conv_shape]
    else:  # o: the whole [B, T, Hv, Dv] (the winner of a head reads its other blocks)
        n_out = t
        args.append(norm_weight)
        in_specs.append(whole((dv,)))
        out_shape = [jax.ShapeDtypeStruct((bsz, t, hv, dv), F32), conv_shape,
                     jax.ShapeDtypeStruct((bsz, t, hv * dv), qkv.dtype),
                     jax.ShapeDtypeStruct((bsz, hv), jnp.int32)]
        out_specs = [whole(o.shape) for o in out_shape]
    args += [window, state]
    in_specs += [whole(window.shape), state_spec]
    aliases = {}
    if output_norm is not None:
        aliases[len(args)] = 3
        args.append(sync)
        in_specs.append(whole(sync.shape))
    outs = ring_call(
        functools.partial(_verify_kernel, n_rows=tp, n_out=n_out, hk=num_k_heads,
                          rep=hv // num_k_heads, dv=dv, kernel=window.shape[-1], a_col=a_col,
                          b_col=b_col, norm=output_norm,
                          barrier=not interpret_mode(interpret)),
        "gdn_fused_verify_ring", output_norm, (bsz, hv, dv // block_v), in_specs, out_specs,
        out_shape, aliases, num_warps, interpret)(*args)
    if output_norm is None:
        o, conv = outs
        return o[:, :t], conv[:, :t]
    _, conv, y, sync = outs
    return y, conv[:, :t], sync
