"""A loaded qwen4_exp model: a :class:`~mtp_jax.models.loaded.LoadedModel` with its PLE n-gram
tables on the host (and, with ``ple_backend="device"``, on the accelerator too).

The engine serves it like every family: its programs look the PLE rows of their tokens up on the
host from inside the program (:mod:`~mtp_jax.models.qwen4_exp.ple_callback`), or, with the
device backend, in the program from the device tables
(:mod:`~mtp_jax.models.qwen4_exp.ple_device`, no host callback). The research API
(``forward``, ``mtp_forward``) is jit- and grad-able: inside a traced function the PLE rows are
looked up by a host callback (``jax.pure_callback``) or, with device tables, in the program.
``new_cache`` / ``extend`` decode with a cache outside the engine (prefill mode, every row
committed; their rows are looked up on the host, every backend keeps the host tables).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.models.loaded import DTYPES, LoadedModel
from mtp_jax.models.qwen4_exp.ple import ngram_ids
from mtp_jax.models.qwen4_exp.pools import QSAPaged, Qwen4Slots

__all__ = ["PLEHost", "PLETables", "ple_rows", "LoadedQwen4Exp", "Qwen4Cache"]

PAGE = 16


@dataclasses.dataclass
class PLEHost:
    """Host side of one PLE layer: its table (:class:`~mtp_jax.models.qwen4_exp.ple_store.
    NgramTable`) and hash constants."""

    layer: int
    table: object
    multipliers: tuple[int, ...]
    vocab_sizes: tuple[int, ...]
    offsets: tuple[int, ...]


class PLETables(list):
    """The :class:`PLEHost` of every PLE layer, in layer order (a list that can be weakly
    referenced: :mod:`~mtp_jax.models.qwen4_exp.ple_callback` holds it so)."""


def ple_rows(cfg, ple: Sequence[PLEHost], contexts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The PLE rows of ``ids [B, T]`` following ``contexts [B, N-1]`` int (the ``N-1`` ids
    before each row's first token, eos before a request's start): ``[B, T, n_ple *
    ple_embed_dim]`` float32, the rows of every PLE layer of ``ple`` concatenated in layer
    order (each ``(N-1) * heads_per_ngram`` table rows of ``ple_embed_dim /`` that many
    values). Reads only the tables (thread-safe)."""
    ids = np.asarray(ids, np.int64)
    hist = np.concatenate([np.asarray(contexts, np.int64).reshape(ids.shape[0], -1), ids], 1)
    d = cfg.ple_embed_dim
    out = np.empty((*ids.shape, len(ple) * d), np.float32)
    for j, p in enumerate(ple):
        g = ngram_ids(hist, ids.shape[1], p.multipliers, p.vocab_sizes, p.offsets,
                      cfg.ngram_size, cfg.heads_per_ngram, cfg.eos_token_id)
        out[..., j * d:(j + 1) * d] = p.table.lookup(g).reshape(*ids.shape, d)
    return out


@dataclasses.dataclass(eq=False)
class LoadedQwen4Exp(LoadedModel):
    """``ple``: one :class:`PLEHost` per PLE layer, in layer order. Hidden states of this family
    are the pre-mixer residual streams ``[B, T, hc*H]``."""

    ple: list = dataclasses.field(default_factory=list, repr=False)

    # ---- PLE rows (host) ---------------------------------------------------------------------
    @property
    def host_row_width(self) -> int:
        """Floats per token of :meth:`host_rows` (``n_ple * ple_embed_dim``; 0 without PLE)."""
        return len(self.cfg.ple_layers) * self.cfg.ple_embed_dim

    def ngram_context(self, before: Sequence[int]) -> np.ndarray:
        """The n-gram context ``[N-1]`` int64 of a token after ``before`` (the request's
        committed tokens): its last ``ngram_size - 1`` ids, eos in front where there are
        fewer (a request starts after an eos)."""
        n = self.cfg.ngram_size - 1
        eos = self.cfg.eos_token_ids[0] if self.cfg.eos_token_ids else 0
        tail = list(before[-n:]) if n else []
        return np.asarray([eos] * (n - len(tail)) + tail, np.int64)

    def host_rows(self, contexts: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The PLE rows of ``ids [B, T]`` following ``contexts [B, N-1]`` (:meth:`ngram_context`):
        ``[B, T, host_row_width]`` float32 (:func:`ple_rows`)."""
        return ple_rows(self.cfg, self.ple, contexts, ids)

    @property
    def device_tables(self) -> bool:
        """Whether the n-gram tables are on the device (``ple_backend="device"``): the
        programs look their rows up there."""
        return bool(self.cfg.ple_layers) and "ple_device" in self.params

    @property
    def host_callbacks(self) -> bool:
        """True with PLE layers whose tables stay on the host: the engine's programs look their
        rows up there (:mod:`~mtp_jax.models.qwen4_exp.ple_callback`). False with device
        tables (and without PLE layers)."""
        return bool(self.cfg.ple_layers) and not self.device_tables

    @property
    def extra_weight_bytes(self) -> int:
        """Device bytes of the n-gram tables with ``ple_backend="device"`` (0 otherwise)."""
        if "ple_device" not in self.params:
            return 0
        return sum(int(a.size) * a.dtype.itemsize
                   for a in jax.tree.leaves(self.params["ple_device"]))

    def _fresh_rows(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`host_rows` of whole sequences ``ids [B, T]`` (each starting a request)."""
        ids = np.asarray(ids)
        ctx = np.stack([self.ngram_context([]) for _ in range(ids.shape[0])])
        return self.host_rows(ctx, ids)

    def traced_rows(self, ids: jax.Array, params=None) -> jax.Array:
        """:meth:`host_rows` of whole sequences ``ids [B, T]`` (traced or not):
        ``[B, T, host_row_width]`` float32; with device tables looked up in jnp from
        ``params``' tables (default: the model's), else through a host callback."""
        if self.device_tables:
            ids = jnp.asarray(ids, jnp.int32)
            ctx = jnp.asarray(np.stack([self.ngram_context([])] * ids.shape[0]), jnp.int32)
            return self.module(params).ple_device(ctx, ids)
        shape = jax.ShapeDtypeStruct((*ids.shape, self.host_row_width), jnp.float32)
        return jax.pure_callback(self._fresh_rows, shape, ids)

    # ---- research API ------------------------------------------------------------------------
    def forward(self, input_ids, params=None):
        """``input_ids [B, T]`` -> ``(logits [B, T, V] f32, streams [B, T, hc*H])``, the
        sequences starting a request; ``streams`` are the pre-mixer residual streams (what the
        MTP head reads). ``params``: a pytree shaped like :attr:`params` (may be traced: the
        function can be jitted and differentiated; the ids may be traced too).
        Raises ValueError for ids that are not ``[B, T]``."""
        ids = jnp.asarray(input_ids, jnp.int32)
        if ids.ndim != 2:
            raise ValueError(f"forward takes input_ids [B, T]; got shape {ids.shape}. Add a batch "
                             "axis (e.g. ids[None]).")
        # Device tables: the program looks the rows up itself, from params' tables.
        rows = None if self.device_tables else self.traced_rows(ids)
        return _JIT_FORWARD(self.graphdef, self.params if params is None else params, ids, rows)

    def mtp_forward(self, hidden_states, next_token_ids, params=None):
        """Teacher-forced MTP rows at positions ``0..T-1``: ``hidden_states [B, T, hc*H]``
        (target streams, or a previous ``mtp_streams`` for a chained step), ``next_token_ids
        [B, T]``, ``params`` as for :meth:`forward`. Returns ``(logits [B, T, V] f32,
        mtp_streams [B, T, hc*H])``. ValueError without the draft."""
        if not self.has_mtp:
            raise ValueError("this model was loaded without its mtp.* draft; use "
                             "load_model(path, with_mtp=True).")
        return _JIT_MTP(self.graphdef, self.params if params is None else params,
                        jnp.asarray(hidden_states), jnp.asarray(next_token_ids, jnp.int32))

    # ---- cached decoding outside the engine --------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> "Qwen4Cache":
        """A decode cache for ``batch`` requests of up to ``max_len`` tokens."""
        per = -(-max_len // PAGE)
        table = 1 + jnp.arange(batch * per, dtype=jnp.int32).reshape(batch, per)
        dt = DTYPES[self.dtype]
        return Qwen4Cache(QSAPaged.zeros(self.cfg, len(self.cfg.full_layer_ids),
                                         1 + batch * per, PAGE, dt),
                          Qwen4Slots.zeros(self.cfg, batch, dt), table,
                          [[] for _ in range(batch)], 0)

    def extend(self, cache: "Qwen4Cache", ids) -> jax.Array:
        """Run ``ids [B, T]`` after the cache's tokens (prefill or decode), every row committed.
        Returns the logits ``[B, T, V]`` float32 and updates ``cache`` in place."""
        ids = np.asarray(ids)
        b, t = ids.shape
        ctx = np.stack([self.ngram_context(h) for h in cache.tokens])
        rows = self.host_rows(ctx, ids)
        pos = np.broadcast_to(np.arange(cache.length, cache.length + t, dtype=np.int32), (b, t))
        batch = AttentionBatch(jnp.asarray(pos), jnp.ones((b, t), bool), cache.page_table)
        logits, cache.paged, cache.slots = _JIT_EXTEND(
            self.graphdef, self.params, jnp.asarray(ids, jnp.int32), jnp.asarray(rows), batch,
            cache.paged, cache.slots)
        for h, row in zip(cache.tokens, ids.tolist()):
            h.extend(row)
        cache.length += t
        return logits


@dataclasses.dataclass
class Qwen4Cache:
    """Decode cache of ``B`` requests outside the engine: ``paged``, ``slots`` (the batch
    view), ``page_table [B, pages]`` int32, ``tokens`` (per request, host) and ``length``."""

    paged: QSAPaged
    slots: Qwen4Slots
    page_table: jax.Array
    tokens: list
    length: int


def _scratch(cfg, b, t, dtype, layers):
    per = -(-t // PAGE)
    table = 1 + jnp.arange(b * per, dtype=jnp.int32).reshape(b, per)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    paged = QSAPaged.zeros(cfg, layers, 1 + b * per, PAGE, dtype)
    return AttentionBatch(pos, jnp.ones((b, t), bool), table), paged


@functools.partial(jax.jit, static_argnums=(0,))
def _JIT_FORWARD(graphdef, params, ids, rows):
    model = nnx.merge(graphdef, params)
    b, t = ids.shape
    dtype = model.embed_tokens.weight.dtype
    batch, paged = _scratch(model.cfg, b, t, dtype, len(model.cfg.full_layer_ids))
    streams, _, _ = model(ids, batch, paged, Qwen4Slots.zeros(model.cfg, b, dtype),
                          host_rows=rows)
    return model.logits(streams), streams


@functools.partial(jax.jit, static_argnums=(0,))
def _JIT_MTP(graphdef, params, streams, next_ids):
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b, t = next_ids.shape
    batch, draft = _scratch(cfg, b, t, model.embed_tokens.weight.dtype, cfg.mtp_num_hidden_layers)
    y, _ = model.mtp(model.embed_tokens, streams, next_ids, batch, draft)
    return model.draft_logits(y)[0], y


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(5, 6))
def _JIT_EXTEND(graphdef, params, ids, rows, batch, paged, slots):
    model = nnx.merge(graphdef, params)
    streams, paged, slots = model(ids, batch, paged, slots, host_rows=rows)
    return model.logits(streams), paged, slots
