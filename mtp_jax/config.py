"""Configuration: the model's shape (from ``config.json``), the engine's and speculation's settings.

Every check that can be made without weights is made here, so a bad configuration fails in
seconds, before any tensor is read.

``ModelConfig`` is frozen and hashable: compiled programs take it as a static argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mtp_jax.config_fields import check_fixed_fields, check_shared_expert
from mtp_jax.errors import ConfigError, check_field_types
from mtp_jax.rope import DEFAULT_ROPE, RopeScaling, parse_rope_scaling, rope_section

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
_TEXT_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
SPECULATIVE_ALGORITHMS = ("none", "mtp", "external")
MAX_SPECULATIVE_NUM_STEPS = 8
DRAFT_HEAD_DTYPES = ("int8",)  # speculative_draft_head_dtype besides None (the model dtype)
DRAFT_DTYPE_AUTO = "auto"  # the draft dtypes' default: mtp_jax.speculative.draft_dtypes
DRAFT_LAYER_DTYPES = ("int8",)  # speculative_draft_layer_dtype besides None (the model dtype)


class LayerShapes:
    """Sizes derived from the fields that the Qwen3.5 family and qwen4_exp configs share
    (``head_dim``, ``partial_rotary_factor``, ``layer_types``, the ``linear_*`` sizes and
    ``mtp_num_hidden_layers``)."""

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k (Hk*Dk each) and v (Hv*Dv)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0


@dataclasses.dataclass(frozen=True)
class ModelConfig(LayerShapes):
    """Text-model shape of a Qwen3.5-family checkpoint.

    Built by :func:`ModelConfig.from_dict` from an HF ``config.json`` (composite with
    ``text_config`` or flat). Sizes are in elements; ``layer_types`` holds
    ``"linear_attention"`` (Gated DeltaNet) or ``"full_attention"`` per layer.
    """

    model_type: str  # "qwen3_5" | "qwen3_5_moe"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int  # dense MLP (qwen3_5); 0 for MoE
    num_experts: int  # 0 for dense
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    composite: bool  # tensors under model.language_model.* (True) or model.* (False)
    # rope_parameters / rope_scaling: default, linear or yarn (mtp_jax.rope); target and draft
    rope_scaling: RopeScaling = DEFAULT_ROPE
    # Not from config.json: which implementation runs the hot ops (mtp_jax.kernels); set by
    # load_model from its *_backend arguments.
    kernels: Any = None

    # ---- derived -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse an HF config dict; raises :class:`ConfigError` naming any bad or missing key."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json holds a JSON {type(raw).__name__}, not an object; "
                              "it is not an HF model config (fetch it again).")
        top_type = raw.get("model_type")
        text = raw.get("text_config")
        composite = isinstance(text, dict)
        cfg = dict(text) if composite else dict(raw)
        model_type = top_type if composite else cfg.get("model_type")
        model_type = _TEXT_MODEL_TYPES.get(model_type, model_type)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; mtp_jax reads "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (and their *_text variants). "
                "Check that --model points at a Qwen3.5-family checkpoint.")
        rope = rope_section(cfg, raw)[0]  # refuses unsupported RoPE types and keys
        check_fixed_fields([cfg, raw] if composite else [cfg], model_type)

        def get(key, default=_MISSING):
            for src in (cfg, rope, raw):
                if key in src and src[key] is not None:
                    return src[key]
            if default is _MISSING:
                raise ConfigError(f"config.json has no {key!r} (looked in text_config, "
                                  "rope_parameters and the top level); the file is incomplete.")
            return default

        def num(key, kind, default=_MISSING):
            """``get(key)`` as an int or float; a wrong type is a ConfigError naming the key."""
            v = get(key, default)
            if isinstance(v, bool) or not isinstance(v, int if kind is int else (int, float)):
                raise ConfigError(f"config.json key {key!r} is {v!r}; expected "
                                  f"{'an integer' if kind is int else 'a number'}. The file "
                                  "is corrupt or not an HF Qwen3.5-family config.")
            return kind(v)

        n_layers = num("num_hidden_layers", int)
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = num("full_attention_interval", int, 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n_layers)]
        if not isinstance(layer_types, (list, tuple)):
            raise ConfigError(f"config.json key 'layer_types' is {layer_types!r}; expected a "
                              "list of 'linear_attention' / 'full_attention'.")
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers "
                              f"is {n_layers}; they must agree.")
        bad = sorted({t for t in layer_types} - {"full_attention", "linear_attention"})
        if bad:
            raise ConfigError(f"layer_types holds {bad}; supported: full_attention, "
                              "linear_attention.")
        is_moe = model_type == "qwen3_5_moe"
        eos = get("eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
            raise ConfigError(f"config.json key 'eos_token_id' is {eos!r}; expected an integer "
                              "or a list of integers.")
        n_heads = num("num_attention_heads", int)
        hidden = num("hidden_size", int)
        for key, value in (("num_hidden_layers", n_layers), ("num_attention_heads", n_heads),
                           ("hidden_size", hidden)):
            if value < 1:
                raise ConfigError(f"config.json key {key!r} is {value}; it must be >= 1.")
        mc = cls(
            model_type=model_type,
            vocab_size=num("vocab_size", int),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=n_heads,
            num_key_value_heads=num("num_key_value_heads", int),
            head_dim=num("head_dim", int, hidden // n_heads),
            partial_rotary_factor=num("partial_rotary_factor", float, 1.0),
            rope_theta=num("rope_theta", float, 10000.0),
            rms_norm_eps=num("rms_norm_eps", float, 1e-6),
            linear_num_key_heads=num("linear_num_key_heads", int),
            linear_num_value_heads=num("linear_num_value_heads", int),
            linear_key_head_dim=num("linear_key_head_dim", int),
            linear_value_head_dim=num("linear_value_head_dim", int),
            linear_conv_kernel_dim=num("linear_conv_kernel_dim", int, 4),
            intermediate_size=0 if is_moe else num("intermediate_size", int),
            num_experts=num("num_experts", int) if is_moe else 0,
            num_experts_per_tok=num("num_experts_per_tok", int) if is_moe else 0,
            moe_intermediate_size=num("moe_intermediate_size", int) if is_moe else 0,
            shared_expert_intermediate_size=(num("shared_expert_intermediate_size", int)
                                             if is_moe else 0),
            # qwen3_5_moe configs carry no norm_topk_prob: its router always renormalises.
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             raw.get("tie_word_embeddings", False))),
            mtp_num_hidden_layers=num("mtp_num_hidden_layers", int,
                                      num("num_nextn_predict_layers", int, 0)),
            max_position_embeddings=num("max_position_embeddings", int, 262144),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            composite=composite,
            rope_scaling=parse_rope_scaling(cfg, raw, num("max_position_embeddings", int,
                                                          262144)),
        )
        mc.validate()
        return mc

    @classmethod
    def from_folder(cls, path: str) -> "ModelConfig":
        """Read ``<path>/config.json``; raises :class:`ConfigError` if absent or unreadable."""
        return cls.from_dict(read_config_json(path))

    def validate(self) -> None:
        sizes = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim", "max_position_embeddings"]
        sizes += ["num_experts", "moe_intermediate_size"] if self.is_moe else ["intermediate_size"]
        if self.is_moe:
            check_shared_expert(self.shared_expert_intermediate_size)
        for key in sizes:
            if getattr(self, key) < 1:
                raise ConfigError(f"config.json key {key!r} is {getattr(self, key)}; it must be "
                                  ">= 1. The file is corrupt or not a Qwen3.5-family config.")
        if self.mtp_num_hidden_layers < 0:
            raise ConfigError(f"mtp_num_hidden_layers {self.mtp_num_hidden_layers} must be >= 0.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                              f"of num_key_value_heads {self.num_key_value_heads}.")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads {self.linear_num_value_heads} is not a "
                              f"multiple of linear_num_key_heads {self.linear_num_key_heads}.")
        if self.rotary_dim % 2:
            raise ConfigError(f"head_dim * partial_rotary_factor = {self.rotary_dim} is odd.")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                              f"1..num_experts ({self.num_experts}).")


_MISSING = object()


def read_config_json(path: str) -> Any:
    """The parsed ``<path>/config.json`` of a checkpoint folder. Raises :class:`ConfigError`
    when ``path`` does not exist, is not a folder, has no config.json, or it cannot be parsed."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"model path {path!r} does not exist: no such "
                          f"{'file' if path.lower().endswith('.gguf') else 'file or folder'} on "
                          "this machine. Pass an existing checkpoint folder (config.json + "
                          "*.safetensors) or Flash-Next .gguf file.")
    if not os.path.isdir(path):
        raise ConfigError(f"model path {path!r} is not a folder; pass a checkpoint folder "
                          "holding config.json and *.safetensors.")
    if not os.path.isfile(file):
        raise ConfigError(f"{path!r} has no config.json; pass an HF checkpoint folder.")
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot parse {file}: {e}") from e


def strip_private_keys(obj: Any) -> Any:
    """Copy of a JSON value with every dict key starting with ``_`` removed, recursively (the
    presets in ``configs/`` carry notes under such keys)."""
    if isinstance(obj, dict):
        return {k: strip_private_keys(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [strip_private_keys(v) for v in obj]
    return obj


def config_dict(config: dict | str) -> dict:
    """A config dict from a dict, a ``config.json`` path or a checkpoint folder, with ``_``
    keys stripped. Raises ``OSError`` for a missing file, ``TypeError`` for another value."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or a path, got {type(config).__name__}")
    return strip_private_keys(config)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    ``algorithm``: ``"none"`` (plain decoding), ``"mtp"`` (the checkpoint's ``mtp.*`` layer
    drafts) or ``"external"`` (a host callable drafts, see ``mtp_jax.speculative.external``).
    ``num_steps`` is ``speculative_num_steps`` (k drafted tokens per round, 1..8).
    ``draft_vocab_size`` / ``token_map_path`` (``speculative_draft_vocab_size`` /
    ``speculative_token_map``, MTP only): the draft scores only a hot subset of N token ids
    (FR-Spec; the N lowest ids, the map's ids, or the map's first N; see
    :mod:`mtp_jax.speculative.draft_vocab`, which also checks them: the token map is a file,
    read by the config-time checks, :func:`mtp_jax.checks.check_settings`). ``None``/``None``
    is the full vocabulary.
    ``draft_head_dtype`` (``speculative_draft_head_dtype``, MTP only): ``"auto"`` (the default)
    is int8 for a 16-bit compute dtype on an accelerator, else the model dtype (resolved by
    :func:`mtp_jax.speculative.draft_dtypes.resolve_draft_dtypes`); ``None`` scores drafts
    with the LM head in the model dtype; ``"int8"`` with an int8 copy of its rows (half the
    bytes per draft step) whose best few logits are re-scored in the model dtype
    (:mod:`mtp_jax.models.draft_head`).
    ``draft_layer_dtype`` (``speculative_draft_layer_dtype``, MTP only): ``None`` runs the
    draft's projections (its ``fc`` and the MTP decoder layers' attention and MLP projections;
    a MoE layer's routed experts always stay in the model dtype) in the model dtype;
    ``"int8"`` runs an int8 copy of them (one float32 scale per row,
    :func:`mtp_jax.models.layers.basic.quantize_projections`): about half the draft layer's
    bytes per draft step, and drafts that may differ a little from the model dtype's.
    ``adaptive`` / ``adaptive_round_cost`` (a round's time in decode steps; None: from bytes):
    a request drafts only while it pays (:mod:`mtp_jax.speculative.adaptive`).
    """

    algorithm: str = "mtp"
    num_steps: int = 3
    draft_model_path: str | None = None
    draft_vocab_size: int | None = None
    token_map_path: str | None = None
    draft_head_dtype: str | None = DRAFT_DTYPE_AUTO
    draft_layer_dtype: str | None = DRAFT_DTYPE_AUTO
    adaptive: bool = True
    adaptive_round_cost: float | None = None

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"

    @property
    def k(self) -> int:
        return self.num_steps if self.enabled else 0

    def validate(self, model: ModelConfig | None = None) -> None:
        """Raise :class:`ConfigError` for a combination that cannot run.

        Without ``model`` only the settings themselves are checked; with it, also that the
        checkpoint's config can feed the algorithm. The reduced draft vocabulary is checked
        with its token map by :func:`mtp_jax.speculative.draft_vocab.hot_token_ids`. The full
        set of config-time checks (model family, GGUF, draft source, slot states, dummy
        weights, draft vocabulary) is :func:`mtp_jax.checks.check_before_load`."""
        check_field_types(self, {f.name: f"speculative_{f.name}"
                                 for f in dataclasses.fields(self)})
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ConfigError(f"speculative_algorithm (--speculative-algorithm) {self.algorithm!r} "
                              f"is unknown; use one of {', '.join(SPECULATIVE_ALGORITHMS)} "
                              "(mtp also accepts nextn and eagle; external, a host callable "
                              "that drafts, is for the Python API: "
                              "mtp_jax.speculative.external).")
        low = 0 if self.algorithm == "none" else 1  # 0 with speculation off, as SGLang's
        if not low <= self.num_steps <= MAX_SPECULATIVE_NUM_STEPS:
            fix = ("leave it at the default 3 or 0 (it is unused with speculation off)"
                   if self.algorithm == "none" else "pick k in that range (3 is a good default), "
                   "or turn speculation off with speculative_algorithm='none' "
                   "(--speculative-algorithm none)")
            raise ConfigError(f"speculative_num_steps (--speculative-num-steps) {self.num_steps!r} "
                              f"is outside {low}..{MAX_SPECULATIVE_NUM_STEPS}; {fix}.")
        if self.draft_model_path and self.algorithm != "mtp":
            raise ConfigError(f"speculative_draft_model_path (--speculative-draft-model-path) "
                              f"{self.draft_model_path!r} was given but speculative_algorithm is "
                              f"{self.algorithm!r}; it only applies with speculative_algorithm="
                              "'mtp'. Drop the path or use --speculative-algorithm mtp.")
        for part, value, known in (("head", self.draft_head_dtype, DRAFT_HEAD_DTYPES),
                                   ("layer", self.draft_layer_dtype, DRAFT_LAYER_DTYPES)):
            if value in (None, DRAFT_DTYPE_AUTO):
                continue
            flag = f"speculative_draft_{part}_dtype (--speculative-draft-{part}-dtype)"
            if value not in known:
                raise ConfigError(f"{flag} {value!r} is unknown; use {', '.join(map(repr, known))}"
                                  ", 'model' (the model dtype) or 'auto' (the default).")
            if self.algorithm != "mtp":
                what = "draft's LM head" if part == "head" else "draft layer's projections"
                raise ConfigError(f"{flag} {value!r} was given but speculative_algorithm is "
                                  f"{self.algorithm!r}; it sets the MTP {what}. Drop it "
                                  "or use --speculative-algorithm mtp.")
        c = self.adaptive_round_cost
        if c is not None and (not 1 <= c <= 100 or not (self.adaptive and self.enabled)):
            raise ConfigError(f"speculative_adaptive_round_cost (--speculative-adaptive-round-"
                              f"cost) {c!r} must be a number in 1..100 (a round's time in decode "
                              "steps, e.g. 1.5) with speculation and its adaptation on; omit it "
                              "to derive it from the bytes a round reads.")
        if model is not None and self.algorithm == "mtp":
            if not model.has_mtp and not self.draft_model_path:
                raise ConfigError("speculative_algorithm='mtp' but the checkpoint's config declares "
                                  "no MTP layer (mtp_num_hidden_layers is 0) and no "
                                  "speculative_draft_model_path was given; pass a draft path "
                                  "(--speculative-draft-model-path) or use "
                                  "speculative_algorithm='none' (--speculative-algorithm none).")


def normalize_draft_dtype(name):
    """Map user spellings of ``speculative_draft_head_dtype`` and
    ``speculative_draft_layer_dtype`` to :class:`SpeculativeConfig`'s: None, ``"model"`` and
    ``""`` (any case) -> None (the model dtype); other strings lower-cased (``"AUTO"`` ->
    ``"auto"``, ``"INT8"`` -> ``"int8"``); anything else unchanged, for
    :meth:`SpeculativeConfig.validate` to refuse."""
    if not isinstance(name, str):
        return name
    n = name.strip().lower()
    return None if n in ("", "model") else n


def normalize_algorithm(name: str | None) -> str:
    """Map user spellings (None, 'NONE', 'MTP', and SGLang's 'NEXTN' and 'EAGLE', which there
    name drafting with the checkpoint's own MTP layer) to a canonical algorithm name."""
    if name is None:
        return "none"
    n = str(name).strip().lower()
    return {"nextn": "mtp", "eagle": "mtp", "": "none", "off": "none"}.get(n, n)


MAX_SCHEDULER_STEPS = 16  # rounds per program call (one lax.scan of that many rounds)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizing. Token counts are tokens; ``page_size`` tokens per KV page."""

    max_running_requests: int = 8
    page_size: int = 16
    max_model_len: int = 4096
    num_pages: int | None = None  # None: enough for max_running_requests * max_model_len
    dtype: str = "bfloat16"
    chunked_prefill_size: int = 2048  # prompt tokens prefilled per scheduler step
    # Requests whose prompt chunks one prefill call holds (batched prefill; 1: one request per
    # call). A call's padded rows x tokens stay within the chunked_prefill_size bucket
    # (mtp_jax/engine/prefill_batch.py).
    max_prefill_batch: int = 8
    mem_fraction: float = 0.9  # of device memory for weights + pools (when num_pages is None)
    max_total_tokens: int | None = None  # KV positions for all requests; wins over mem_fraction
    enable_prefix_cache: bool = True
    snapshot_interval_pages: int = 4  # GDN snapshots every page_size * this many tokens
    max_prefix_snapshots: int | None = None  # None: 4 per running request
    # Dispatch each round before reading the previous one's result (SGLang's overlap schedule,
    # vLLM's async scheduling): the host's per-round work runs while the device computes.
    overlap_schedule: bool = True
    # Rounds (decode steps, or speculative rounds) per program call: multi-step scheduling, as
    # vLLM's --num-scheduler-steps. The host's cost of a call (argument buffers, launch,
    # readback, stop checks) is paid once for that many rounds; tokens surface in groups of
    # that many rounds, and up to 2N - 1 rounds past a stop (N - 1 without overlap) are
    # computed and discarded. None: the engine chooses (auto_rounds_per_call).
    num_scheduler_steps: int | None = None

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a field of the wrong type (its value, type and the
        type expected: :func:`~mtp_jax.errors.check_field_types`) or a value out of range."""
        check_field_types(self)
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages {self.num_pages!r} must be an int >= 2 (or None to "
                              "size it from max_running_requests * max_model_len).")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ConfigError(f"dtype (--dtype) {self.dtype!r} is not supported; use auto, "
                              "bfloat16, float16 or float32.")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size (--page-size) {self.page_size} must be a power of two; "
                              "use 16 (the default) or another power of two.")
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests (--max-running-requests) "
                              f"{self.max_running_requests} must be >= 1; use 8 (the default) "
                              "or the number of requests to serve at once.")
        n = self.num_scheduler_steps
        if n is not None and not 1 <= n <= MAX_SCHEDULER_STEPS:
            raise ConfigError(f"num_scheduler_steps (--num-scheduler-steps) {n!r} must be an "
                              f"int in 1..{MAX_SCHEDULER_STEPS}, or automatic (the default: "
                              "the engine chooses the rounds per program call; None in Python, "
                              "auto on the command line).")
        t = self.max_total_tokens
        if t is not None and t < 1:
            raise ConfigError(f"max_total_tokens (--max-total-tokens) {t!r} must be an int >= 1 "
                              "(KV positions for all requests together); leave it unset to "
                              "size the pools from --mem-fraction.")
        if self.chunked_prefill_size < 1:
            raise ConfigError(f"chunked_prefill_size (--chunked-prefill-size) "
                              f"{self.chunked_prefill_size} must be >= 1 (prompt tokens per "
                              "prefill chunk); use 2048 (the default).")
        m = self.max_prefill_batch
        if m < 1:
            raise ConfigError(f"max_prefill_batch (--max-prefill-batch) {m!r} must be an int "
                              ">= 1 (requests' prompt chunks per prefill call; 1: one request "
                              "per call); use 8 (the default).")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len (--max-model-len) {self.max_model_len} must be "
                              ">= 2 (prompt plus output tokens); use 4096 (the default) or the "
                              "longest prompt + output you need.")


def check_scheduler_steps(speculative: SpeculativeConfig, engine: EngineConfig) -> None:
    """Multi-step calls need drafts made on the device (not by a host proposer); raises
    :class:`ConfigError` when ``num_scheduler_steps > 1`` is asked of a host proposer (auto
    chooses 1 for it)."""
    n = engine.num_scheduler_steps
    if speculative.algorithm == "external" and n is not None and n > 1:
        raise ConfigError(f"num_scheduler_steps (--num-scheduler-steps) {n} needs drafts made "
                          "on the device; speculative_algorithm='external' takes them from the "
                          "host every round: use 1 or leave it automatic (the default).")
