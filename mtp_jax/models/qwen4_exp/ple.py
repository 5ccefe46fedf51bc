"""PLE (per-layer n-gram embedding, "Engram") of qwen4_exp.

Host side (numpy, int64): hashed n-gram ids. For a token at position t and shift s, the shifted
token is ``x[t-s]`` if ``t-s`` is inside t's eos-delimited segment (a segment ends with its eos;
the next starts after it), else ``eos``. For n-gram order n in 2..N (N = ngram_size) and each of
its ``heads_per_ngram`` heads h::

    mixed = XOR_{s<n} (shifted_s * m_s)          # m = the module's odd multipliers
    id    = mixed mod vocab_h + offset_h         # prime vocab per head, offsets into one table

Each token reads ``(N-1) * heads_per_ngram`` rows of ``ple_embed_dim / heads`` and concatenates
them. The request's history before the current rows is its last N-1 tokens (eos at start).

Device side (:class:`PLE`), with ``e`` the concatenated rows and ``h`` the residual streams::

    key = norm_key(key_proj e) [hc, H];  value = value_proj e [H];  query = norm_query(h) [hc, H]
    g   = sum(key * query) / sqrt(H);  g = sign(g) * sqrt(max(|g|, 1e-6))
    gv  = sigmoid(g) * value  (per stream);  out = gv + silu(dconv(norm_conv(gv)))

``dconv`` is a causal depthwise conv of kernel K and dilation N whose state is the last
``(K-1)*N`` normed inputs. The PLE output is added to ``h`` before the layer's attention
hyper-connection. Source: HF transformers ``qwen4_exp`` (``Qwen4ExpTextPLELayer``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.models.layers.basic import Linear
from mtp_jax.models.qwen4_exp.hyper_connection import GroupedRMSNorm
from mtp_jax.models.qwen4_exp.slot_states import shift_register_commit


def shifted_tokens(history: np.ndarray, shifts: np.ndarray, eos: int, n_new: int
                   ) -> np.ndarray:
    """``history [B, L]`` -> ``[B, S, n_new]``: for each shift ``s`` of ``shifts [S]``, the
    token ``s`` places back of each of the last ``n_new`` positions if it lies inside that
    position's eos segment, else ``eos``."""
    b, n = history.shape
    pos = np.arange(n - n_new, n)
    # The last eos strictly before each position (-1: none): a segment starts after it.
    eos_pos = np.where(history == eos, np.arange(n), -1)
    prev = np.maximum.accumulate(eos_pos, axis=1)[:, n - n_new - 1:n - 1] if n > n_new else \
        np.concatenate([np.full((b, 1), -1), np.maximum.accumulate(eos_pos, axis=1)[:, :-1]], 1)
    src = pos[None, :] - shifts[:, None]  # [S, n_new]
    out = history[:, np.clip(src, 0, None)]  # [B, S, n_new]
    ok = ((pos[None, :] - (prev + 1))[:, None, :] >= shifts[None, :, None]) & (src >= 0)
    return np.where(ok, out, eos)


def ngram_ids(history: np.ndarray, n_new: int, multipliers, vocab_sizes, offsets,
              ngram_size: int, heads_per_ngram: int, eos: int) -> np.ndarray:
    """Table row ids ``[B, n_new, (N-1)*heads_per_ngram]`` (int64) of the last ``n_new`` tokens
    of ``history [B, L]`` (L >= n_new + N - 1 so that every shift reads real history).

    One pass over all shifts and heads (a round calls this for a few tokens: numpy's per-call
    cost, not the arithmetic, sets its time): ``acc[:, s]`` is the XOR of the first ``s + 1``
    shifted products (int64, wrapping as the reference's int64 products do), and head ``h`` of
    order ``n`` reads ``acc[:, n - 1]``."""
    history = np.asarray(history, np.int64)
    if n_new == 0:
        return np.zeros((history.shape[0], 0, (ngram_size - 1) * heads_per_ngram), np.int64)
    m = np.asarray(multipliers, np.int64)[:ngram_size]
    sh = shifted_tokens(history, np.arange(ngram_size), eos, n_new)  # [B, N, n_new]
    acc = np.bitwise_xor.accumulate(sh * m[None, :, None], axis=1)
    order = np.repeat(np.arange(1, ngram_size), heads_per_ngram)  # acc index of each head
    mixed = np.swapaxes(acc[:, order, :], 1, 2)  # [B, n_new, heads]
    return np.remainder(mixed, np.asarray(vocab_sizes, np.int64)) + np.asarray(offsets, np.int64)


class PLE(nnx.Module):
    def __init__(self, cfg, dtype):
        w, h, d = cfg.hc_hidden, cfg.hidden_size, cfg.ple_embed_dim
        self.hc, self.hidden = cfg.hc_count, h
        self.kernel, self.dilation = cfg.ple_conv_kernel_size, cfg.ngram_size
        eps = cfg.rms_norm_eps
        self.key_proj = Linear(d, w, dtype)
        self.value_proj = Linear(d, h, dtype)
        self.norm_key = GroupedRMSNorm(w, h, eps, dtype)
        self.norm_query = GroupedRMSNorm(w, h, eps, dtype)
        self.norm_conv = GroupedRMSNorm(w, h, eps, dtype)
        self.conv1d = _ConvWeight(w, self.kernel, dtype)

    def __call__(self, h: jax.Array, emb: jax.Array, conv_state: jax.Array, valid: jax.Array,
                 verify: bool = False):
        """``h [B, T, hc*H]``, ``emb [B, T, D]`` (the looked-up n-gram rows), ``conv_state
        [B, hc*H, (K-1)*N]``, ``valid [B, T]``. Returns ``(out [B, T, hc*H], new conv_state)``;
        rows where ``valid`` is False do not enter the new state. ``verify``: the live state is
        not advanced; the conv inputs of the rows ``[B, T, hc*H]`` (zero where not valid) are
        returned in its place, for the commit of the accepted rows
        (:func:`~mtp_jax.models.qwen4_exp.slot_states.shift_register_commit`)."""
        b, t, w = h.shape
        emb = emb.astype(h.dtype)
        key = self.norm_key(self.key_proj(emb)).reshape(b, t, self.hc, self.hidden)
        value = self.value_proj(emb)
        query = self.norm_query(h).reshape(b, t, self.hc, self.hidden)
        g = jnp.sum((key * query).astype(jnp.float32), axis=-1) / jnp.sqrt(
            jnp.float32(self.hidden))
        g = jnp.sign(g) * jnp.sqrt(jnp.maximum(jnp.abs(g), 1e-6))
        gv = (jax.nn.sigmoid(g)[..., None] * value[:, :, None, :]).astype(h.dtype)
        gv = gv.reshape(b, t, w)
        gn = self.norm_conv(gv)
        gn = jnp.where(valid[..., None], gn, 0)
        L = conv_state.shape[-1]
        ext = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(jnp.float32),
                               gn.astype(jnp.float32)], axis=1)  # [B, L+T, W]
        wt = self.conv1d.weight[...][:, 0, :].astype(jnp.float32)  # [W, K]
        conv = sum(ext[:, j * self.dilation:j * self.dilation + t] * wt[:, j]
                   for j in range(self.kernel))
        out = gv + jax.nn.silu(conv).astype(h.dtype)
        length = jnp.sum(valid, axis=1).astype(jnp.int32)
        assert L == (self.kernel - 1) * self.dilation
        if verify:
            return out, gn.astype(conv_state.dtype)
        return out, shift_register_commit(conv_state, gn, None, length)


class _ConvWeight(nnx.Module):
    def __init__(self, channels: int, kernel: int, dtype):
        self.weight = nnx.Param(jnp.zeros((channels, 1, kernel), dtype))
