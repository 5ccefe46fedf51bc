"""The MTP draft's own LM head: the rows of the LM head for the hot token ids (a reduced
draft vocabulary), in the model dtype or as int8 rows, or all rows as int8.

Made once after load (:func:`with_draft_head`) from ``lm_head.weight`` (or the embedding when
the head is tied) and stored on the model as ``draft_head``; ``model.draft_logits(z)`` then
calls it instead of the target's full head. The target's logits are untouched, so the output
stays exact whatever the draft head scores: only the drafts, hence the accept length, can
change (:mod:`mtp_jax.speculative.draft_vocab` defines the hot set).

**int8** (``head_dtype="int8"``, ``speculative_draft_head_dtype``): the rows are stored as
weight-only int8 with a float32 scale per row (:mod:`mtp_jax.models.layers.int8_rows`), so a
draft step reads half the head's bytes (on the 27B shape the head is 2.5 GB of bf16, read by
each of the k draft steps). The int8 logits pick the :data:`RESCORE` blocks of :data:`BLOCK`
rows holding the best logits (:func:`candidates`), whose logits are then computed again from
the model-dtype rows of the LM head (``z @ W[c].T``: 256 rows, 2.6 MB per request on the 27B
shape) and written over the int8 ones. A greedy draft is therefore the full head's argmax
unless that token falls outside the int8 head's top RESCORE, which takes a quantization error
of the order of the gap between the best and the RESCORE-th logit (each int8 logit is off by
about 1% of the logits' spread, the gap is tens of percent on any real or random head). A
sampled draft is drawn from the softmax of those mixed logits, the ``q`` the accept step is
given, so the rejection sampling stays exact for it as for any draft distribution.

**int8 layer** (``layer_dtype="int8"``, ``speculative_draft_layer_dtype``):
:func:`with_draft_head` also stores the draft's projections as int8 rows
(:func:`mtp_jax.models.layers.basic.quantize_projections`; no re-scoring), and
:func:`draft_layer_bytes` counts them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.config import DRAFT_HEAD_DTYPES as HEAD_DTYPES
from mtp_jax.config import DRAFT_LAYER_DTYPES as LAYER_DTYPES
from mtp_jax.kernels import kernels_of
from mtp_jax.models.layers.basic import as_data, quantize_projections
from mtp_jax.models.layers.mlp import SHARED_EXPERT_TENSORS, folds_shared_expert
from mtp_jax.models.layers.int8_rows import int8_matmul, quantize_rows_in_blocks
from mtp_jax.weights import names
from pallas_kernels.gemv import gemv

__all__ = ["DraftHead", "HEAD_DTYPES", "LAYER_DTYPES", "RESCORE", "BLOCK", "candidates",
           "rescore", "with_draft_head", "draft_head_bytes", "draft_layer_bytes",
           "int8_layer_projections",
           "head_logits", "head_greedy"]

RESCORE = 8  # int8 head: blocks of BLOCK rows, those with the best logits, re-scored
BLOCK = 32


class DraftHead(nnx.Module):
    """The draft's LM head over ``N`` rows.

    ``weight [N, H]``: the model dtype, or int8 with ``scale [N]`` float32 (``None`` for the
    model dtype); ``ids [N] int32``: the token id of each row, or ``None`` when row i is token
    i of the whole vocabulary (an int8 head of all V rows); ``backend``: how a model-dtype call
    runs (:func:`pallas_kernels.gemv.gemv`, as the LM head's)."""

    def __init__(self, weight: jax.Array, ids: jax.Array | None = None,
                 scale: jax.Array | None = None, backend: str = "xla"):
        self.weight = nnx.Param(weight)
        self.scale = None if scale is None else nnx.Param(scale)
        self.ids = None if ids is None else nnx.Variable(ids)
        self.backend = backend

    def __call__(self, z: jax.Array, table: jax.Array | None = None) -> jax.Array:
        """``z [..., H]`` -> logits ``[..., N]`` float32. Model dtype: the full head's product
        restricted to the rows. int8: the int8 product, with the columns of the best
        :data:`RESCORE` blocks recomputed from ``table [V, H]`` (the model-dtype LM head,
        indexed by token id) when it is given (:func:`rescore`)."""
        if self.scale is None:
            return gemv(z, self.weight[...], backend=self.backend).astype(jnp.float32)
        logits = int8_matmul(z, self.weight[...], self.scale[...])
        if table is None:
            return logits
        return rescore(logits, z, table, None if self.ids is None else self.ids[...])

    def greedy(self, z: jax.Array, table: jax.Array) -> jax.Array:
        """int8 head: the greedy draft tokens, ``z [..., H]`` -> ``[...]`` int32 token ids: the
        best of the :func:`candidates` by their re-scored logits (ties to the lower column),
        without writing them into the ``[..., N]`` logits and taking an argmax over N (two
        passes over N floats per draft step fewer than ``argmax(self(z, table))``, which it
        equals unless an int8 logit outside the candidates exceeds every re-scored one)."""
        ids = None if self.ids is None else self.ids[...]
        logits = int8_matmul(z, self.weight[...], self.scale[...])
        cand = candidates(logits)
        exact = _exact(z, table, ids, cand)
        best = exact == jnp.max(exact, axis=-1, keepdims=True)
        col = jnp.min(jnp.where(best, cand, logits.shape[-1]), axis=-1)
        return (col if ids is None else jnp.take(ids, col)).astype(jnp.int32)


def head_logits(head: "DraftHead | None", table: jax.Array, z: jax.Array, full_logits):
    """A family's ``draft_logits``: ``z [..., H]`` (what its LM head reads) -> ``(logits
    [..., N] float32, ids [N] int32)`` over the hot ids of ``head``, or ``(full_logits(z)
    [..., V], None)`` without a draft head of its own (column i is token id i). ``table``: the
    model-dtype LM head ``[V, H]`` (the int8 head re-scores from it)."""
    if head is None:
        return full_logits(z), None
    return head(z, table), None if head.ids is None else head.ids[...]


def head_greedy(head: "DraftHead | None", table: jax.Array, z: jax.Array,
                full_logits) -> jax.Array:
    """A family's ``draft_greedy``: the argmax of :func:`head_logits` mapped to token ids
    ``[...]`` int32 (an int8 head takes it over its re-scored candidates only:
    :meth:`DraftHead.greedy`)."""
    if head is not None and head.scale is not None:
        return head.greedy(z, table)
    logits, hot = head_logits(head, table, z, full_logits)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    return tok if hot is None else jnp.take(hot, tok)


def candidates(logits: jax.Array, r: int = RESCORE, size: int = BLOCK) -> jax.Array:
    """The columns of the ``r`` blocks of ``size`` consecutive columns of ``logits [..., N]``
    with the largest maxima: ``[..., r * size]`` int32 (a last partial block's missing columns
    repeat column N-1). They hold the ``r`` largest logits: each block holding one of those
    has a maximum at least the r-th largest, and at most ``r`` blocks do. (A block maximum
    and a top-k over N / size blocks: ``lax.top_k`` over all 248,320 columns took about 220 us
    on the H200, this about 15-20: ``python -m mtp_jax.bench draft-head --parts``.)"""
    *lead, n = logits.shape
    nb = -(-n // size)
    padded = jnp.pad(logits, [(0, 0)] * len(lead) + [(0, nb * size - n)],
                     constant_values=-jnp.inf)
    top = jax.lax.top_k(jnp.max(padded.reshape(*lead, nb, size), -1), min(r, nb))[1]
    cols = top[..., None] * size + jnp.arange(size, dtype=top.dtype)
    return jnp.minimum(cols.reshape(*lead, -1), n - 1).astype(jnp.int32)


def rescore(logits: jax.Array, z: jax.Array, table: jax.Array, ids: jax.Array | None,
            r: int = RESCORE) -> jax.Array:
    """``logits [..., N]`` float32 with the columns of :func:`candidates` replaced by ``z
    [..., H] @ table[id].T`` (``id = ids[column]``, or the column itself when ``ids`` is
    None), rounded to ``table``'s dtype as the model-dtype head rounds its logits."""
    cand = candidates(logits, r)  # [..., r * BLOCK]
    return jnp.put_along_axis(logits, cand, _exact(z, table, ids, cand), axis=-1,
                              inplace=False)


def _exact(z, table, ids, cand):
    """``z [..., H] @ table[id].T`` for the columns ``cand [..., R]`` (``id = ids[column]`` or
    the column), float32 rounded to ``table``'s dtype: ``[..., R]``."""
    rows = jnp.take(table, cand if ids is None else jnp.take(ids, cand), axis=0)  # [..., R, H]
    exact = jnp.einsum("...h,...rh->...r", z.astype(table.dtype), rows,
                       preferred_element_type=jnp.float32)
    return exact.astype(table.dtype).astype(jnp.float32)


def _check(model, ids, head_dtype, layer_dtype) -> None:
    if head_dtype is not None and head_dtype not in HEAD_DTYPES:
        raise ValueError(f"draft head dtype {head_dtype!r} is unknown; use None (the model "
                         f"dtype) or one of {HEAD_DTYPES}.")
    if layer_dtype is not None and layer_dtype not in LAYER_DTYPES:
        raise ValueError(f"draft layer dtype {layer_dtype!r} is unknown; use None (the model "
                         f"dtype) or one of {LAYER_DTYPES}.")
    if not model.has_mtp:
        raise ValueError("a draft head of its own (reduced vocabulary or int8) or an int8 draft "
                         "layer needs the mtp.* draft, which this model was loaded without; "
                         "load it with with_mtp=True.")
    if ids is not None and (ids.ndim != 1 or ids.size == 0 or ids.min() < 0
                            or ids.max() >= model.cfg.vocab_size):
        raise ValueError(f"hot ids must be a non-empty 1-D array in [0, {model.cfg.vocab_size});"
                         f" got shape {ids.shape}.")


def with_draft_head(model, hot_ids: np.ndarray | None, head_dtype: str | None = None,
                    layer_dtype: str | None = None):
    """A :class:`~mtp_jax.models.loaded.LoadedModel` whose MTP draft has weights of its own.
    With ``hot_ids`` or ``head_dtype``: its own head, the rows of ``hot_ids`` (``[N]`` ints in
    ``[0, V)``, unique; from :func:`mtp_jax.speculative.draft_vocab.hot_token_ids`; ``None``:
    all V), in the model dtype or, with ``head_dtype="int8"``, as int8 rows (see the module
    docstring). With ``layer_dtype="int8"``: draft projections (``mtp.fc`` and the MTP
    decoder layers' :class:`~mtp_jax.models.layers.basic.Linear` / ``MergedLinear``
    modules) that run from int8 rows
    (:func:`~mtp_jax.models.layers.basic.quantize_projections`).

    ``hot_ids``, ``head_dtype`` and ``layer_dtype`` all ``None`` return ``model`` itself.
    Otherwise the new model shares every other parameter array with ``model`` and holds the
    ``draft_head`` and/or the int8 projections as well (``model`` keeps its own), so it has
    its own compiled programs (shared with any model of the same structure); it is made once
    per (model, hot ids, dtypes), kept in ``model.derived``, and reused.
    Raises ``ValueError`` when the model has no MTP draft, ids are out of range or a dtype
    is unknown.
    """
    if hot_ids is None and head_dtype is None and layer_dtype is None:
        return model
    ids = None if hot_ids is None else np.asarray(hot_ids, np.int32)
    _check(model, ids, head_dtype, layer_dtype)
    key = (b"all" if ids is None else ids.tobytes(), head_dtype, layer_dtype)
    if key not in model.derived:
        module = model.module()
        if hot_ids is not None or head_dtype is not None:
            module.draft_head = as_data(_head(model, module, ids, head_dtype))
        if layer_dtype == "int8":
            quantize_projections(module.mtp)
        graphdef, params = nnx.split(module)
        # Heads of the same size and dtype give the same program structure (the ids are a
        # parameter): the engine shares their compiled programs
        # (mtp_jax.engine.programs.programs_for).
        model.derived[key] = dataclasses.replace(model, graphdef=graphdef, params=params,
                                                 derived={})
    return model.derived[key]


def _head(model, module, ids, head_dtype) -> DraftHead:
    """The :class:`DraftHead` of ``ids`` (None: all V rows) in ``head_dtype``."""
    table = (module.lm_head if module.lm_head is not None else module.embed_tokens).weight
    device = next(iter(table[...].devices()))
    dev_ids = None if ids is None else jax.device_put(ids, device)
    rows = table[...] if ids is None else jnp.take(table[...], dev_ids, axis=0)
    scale = None
    if head_dtype == "int8":
        rows, scale = jax.jit(quantize_rows_in_blocks)(rows)
    return DraftHead(rows, dev_ids, scale, backend=kernels_of(model.cfg).gemv)


def draft_head_bytes(cfg, n: int | None, dtype: str, head_dtype: str | None = None) -> int:
    """Bytes the draft head adds: ``n`` rows (``None``: all ``vocab_size``) of ``hidden_size``
    in ``dtype`` (or int8 plus a float32 scale per row), plus the ids of a reduced head; 0
    when there is no head of its own (``n`` and ``head_dtype`` both None)."""
    if n is None and head_dtype is None:
        return 0
    rows = cfg.vocab_size if n is None else n
    item = 1 if head_dtype == "int8" else np.dtype(jnp.dtype(dtype)).itemsize
    return rows * cfg.hidden_size * item + (4 * rows if head_dtype == "int8" else 0) + (
        0 if n is None else 4 * n)


def draft_layer_bytes(cfg, layer_dtype: str | None = None,
                      tensor_shapes: dict | None = None) -> int:
    """Bytes an int8 draft layer adds (``layer_dtype="int8"``): out x (in + 4) per projection
    of the ``mtp.*`` draft, its 2-D ``.weight`` tensors (the model-dtype copies stay loaded)
    but a shared expert folded into the routed experts
    (:func:`~mtp_jax.models.layers.mlp.folds_shared_expert`); 0 for ``None``.
    ``tensor_shapes``: the family's tensor name -> shape map with the draft
    (``ModelEntry.tensor_shapes(cfg, True)``; default: the Qwen3.5 names,
    :func:`mtp_jax.weights.names.mtp_tensors`)."""
    if layer_dtype is None:
        return 0
    shapes = names.mtp_tensors(cfg) if tensor_shapes is None else tensor_shapes
    return sum(out * (inp + 4) for out, inp in int8_layer_projections(cfg, shapes).values())


def int8_layer_projections(cfg, tensor_shapes: dict) -> dict:
    """Of ``tensor_shapes`` (tensor name -> shape), the projections an int8 draft layer holds
    as int8 rows: the ``mtp.*`` 2-D ``.weight`` tensors but those of a shared expert folded
    into the routed experts (:func:`~mtp_jax.models.layers.mlp.folds_shared_expert`)."""
    folded = folds_shared_expert(cfg)
    return {n: s for n, s in tensor_shapes.items()
            if n.startswith("mtp.") and n.endswith(".weight") and len(s) == 2
            and not (folded and SHARED_EXPERT_TENSORS in n)}
