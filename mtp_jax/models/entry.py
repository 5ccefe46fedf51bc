"""What a model family declares to the engine: :class:`ModelEntry` and its slot states.

Each family package (``mtp_jax/models/<family>/entry.py``) builds one ``ModelEntry``;
:mod:`mtp_jax.models.registry` maps ``config.json``'s ``model_type`` to it. Everything outside
``models/`` asks the registry (which config class parses the file, which loader reads the
weights, which drafts exist, which slot states a verify must commit, which engine serves the
family) and never tests a family by name. This module imports no family, so families import it
freely.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["VERIFY_HANDLERS", "SERVING", "SlotState", "LoadRequest", "ModelEntry"]

# How a slot state is committed after a speculative verify window of k+1 rows:
#   "replay":     verify leaves the live state untouched and keeps the per-row inputs; the commit
#                 replays the accepted rows onto the live state;
#   "checkpoint": verify keeps one state per row; the commit selects the accepted row's copy.
VERIFY_HANDLERS = ("replay", "checkpoint")

# Which engine serves a family: "rounds" — the batched engine (mtp_jax.engine.engine.Engine:
# continuous batching, prefix cache, speculative rounds), the one engine of every family.
SERVING = ("rounds",)


@dataclasses.dataclass(frozen=True)
class SlotState:
    """A per-request state that a verify must commit (beyond the paged KV, which rolls back by
    position). ``verify_handler`` is one of :data:`VERIFY_HANDLERS`; ``None`` means the state
    cannot be verified, so speculation is refused for the model at config time."""

    name: str
    description: str
    verify_handler: str | None


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What :func:`mtp_jax.models.loader.load_model` asks a family's loader for, checked
    against the family's :class:`ModelEntry` before any weight is read.

    dtype: ``"float32" | "bfloat16" | "float16"`` (resolved); with_mtp: read the ``mtp.*``
    draft; draft_path: a separate local folder holding it (None: the checkpoint); dummy_weight
    / seed: random weights instead of the checkpoint's; device: where arrays go (None: the
    default device); backends: ``{op: choice}`` of the kernel backend arguments
    (``"auto" | "xla" | "pallas" | ...``, :class:`mtp_jax.kernels.KernelBackends`);
    merge_projections / pack_small_params: the batched engine's parameter forms; quantization:
    ``"auto" | "dequantize" | "keep"``, how a quantized checkpoint's projections are held
    (:func:`mtp_jax.weights.quant_config.keeps_quantized`); options: family-specific loader
    options given (e.g. ``{"ple_backend": "disk"}``)."""

    dtype: str
    with_mtp: bool = True
    draft_path: str | None = None
    dummy_weight: bool = False
    seed: int = 0
    device: object = None
    backends: tuple = ()  # ((op, choice), ...), sorted
    merge_projections: bool = True
    pack_small_params: bool = False
    quantization: str = "auto"
    options: tuple = ()  # ((name, value), ...), given options only

    @property
    def backend_choices(self) -> dict:
        return dict(self.backends)

    @property
    def option_values(self) -> dict:
        return dict(self.options)


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model family, as the rest of the package sees it.

    model_type: the canonical HF ``model_type`` (``cfg.model_type`` of its configs);
    hf_model_types: every spelling of ``model_type`` in a ``config.json`` (the file's or its
      ``text_config``'s) that the family reads;
    config_class: parses ``config.json``: ``config_class.from_dict(raw) -> config`` (frozen,
      hashable; raises ``ConfigError``);
    build: ``(cfg, dtype, with_mtp) -> nnx.Module``, the model with (or without) its draft.
      For a family served by the batched engine (``serving="rounds"``) the module is what the
      engine's programs (:mod:`mtp_jax.engine.programs`, :mod:`mtp_jax.speculative.mtp`) call:
      ``module(ids [B, T], batch, kv, gdn, mode, slots=) -> (hidden, kv, gdn or verify rows)``
      with ``mode`` in ``module.gdn_modes`` (``"prefill"``, ``"verify"``, ``"decode"``),
      ``module.logits(hidden) -> [..., V] float32``, ``module.commit(gdn, rows, length,
      slots=)`` (the slot states' replay of the accepted rows), and for MTP drafts
      ``module.mtp(embed, hidden, next_ids, batch, draft_kv, step=)``,
      ``module.embed_tokens``, ``module.draft_logits(z)`` and ``module.draft_greedy(z)``;
    load: ``(path, cfg, request: LoadRequest) -> loaded model`` (a
      :class:`~mtp_jax.models.loaded.LoadedModel`, or the family's own loaded form);
    tensor_shapes: ``(cfg, with_mtp) -> {canonical tensor name: shape}``, the checkpoint's
      tensors (for memory plans and floors);
    drafts: speculative algorithms with a draft registered (``"mtp"``: the family has an MTP
      draft layer that ``load_model`` reads; ``"external"``: its rounds take host drafts);
    slot_states: per-request states and their verify handlers;
    serving: one of :data:`SERVING`;
    kernel_ops: ops whose GPU kernels it can run (others: XLA only; a ``pallas`` choice for
      them is refused);
    dummy_weight: whether random weights (``dummy_weight=True``) can be drawn for it;
    draft_folder: whether a separate draft folder (``speculative_draft_model_path``) can
      supply its ``mtp.*`` draft;
    load_options: the family-specific options its loader takes, as ``((name, (allowed
      values...)), ...)``;
    make_pools: for ``serving="rounds"``: ``(cfg, *, num_pages, page_size, slots, k, mtp,
      dtype, num_snapshots) -> Pools``, the zeroed state pools its programs take
      (:func:`mtp_jax.cache.pools.make_pools`, or the family's own);
    write_random: ``(raw, out_dir, *, dtype, experts, mtp_experts, include_mtp,
      shard_size_bytes, seed, zero_rows_from, workers) -> out_dir``, the family's writer of
      random-weight checkpoints (:mod:`mtp_jax.tools.random_checkpoint`), or None;
    draft_chain: ``(module, hidden [B, T, H], ids [B, T], k) -> [z_j [B, T, H]] * k``, the
      family's MTP chain teacher-forced as its round runs it (:mod:`mtp_jax.train.chain`), for
      training the draft (``python -m mtp_jax.train_mtp``); None: its draft cannot be trained;
    check_engine: ``(cfg, engine_cfg, speculative) -> None``, the family's own config-time
      checks of the engine settings (raises ``ConfigError``; run before any weight loads and
      again by the engine); None: none;
    prefill_snapshots: the module's prefill forward takes ``state_rows [B, S]`` and also
      returns its slot states after those rows (``module(ids, batch, kv, gdn, "prefill",
      state_rows=) -> (hidden, kv, gdn, states [B, S, ...])``), so one prefill chunk saves
      the prefix-cache snapshots of every boundary inside it; False: the engine ends prefill
      chunks on snapshot boundaries and saves the chunk's final states there.
    """

    model_type: str
    hf_model_types: tuple[str, ...]
    config_class: type
    build: Callable
    load: Callable
    tensor_shapes: Callable
    drafts: tuple[str, ...]
    slot_states: tuple[SlotState, ...] = ()
    serving: str = "rounds"
    kernel_ops: tuple[str, ...] = ("attention", "gdn", "moe", "norm", "gemv")
    dummy_weight: bool = True
    draft_folder: bool = True
    load_options: tuple = ()  # ((name, (allowed values...)), ...)
    make_pools: Callable | None = None
    write_random: Callable | None = None
    draft_chain: Callable | None = None
    check_engine: Callable | None = None
    prefill_snapshots: bool = False

    def __post_init__(self):
        if self.serving not in SERVING:
            raise ValueError(f"ModelEntry {self.model_type!r}: serving {self.serving!r} is not "
                             f"one of {SERVING}.")
        if self.serving == "rounds" and self.make_pools is None:
            raise ValueError(f"ModelEntry {self.model_type!r}: a family served by the batched "
                             "engine needs make_pools (its state pools).")
