"""Pallas (Triton lowering) kernels for the step form of the gated delta rule over a short window.

Per value head the state ``S [Dk, Dv]`` evolves row by row (see ``reference.py``):

    S = S * exp(g_t);  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

Column ``j`` of ``S`` only needs ``v_t[j]``, so the grid is ``(B, H, Dv // block_v)`` and each
program keeps its ``[Dk, block_v]`` tile of ``S`` in registers across all ``T`` rows (the row
loop is unrolled; ``T`` is static). :func:`gdn_verify_pallas` reads the state once and writes
only ``o``; :func:`gdn_commit_pallas` reads and writes the state once and writes no ``o``;
:func:`gdn_decode_pallas` (one row, ``T = 1``) reads the state once and writes both ``o`` and
the new state, so a plain decode step needs no separate commit. All run the same per-row code
(:func:`_rows`), so a verify's row ``t`` equals what a commit of ``t + 1`` rows followed by a
one-row verify gives, and a decode equals a one-row verify plus commit, up to the compiler's
instruction choice.

All kernel arrays must have power-of-two shapes for Triton: ``T``, ``Dk`` and ``block_v``
(``api.py`` pads ``T`` with ``g = beta = 0`` rows, which change nothing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SM_COUNT = 132  # H200 streaming multiprocessors


def pad_rows(a: jax.Array, tp: int) -> jax.Array:
    """Zero-pad the row axis (1) of ``a`` to ``tp`` rows (zero gates: rows that change nothing)."""
    t = a.shape[1]
    return a if tp == t else jnp.pad(a, [(0, 0), (0, tp - t)] + [(0, 0)] * (a.ndim - 2))


def step(s, k_t, v_t, g_t, b_t):
    """One row of the step form on a state tile ``s [Dk, BV]``: ``k_t [Dk]``, ``v_t [BV]``,
    scalars ``g_t``, ``b_t``. Every step-form kernel (here and in :mod:`.fused`) runs this code,
    so a verify, a commit and a decode agree row for row."""
    # The select makes a g = 0 row's decay exactly 1 whatever exp's accuracy.
    s = s * jnp.where(g_t == 0.0, 1.0, jnp.exp(g_t))
    kv = jnp.sum(s * k_t[:, None], axis=0)  # S^T k: [BV]
    delta = (v_t - kv) * b_t
    return s + k_t[:, None] * delta[None, :]


def _rows(s, q_ref, k_ref, v_ref, g_ref, b_ref, n_rows: int, emit=None):
    """Apply ``n_rows`` rows to the tile ``s [Dk, BV]``; calls ``emit(t, o_t [BV])`` if given."""
    for t in range(n_rows):
        s = step(s, k_ref[t, :], v_ref[t, :], g_ref[t], b_ref[t])
        if emit is not None:
            emit(t, jnp.sum(s * q_ref[t, :][:, None], axis=0))
    return s


def _verify_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, *, n_rows: int):
    def emit(t, o_t):
        o_ref[t, :] = o_t

    _rows(s_ref[...], q_ref, k_ref, v_ref, g_ref, b_ref, n_rows, emit)


def _commit_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, out_ref, *, n_rows: int):
    out_ref[...] = _rows(s_ref[...], q_ref, k_ref, v_ref, g_ref, b_ref, n_rows)


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, out_ref, *, n_rows: int):
    """Verify and commit in one pass: ``o`` rows and the new state tile (``out_ref`` may alias
    ``s_ref``: the tile is read whole before it is written)."""
    def emit(t, o_t):
        o_ref[t, :] = o_t

    out_ref[...] = _rows(s_ref[...], q_ref, k_ref, v_ref, g_ref, b_ref, n_rows, emit)


def default_tiling(batch: int, heads: int, dv: int) -> tuple[int, int]:
    """``(block_v, num_warps)``: the widest ``block_v`` in (64, 32, 16) that still gives about
    two programs per SM; 4 warps (a ``[128, 64]`` f32 tile is 64 registers a thread).
    It does not depend on ``T``, so a verify and a commit of one batch share the tiling and
    hence the reduction order (a guess until tuned: ``python -m mtp_jax.bench gdn --sweep``)."""
    for bv in (64, 32):
        if dv % bv == 0 and batch * heads * (dv // bv) >= 2 * SM_COUNT:
            return bv, 4
    return min(16, dv), 4


def resolve_tiling(caller: str, batch: int, heads: int, dv: int, block_v: int | None,
                   num_warps: int | None) -> tuple[int, int]:
    """``(block_v, num_warps)``: the given ones, else :func:`default_tiling`'s. Raises
    ValueError (naming ``caller``) when ``block_v`` is not a power of two dividing ``dv``."""
    bv0, nw0 = default_tiling(batch, heads, dv)
    block_v, num_warps = block_v or bv0, num_warps or nw0
    if dv % block_v or block_v & (block_v - 1):
        raise ValueError(f"{caller}: block_v={block_v} must be a power of two dividing "
                         f"Dv={dv}.")
    return block_v, num_warps


def _specs(t: int, dk: int, bv: int):
    rows_k = pl.BlockSpec((None, t, None, dk), lambda b, h, j: (b, 0, h, 0))
    rows_v = pl.BlockSpec((None, t, None, bv), lambda b, h, j: (b, 0, h, j))
    scal = pl.BlockSpec((None, t, None), lambda b, h, j: (b, 0, h))
    state = pl.BlockSpec((None, None, dk, bv), lambda b, h, j: (b, h, 0, j))
    return [rows_k, rows_k, rows_v, scal, scal, state], rows_v, state


def _check(q, k, v, g, beta, state, block_v: int):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    want = {"q": (b, t, h, dk), "k": (b, t, h, dk), "v": (b, t, h, dv), "g": (b, t, h),
            "beta": (b, t, h), "state": (b, h, dk, dv)}
    for name, a in zip(want, (q, k, v, g, beta, state)):
        if a.shape != want[name]:
            raise ValueError(f"gdn: {name} has shape {a.shape}, expected {want[name]} "
                             "(q,k [B,T,H,Dk], v [B,T,H,Dv], g,beta [B,T,H], state [B,H,Dk,Dv]).")
        if a.dtype != jnp.float32:
            raise ValueError(f"gdn: {name} is {a.dtype}; the Pallas kernel takes float32.")
    for name, n in (("T", t), ("Dk", dk), ("block_v", block_v)):
        if n & (n - 1):
            raise ValueError(f"gdn: {name}={n} is not a power of two (Triton needs one); "
                             "pad T with g=beta=0 rows or use api.gdn_verify/gdn_commit.")
    if dv % block_v:
        raise ValueError(f"gdn: Dv={dv} is not a multiple of block_v={block_v}.")


def _call(q, k, v, g, beta, state, block_v, num_warps, interpret, *, mode: str):
    """The ``pallas_call`` of ``mode``: ``"verify"`` (``o``), ``"commit"`` (new state, aliasing
    ``state``) or ``"decode"`` (``(o, new state)``, the state aliasing ``state``)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    bv0, nw0 = default_tiling(b, h, dv)
    block_v, num_warps = block_v or bv0, num_warps or nw0
    _check(q, k, v, g, beta, state, block_v)
    in_specs, o_spec, s_spec = _specs(t, dk, block_v)
    o_shape = jax.ShapeDtypeStruct((b, t, h, dv), jnp.float32)
    s_shape = jax.ShapeDtypeStruct(state.shape, jnp.float32)
    kernel, out_specs, out_shape, aliases = {
        "verify": (_verify_kernel, o_spec, o_shape, {}),
        "commit": (_commit_kernel, s_spec, s_shape, {5: 0}),
        "decode": (_decode_kernel, [o_spec, s_spec], [o_shape, s_shape], {5: 1}),
    }[mode]
    return pl.pallas_call(
        functools.partial(kernel, n_rows=t),
        grid=(b, h, dv // block_v),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"gdn_{mode}",
    )(q, k, v, g, beta, state)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret"))
def gdn_verify_pallas(q, k, v, g, beta, state, *, block_v: int | None = None,
                      num_warps: int | None = None, interpret: bool = False):
    """Outputs of the step form over a window from ``state``, which is only read.

    Args: q, k ``[B, T, H, Dk]``; v ``[B, T, H, Dv]``; g, beta ``[B, T, H]``; state
    ``[B, H, Dk, Dv]``; all float32, ``T`` and ``Dk`` powers of two. ``block_v`` / ``num_warps``
    default to :func:`default_tiling`. Returns ``o [B, T, H, Dv]`` float32.
    Raises ValueError on a shape, dtype or tiling the kernel cannot take.
    """
    return _call(q, k, v, g, beta, state, block_v, num_warps, interpret, mode="verify")


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret"))
def gdn_commit_pallas(q, k, v, g, beta, state, *, block_v: int | None = None,
                      num_warps: int | None = None, interpret: bool = False):
    """State after the step form over a window; same arguments as :func:`gdn_verify_pallas`.

    Returns the new state ``[B, H, Dk, Dv]`` float32. The output aliases ``state`` (each program
    reads its tile before writing it), so a donated state is updated in place.
    """
    return _call(q, k, v, g, beta, state, block_v, num_warps, interpret, mode="commit")


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret"))
def gdn_decode_pallas(q, k, v, g, beta, state, *, block_v: int | None = None,
                      num_warps: int | None = None, interpret: bool = False):
    """One decode row: outputs and the new state from one read of ``state``.

    Args as :func:`gdn_verify_pallas` with ``T = 1`` (q, k ``[B, 1, H, Dk]``, v ``[B, 1, H, Dv]``,
    g, beta ``[B, 1, H]``, state ``[B, H, Dk, Dv]``, float32). Returns ``(o [B, 1, H, Dv], new
    state [B, H, Dk, Dv])``, both float32: the per-row code and tiling of verify and commit, so
    ``o`` is the one-row verify's and the state the one-row commit's (up to the compiler's
    instruction choice). The new state aliases ``state`` (each program reads its tile before
    writing it), so a donated state is updated in place; a row with ``g = beta = 0`` leaves it
    unchanged exactly. Raises ValueError when ``T != 1`` or as :func:`gdn_verify_pallas`.
    """
    if q.shape[1] != 1:
        raise ValueError(f"gdn decode: T={q.shape[1]} rows; the decode kernel takes one row "
                         "per request (use gdn_verify_pallas + gdn_commit_pallas for a window).")
    return _call(q, k, v, g, beta, state, block_v, num_warps, interpret, mode="decode")
