"""``Qwen4ExpConfig``: the text-model shape of a Qwen3.8-Flash-Next (``qwen4_exp``) checkpoint.

Frozen and hashable (compiled programs take it as a static argument). Parsed from an HF
``config.json`` (composite ``{"model_type": "qwen4_exp", "text_config": {...}}`` or flat
``qwen4_exp_text``). Every check that needs no weights is made here.

Conventions (../shared/MODEL_FACTS.md, "Qwen3.8-Flash-Next"):

* ``layer_types`` entries ``full_attention``, ``qwen_sparse_attention``, ``indexed_attention``,
  ``deepseek_sparse_attention`` and ``hybrid_indexed`` all mean a QSA (indexed attention) layer;
  they are normalised to ``"full_attention"`` here so the shared helpers (``full_layer_ids``)
  keep working. ``linear_attention`` is a Gated DeltaNet layer.
* ``ple_layer_ids`` in config.json are ONE-indexed; ``ple_layers`` holds the 0-based ids.
* The attribute names the shared layers read (``hidden_size``, ``head_dim``, ``rotary_dim``,
  ``linear_*``, ``num_experts`` ...) match :class:`mtp_jax.config.ModelConfig`, so
  ``GatedDeltaNet`` and ``SparseMoE`` accept this config as is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mtp_jax.config import ConfigError, LayerShapes, read_config_json
from mtp_jax.config_fields import check_fixed_fields, check_mtp_section, check_shared_expert
from mtp_jax.rope import DEFAULT_ROPE, RopeScaling, describe, parse_rope_scaling, rope_section

MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
QSA_SPELLINGS = ("full_attention", "qwen_sparse_attention", "indexed_attention",
                 "deepseek_sparse_attention", "hybrid_indexed")
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Qwen4ExpConfig(LayerShapes):
    model_type: str  # always "qwen4_exp"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" (= QSA)
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
    output_gate_type: str  # GDN output gate: "sigmoid" | "silu"
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    mtp_rope_theta: float
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    composite: bool
    # hyper-connections
    hc_count: int
    hc_lowrank: int
    # QSA indexer
    indexer_n_heads: int
    indexer_kv_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    # PLE / n-gram embedding
    ple_layers: tuple[int, ...]  # 0-based
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    seed: int
    split_ngram_parts: int

    intermediate_size: int = 0  # no dense MLP in this family
    # rope_parameters / rope_scaling (mtp_jax.rope); the MTP layer takes it too, on its own base
    # mtp_rope_theta
    rope_scaling: RopeScaling = DEFAULT_ROPE
    # Not from config.json: which implementation runs the GDN, MoE, hyper-connection (norm) and
    # one-row projection (gemv) ops (a frozen, hashable mtp_jax.kernels.KernelBackends; None =
    # XLA), set at load by mtp_jax.models.qwen4_exp.kernels.resolve_kernels.
    kernels: Any = None

    # ---- derived -------------------------------------------------------------------------
    is_moe = True

    @property
    def hc_hidden(self) -> int:
        return self.hc_count * self.hidden_size

    @property
    def block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def eos_token_id(self) -> int:
        """The eos id PLE segments on (the first one listed)."""
        return self.eos_token_ids[0]

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ngram_head_dim(self) -> int:
        return self.ple_embed_dim // self.ngram_heads

    @property
    def ple_conv_state_len(self) -> int:
        """Rows of the PLE dilated conv window: (kernel - 1) * dilation (dilation = ngram_size)."""
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Qwen4ExpConfig":
        raw = {k: v for k, v in raw.items() if not str(k).startswith("_")}
        text = raw.get("text_config")
        composite = isinstance(text, dict)
        cfg = dict(text) if composite else dict(raw)
        mt = raw.get("model_type") if composite else cfg.get("model_type")
        if mt not in MODEL_TYPES:
            raise ConfigError(f"model_type {mt!r} is not a qwen4_exp config (expected one of "
                              f"{', '.join(MODEL_TYPES)}).")
        rope = rope_section(cfg, raw)[0]  # refuses unsupported RoPE types and keys
        check_fixed_fields([cfg, raw] if composite else [cfg], "qwen4_exp")
        if isinstance(cfg.get("mtp"), dict):
            check_mtp_section(cfg["mtp"], cfg.get("mtp_num_hidden_layers"), QSA_SPELLINGS)

        def get(key, default=_MISSING):
            for src in (cfg, rope, raw):
                if key in src and src[key] is not None:
                    return src[key]
            if default is _MISSING:
                raise ConfigError(f"config.json has no {key!r} (looked in text_config, "
                                  "rope_parameters and the top level); qwen4_exp needs it.")
            return default

        n_layers = int(get("num_hidden_layers"))
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = int(get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n_layers)]
        bad = sorted({t for t in layer_types} - set(QSA_SPELLINGS) - {"linear_attention"})
        if bad:
            raise ConfigError(f"layer_types holds {bad}; qwen4_exp supports linear_attention and "
                              f"QSA layers spelled {', '.join(QSA_SPELLINGS)}.")
        layer_types = tuple("linear_attention" if t == "linear_attention" else "full_attention"
                            for t in layer_types)
        if len(layer_types) != n_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers "
                              f"is {n_layers}; they must agree.")
        eos = get("eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        hidden = int(get("hidden_size"))
        n_heads = int(get("num_attention_heads"))
        ple_ids = cfg.get("ple_layer_ids") or []
        mtp = cfg.get("mtp") if isinstance(cfg.get("mtp"), dict) else {}
        rope_theta = float(get("rope_theta", 10000.0))
        max_positions = int(get("max_position_embeddings", 262144))
        scaling = parse_rope_scaling(cfg, raw, max_positions)
        gate = cfg.get("output_gate_type") or cfg.get("hidden_act") or "silu"
        gate = {"swish": "silu"}.get(gate, gate)
        mc = cls(
            model_type="qwen4_exp",
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=n_heads,
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(get("head_dim", hidden // n_heads)),
            partial_rotary_factor=float(get("partial_rotary_factor", 1.0)),
            rope_theta=rope_theta,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            linear_num_key_heads=int(get("linear_num_key_heads")),
            linear_num_value_heads=int(get("linear_num_value_heads")),
            linear_key_head_dim=int(get("linear_key_head_dim")),
            linear_value_head_dim=int(get("linear_value_head_dim")),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            output_gate_type=str(gate),
            num_experts=int(get("num_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_intermediate_size=int(get("moe_intermediate_size")),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size")),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             raw.get("tie_word_embeddings", False))),
            mtp_num_hidden_layers=int(get("mtp_num_hidden_layers",
                                          mtp.get("num_hidden_layers", 0))),
            mtp_rope_theta=_mtp_rope_theta(mtp, rope_theta, scaling, max_positions),
            max_position_embeddings=max_positions,
            eos_token_ids=tuple(int(e) for e in eos_ids),
            composite=composite,
            hc_count=int(get("hc_count", 4)),
            hc_lowrank=int(get("hc_lowrank", 320)),
            indexer_n_heads=int(get("indexer_n_heads", 0)),
            indexer_kv_heads=int(get("indexer_kv_heads", 0)),
            indexer_head_dim=int(get("indexer_head_dim", 0)),
            indexer_budget=int(get("indexer_budget", 0)),
            indexer_compress_ratio=int(get("indexer_compress_ratio", 0)),
            ple_layers=tuple(sorted({int(i) - 1 for i in ple_ids})),
            ple_embed_dim=int(get("ple_embed_dim", hidden)),
            ple_conv_kernel_size=int(get("ple_conv_kernel_size", 4)),
            ngram_size=int(get("ngram_size", 3)),
            heads_per_ngram=int(get("heads_per_ngram", 8)),
            ngram_vocab_size_base=int(get("ngram_vocab_size_base", 20_000_000)),
            make_ngram_vocab_size_divisible_by=int(get("make_ngram_vocab_size_divisible_by", 128)),
            seed=int(get("seed", 1234)),
            split_ngram_parts=int(get("split_ngram_parts", 512)),
            rope_scaling=scaling,
        )
        mc.validate(raw_ple_ids=list(ple_ids))
        return mc

    @classmethod
    def from_folder(cls, path: str) -> "Qwen4ExpConfig":
        """Read ``<path>/config.json``; raises :class:`ConfigError` if absent or unreadable."""
        return cls.from_dict(read_config_json(path))

    def validate(self, raw_ple_ids=None) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                              f"of num_key_value_heads {self.num_key_value_heads}.")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads {self.linear_num_value_heads} is not a "
                              f"multiple of linear_num_key_heads {self.linear_num_key_heads}.")
        if self.rotary_dim % 2:
            raise ConfigError(f"head_dim * partial_rotary_factor = {self.rotary_dim} is odd.")
        if self.output_gate_type not in ("sigmoid", "silu"):
            raise ConfigError(f"output_gate_type {self.output_gate_type!r} is not supported; "
                              "qwen4_exp GDN gates are 'sigmoid' or 'silu'.")
        if self.hc_count < 2:
            raise ConfigError(f"hc_count {self.hc_count} must be >= 2: qwen4_exp has at least "
                              "two residual streams (transformers' Qwen4ExpTextConfig refuses "
                              "hc_count <= 1 too); fix hc_count in config.json.")
        if self.hc_lowrank < 1:
            raise ConfigError(f"hc_lowrank {self.hc_lowrank} must be >= 1: it is the width of "
                              "each hyper-connection's low-rank mix; use the checkpoint's own "
                              "value (320 in the released config).")
        check_shared_expert(self.shared_expert_intermediate_size)
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                              f"1..num_experts ({self.num_experts}).")
        if self.full_layer_ids or self.mtp_num_hidden_layers:
            vals = dict(indexer_n_heads=self.indexer_n_heads, indexer_kv_heads=self.indexer_kv_heads,
                        indexer_head_dim=self.indexer_head_dim, indexer_budget=self.indexer_budget,
                        indexer_compress_ratio=self.indexer_compress_ratio)
            bad = [k for k, v in vals.items() if v <= 0]
            if bad:
                raise ConfigError(f"QSA layers need positive {', '.join(bad)} (got {vals}); the "
                                  "config.json is incomplete.")
            if self.indexer_kv_heads != 1:
                raise ConfigError(f"indexer_kv_heads {self.indexer_kv_heads} is not supported; "
                                  "qwen4_exp QSA has exactly one index key head.")
            if self.indexer_budget % self.indexer_compress_ratio:
                raise ConfigError(f"indexer_budget {self.indexer_budget} is not a multiple of "
                                  f"indexer_compress_ratio {self.indexer_compress_ratio}.")
            if self.rotary_dim > self.indexer_head_dim:
                raise ConfigError(f"rotary dims {self.rotary_dim} exceed indexer_head_dim "
                                  f"{self.indexer_head_dim}; the index heads are roped on them.")
        if self.ple_layers:
            ids = raw_ple_ids if raw_ple_ids is not None else [i + 1 for i in self.ple_layers]
            out = [i for i in ids if not 1 <= int(i) <= self.num_hidden_layers]
            if out:
                raise ConfigError(f"ple_layer_ids {out} are outside 1..{self.num_hidden_layers} "
                                  "(they are one-indexed layer ids).")
            nonlin = [i + 1 for i in self.ple_layers if self.layer_types[i] != "linear_attention"]
            if nonlin:
                raise ConfigError(f"ple_layer_ids {nonlin} (one-indexed) are not linear_attention "
                                  "layers; qwen4_exp PLE sits on GDN layers only.")
            if self.ngram_size < 2 or self.heads_per_ngram < 1:
                raise ConfigError(f"ngram_size {self.ngram_size} must be >= 2 and heads_per_ngram "
                                  f"{self.heads_per_ngram} >= 1.")
            if self.ple_embed_dim % self.ngram_heads:
                raise ConfigError(f"ple_embed_dim {self.ple_embed_dim} is not divisible by the "
                                  f"{self.ngram_heads} n-gram heads ((ngram_size-1)*heads_per_ngram).")
            if not self.eos_token_ids:
                raise ConfigError("eos_token_id must be set when ple_layer_ids is non-empty (PLE "
                                  "segments n-grams at eos).")


def _mtp_rope_theta(mtp: dict, rope_theta: float, scaling: RopeScaling,
                    max_positions: int) -> float:
    """The MTP layer's RoPE base: ``mtp.rope_theta`` (or the one in ``mtp.rope_parameters``),
    else the target's. The draft runs the target's RoPE scaling, as vLLM and SGLang build an MTP
    layer from the target's config; a different scaling under ``mtp`` is refused."""
    if any(mtp.get(k) is not None for k in ("rope_parameters", "rope_scaling")):
        own = parse_rope_scaling(mtp, mtp, max_positions)
        if own != scaling:
            raise ConfigError(f"config.json mtp.rope_parameters / mtp.rope_scaling ask for RoPE "
                              f"{describe(own)} in the MTP layer but the model has "
                              f"{describe(scaling)}; mtp_jax runs the draft with the target's "
                              "scaling. Make them equal or drop the draft's.")
    own_theta = mtp.get("rope_theta") or rope_section(mtp, mtp)[0].get("rope_theta")
    return float(own_theta or rope_theta)


# ---- n-gram hash constants derived from the config (checked against the stored buffers) ------
_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def layer_multipliers(cfg: Qwen4ExpConfig, ple_index: int) -> tuple[int, ...]:
    """Odd hash multipliers of the ``ple_index``-th PLE module (one per n-gram position)."""
    bound = max(1, (((1 << 63) - 1) // max(cfg.vocab_size, 1)) // 2)
    base = cfg.seed + 10007 * ple_index
    return tuple(2 * (_mix64((base + _GAMMA * (i + 1)) & _MASK64) % bound) + 1
                 for i in range(cfg.ngram_size))


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(cfg: Qwen4ExpConfig, ple_index: int) -> tuple[int, ...]:
    """Prime table size of each n-gram head: the (g+1)-th prime >= ngram_vocab_size_base, with
    g the head's global index over all PLE modules."""
    out, p, count = [], cfg.ngram_vocab_size_base - 1, 0
    first = ple_index * cfg.ngram_heads
    while len(out) < cfg.ngram_heads:
        p += 1
        while not _is_prime(p):
            p += 1
        if count >= first:
            out.append(p)
        count += 1
    return tuple(out)


def head_offsets(sizes) -> tuple[int, ...]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return tuple(out)


def ngram_table_rows(cfg: Qwen4ExpConfig, ple_index: int) -> int:
    """Rows of a PLE n-gram table, padded up to ``make_ngram_vocab_size_divisible_by``."""
    total = sum(head_vocab_sizes(cfg, ple_index))
    d = cfg.make_ngram_vocab_size_divisible_by
    return -(-total // d) * d


def ple_table_bytes(cfg: Qwen4ExpConfig, itemsize: int) -> int:
    """Bytes of every PLE layer's n-gram table held in a dtype of ``itemsize`` bytes
    (``ple_backend="device"``): ``ngram_table_rows * ngram_head_dim * itemsize`` per layer."""
    return sum(ngram_table_rows(cfg, j) * cfg.ngram_head_dim * itemsize
               for j in range(len(cfg.ple_layers)))

