"""Load a qwen4_exp checkpoint folder: dense tensors into the Flax model, PLE n-gram tables into
host-side :class:`~mtp_jax.models.qwen4_exp.ple_store.NgramTable` (memory or disk backend), the
int64 hash buffers checked against the config.

``load_qwen4_exp(path)`` returns a :class:`LoadedQwen4Exp` whose ``forward`` / ``mtp_forward``
mirror :class:`mtp_jax.models.loaded.LoadedModel` (hidden states of this family are the
pre-mixer residual streams ``[B, T, hc*H]``), plus cached decoding over a :class:`Qwen4Cache`:
``extend`` (prefill or decode), built from the split step the engine overlaps::

    start_step(cache, ids)            head program: embedding + layers before the first PLE layer
    lookup(context, ids)              host: n-gram ids, table rows, upload (thread-safe)
    finish_step(cache, pending, rows) tail program: the rest, with the rows as an input array
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.models.loaded import DTYPES, NP_DTYPES, resolve_dtype
from mtp_jax.models.qwen4_exp import names
from mtp_jax.models.qwen4_exp.config import (Qwen4ExpConfig, head_offsets, head_vocab_sizes,
                                             layer_multipliers, ngram_table_rows)
from mtp_jax.models.qwen4_exp.model import Qwen4ExpModel, Qwen4State, state_merge, state_part
from mtp_jax.models.qwen4_exp.ple import ngram_ids
from mtp_jax.models.qwen4_exp.ple_store import NgramTable
from mtp_jax.models.qwen4_exp.slot_states import check_slot_states, token_register_commit
from mtp_jax.weights.safetensors_files import (_FLOAT_DTYPES, CheckpointError, _Files, _read,
                                               checkpoint_files, read_header)

_EXPERT = re.compile(r"^(?P<p>.*)mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.weight$")
_TABLE = re.compile(r"^layers\.(?P<l>\d+)\.ple\.ple_embedding\.ngram_embedding"
                    r"(?:\.shard_(?P<s>\d+))?\.weight$")
_BUFFER = re.compile(r"^layers\.(?P<l>\d+)\.ple\.ple_embedding\.(?P<b>layer_multipliers|"
                     r"ngram_heads_vocab_sizes|ngram_heads_offsets)$")
PAGE = 16


def _param_name(path) -> str:
    return ".".join(str(p) for p in path)


@dataclasses.dataclass
class PLEHost:
    """Host side of one PLE layer: table + hash constants."""

    layer: int
    table: NgramTable
    multipliers: tuple[int, ...]
    vocab_sizes: tuple[int, ...]
    offsets: tuple[int, ...]


def read_checkpoint(path: str, cfg: Qwen4ExpConfig, expected: dict[str, tuple], *, dtype: str,
                    with_mtp: bool, ple_backend: str = "disk"):
    """Read every dense tensor of ``expected`` and the PLE tables / buffers.

    Returns ``(arrays: name -> np.ndarray, ple: list[PLEHost])``. Raises CheckpointError listing
    missing, unexpected, mis-shaped tensors and buffer/config conflicts before reading data.
    """
    files, _ = checkpoint_files(path)
    single, parts, tables, buffers, unexpected = {}, {}, {}, {}, []
    for fn in files:
        for disk, t in read_header(os.path.join(path, fn)).items():
            c = names.canonical_name(disk)
            if c is None or c.endswith("rotary_emb.inv_freq"):
                continue
            if c.startswith("mtp.") and not with_mtp:
                continue
            if c in expected:
                single.setdefault(c, []).append(t)
            elif c.endswith(".weight") and c[:-7] in expected and "mlp.experts." in c:
                single.setdefault(c[:-7], []).append(t)
            elif (m := _EXPERT.match(c)) and (
                    m["p"] + ("mlp.experts.down_proj" if m["proj"] == "down_proj"
                              else "mlp.experts.gate_up_proj")) in expected:
                tgt = m["p"] + ("mlp.experts.down_proj" if m["proj"] == "down_proj"
                                else "mlp.experts.gate_up_proj")
                parts.setdefault(tgt, {})[(int(m["e"]), m["proj"])] = t
            elif (m := _TABLE.match(c)) and int(m["l"]) in cfg.ple_layers:
                tables.setdefault(int(m["l"]), {})[-1 if m["s"] is None else int(m["s"])] = t
            elif (m := _BUFFER.match(c)) and int(m["l"]) in cfg.ple_layers:
                buffers[(int(m["l"]), m["b"])] = t
            else:
                unexpected.append(disk)
    problems, plans = [], []
    for c, shape in expected.items():
        s = single.get(c, [])
        if len(s) > 1:
            problems.append(f"{c} stored more than once")
        elif s:
            if s[0].dtype not in _FLOAT_DTYPES:
                problems.append(f"{c} stored as {s[0].dtype} (F16/BF16/F32 supported)")
            elif tuple(s[0].shape) != tuple(shape):
                problems.append(f"{c} has shape {list(s[0].shape)}, config expects {list(shape)}")
            else:
                plans.append((c, s[0], None))
        elif c in parts:
            p = parts[c]
            e = shape[0]
            projs = ("down_proj",) if c.endswith("down_proj") else ("gate_proj", "up_proj")
            gaps = [(i, q) for i in range(e) for q in projs if (i, q) not in p]
            if gaps or len(p) != e * len(projs):
                problems.append(f"{c}: per-expert tensors incomplete (missing {gaps[:4]}, "
                                f"num_experts={cfg.num_experts})")
            else:
                plans.append((c, None, p))
        else:
            problems.append(f"{c} missing")
    ple: list[PLEHost] = []
    for j, layer in enumerate(cfg.ple_layers):
        sh = tables.get(layer, {})
        if not sh:
            problems.append(f"PLE layer {layer + 1} (one-indexed) has no n-gram table "
                            f"(layers.{layer}.ple.ple_embedding.ngram_embedding.shard_*.weight)")
            continue
        if -1 in sh and len(sh) > 1:
            problems.append(f"PLE layer {layer}: both a whole table and shards are stored")
            continue
        order = sorted(sh)
        if order != [-1] and order != list(range(len(order))):
            problems.append(f"PLE layer {layer}: n-gram shards {order} are not 0..n-1")
            continue
        if order != [-1] and len(order) != cfg.split_ngram_parts:
            problems.append(f"PLE layer {layer}: {len(order)} n-gram shards stored but "
                            f"split_ngram_parts is {cfg.split_ngram_parts}")
        shards = [sh[k] for k in order]
        rows = sum(t.shape[0] for t in shards)
        want = ngram_table_rows(cfg, j)
        if rows != want or any(t.shape[1] != cfg.ngram_head_dim for t in shards):
            problems.append(f"PLE layer {layer}: n-gram table is {rows} x "
                            f"{shards[0].shape[1]} but the config gives {want} x "
                            f"{cfg.ngram_head_dim} (ngram_vocab_size_base, heads_per_ngram, "
                            "ngram_size, ple_embed_dim)")
            continue
        derived = {"layer_multipliers": layer_multipliers(cfg, j),
                   "ngram_heads_vocab_sizes": head_vocab_sizes(cfg, j)}
        derived["ngram_heads_offsets"] = head_offsets(derived["ngram_heads_vocab_sizes"])
        vals = {}
        for b, d in derived.items():
            t = buffers.get((layer, b))
            if t is None:
                vals[b] = d  # not stored: use the values the config defines
                continue
            fh = _Files()
            try:
                raw = np.frombuffer(fh.get(t.file), dtype="<i8", count=int(np.prod(t.shape)),
                                    offset=t.start).copy()
            finally:
                fh.close()
            if t.dtype != "I64" or tuple(raw.tolist()) != tuple(d):
                problems.append(f"PLE layer {layer}: stored {b} {raw.tolist()} ({t.dtype}) "
                                f"differs from the config's {list(d)} (seed={cfg.seed}, "
                                f"vocab_size={cfg.vocab_size}, ngram_vocab_size_base="
                                f"{cfg.ngram_vocab_size_base})")
            vals[b] = tuple(int(x) for x in raw)
        table = NgramTable(shards, ple_backend, NP_DTYPES[dtype]) if not problems else None
        ple.append(PLEHost(layer, table, vals["layer_multipliers"],
                           vals["ngram_heads_vocab_sizes"], vals["ngram_heads_offsets"]))
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) not expected by the config: "
                        f"{unexpected[:8]}")
    if problems:
        raise CheckpointError(f"cannot load qwen4_exp checkpoint {path}:\n- "
                              + "\n- ".join(problems))
    out, fh = {}, _Files()
    try:
        for c, t, p in plans:
            shape = expected[c]
            if t is not None:
                out[c] = _read(fh, t).astype(NP_DTYPES[dtype])
                continue
            arr = np.empty(shape, NP_DTYPES[dtype])
            half = shape[1] // 2
            for (e, proj), ti in p.items():
                raw = _read(fh, ti)
                if proj == "down_proj":
                    arr[e] = raw
                elif proj == "gate_proj":
                    arr[e, :half] = raw
                else:
                    arr[e, half:] = raw
            out[c] = arr
    finally:
        fh.close()
    return out, ple


@dataclasses.dataclass
class LoadedQwen4Exp:
    cfg: Qwen4ExpConfig
    dtype: str
    graphdef: object
    params: object
    has_mtp: bool
    ple: list[PLEHost]

    def module(self, params=None):
        return nnx.merge(self.graphdef, self.params if params is None else params)

    # ---- PLE (host) -------------------------------------------------------------------------
    def ngram_context(self, batch: int) -> np.ndarray:
        """A fresh request's n-gram context: ``ngram_size - 1`` eos ids per row (0 when the
        config has no eos, which only a model without PLE layers may have)."""
        eos = self.cfg.eos_token_ids[0] if self.cfg.eos_token_ids else 0
        return np.full((batch, self.cfg.ngram_size - 1), eos, np.int64)

    def ple_rows(self, context: np.ndarray, ids: np.ndarray):
        """Look up the PLE rows of ``ids [B, T]`` after ``context [B, N-1]``.
        Returns ``(rows: tuple per PLE layer of [B, T, D], new context [B, N-1])``."""
        cfg = self.cfg
        ids = np.asarray(ids, np.int64)
        hist = np.concatenate([np.asarray(context, np.int64), ids], axis=1)
        out = []
        for p in self.ple:
            g = ngram_ids(hist, ids.shape[1], p.multipliers, p.vocab_sizes, p.offsets,
                          cfg.ngram_size, cfg.heads_per_ngram, cfg.eos_token_id)
            r = p.table.lookup(g)
            out.append(r.reshape(*ids.shape, -1))
        return tuple(out), token_register_commit(context, ids, None, ids.shape[1])

    # ---- cache-free research API -------------------------------------------------------------
    @property
    def _forward(self):
        return _JIT_FORWARD

    @property
    def _mtp_forward(self):
        return _JIT_MTP

    def forward(self, input_ids, params=None):
        """``input_ids [B, T]`` -> ``(logits [B, T, V] f32, streams [B, T, hc*H])`` where
        ``streams`` are the pre-mixer residual streams (what the MTP head reads). ``params``: a
        pytree shaped like :attr:`params` to run with instead (may be traced); the ids must be
        concrete (the PLE rows are looked up on the host)."""
        ids = np.asarray(input_ids)
        rows, _ = self.ple_rows(self.ngram_context(ids.shape[0]), ids)
        return self._forward(self.graphdef, self.params if params is None else params,
                             jnp.asarray(ids, jnp.int32), tuple(jnp.asarray(r) for r in rows))

    def mtp_forward(self, hidden_states, next_token_ids, params=None):
        """Teacher-forced MTP rows at positions ``0..T-1``: ``hidden_states [B, T, hc*H]``
        (target streams, or a previous ``mtp_streams`` for a chained step), ``next_token_ids
        [B, T]``, ``params`` as for :meth:`forward`. Returns ``(logits [B, T, V] f32,
        mtp_streams [B, T, hc*H])``."""
        if not self.has_mtp:
            raise ValueError("this model was loaded without its mtp.* draft; use "
                             "load_model(path, with_mtp=True).")
        return self._mtp_forward(self.graphdef, self.params if params is None else params,
                                 jnp.asarray(hidden_states), jnp.asarray(next_token_ids, jnp.int32))

    # ---- cached decoding --------------------------------------------------------------------
    @functools.cached_property
    def _leaves(self) -> tuple:
        """The parameters as a flat tuple of arrays (flattened once, not per call)."""
        return tuple(jax.tree_util.tree_leaves(self.params))

    @functools.cached_property
    def _programs(self) -> "_StepPrograms":
        return _step_programs(self.graphdef, jax.tree_util.tree_structure(self.params))

    @property
    def split_layer(self) -> int:
        """First PLE layer (0-based), or ``num_hidden_layers`` without PLE: a step runs layers
        ``[0, split_layer)`` (the head program, which needs no PLE rows) and then
        ``[split_layer, L)`` + mixer + ``lm_head`` (the tail program, which takes the rows)."""
        return self.cfg.ple_layers[0] if self.cfg.ple_layers else self.cfg.num_hidden_layers

    def new_cache(self, batch: int, max_len: int) -> "Qwen4Cache":
        """A decode cache for ``batch`` requests of up to ``max_len`` tokens."""
        per = -(-max_len // PAGE)
        table = 1 + jnp.arange(batch * per, dtype=jnp.int32).reshape(batch, per)
        state = Qwen4State.zeros(self.cfg, num_pages=1 + batch * per, page_size=PAGE,
                                 slots=batch, dtype=DTYPES[self.dtype])
        return Qwen4Cache(state, table, self.ngram_context(batch), 0)

    def lookup(self, context: np.ndarray, ids) -> tuple[tuple, np.ndarray]:
        """Host side of a step: n-gram ids and table rows of ``ids [B, T]`` after ``context``,
        uploaded. Returns ``(rows: per PLE layer [B, T, ple_embed_dim] device arrays, new
        context)``. Reads only the tables (safe on a worker thread)."""
        rows, ctx = self.ple_rows(context, np.asarray(ids))
        return tuple(jax.device_put(r) for r in rows), ctx

    def start_step(self, cache: "Qwen4Cache", ids) -> "PendingStep":
        """Dispatch the head program (embedding + layers before the first PLE layer) for
        ``ids [B, T]`` (host or device int array) at the cache's next positions. Asynchronous:
        returns at once; the device runs it while the host looks the PLE rows up."""
        b, t = ids.shape
        pos = np.broadcast_to(np.arange(cache.length, cache.length + t, dtype=np.int32), (b, t))
        batch = AttentionBatch(pos, np.ones((b, t), bool), cache.page_table)
        stop = self.split_layer
        h, part = self._programs.head(self._leaves, jnp.asarray(ids, jnp.int32), batch,
                                      state_part(cache.state, self.cfg, 0, stop), stop)
        cache.state = state_merge(cache.state, part, self.cfg, 0, stop)
        return PendingStep(h, batch, t)

    def finish_step(self, cache: "Qwen4Cache", pending: "PendingStep", rows: tuple,
                    context: np.ndarray, *, last_only: bool = False) -> jax.Array:
        """Dispatch the tail program (layers from the first PLE layer on, mixer, ``lm_head``)
        with the looked-up ``rows`` as inputs; advance the cache by the step's rows.
        Returns logits ``[B, T, V]`` float32 (``[B, 1, V]``, the last row, with
        ``last_only``), not yet on the host."""
        start, stop = self.split_layer, self.cfg.num_hidden_layers
        logits, part = self._programs.tail(self._leaves, pending.h, tuple(rows), pending.batch,
                                           state_part(cache.state, self.cfg, start, stop),
                                           start, last_only and pending.rows > 1)
        cache.state = state_merge(cache.state, part, self.cfg, start, stop)
        cache.ngram_context = context
        cache.length += pending.rows
        return logits

    def extend(self, cache: "Qwen4Cache", ids) -> jax.Array:
        """Run ``ids [B, T]`` after the cache's tokens (prefill or decode): head program, PLE
        lookup on the host while it runs, tail program. Returns the logits ``[B, T, V]`` and
        updates ``cache`` in place."""
        pending = self.start_step(cache, np.asarray(ids))
        rows, ctx = self.lookup(cache.ngram_context, ids)
        return self.finish_step(cache, pending, rows, ctx)


@dataclasses.dataclass
class Qwen4Cache:
    """Decode cache of ``B`` requests: ``state`` (:class:`Qwen4State`), ``page_table [B,
    pages]`` int32, ``ngram_context [B, ngram_size-1]`` int64 (host) and ``length``, the tokens
    cached per request."""

    state: Qwen4State
    page_table: jax.Array
    ngram_context: np.ndarray
    length: int


@dataclasses.dataclass
class PendingStep:
    """A step whose head program is dispatched: ``h [B, T, hc*H]`` streams after layers
    ``[0, split_layer)``, the step's :class:`AttentionBatch` and its row count."""

    h: jax.Array
    batch: AttentionBatch
    rows: int


def _scratch(cfg, b, t, dtype, n_qsa=None):
    per = -(-t // PAGE)
    table = 1 + jnp.arange(b * per, dtype=jnp.int32).reshape(b, per)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    state = Qwen4State.zeros(cfg, num_pages=1 + b * per, page_size=PAGE, slots=b, dtype=dtype,
                             num_qsa=n_qsa)
    return AttentionBatch(pos, jnp.ones((b, t), bool), table), state


def _forward_fn(graphdef, params, ids, ple_rows):
    model = nnx.merge(graphdef, params)
    b, t = ids.shape
    batch, state = _scratch(model.cfg, b, t, model.embed_tokens.weight.dtype)
    streams, _ = model(ids, ple_rows, batch, state)
    return model.logits(streams), streams


def _mtp_forward_fn(graphdef, params, streams, next_ids):
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b, t = next_ids.shape
    batch, state = _scratch(cfg, b, t, model.embed_tokens.weight.dtype,
                            n_qsa=cfg.mtp_num_hidden_layers)
    z, y, _, _, _ = model.mtp(model.embed_tokens, streams, next_ids, batch, state.kv, state.idx,
                              state.open_idx)
    return model.head(z), y


@dataclasses.dataclass(frozen=True)
class _StepPrograms:
    """Jitted head and tail programs of one model structure: ``head(leaves, ids, batch, part,
    stop)`` and ``tail(leaves, h, ple_rows, batch, part, start, last_only)``; each donates the
    states of its own layers (``part``)."""

    head: object
    tail: object


_STEP_PROGRAMS: dict = {}


def _step_programs(graphdef, treedef) -> _StepPrograms:
    """The step programs of a model structure, built once and shared by every model loaded with
    it. They close over the graphdef (hashing it as a static argument on every call costs the
    host milliseconds on a large model) and take the parameters as a flat tuple of arrays."""
    key = (graphdef, treedef)
    if key not in _STEP_PROGRAMS:
        def model_of(leaves):
            return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))

        def head(leaves, ids, batch, part, stop):
            model = model_of(leaves)
            return model.run_layers(model.embed(ids), (), batch, part, 0, stop)

        def tail(leaves, h, ple_rows, batch, part, start, last_only):
            model = model_of(leaves)
            h, part = model.run_layers(h, ple_rows, batch, part, start,
                                       model.cfg.num_hidden_layers)
            if last_only:
                h = h[:, -1:]
            return model.logits(h), part

        _STEP_PROGRAMS[key] = _StepPrograms(
            jax.jit(head, static_argnums=(4,), donate_argnums=(3,)),
            jax.jit(tail, static_argnums=(5, 6), donate_argnums=(4,)))
    return _STEP_PROGRAMS[key]


# One jitted function each for the cache-free research API, shared by every loaded model
# (graphdef is a static, hashable argument, so models of one shape share their compilations).
_JIT_FORWARD = jax.jit(_forward_fn, static_argnums=(0,))
_JIT_MTP = jax.jit(_mtp_forward_fn, static_argnums=(0,))


def load_qwen4_exp(path: str, dtype: str | None = "auto", *, with_mtp: bool = True,
                   ple_backend: str = "disk", cfg: Qwen4ExpConfig | None = None) -> LoadedQwen4Exp:
    """Load a qwen4_exp checkpoint folder (composite ``model.language_model.*`` or text-only
    ``model.*``). ``ple_backend``: ``"disk"`` (default, memory-mapped tables) or ``"memory"``."""
    cfg = cfg or Qwen4ExpConfig.from_folder(path)
    check_slot_states()
    dtype = resolve_dtype(dtype)
    with_mtp = with_mtp and cfg.has_mtp
    module = nnx.eval_shape(lambda: Qwen4ExpModel(cfg, DTYPES[dtype], with_mtp=with_mtp))
    graphdef, abstract = nnx.split(module)
    flat = list(nnx.to_flat_state(abstract))
    expected = {_param_name(p): tuple(v.shape) for p, v in flat}
    want = dict(names.target_tensors(cfg))
    if with_mtp:
        want.update(names.mtp_tensors(cfg))
    assert want == expected, (sorted(set(want) ^ set(expected)),
                              [k for k in want if k in expected and want[k] != expected[k]])
    arrays, ple = read_checkpoint(path, cfg, expected, dtype=dtype, with_mtp=with_mtp,
                                  ple_backend=ple_backend)
    filled = []
    for p, v in flat:
        a = arrays[_param_name(p)]
        filled.append((p, v.replace(jnp.asarray(a, dtype=v.dtype))))
    params = nnx.from_flat_state(filled)
    return LoadedQwen4Exp(cfg=cfg, dtype=dtype, graphdef=graphdef, params=params,
                          has_mtp=with_mtp, ple=ple)
