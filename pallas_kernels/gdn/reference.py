"""XLA references of the gated delta rule (Yang et al. 2024, "Gated Delta Networks").

Per value head, with state ``S [Dk, Dv]`` (float32) and inputs at step t:

    S = S * exp(g_t)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t

The step form is the decode / verify path; the chunked (WY) form is the prefill path. The two
agree up to rounding only, so a verify must use the step form to reproduce decoding.
A row with ``g = 0`` and ``beta = 0`` leaves ``S`` unchanged exactly, which is how padding rows
and rejected verify rows are kept out of a state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import next_pow2


def gdn_recurrent_reference(q, k, v, g, beta, state, unroll: int | bool = 1):
    """Step form over T rows.

    Args:
      q, k: ``[B, T, H, Dk]`` float32 (q already scaled by ``Dk**-0.5``, both L2-normalised).
      v: ``[B, T, H, Dv]`` float32.  g, beta: ``[B, T, H]`` float32.
      state: ``[B, H, Dk, Dv]`` float32 initial state.
      unroll: passed to ``lax.scan`` (``True`` unrolls all rows: on a GPU a rolled scan costs
        a host round-trip per row, so short verify windows want it unrolled).
    Returns:
      ``(o [B, T, H, Dv] float32, final state [B, H, Dk, Dv])``.
    """

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, o = jax.lax.scan(_step, state, xs, unroll=unroll)
    return jnp.moveaxis(o, 0, 1), state


def _step(s, xs):
    """One row of the step form: ``s [B, H, Dk, Dv]``, ``xs = (q_t, k_t [B, H, Dk], v_t
    [B, H, Dv], g_t, beta_t [B, H])`` -> ``(new s, o_t [B, H, Dv])``."""
    q_t, k_t, v_t, g_t, b_t = xs
    s = s * jnp.exp(g_t)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
    delta = (v_t - kv_mem) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)


def gdn_decode_reference(q, k, v, g, beta, state):
    """One decode row of the step form: outputs and the new state from one read of ``state``.

    Args: as :func:`gdn_recurrent_reference` with ``T = 1`` (q, k ``[B, 1, H, Dk]``, v
    ``[B, 1, H, Dv]``, g, beta ``[B, 1, H]``, state ``[B, H, Dk, Dv]``, float32).
    Returns ``(o [B, 1, H, Dv], new state [B, H, Dk, Dv])``: the same per-row arithmetic as the
    step form, so equal to its ``(o, state)`` for one row; a row with ``g = beta = 0`` returns
    ``state`` unchanged exactly.
    Raises ValueError when ``T != 1``.
    """
    if q.shape[1] != 1:
        raise ValueError(f"gdn decode: T={q.shape[1]} rows; decode takes one row per request "
                         "(use gdn_recurrent_reference / verify + commit for a window).")
    s, o = _step(state, tuple(a[:, 0] for a in (q, k, v, g, beta)))
    return o[:, None], s


MAX_CHUNK = 128  # rows per chunk of the chunked form (H200, 27B shape: 64 -> 128 +0.8%)


def gdn_chunked_reference(q, k, v, g, beta, state, chunk_size: int | None = None):
    """Chunked (WY-representation) form; same arguments and results as the step form.

    Within a chunk with cumulative log-decay ``G_t`` and start state ``S0``, the written values
    ``U`` solve ``(I + A) U = beta*V - (beta*exp(G)*K) S0`` with the strictly lower
    ``A[t, s] = beta_t exp(G_t - G_s) k_t.k_s``; then
    ``o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s)(q_t.k_s) u_s`` and
    ``S_end = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T``.

    Everything that does not depend on ``S0`` (the decays, ``A``, the triangular solves
    ``W_v = (I + A)^-1 beta*V`` and ``W_k = (I + A)^-1 beta*exp(G)*K``, the masked ``q.k``) is
    computed for all chunks at once, so the sequential scan over chunks is four small matmuls
    per chunk: ``U = W_v - W_k S0``, ``o``, ``S_end`` (the split of the intra- and inter-chunk
    work of flash-linear-attention's chunked kernels, Yang et al. 2024).

    ``chunk_size``: rows per chunk; default :data:`MAX_CHUNK`, or the next power of two of
    ``T`` (at least 16) when that is smaller.
    """
    o, state, _ = _chunked(q, k, v, g, beta, state, chunk_size, keep=False)
    return o, state


def gdn_chunked_states(q, k, v, g, beta, state, at, chunk_size: int | None = None):
    """:func:`gdn_chunked_reference` that also gives the state after the first ``at [B, S]``
    int32 rows (``0 <= at <= T``; 0: the initial ``state``) of each request, e.g. at the
    prefix-cache boundaries inside a prefill chunk.

    Row ``j`` of chunk ``n`` (start state ``S0_n``, written values ``u`` of the scan) leaves
    ``S = exp(G_j) S0_n + sum_{s<=j} exp(G_j - G_s) k_s u_s^T`` (``S_end`` of the chunk cut
    after row ``j``): one masked ``[C] x [C, Dk] x [C, Dv]`` contraction per requested row,
    no second pass over the rows.

    Returns ``(o [B, T, H, Dv], final state [B, H, Dk, Dv], states [B, S, H, Dk, Dv])``
    float32.
    """
    o, final, (s0, u, kc, cum) = _chunked(q, k, v, g, beta, state, chunk_size, keep=True)
    n_chunks, _, _, c = cum.shape
    at = jnp.asarray(at, jnp.int32)
    last = at - 1  # the last row consumed; -1: none
    n = jnp.clip(last // c, 0, n_chunks - 1)  # [B, S]
    j = last - n * c  # row within chunk n (-1 for at = 0)
    bi = jnp.arange(at.shape[0])[:, None]
    cum_n = cum[n, bi]  # [B, S, H, C]
    cum_j = jnp.take_along_axis(cum_n, jnp.maximum(j, 0)[:, :, None, None], axis=-1)
    upto = jnp.arange(c)[None, None, None, :] <= j[:, :, None, None]
    w = jnp.where(upto, jnp.exp(jnp.where(upto, cum_j - cum_n, 0.0)), 0.0)
    states = (jnp.exp(cum_j)[..., None] * s0[n, bi]
              + jnp.einsum("bshc,bshck,bshcv->bshkv", w, kc[n, bi], u[n, bi]))
    states = jnp.where((at == 0)[:, :, None, None, None], state[:, None], states)
    return o, final, states


def _chunked(q, k, v, g, beta, state, chunk_size, keep: bool):
    """The chunked form; ``keep``: also return ``(S0 [N, B, H, Dk, Dv], u [N, B, H, C, Dv],
    k [N, B, H, C, Dk], G [N, B, H, C])`` of every chunk (else ``None``)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    if chunk_size is None:  # short inputs (prefill tails, tests): a chunk of their own size
        chunk_size = min(MAX_CHUNK, max(16, next_pow2(t)))
    pad = (-t) % chunk_size
    if pad:
        padw = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        q, k, v, g, beta = (padw(a) for a in (q, k, v, g, beta))
    n = (t + pad) // chunk_size
    # [N, B, H, C, ...]
    to_chunks = lambda a: jnp.moveaxis(a.reshape(b, n, chunk_size, h, *a.shape[3:]), (1, 3), (0, 2))
    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    gc, bc = to_chunks(g[..., None])[..., 0], to_chunks(beta[..., None])[..., 0]
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    strict = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    eye = jnp.eye(chunk_size, dtype=jnp.float32)

    # Intra-chunk terms of all chunks at once.
    cum = jnp.cumsum(gc, axis=-1)  # [N, B, H, C]
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
    kk = jnp.einsum("nbhtd,nbhsd->nbhts", kc, kc)
    a = jnp.where(strict, bc[..., :, None] * decay * kk, 0.0)
    rhs = jnp.concatenate([vc * bc[..., None], kc * (bc * jnp.exp(cum))[..., None]], axis=-1)
    w = jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)
    w_v, w_k = w[..., :dv], w[..., dv:]
    qk = jnp.where(lower, jnp.einsum("nbhtd,nbhsd->nbhts", qc, kc) * decay, 0.0)
    q_decayed = qc * jnp.exp(cum)[..., None]
    last = cum[..., -1]  # [N, B, H]
    k_decayed = jnp.exp(last[..., None] - cum)[..., None] * kc

    def chunk(s0, xs):
        w_v, w_k, qk, q_decayed, k_decayed, last = xs
        u = w_v - jnp.einsum("bhtk,bhkv->bhtv", w_k, s0)
        o = (jnp.einsum("bhtk,bhkv->bhtv", q_decayed, s0)
             + jnp.einsum("bhts,bhsv->bhtv", qk, u))
        s1 = s0 * jnp.exp(last)[..., None, None] + jnp.einsum("bhsk,bhsv->bhkv", k_decayed, u)
        return s1, ((o, s0, u) if keep else o)

    state, o = jax.lax.scan(chunk, state, (w_v, w_k, qk, q_decayed, k_decayed, last))
    kept = None
    if keep:
        o, s0, u = o
        kept = (s0, u, kc, cum)
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(b, n * chunk_size, h, dv)
    return o[:, :t], state, kept
