"""The bytes a decode step or speculative round must move (the HBM floor's numerator).

Weights read (the embedding only for the rows used; routed experts only for the experts hit
under uniform routing), KV read over the context, GDN state read by the verify and read +
written by the commit, and for k > 0 the MTP draft's weights and KV over its k calls (with a
reduced draft vocabulary of N hot ids, the draft's LM head reads N rows instead of V; with
an int8 draft head or layer, 1 byte per weight and 4 per row's scale). Computed from the
config and the family's tensor shapes alone (no weights): the bench's floor
(:mod:`mtp_jax.bench.floor`) and the engine's adaptive speculation
(:mod:`mtp_jax.speculative.adaptive`) read it.
"""

from __future__ import annotations

import numpy as np

from mtp_jax.config import ModelConfig
from mtp_jax.models.draft_head import int8_layer_projections
from mtp_jax.models.registry import entry_of

__all__ = ["expected_experts", "forward_weight_bytes", "round_bytes"]


def _numel(shape) -> int:
    return int(np.prod(shape))


def expected_experts(cfg: ModelConfig, tokens: int) -> float:
    """Expected distinct experts hit by ``tokens`` tokens under uniform routing."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def forward_weight_bytes(cfg: ModelConfig, tensors: dict, tokens: int, itemsize: int,
                         experts_ratio: float = 1.0) -> float:
    """Weight bytes one forward over ``tokens`` rows reads: every tensor except the embedding
    table (only ``tokens`` rows) and the routed experts (only the experts hit, times
    ``experts_ratio``: their held bytes over their model-dtype bytes)."""
    total = 0.0
    for name, shape in tensors.items():
        if name == "embed_tokens.weight":
            total += tokens * shape[1] * itemsize
        elif ".mlp.experts." in name:
            total += (_numel(shape) / shape[0] * expected_experts(cfg, tokens) * itemsize
                      * experts_ratio)
        else:
            total += _numel(shape) * itemsize
    return total


def round_bytes(cfg: ModelConfig, batch: int, k: int, context: int, itemsize: int,
                draft_vocab_size: int | None = None, draft_head_dtype: str | None = None,
                draft_layer_dtype: str | None = None,
                quantized_saving: tuple[float, float] = (0, 0),
                experts_ratio: float = 1.0) -> dict:
    """Bytes a round (k > 0) or decode step (k = 0) moves, by kind. ``draft_vocab_size``: the
    draft's LM head has that many rows (hot token ids) instead of ``vocab_size``;
    ``draft_head_dtype="int8"``: those rows are int8 with a float32 scale each (the few rows
    the int8 head re-scores per request are not counted); ``draft_layer_dtype="int8"``: the
    draft's projections (its 2-D ``mtp.*`` ``.weight`` tensors) likewise. Any family whose
    registry entry gives its tensor shapes; for qwen4_exp's QSA layers the K/V of the whole
    context is counted (an upper bound: a QSA query reads the K/V of its selected blocks) and
    the index keys are not. ``quantized_saving``: ``(target, draft)`` bytes that projections
    kept quantized save on one read of the target's and of the draft's weights
    (:func:`mtp_jax.models.quantized.saved_bytes_by_part`), taken off their weights;
    ``experts_ratio``: the routed experts' held bytes over their model-dtype bytes
    (:func:`mtp_jax.models.quantized.experts_bytes_ratio`)."""
    shapes = entry_of(cfg).tensor_shapes  # the family's checkpoint tensors (the registry)
    target = shapes(cfg, False)
    lm_head = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}
    if cfg.tie_word_embeddings:
        target = {**target, **lm_head}  # the tied head reads the whole table
    rows = batch * (k + 1)
    out = {"weights": forward_weight_bytes(cfg, target, rows, itemsize, experts_ratio)
           - quantized_saving[0]}
    kv_per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    out["kv_read"] = batch * context * kv_per_token * len(cfg.full_layer_ids)
    state = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
             * len(cfg.linear_layer_ids))
    # verify reads the state; the commit reads it and writes it back (k > 0), decode the same.
    out["gdn_state"] = batch * state * 3
    if k:
        draft_rows = cfg.vocab_size if draft_vocab_size is None else draft_vocab_size
        head = draft_rows * cfg.hidden_size * itemsize
        if draft_head_dtype == "int8":
            head = draft_rows * (cfg.hidden_size + 4)
        draft = {n: s for n, s in shapes(cfg, True).items() if n not in target}
        int8 = int8_layer_projections(cfg, draft) if draft_layer_dtype == "int8" else {}
        rest = {n: shape for n, shape in draft.items() if n not in int8}
        int8_bytes = sum(o * (i + 4) for o, i in int8.values())
        out["draft_weights"] = (forward_weight_bytes(cfg, rest, batch * (k + 1), itemsize,
                                                     experts_ratio)
                                + (k - 1) * forward_weight_bytes(cfg, rest, batch, itemsize,
                                                                 experts_ratio)
                                + k * (head + int8_bytes) - k * quantized_saving[1])
        out["draft_kv_read"] = k * batch * context * kv_per_token * cfg.mtp_num_hidden_layers
    out["total"] = sum(out.values())
    return out
