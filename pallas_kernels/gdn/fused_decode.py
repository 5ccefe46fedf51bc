"""A GDN layer's decode step (one row per request) from the in-projection on, as one Pallas
(Triton lowering) kernel: causal conv + SiLU, the q/k L2 norms, the gates and the step-form
recurrence, with the conv window and the recurrent state updated in place by slot.

It does what :func:`pallas_kernels.gdn.fused.gdn_conv_rows` (with ``length``) followed by
:func:`~pallas_kernels.gdn.fused.gdn_step` (``mode="decode"``) do, with the same formulas in
the same order (the conv summed tap by tap in float32 and rounded to the model dtype, then
:func:`~pallas_kernels.gdn.fused.l2` and :func:`pallas_kernels.gdn.pallas.step`), minus one
kernel launch and the conv output's round trip through memory. Being another kernel, it is
not promised bit for bit equal to them (the compiler may contract or order float32 operations
differently; the tests check a relative 1e-5), and the folded output norm (:class:`OutputNorm`,
also folded into the verify kernel) may take its mean in another order than XLA's fusion of
the unfolded norm. So a plain decode step and a verify of the same row can differ in the last
bits, as the one-row and multi-row projections already do.

One program per (request, value head, value block) computes the conv of the channels it reads:
its key head's q and k (shared with every other value block of the head and, with GQA, the
other value heads of the key head) and its value block. That is why the conv state must be a
**ring** (``[S, C, K]``, the input at position ``p`` in column ``p mod K``; see
:mod:`mtp_jax.models.layers.conv_state`): the step at ``p`` reads columns ``(p-K+1 .. p-1) mod
K`` and writes only column ``p mod K``, so one program's write can never reach another's read.
With a shift register every write would move columns that other programs still read.

Source of the formulas: HF transformers ``qwen3_5`` (``Qwen3_5GatedDeltaNet``), as in
:mod:`mtp_jax.models.layers.gdn`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode, whole
from pallas_kernels.gdn.fused import gates, l2, ring_ext, state_tile_spec
from pallas_kernels.gdn.pallas import resolve_tiling, step

F32 = jnp.float32


def _conv(qkv_ref, w_ref, win_ref, bi, slot, start, off: int | jax.Array, n: int, kernel: int,
          dtype):
    """Conv + SiLU of channels ``off .. off+n`` at the row of request ``bi`` (position
    ``start``), rounded to ``dtype``: ``(out [n] f32, raw input [n] in the window's dtype)``."""
    cs = pl.ds(off, n)
    cols = [win_ref[slot, cs, c].astype(F32) for c in range(kernel)]
    x = qkv_ref[bi, 0, cs]
    ext = ring_ext(cols, start) + [x.astype(F32)]
    acc = ext[0] * w_ref[cs, 0].astype(F32)
    for i in range(1, kernel):
        acc = acc + ext[i] * w_ref[cs, i].astype(F32)
    return jax.nn.silu(acc).astype(dtype).astype(F32), x.astype(win_ref.dtype)


@dataclasses.dataclass(frozen=True)
class OutputNorm:
    """The layer's gated output norm, ``norm(o) * weight * act(z)`` (HF ``Qwen3_5RMSNormGated``:
    RMSNorm without zero-centring, rounded to the model dtype, times the weight, times the
    gate's activation in float32, rounded again), folded into :func:`gdn_decode_ring` and
    :func:`pallas_kernels.gdn.fused_verify.gdn_verify_ring` (:func:`fold_output_norm`).

    z_col: static column of ``z`` (the ``in_proj_z`` output, ``Hv * Dv`` columns) in the array
    passed as ``qkv``; eps: the norm's epsilon; act: ``"silu"`` (Qwen3.5) or ``"sigmoid"``.
    """

    z_col: int
    eps: float
    act: str = "silu"


def _gated_norm(o, z, weight, norm: OutputNorm, dtype):
    """``o [Dv]`` f32, ``z [Dv]``, ``weight [Dv]`` -> the gated norm ``[Dv]`` in ``dtype``,
    rounded where :meth:`mtp_jax.models.layers.gdn.GatedDeltaNet._output` rounds."""
    y = (o * jax.lax.rsqrt(jnp.mean(o * o) + norm.eps)).astype(dtype)
    y = (y.astype(F32) * weight.astype(F32)).astype(dtype)
    z = z.astype(F32)
    act = jax.nn.sigmoid(z) if norm.act == "sigmoid" else jax.nn.silu(z)
    return (y.astype(F32) * act).astype(dtype)


def _decode_kernel(slot_ref, valid_ref, start_ref, qkv_ref, w_ref, a_ref, b_ref, alog_ref,
                   dtb_ref, *refs, hk: int, rep: int, dv: int, kernel: int, a_col: int,
                   b_col: int, norm: OutputNorm | None, barrier: bool):
    """One (request, value head ``h``, value block ``j``); ``s_ref``: ``[S, Dk, bv]`` (this
    head's and block's column of the recurrent pool). Without ``norm``, ``o_ref`` is this
    program's ``[bv]`` of the output; with it, the whole ``[B, 1, Hv, Dv]`` float32 output,
    and the last program of a (request, head) to finish (counted in ``sync_ref``) writes the
    head's gated norm to ``y_ref``."""
    if norm is None:
        win_ref, s_ref, o_ref, s_out, win_out = refs
    else:
        nw_ref, win_ref, s_ref, _, o_ref, s_out, win_out, y_ref, sync_ref = refs
    bi, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, dk, bv = s_ref.shape
    slot, start, valid = slot_ref[bi], start_ref[bi], valid_ref[bi] != 0
    kh = h // rep
    dtype = qkv_ref.dtype
    conv = functools.partial(_conv, qkv_ref, w_ref, win_ref, bi, slot, start, kernel=kernel,
                             dtype=dtype)
    q_off, k_off = kh * dk, hk * dk + kh * dk
    v_off = pl.multiple_of(2 * hk * dk + h * dv + j * bv, bv)
    q, q_raw = conv(q_off, dk)
    k, k_raw = conv(k_off, dk)
    v, v_raw = conv(v_off, bv)
    q, k = l2(q) * (dk ** -0.5), l2(k)
    g, beta = gates(a_ref[bi, 0, a_col + h], b_ref[bi, 0, b_col + h], alog_ref[h], dtb_ref[h],
                    valid)
    s = step(s_ref[slot], k, v, g, beta)
    o = jnp.sum(s * q[:, None], axis=0)
    s_out[slot] = s
    column = jax.lax.rem(start, kernel)  # the column this step's input goes to

    @pl.when(valid)
    def _():
        win_out[slot, pl.ds(v_off, bv), column] = v_raw

    @pl.when(valid & (j == 0) & (h % rep == 0))  # one writer per key head's q/k channels
    def _():
        win_out[slot, pl.ds(q_off, dk), column] = q_raw
        win_out[slot, pl.ds(k_off, dk), column] = k_raw

    if norm is None:
        o_ref[...] = o
        return
    o_ref[bi, 0, h, pl.ds(pl.multiple_of(j * bv, bv), bv)] = o
    fold_output_norm(o_ref, qkv_ref, nw_ref, y_ref, sync_ref, bi, h, n_rows=1,
                     n_blocks=dv // bv, norm=norm, barrier=barrier)


def fold_output_norm(o_ref, qkv_ref, nw_ref, y_ref, sync_ref, bi, h, *, n_rows: int,
                     n_blocks: int, norm: OutputNorm, barrier: bool) -> None:
    """The tail of a ring kernel's program ``(bi, h, j)`` that folds the output norm in, after
    it stored its value block of rows ``0 .. n_rows-1`` in ``o_ref [B, T, Hv, Dv]`` (float32,
    the whole output): the last of the head's ``n_blocks`` programs to arrive (counted in
    ``sync_ref [B, Hv]`` int32) writes the head's gated norm of those rows to ``y_ref [B, T,
    Hv * Dv]``, with ``z`` from ``qkv_ref [B, T, N]`` at ``norm.z_col + h * Dv`` and the
    weight ``nw_ref [Dv]``, and resets the counter to zero for the next call. ``barrier``:
    False in interpret mode, which runs the programs one after another."""
    # The barrier puts every thread's store before the counter's (acquire-release, GPU-scope)
    # increment, which one thread does; the winner's loads come after its acquire and are
    # volatile (not served from L1).
    if barrier:
        plgpu.debug_barrier()
    arrived = plgpu.atomic_add(sync_ref, (bi, h), jnp.ones((), jnp.int32))

    @pl.when(arrived == n_blocks - 1)
    def _():
        dv = o_ref.shape[-1]
        weight = nw_ref[...]
        for t in range(n_rows):
            o_head = plgpu.load(o_ref.at[bi, pl.ds(t, 1), h, :], volatile=True)[0]
            z = qkv_ref[bi, t, pl.ds(norm.z_col + h * dv, dv)]
            y_ref[bi, t, pl.ds(h * dv, dv)] = _gated_norm(o_head, z, weight, norm, y_ref.dtype)
        sync_ref[bi, h] = 0


def check_ring_inputs(caller: str, qkv, weight, window, a, b, a_log, dt_bias, valid, state,
                      slot, start, hk: int, a_col: int, b_col: int, one_row: bool) -> None:
    """The shape checks of the ring kernels (``gdn_decode_ring``, one row per request, and
    :func:`pallas_kernels.gdn.fused_verify.gdn_verify_ring`, ``T`` rows). Raises ValueError
    naming ``caller``, the argument and the shapes expected."""
    bsz, t, n = qkv.shape
    s, c, cols = window.shape
    kernel = weight.shape[-1]
    _, hv, dk, dv = state.shape
    rows = 1 if one_row else t
    r = "1" if one_row else "T"
    if cols != kernel:
        raise ValueError(f"{caller}: window {window.shape} has {cols} columns; this kernel "
                         f"needs a ring [S, C, K={kernel}] (a shift register of K-1 columns "
                         "takes gdn_conv_rows + gdn_step).")
    if n < c:
        raise ValueError(f"{caller}: qkv has {n} columns; the conv inputs need the first C = "
                         f"2*Hk*Dk + Hv*Dv = {c} (the window's channels).")
    want = {"qkv rows": (t, rows),
            "weight": (weight.shape, (c, kernel)), "A_log": (a_log.shape, (hv,)),
            "dt_bias": (dt_bias.shape, (hv,)), "valid": (valid.shape, (bsz, rows)),
            "slot": (slot.shape, (bsz,)), "start": (start.shape, (bsz,)),
            "state slots": (state.shape[0], s), "conv width": (c, 2 * hk * dk + hv * dv)}
    for name, (got, expected) in want.items():
        if got != expected:
            raise ValueError(f"{caller}: {name} is {got}, expected {expected} (qkv "
                             f"[B,{r},N>=C], weight [C,K], window [S,C,K] (a ring), a/b "
                             f"[B,{r},N], A_log/dt_bias [Hv], valid [B,{r}], state "
                             "[S,Hv,Dk,Dv], slot and start [B], C = 2*Hk*Dk + Hv*Dv).")
    for name, x, col in (("a", a, a_col), ("b", b, b_col)):
        if x.ndim != 3 or x.shape[:2] != (bsz, rows) or col < 0 or x.shape[2] < col + hv:
            raise ValueError(f"{caller}: {name} has shape {x.shape} with {name}_col={col}; it "
                             f"must be [B={bsz}, {rows}, N] holding Hv={hv} columns from "
                             f"{name}_col.")
    if hv % hk or dk & (dk - 1) or state.dtype != F32:
        raise ValueError(f"{caller}: Hv={hv} must be a multiple of Hk={hk}, Dk={dk} a power of "
                         f"two and the state float32 (got {state.dtype}); use the XLA "
                         "backend.")


def gdn_decode_ring(qkv: jax.Array, weight: jax.Array, window: jax.Array, a: jax.Array,
                    b: jax.Array, a_log: jax.Array, dt_bias: jax.Array, valid: jax.Array,
                    state: jax.Array, slot: jax.Array, start: jax.Array, *, num_k_heads: int,
                    a_col: int = 0, b_col: int = 0, output_norm: OutputNorm | None = None,
                    norm_weight: jax.Array | None = None, sync: jax.Array | None = None,
                    block_v: int | None = None, num_warps: int | None = None,
                    interpret: bool | None = None):
    """One decode row per request: conv, norms, gates and recurrence (and optionally the gated
    output norm); both pools in place.

    Args:
      qkv: ``[B, 1, N]``, the raw conv inputs in its first ``C = 2 Hk Dk + Hv Dv`` columns
        (``[q heads | k heads | v heads]``, model dtype); e.g. the merged in-projection's whole
        output, read in place (then also ``z`` at ``output_norm.z_col``).
      weight: ``[C, K]`` conv taps (``conv1d.weight[:, 0, :]``).
      window: ``[S, C, K]`` ring of raw inputs (position p in column p mod K).
      a, b: ``[B, 1, N]`` holding the raw ``in_proj_a`` / ``in_proj_b`` outputs in the ``Hv``
        columns from ``a_col`` / ``b_col``.
      a_log, dt_bias: ``[Hv]``.
      valid: ``[B, 1]`` bool; an invalid row (padding) leaves both pools unchanged
        (``g = beta = 0``, no window write).
      state: ``[S, Hv, Dk, Dv]`` float32 recurrent pool.
      slot: ``[B]`` int32 rows of the pools; a live slot appears once.
      start: ``[B]`` int32 position of the row (tokens the slot's state has consumed).
      num_k_heads: ``Hk``; value head ``h`` reads key head ``h // (Hv / Hk)``.
      a_col, b_col: static column offsets of ``a`` and ``b``.
      output_norm: fold the gated output norm in (:class:`OutputNorm`); then ``norm_weight
        [Dv]`` (the norm's weight) and ``sync [B, Hv]`` int32 (zeros; the kernel leaves it
        zero, so one buffer can pass from layer to layer) are needed.
      block_v, num_warps: tiling (default :func:`pallas_kernels.gdn.pallas.default_tiling`).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``(o [B, 1, Hv, Dv] float32, new state pool, new window pool)``, or with
      ``output_norm`` ``(y [B, 1, Hv * Dv] in qkv.dtype, new state pool, new window pool,
      sync)``; the pools alias the inputs (updated in place when the caller donates them).
    Raises:
      ValueError: shapes that do not fit, or sizes Triton cannot take.
    """
    check_ring_inputs("gdn_decode_ring", qkv, weight, window, a, b, a_log, dt_bias, valid,
                      state, slot, start, num_k_heads, a_col, b_col, one_row=True)
    bsz = qkv.shape[0]
    _, hv, _, dv = state.shape
    block_v, num_warps = resolve_tiling("gdn_decode_ring", bsz, hv, dv, block_v, num_warps)
    state_spec = state_tile_spec(state, block_v)
    o_shape = jax.ShapeDtypeStruct((bsz, 1, hv, dv), F32)
    args = [slot.astype(jnp.int32), valid.reshape(bsz).astype(jnp.int32),
            start.astype(jnp.int32), qkv, weight, a, b, a_log.astype(F32), dt_bias.astype(F32)]
    in_specs = [whole((bsz,))] * 3 + [whole(x.shape) for x in (qkv, weight, a, b)]
    in_specs += [whole((hv,))] * 2
    out_shape = [o_shape, jax.ShapeDtypeStruct(state.shape, F32),
                 jax.ShapeDtypeStruct(window.shape, window.dtype)]
    if output_norm is None:
        out_specs = [pl.BlockSpec((None, None, None, block_v), lambda i, h, j: (i, 0, h, j))]
    else:
        check_output_norm("gdn_decode_ring", qkv, norm_weight, sync, output_norm, hv, dv)
        args.append(norm_weight)
        in_specs.append(whole((dv,)))
        out_specs = [whole(o_shape.shape)]
        out_shape += [jax.ShapeDtypeStruct((bsz, 1, hv * dv), qkv.dtype),
                      jax.ShapeDtypeStruct((bsz, hv), jnp.int32)]
    n = len(args)
    args += [window, state]
    in_specs += [whole(window.shape), state_spec]
    out_specs += [state_spec, whole(window.shape)]
    aliases = {n + 1: 1, n: 2}
    if output_norm is not None:
        args.append(sync)
        in_specs.append(whole(sync.shape))
        out_specs += [whole(out_shape[3].shape), whole(sync.shape)]
        aliases[n + 2] = 4
    outs = ring_call(
        functools.partial(_decode_kernel, hk=num_k_heads, rep=hv // num_k_heads, dv=dv,
                          kernel=window.shape[-1], a_col=a_col, b_col=b_col, norm=output_norm,
                          barrier=not interpret_mode(interpret)),
        "gdn_fused_decode_ring", output_norm, (bsz, hv, dv // block_v), in_specs, out_specs,
        out_shape, aliases, num_warps, interpret)(*args)
    if output_norm is None:
        return tuple(outs)
    _, state, window, y, sync = outs
    return y, state, window, sync


def ring_call(kernel, name: str, norm: OutputNorm | None, grid: tuple, in_specs, out_specs,
              out_shape, aliases: dict, num_warps: int, interpret: bool | None):
    """The ``pl.pallas_call`` of a ring kernel (one program per request, value head and value
    block; Triton, one stage), named ``name`` plus ``_norm`` with a folded output norm."""
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret_mode(interpret), name=name + ("_norm" if norm is not None else ""))


def check_output_norm(caller: str, qkv, norm_weight, sync, norm: OutputNorm, hv: int,
                      dv: int) -> None:
    """The checks of a ring kernel's folded output norm (``qkv [B, T, N]``, ``T`` rows per
    request): ``norm.act``, ``norm_weight [Dv]``, ``sync [B, Hv]`` int32 and ``z``'s ``Hv *
    Dv`` columns from ``norm.z_col`` inside ``qkv``. Raises ValueError naming ``caller`` and
    the argument."""
    bsz, _, n = qkv.shape
    if norm.act not in ("silu", "sigmoid"):
        raise ValueError(f"{caller}: output_norm.act {norm.act!r} must be 'silu' or "
                         "'sigmoid'.")
    if norm_weight is None or norm_weight.shape != (dv,):
        raise ValueError(f"{caller}: output_norm needs norm_weight [Dv={dv}]; got "
                         f"{None if norm_weight is None else norm_weight.shape}.")
    if sync is None or sync.shape != (bsz, hv) or sync.dtype != jnp.int32:
        raise ValueError(f"{caller}: output_norm needs sync, int32 zeros [B={bsz}, Hv={hv}]; "
                         f"got {None if sync is None else (sync.shape, sync.dtype)}.")
    if norm.z_col < 0 or norm.z_col + hv * dv > n:
        raise ValueError(f"{caller}: output_norm.z_col={norm.z_col} + Hv*Dv={hv * dv} is "
                         f"outside the {n} columns of qkv.")
