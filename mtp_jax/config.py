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

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
_TEXT_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
SPECULATIVE_ALGORITHMS = ("none", "mtp", "external")
MAX_SPECULATIVE_NUM_STEPS = 8


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the value and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
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

    # ---- derived -------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse an HF config dict; raises :class:`ConfigError` naming any bad or missing key."""
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
        rope = cfg.get("rope_parameters") or {}

        def get(key, default=_MISSING):
            for src in (cfg, rope, raw):
                if key in src and src[key] is not None:
                    return src[key]
            if default is _MISSING:
                raise ConfigError(f"config.json has no {key!r} (looked in text_config, "
                                  "rope_parameters and the top level); the file is incomplete.")
            return default

        n_layers = int(get("num_hidden_layers"))
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = int(get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n_layers)]
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
        n_heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        mc = cls(
            model_type=model_type,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=n_heads,
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(get("head_dim", hidden // n_heads)),
            partial_rotary_factor=float(get("partial_rotary_factor", 1.0)),
            rope_theta=float(get("rope_theta", 10000.0)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            intermediate_size=0 if is_moe else int(get("intermediate_size")),
            num_experts=int(get("num_experts")) if is_moe else 0,
            num_experts_per_tok=int(get("num_experts_per_tok")) if is_moe else 0,
            moe_intermediate_size=int(get("moe_intermediate_size")) if is_moe else 0,
            shared_expert_intermediate_size=(int(get("shared_expert_intermediate_size"))
                                             if is_moe else 0),
            # qwen3_5_moe configs carry no norm_topk_prob: its router always renormalises.
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             raw.get("tie_word_embeddings", False))),
            mtp_num_hidden_layers=int(get("mtp_num_hidden_layers",
                                          get("num_nextn_predict_layers", 0))),
            max_position_embeddings=int(get("max_position_embeddings", 262144)),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            composite=composite,
        )
        mc.validate()
        return mc

    @classmethod
    def from_folder(cls, path: str) -> "ModelConfig":
        """Read ``<path>/config.json``; raises :class:`ConfigError` if absent or unreadable."""
        file = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ConfigError(f"model path {path!r} is not a folder; pass a checkpoint folder "
                              "holding config.json and *.safetensors.")
        if not os.path.isfile(file):
            raise ConfigError(f"{path!r} has no config.json; pass an HF checkpoint folder.")
        try:
            with open(file) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot parse {file}: {e}") from e
        return cls.from_dict(raw)

    def validate(self) -> None:
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


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings.

    ``algorithm``: ``"none"`` (plain decoding), ``"mtp"`` (the checkpoint's ``mtp.*`` layer
    drafts) or ``"external"`` (a host callable drafts, see ``mtp_jax.spec.external``).
    ``num_steps`` is ``speculative_num_steps`` (k drafted tokens per round, 1..8).
    """

    algorithm: str = "mtp"
    num_steps: int = 3
    draft_model_path: str | None = None

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none"

    @property
    def k(self) -> int:
        return self.num_steps if self.enabled else 0

    def validate(self, model: ModelConfig | None = None) -> None:
        """Raise :class:`ConfigError` for a combination that cannot run."""
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ConfigError(f"speculative_algorithm {self.algorithm!r} is unknown; use one of "
                              f"{', '.join(SPECULATIVE_ALGORITHMS)}.")
        if not isinstance(self.num_steps, int) or not 1 <= self.num_steps <= MAX_SPECULATIVE_NUM_STEPS:
            raise ConfigError(f"speculative_num_steps {self.num_steps!r} is outside 1.."
                              f"{MAX_SPECULATIVE_NUM_STEPS}; pick k in that range "
                              "(3 is a good default).")
        if self.draft_model_path and self.algorithm != "mtp":
            raise ConfigError(f"speculative_draft_model_path {self.draft_model_path!r} was given "
                              f"but speculative_algorithm is {self.algorithm!r}; it only applies "
                              "with speculative_algorithm='mtp'.")
        if model is not None and self.algorithm == "mtp":
            if not model.has_mtp and not self.draft_model_path:
                raise ConfigError("speculative_algorithm='mtp' but the checkpoint's config declares "
                                  "no MTP layer (mtp_num_hidden_layers is 0) and no "
                                  "speculative_draft_model_path was given; pass a draft path or "
                                  "use speculative_algorithm='none'.")


def normalize_algorithm(name: str | None) -> str:
    """Map user spellings (None, 'NONE', 'MTP', 'nextn') to a canonical algorithm name."""
    if name is None:
        return "none"
    n = str(name).strip().lower()
    return {"nextn": "mtp", "eagle": "mtp", "": "none", "off": "none"}.get(n, n)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizing. Token counts are tokens; ``page_size`` tokens per KV page."""

    max_running_requests: int = 8
    page_size: int = 16
    max_model_len: int = 4096
    num_pages: int | None = None  # None: enough for max_running_requests * max_model_len
    dtype: str = "bfloat16"

    def validate(self) -> None:
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ConfigError(f"dtype {self.dtype!r} is not supported; use bfloat16, float16 "
                              "or float32.")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size {self.page_size} must be a power of two (e.g. 16).")
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests {self.max_running_requests} must be >= 1.")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len {self.max_model_len} must be >= 2.")
