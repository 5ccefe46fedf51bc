"""PLE n-gram rows looked up inside the program (``ple_backend="device"``): the hash in jnp, the
tables on the accelerator as program inputs, no host callback.

Bit for bit the host path's rows (:func:`~mtp_jax.models.qwen4_exp.loaded.ple_rows` over
:func:`~mtp_jax.models.qwen4_exp.ple.ngram_ids` and the ``memory`` / ``disk`` tables). The
reference hashes in int64 (``mixed = XOR_s shifted_s * m_s``, ``id = mixed mod p_h + off_h``;
formula of HF transformers ``qwen4_exp``, see :mod:`~mtp_jax.models.qwen4_exp.ple`); JAX runs
with x64 off, so the 64-bit values are held as uint32 pairs ``(hi, lo)``:

* product ``token * m`` (``token [..]`` < 2^31, ``m`` a static Python int): the token in two
  16-bit halves, ``m`` in four 16-bit limbs; each partial product fits uint32; the 16-bit
  columns are summed with carries into ``(hi, lo)`` mod 2^64;
* XOR: of the pairs, word by word;
* remainder by a static prime ``p``: Horner from the top bit down in chunks of
  ``w = 32 - bit_length(max p)`` bits, ``r = ((r << w) | chunk) % p``, exact in uint32
  (``r < p``).

This equals numpy's int64 arithmetic because (checked at load, :func:`check_constants`) token
ids are below ``vocab_size`` < 2^31 and every multiplier has ``m * vocab_size < 2^63``: no
product wraps and every XOR is non-negative, so ``np.remainder`` is the unsigned remainder; the
head vocab sizes are < 2^31 and ``offset + p`` fits int32 and the table.

Shapes and dtypes: contexts ``[B, N-1]`` and ids ``[B, T]`` int32 (the history is ``[context |
ids]``, as ``ple_rows`` builds it); row ids ``[B, T, (N-1) * heads_per_ngram]`` int32; each PLE
layer's table ``[rows, ple_embed_dim / heads]`` in the model dtype (the host table's
``out_dtype``), a :class:`PLETable` variable (not an ``nnx.Param``: never trained); the rows
``[B, T, n_ple * ple_embed_dim]`` float32.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["PLETable", "PLEDevice", "AUTO_DEVICE_FRACTION", "choose_backend", "check_constants", "device_ngram_ids", "mul64",
           "mod_u64", "shifted_tokens_jnp"]

_M16 = 0xFFFF
# ple_backend="auto" copies the tables to an accelerator when they take at most this fraction
# of its memory (the rest stays for the weights and the KV / state pools).
AUTO_DEVICE_FRACTION = 0.25


def choose_backend(asked: str | None, table_bytes: int, device=None) -> str:
    """The PLE backend to load with: ``asked`` unless it is ``None`` or ``"auto"``; then
    ``"device"`` on an accelerator whose memory limit is known and at least
    ``table_bytes / AUTO_DEVICE_FRACTION``, else ``"disk"`` (the CPU, and tables too large,
    e.g. the released checkpoint's ~100 GB). ``table_bytes``: the tables' bytes in the model
    dtype (:func:`~mtp_jax.models.qwen4_exp.config.ple_table_bytes`). On the H200 the device
    lookup decodes the cut Flash-Next shape 2.6x faster than the host callback
    (docs/benchmarks.md, session 32)."""
    if asked not in (None, "auto"):
        return asked
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return "disk"
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return "device" if limit and table_bytes <= AUTO_DEVICE_FRACTION * limit else "disk"


class PLETable(nnx.Variable):
    """An n-gram table on the device: a program input that nothing trains or saves (the
    trainers take ``nnx.Param`` leaves only)."""


def _u32(v: int) -> jax.Array:
    return jnp.uint32(v)


def mul64(x: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """``x [...]`` uint32 (< 2^32) times the static ``m`` (0 <= m < 2^64): ``(hi, lo)`` uint32,
    the product mod 2^64."""
    x = x.astype(jnp.uint32)
    xs = (x & _u32(_M16), x >> _u32(16))
    ms = [(m >> (16 * j)) & _M16 for j in range(4)]
    digits = [jnp.zeros_like(x) for _ in range(4)]  # 16-bit columns, before carries
    for i, xi in enumerate(xs):
        for j, mj in enumerate(ms):
            k = i + j
            if k > 3 or mj == 0:
                continue
            p = xi * _u32(mj)  # < 2^32
            digits[k] = digits[k] + (p & _u32(_M16))
            if k + 1 <= 3:
                digits[k + 1] = digits[k + 1] + (p >> _u32(16))
    out, carry = [], jnp.zeros_like(x)
    for d in digits:  # each sum < 8 * 2^16: no overflow
        s = d + carry
        out.append(s & _u32(_M16))
        carry = s >> _u32(16)
    return out[3] << _u32(16) | out[2], out[1] << _u32(16) | out[0]


def _bits(hi: jax.Array, lo: jax.Array, start: int, width: int) -> jax.Array:
    """Bits ``[start, start + width)`` of the 64-bit ``(hi, lo)`` (static, width < 32)."""
    mask = _u32((1 << width) - 1)
    if start >= 32:
        return (hi >> _u32(start - 32)) & mask
    if start + width <= 32:
        return (lo >> _u32(start)) & mask
    return ((lo >> _u32(start)) | (hi << _u32(32 - start))) & mask


def mod_u64(hi: jax.Array, lo: jax.Array, p: Sequence[int]) -> jax.Array:
    """``(hi, lo) [..., H]`` mod ``p [H]`` (static, 2 <= p < 2^31), uint32: Horner over chunks
    of ``w = 32 - bit_length(max p)`` bits from the top (``r < p`` keeps ``r << w`` < 2^32)."""
    w = 32 - max(p).bit_length()
    pv = jnp.asarray(np.asarray(p, np.uint32))
    n = -(-64 // w)
    r = jnp.zeros(jnp.broadcast_shapes(hi.shape, pv.shape), jnp.uint32)
    top = 64
    for c in range(n):
        width = top - (n - 1 - c) * w if c == 0 else w
        top -= width
        r = ((r << _u32(width)) | _bits(hi, lo, top, width)) % pv
    return r


def shifted_tokens_jnp(history: jax.Array, n_shifts: int, eos: int, n_new: int) -> jax.Array:
    """:func:`~mtp_jax.models.qwen4_exp.ple.shifted_tokens` for shifts ``0..n_shifts-1``:
    ``history [B, L]`` int32 (L > n_new) -> ``[B, S, n_new]`` int32."""
    n = history.shape[1]
    idx = jnp.arange(n, dtype=jnp.int32)
    pos = idx[n - n_new:]
    # The last eos strictly before each of the last n_new positions (-1: none).
    prev = jax.lax.cummax(jnp.where(history == eos, idx[None], -1), axis=1)[:, n - n_new - 1:n - 1]
    shifts = jnp.arange(n_shifts, dtype=jnp.int32)
    src = pos[None, :] - shifts[:, None]  # [S, n_new]
    out = history[:, jnp.maximum(src, 0)]  # [B, S, n_new]
    ok = ((pos[None, :] - (prev + 1))[:, None, :] >= shifts[None, :, None]) & (src >= 0)
    return jnp.where(ok, out, jnp.int32(eos))


def device_ngram_ids(history: jax.Array, n_new: int, multipliers, vocab_sizes, offsets,
                     ngram_size: int, heads_per_ngram: int, eos: int) -> jax.Array:
    """:func:`~mtp_jax.models.qwen4_exp.ple.ngram_ids` in jnp: ``history [B, L]`` int32
    (L >= n_new + N - 1) -> row ids ``[B, n_new, (N-1) * heads_per_ngram]`` int32."""
    sh = shifted_tokens_jnp(history.astype(jnp.int32), ngram_size, eos, n_new)
    acc, accs = None, []
    for s in range(ngram_size):
        hi, lo = mul64(sh[:, s], int(multipliers[s]))
        acc = (hi, lo) if acc is None else (acc[0] ^ hi, acc[1] ^ lo)
        accs.append(acc)
    order = np.repeat(np.arange(1, ngram_size), heads_per_ngram)  # acc index of each head
    hi = jnp.stack([accs[i][0] for i in order], axis=-1)  # [B, n_new, heads]
    lo = jnp.stack([accs[i][1] for i in order], axis=-1)
    r = mod_u64(hi, lo, [int(p) for p in vocab_sizes]).astype(jnp.int32)
    return r + jnp.asarray(np.asarray(offsets, np.int32))


def check_constants(vocab_size: int, multipliers, vocab_sizes, offsets, rows: int,
                    where: str = "") -> None:
    """The bounds the device hash relies on (module docstring); ValueError naming the one
    that fails."""
    at = f" ({where})" if where else ""
    if not 0 < vocab_size < 2 ** 31:
        raise ValueError(f"ple_backend='device': vocab_size {vocab_size} must be < 2^31{at}.")
    for m in multipliers:
        if int(m) < 0 or int(m) * vocab_size >= 2 ** 63:
            raise ValueError(f"ple_backend='device': n-gram multiplier {m} times vocab_size "
                             f"{vocab_size} is not below 2^63{at}: the 64-bit hash would wrap; "
                             "use ple_backend='disk' or 'memory'.")
    for p, o in zip(vocab_sizes, offsets):
        if not (2 <= int(p) < 2 ** 31 and 0 <= int(o) and int(o) + int(p) < 2 ** 31):
            raise ValueError(f"ple_backend='device': n-gram head size {p} at offset {o} must be "
                             f"in [2, 2^31) with offset + size < 2^31{at}.")
        if int(o) + int(p) > rows:
            raise ValueError(f"ple_backend='device': n-gram head at offset {o} of size {p} "
                             f"passes the table's {rows} rows{at}.")


class PLEDevice(nnx.Module):
    """The device lookup of every PLE layer: its table (:class:`PLETable`) and hash constants
    (static). ``hosts``: the loader's :class:`~mtp_jax.models.qwen4_exp.loaded.PLEHost` list;
    each table gives its device rows by ``device_rows()`` (a real table: all its rows in its
    ``out_dtype``; a synthetic one: fewer rows, read at ``id mod`` their count)."""

    def __init__(self, cfg, hosts):
        self.ngram_size, self.heads = cfg.ngram_size, cfg.heads_per_ngram
        self.eos, self.dim = cfg.eos_token_id, cfg.ple_embed_dim
        consts, wrap, tables = [], [], []
        for h in hosts:
            check_constants(cfg.vocab_size, h.multipliers[:cfg.ngram_size], h.vocab_sizes,
                            h.offsets, h.table.rows, f"PLE layer {h.layer}")
            rows = np.asarray(h.table.device_rows())
            consts.append((tuple(int(m) for m in h.multipliers[:cfg.ngram_size]),
                           tuple(int(p) for p in h.vocab_sizes),
                           tuple(int(o) for o in h.offsets)))
            wrap.append(int(rows.shape[0]) if rows.shape[0] < h.table.rows else 0)
            tables.append(PLETable(jnp.asarray(rows)))
        self.consts, self.wrap = tuple(consts), tuple(wrap)
        self.tables = nnx.List(tables)

    @property
    def nbytes(self) -> int:
        """Device bytes of the tables."""
        return sum(int(t[...].size) * t[...].dtype.itemsize for t in self.tables)

    def __call__(self, contexts: jax.Array, ids: jax.Array) -> jax.Array:
        """``contexts [B, N-1]``, ``ids [B, T]`` int -> rows ``[B, T, n_ple * ple_embed_dim]``
        float32 (:func:`~mtp_jax.models.qwen4_exp.loaded.ple_rows`)."""
        ids = ids.astype(jnp.int32)
        b, t = ids.shape
        hist = jnp.concatenate([contexts.astype(jnp.int32).reshape(b, -1), ids], axis=1)
        out = []
        for (mult, sizes, offs), wrap, table in zip(self.consts, self.wrap, self.tables):
            g = device_ngram_ids(hist, t, mult, sizes, offs, self.ngram_size, self.heads,
                                 self.eos)
            if wrap:
                g = g % jnp.int32(wrap)
            rows = jnp.take(table[...], g, axis=0, mode="clip")  # ids are in range (checked)
            out.append(rows.reshape(b, t, self.dim).astype(jnp.float32))
        return jnp.concatenate(out, axis=-1)
