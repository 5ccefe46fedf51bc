"""Fused Pallas (Triton lowering) kernels of a GDN layer's step form, addressing the state pools
by slot.

On a shift-register conv window (qwen4_exp) a verify window or a decode step of a
``linear_attention`` layer, from the in-projections on, is two kernels:

* :func:`gdn_conv_rows`: the causal depthwise conv and SiLU of ``T`` raw rows ``qkv`` against
  the slot's conv window (pool ``[S, C, K-1]``, or a ring ``[S, C, K]``), rounded to the model
  dtype as the XLA path does; with ``length`` it also moves the window past the first
  ``length[b]`` rows, in place.
* :func:`gdn_step`: per (request, value head, value block), the L2 norms of q and k (q scaled by
  ``Dk**-0.5``), the gates ``beta = sigmoid(b)`` and ``g = -exp(A_log) softplus(a + dt_bias)``
  (both 0 on rows that are not kept, which leaves the state unchanged exactly), then the step
  form on the slot's ``[Dk, block_v]`` tile of the recurrent pool ``[S, Hv, Dk, Dv]``:
  ``verify`` (outputs; the pool is only read), ``commit`` (the pool written in place) or
  ``decode`` (both from one read).

On a ring window (the Qwen3.5 family's pools) a decode step runs both as one kernel,
:func:`pallas_kernels.gdn.fused_decode.gdn_decode_ring`, a verify window too,
:func:`pallas_kernels.gdn.fused_verify.gdn_verify_ring` (which also returns the conv rows), and
the commit of its accepted rows is :func:`gdn_step` with ``ring``: the recurrence on those
conv rows and the ring's new columns in one kernel. They share :func:`ring_ext` and :func:`l2`
with these.

Neither gathers the states into a batch view nor scatters them back, and no XLA kernel runs
between the in-projections and the recurrence: both read their inputs at column offsets of a
wider array, so a merged in-projection's output ``[qkv | z | b | a]`` is passed whole instead
of as sliced copies. ``verify``, ``commit`` and ``decode``, here and in the ring kernels, run
the same per-row code (:func:`l2`, :func:`gates`, :func:`pallas_kernels.gdn.pallas.step`), so
a commit of ``n`` rows gives the state that ``n`` decode steps give. Formulas: HF
transformers ``qwen3_5`` (``Qwen3_5GatedDeltaNet``), as in :mod:`mtp_jax.models.layers.gdn`.

Two rows of a batch may share a slot only if neither changes it (padding rows on the trash
slot, kept nowhere); a live slot appears once. Triton needs power-of-two arrays inside a
kernel: ``T`` is padded here, and ``Dk`` and the value block must be powers of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode, next_pow2, whole
from pallas_kernels.gdn.pallas import pad_rows, resolve_tiling, step

F32 = jnp.float32
MODES = ("verify", "commit", "decode")
CONV_BLOCK = 256  # channels per conv program (at most)


def unsupported_shape(dk: int, dv: int, conv_dim: int) -> str | None:
    """Why these kernels cannot take a layer with key/value head sizes ``dk``/``dv`` and conv
    width ``conv_dim`` (Triton needs power-of-two blocks), or ``None`` when they can."""
    if dk < 1 or dk & (dk - 1):
        return f"linear_key_head_dim {dk} is not a power of two"
    if dv % 16 and dv not in (1, 2, 4, 8):
        return f"linear_value_head_dim {dv} is not a multiple of 16"
    if conv_dim % 16:
        return f"the conv width {conv_dim} is not a multiple of 16"
    return None


# ---------------------------------------------------------------- conv ----------------------


def pick_column(cols: list, index) -> jax.Array:
    """``cols[index]`` for a traced scalar ``index`` (selects; no dynamic load)."""
    out = cols[0]
    for c in range(1, len(cols)):
        out = jnp.where(index == c, cols[c], out)
    return out


def ring_ext(cols: list, position) -> list:
    """The ``K-1`` inputs before ``position``, oldest first, from a ring's ``K`` columns
    (column ``p mod K`` holds position ``p``; :mod:`mtp_jax.models.layers.conv_state`)."""
    kernel = len(cols)
    return [pick_column(cols, jax.lax.rem(position + 1 + i, kernel)) for i in range(kernel - 1)]


def _conv_kernel(slot_ref, length_ref, start_ref, qkv_ref, w_ref, win_ref, out_ref, *win_out,
                 n_rows: int, width: int, kernel: int, ring: bool):
    """One (request, channel block). ``ext`` = the K-1 inputs before row 0 then the T new
    rows; row t's output is ``silu(sum_i ext[t + i] * w[:, i])``."""
    bi = pl.program_id(0)
    cs = pl.ds(pl.multiple_of(pl.program_id(1) * width, width), width)
    slot = slot_ref[bi]
    if ring:
        start = start_ref[bi]
        cols = [win_ref[slot, cs, c].astype(F32) for c in range(kernel)]
        ext = ring_ext(cols, start)
    else:
        ext = [win_ref[slot, cs, i].astype(F32) for i in range(kernel - 1)]
    ext += [qkv_ref[bi, t, cs].astype(F32) for t in range(n_rows)]
    w = [w_ref[cs, i].astype(F32) for i in range(kernel)]
    for t in range(n_rows):
        acc = ext[t] * w[0]
        for i in range(1, kernel):
            acc = acc + ext[t + i] * w[i]
        out_ref[bi, t, cs] = jax.nn.silu(acc).astype(out_ref.dtype)
    if not win_out:
        return
    n = length_ref[bi]
    if ring:  # column c takes the last of rows 0..n-1 at a position = c (mod K)
        for c in range(kernel):
            new = cols[c]
            for t in range(n_rows):
                at_c = (t < n) & (jax.lax.rem(start + t, kernel) == c)
                new = jnp.where(at_c, ext[kernel - 1 + t], new)
            win_out[0][slot, cs, c] = new.astype(win_out[0].dtype)
        return
    for i in range(kernel - 1):
        new = ext[i]
        for m in range(1, n_rows + 1):
            new = jnp.where(n == m, ext[i + m], new)
        win_out[0][slot, cs, i] = new.astype(win_out[0].dtype)


def gdn_conv_rows(qkv: jax.Array, weight: jax.Array, window: jax.Array, slot: jax.Array,
                  length: jax.Array | None = None, *, start: jax.Array | None = None,
                  interpret: bool | None = None):
    """Causal depthwise conv + SiLU of ``T`` rows against each slot's conv window.

    Args:
      qkv: ``[B, T, N]``, ``N >= C``: the raw conv inputs in its first ``C`` columns (model
        dtype); the rest is not read (e.g. the merged in-projection's output, read in place).
      weight: ``[C, K]`` conv taps (``conv1d.weight[:, 0, :]``).
      window: the pool of windows, a shift register ``[S, C, K-1]`` (last K-1 raw inputs per
        slot) or a ring ``[S, C, K]`` (position p in column p mod K; needs ``start``); see
        :mod:`mtp_jax.models.layers.conv_state`.
      slot: ``[B]`` int32 slot of each request, in ``[0, S)``.
      length: ``[B]`` int32 in ``[0, T]``: rows to move the window past (``None``: leave the
        pool alone). The new window ends at row ``length - 1`` (unchanged for 0).
      start: ``[B]`` int32 position of row 0 (a ring only).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``conv [B, T, C]`` in ``qkv.dtype``, or ``(conv, new window pool)`` with ``length``; the
      pool output aliases ``window`` (updated in place when the caller donates it).
    Raises:
      ValueError: shapes that do not fit, ``C`` not a multiple of 16, or a ring without
        ``start``.
    """
    b, t, n = qkv.shape
    s, c, cols = window.shape
    kernel = weight.shape[-1]
    if (weight.shape != (c, kernel) or cols not in (kernel - 1, kernel) or n < c
            or slot.shape != (b,)):
        raise ValueError(f"gdn_conv_rows: qkv {qkv.shape}, weight {weight.shape}, window "
                         f"{window.shape}, slot {slot.shape} do not fit (qkv [B,T,N>=C], "
                         "weight [C,K], window [S,C,K-1] or [S,C,K], slot [B]).")
    ring = cols == kernel
    if ring and (start is None or start.shape != (b,)):
        raise ValueError(f"gdn_conv_rows: the window {window.shape} is a ring (K={kernel} "
                         f"columns); pass start [B={b}], the position of each row 0 (got "
                         f"{None if start is None else start.shape}).")
    width = min(c & -c, CONV_BLOCK)
    if width < 16:
        raise ValueError(f"gdn_conv_rows: conv_dim {c} must be a multiple of 16 (Triton blocks "
                         "are powers of two); use the XLA backend.")
    tp = next_pow2(t)
    write = length is not None
    length = jnp.zeros((b,), jnp.int32) if length is None else length.astype(jnp.int32)
    start = jnp.zeros((b,), jnp.int32) if start is None else start.astype(jnp.int32)
    out_shape = [jax.ShapeDtypeStruct((b, tp, c), qkv.dtype)]  # conv of the first C columns
    if write:
        out_shape.append(jax.ShapeDtypeStruct(window.shape, window.dtype))
    outs = pl.pallas_call(
        functools.partial(_conv_kernel, n_rows=tp, width=width, kernel=kernel, ring=ring),
        grid=(b, c // width),
        in_specs=[whole((b,)), whole((b,)), whole((b,)), whole((b, tp, n)),
                  whole(weight.shape), whole(window.shape)],
        out_specs=[whole(o.shape) for o in out_shape],
        out_shape=out_shape,
        input_output_aliases={5: 1} if write else {},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret_mode(interpret),
        name="gdn_conv_write" if write else "gdn_conv",
    )(slot.astype(jnp.int32), length, start, pad_rows(qkv, tp), weight, window)
    conv = outs[0][:, :t]
    return (conv, outs[1]) if write else conv


# ---------------------------------------------------------------- step ----------------------


def l2(a: jax.Array) -> jax.Array:
    return a * jax.lax.rsqrt(jnp.sum(a * a) + 1e-6)


def gates(a, b, alog, dtb, keep):
    """``(g, beta)`` float32 of one row and value head: ``g = -exp(A_log) softplus(a +
    dt_bias)``, ``beta = sigmoid(b)`` (HF ``Qwen3_5GatedDeltaNet``), both 0 where not ``keep``
    (the row then leaves the state exactly as it is). ``a``, ``b``: the raw in-projection
    outputs; ``alog``, ``dtb``: the head's ``A_log`` and ``dt_bias`` in float32."""
    beta = jax.nn.sigmoid(b.astype(F32))
    g = -jnp.exp(alog) * jax.nn.softplus(a.astype(F32) + dtb)
    return jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)


def _prep(conv_ref, a_ref, b_ref, keep_ref, bi, t, h, kh, j, alog, dtb, *, hk, dk, bv, dv,
          a_col: int, b_col: int, need_q: bool):
    """Row ``t`` of request ``bi`` for value head ``h`` (key head ``kh``), value block ``j``:
    ``(q [Dk] or None, k [Dk], v [bv], g, beta)`` float32."""
    row = lambda off, n: conv_ref[bi, t, pl.ds(off, n)].astype(F32)
    q = l2(row(kh * dk, dk)) * (dk ** -0.5) if need_q else None
    k = l2(row(hk * dk + kh * dk, dk))
    v = row(2 * hk * dk + h * dv + j * bv, bv)
    g, beta = gates(a_ref[bi, t, a_col + h], b_ref[bi, t, b_col + h], alog, dtb,
                    keep_ref[bi, t] != 0)
    return q, k, v, g, beta


def _step_kernel(slot_ref, keep_ref, conv_ref, a_ref, b_ref, alog_ref, dtb_ref, *refs,
                 n_rows: int, hk: int, rep: int, dv: int, a_col: int, b_col: int, mode: str,
                 kernel: int):
    """One (request, value head, value block). ``refs``: with ``kernel`` (a commit that also
    writes a ring window) ``start_ref, length_ref, qkv_ref, win_ref`` first; then ``s_ref``:
    ``[S, Dk, bv]`` (this head's and block's column of the pool); then the outputs: ``o [T,
    bv]`` (verify, decode), the state (commit, decode), which aliases the pool: the tile is
    read whole before it is written, and the ring window (aliased)."""
    bi, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ring, refs = (refs[:4], refs[4:]) if kernel else (None, refs)
    s_ref, outs = refs[0], refs[1:]
    _, dk, bv = s_ref.shape
    slot = slot_ref[bi]
    s = s_ref[slot]
    alog, dtb = alog_ref[h], dtb_ref[h]
    for t in range(n_rows):
        q, k, v, g, beta = _prep(conv_ref, a_ref, b_ref, keep_ref, bi, t, h, h // rep, j,
                                 alog, dtb, hk=hk, dk=dk, bv=bv, dv=dv, a_col=a_col,
                                 b_col=b_col, need_q=mode != "commit")
        s = step(s, k, v, g, beta)
        if mode != "commit":
            outs[0][t, :] = jnp.sum(s * q[:, None], axis=0)
    if mode != "verify":
        outs[1 if mode == "decode" else 0][slot] = s
    if ring:
        _ring_write(*ring, outs[-1], bi, slot, h, j, hk=hk, rep=rep, dk=dk, bv=bv, dv=dv,
                    n_rows=n_rows, kernel=kernel)


def _ring_write(start_ref, length_ref, qkv_ref, win_ref, win_out, bi, slot, h, j, *, hk, rep,
                dk, bv, dv, n_rows, kernel):
    """The first ``length`` rows' raw inputs into the ring (position p in column p mod K; of
    rows sharing a column only the last is written), as :func:`gdn_conv_rows` with
    ``length``. Each program writes its value block's channels, value block 0 of a key
    head's first value head the key head's q/k channels; the window is never read here, so
    no write races a read."""
    del win_ref  # aliased to win_out: passed only to keep the columns not written
    start, n = start_ref[bi], length_ref[bi]
    kh = h // rep
    q_off, k_off = kh * dk, hk * dk + kh * dk
    v_off = pl.multiple_of(2 * hk * dk + h * dv + j * bv, bv)
    writer = (j == 0) & (h % rep == 0)
    for t in range(n_rows):
        col = jax.lax.rem(start + t, kernel)
        last = (t < n) & (t + kernel >= n)

        @pl.when(last)
        def _():
            win_out[slot, pl.ds(v_off, bv), col] = qkv_ref[bi, t, pl.ds(v_off, bv)].astype(
                win_out.dtype)

        @pl.when(last & writer)
        def _():
            for off in (q_off, k_off):
                win_out[slot, pl.ds(off, dk), col] = qkv_ref[bi, t, pl.ds(off, dk)].astype(
                    win_out.dtype)


def state_tile_spec(state: jax.Array, block_v: int) -> pl.BlockSpec:
    """Program ``(request, value head h, value block j)``'s view of the recurrent pool ``[S,
    Hv, Dk, Dv]``: every slot's ``[Dk, block_v]`` tile of head ``h``, block ``j`` (the kernel
    picks the slot)."""
    return pl.BlockSpec((state.shape[0], None, state.shape[2], block_v),
                        lambda i, h, j: (0, h, 0, j))


def rows_out_spec(n_rows: int, block_v: int) -> pl.BlockSpec:
    """Program ``(request i, value head h, value block j)``'s ``[n_rows, block_v]`` of an
    output ``[B, n_rows, Hv, Dv]``."""
    return pl.BlockSpec((None, n_rows, None, block_v), lambda i, h, j: (i, 0, h, j))


def _check_step(conv, a, b, a_log, dt_bias, keep, state, slot, hk, mode, a_col, b_col):
    if mode not in MODES:
        raise ValueError(f"gdn_step: mode {mode!r} is unknown; use one of {MODES}.")
    bsz, t, c = conv.shape
    _, hv, dk, dv = state.shape
    for name, x, col in (("a", a, a_col), ("b", b, b_col)):
        if x.ndim != 3 or x.shape[:2] != (bsz, t) or col < 0 or x.shape[2] < col + hv:
            raise ValueError(f"gdn_step: {name} has shape {x.shape} with {name}_col={col}; it "
                             f"must be [B={bsz}, T={t}, N] holding Hv={hv} columns from "
                             f"{name}_col.")
    want = {"A_log": (a_log.shape, (hv,)), "dt_bias": (dt_bias.shape, (hv,)),
            "keep": (keep.shape, (bsz, t)), "slot": (slot.shape, (bsz,)),
            "conv": (c, 2 * hk * dk + hv * dv)}
    for name, (got, expected) in want.items():
        if got != expected:
            raise ValueError(f"gdn_step: {name} has shape {got}, expected {expected} (conv "
                             "[B,T,2*Hk*Dk+Hv*Dv], A_log,dt_bias [Hv], keep [B,T], "
                             "state [S,Hv,Dk,Dv], slot [B]).")
    if hv % hk:
        raise ValueError(f"gdn_step: Hv={hv} is not a multiple of Hk={hk}.")
    if dk & (dk - 1) or state.dtype != F32:
        raise ValueError(f"gdn_step: Dk={dk} must be a power of two and the state float32 "
                         f"(got {state.dtype}); use the XLA backend.")


def _check_ring(ring, conv, state, mode):
    if mode != "commit":
        raise ValueError(f"gdn_step: ring is for mode='commit' only (got {mode!r}); a verify "
                         "on a ring takes gdn_verify_ring.")
    if len(ring) != 4:
        raise ValueError(f"gdn_step: ring has {len(ring)} arrays; pass (qkv, window, start, "
                         "length).")
    qkv, window, start, length = ring
    bsz, t, c = conv.shape
    if (qkv.ndim != 3 or qkv.shape[:2] != (bsz, t) or qkv.shape[2] < c or window.ndim != 3
            or window.shape[:2] != (state.shape[0], c) or start.shape != (bsz,)
            or length.shape != (bsz,)):
        raise ValueError(f"gdn_step: ring qkv {qkv.shape}, window {window.shape}, start "
                         f"{start.shape}, length {length.shape} do not fit conv {conv.shape} "
                         f"and state {state.shape} (qkv [B,T,N>=C], window [S,C,K], start and "
                         "length [B]).")


def gdn_step(conv: jax.Array, a: jax.Array, b: jax.Array, a_log: jax.Array,
             dt_bias: jax.Array, keep: jax.Array, state: jax.Array, slot: jax.Array, *,
             num_k_heads: int, mode: str, a_col: int = 0, b_col: int = 0,
             ring: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None,
             block_v: int | None = None,
             num_warps: int | None = None, interpret: bool | None = None):
    """Gates, q/k norms and the step-form recurrence of ``T`` rows on the slots' states.

    Args:
      conv: ``[B, T, C]`` outputs of :func:`gdn_conv_rows`, ``C = 2 Hk Dk + Hv Dv`` laid out
        ``[q heads | k heads | v heads]``; value head ``h`` reads key head ``h // (Hv / Hk)``.
      a, b: ``[B, T, N]`` holding the raw ``in_proj_a`` / ``in_proj_b`` outputs in the ``Hv``
        columns from ``a_col`` / ``b_col`` (``[B, T, Hv]`` with 0; or both the merged
        in-projection's whole output, read in place).
      a_log, dt_bias: ``[Hv]`` the layer's ``A_log`` and ``dt_bias``.
      keep: ``[B, T]`` bool: rows applied to the state (others get ``g = beta = 0``).
      state: ``[S, Hv, Dk, Dv]`` float32 recurrent pool; slot ``[B]`` int32 rows into it.
      num_k_heads: ``Hk``.
      mode: ``"verify"`` -> ``o``; ``"commit"`` -> new pool; ``"decode"`` -> ``(o, new pool)``.
      a_col, b_col: static column offsets of ``a`` and ``b``.
      ring: ``mode="commit"`` only: ``(qkv [B, T, N], window [S, C, K], start [B], length
        [B])``: the rows' raw conv inputs (first ``C`` columns), the ring of the slots' conv
        windows (``K`` the conv's kernel size), each row 0's position and the rows to write;
        the first ``length`` rows are also written into the ring, as :func:`gdn_conv_rows`
        with ``length`` does, in the same kernel. ``conv`` must then be those rows' conv (e.g.
        from :func:`pallas_kernels.gdn.fused_verify.gdn_verify_ring`): the window is not read.
      block_v, num_warps: tiling (default :func:`pallas_kernels.gdn.pallas.default_tiling`).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``o [B, T, Hv, Dv]`` float32 and/or the new pool (aliasing ``state``: updated in place
      when the caller donates it), per ``mode``; with ``ring``, ``(new pool, new window)``.
    Raises:
      ValueError: unknown mode, shapes that do not fit, sizes Triton cannot take, or a
        ``ring`` outside a commit or of the wrong shape.
    """
    _check_step(conv, a, b, a_log, dt_bias, keep, state, slot, num_k_heads, mode, a_col, b_col)
    if ring is not None:
        _check_ring(ring, conv, state, mode)
    bsz, t, _ = conv.shape
    _, hv, _, dv = state.shape
    block_v, num_warps = resolve_tiling("gdn_step", bsz, hv, dv, block_v, num_warps)
    tp = next_pow2(t)
    conv, a, b = (pad_rows(x, tp) for x in (conv, a, b))
    keep = pad_rows(keep.astype(jnp.int32), tp)
    state_spec = state_tile_spec(state, block_v)
    o_spec = rows_out_spec(tp, block_v)
    o_shape = jax.ShapeDtypeStruct((bsz, tp, hv, dv), F32)
    s_shape = jax.ShapeDtypeStruct(state.shape, F32)
    out_specs, out_shape, aliases = {
        "verify": ([o_spec], [o_shape], {}),
        "commit": ([state_spec], [s_shape], {7: 0}),
        "decode": ([o_spec, state_spec], [o_shape, s_shape], {7: 1}),
    }[mode]
    args = [slot.astype(jnp.int32), keep, conv, a, b, a_log.astype(F32), dt_bias.astype(F32)]
    in_specs = [whole((bsz,)), whole((bsz, tp)), whole(conv.shape), whole(a.shape),
                whole(b.shape), whole((hv,)), whole((hv,))]
    kernel = 0
    if ring is not None:
        qkv, window, start, length = ring
        kernel = window.shape[-1]
        args += [start.astype(jnp.int32), length.astype(jnp.int32), pad_rows(qkv, tp), window]
        in_specs += [whole((bsz,)), whole((bsz,)), whole((bsz, tp, qkv.shape[2])),
                     whole(window.shape)]
        out_specs = out_specs + [whole(window.shape)]
        out_shape = out_shape + [jax.ShapeDtypeStruct(window.shape, window.dtype)]
        aliases = {11: 0, 10: 1}
    outs = pl.pallas_call(
        functools.partial(_step_kernel, n_rows=tp, hk=num_k_heads, rep=hv // num_k_heads,
                          dv=dv, a_col=a_col, b_col=b_col, mode=mode, kernel=kernel),
        grid=(bsz, hv, dv // block_v),
        in_specs=in_specs + [state_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret_mode(interpret),
        name=f"gdn_fused_{mode}" + ("_ring" if ring is not None else ""),
    )(*args, state)
    if ring is not None:
        return outs[0], outs[1]
    if mode == "commit":
        return outs[0]
    o = outs[0][:, :t]
    return o if mode == "verify" else (o, outs[1])
