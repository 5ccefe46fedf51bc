"""Random-weight qwen4_exp checkpoints in the released layout (tests, benchmarks).

``write_random_qwen4_exp(config, out_dir)`` writes ``config.json`` and ``model.safetensors``
(composite ``model.language_model.*`` names when the config has a ``text_config``): dense
tensors with fused experts, every PLE table split into ``split_ngram_parts`` shards
``...ngram_embedding.shard_{j}.weight`` (torch.chunk sizes, as transformers saves them), the
int64 hash buffers derived from the config, and the ``mtp.*`` tensors. Matrices ``N(0, 1/fan_in)``
(embeddings and n-gram rows ``N(0, 1)``), zero-centred norms ``N(0, 0.02)``, GDN output norm
ones, ``A_log = log U(1, 16)``, ``dt_bias ~ U(-0.5, 0.5)``. Small shapes only (one file, held
in host memory while written).

MoE experts are fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) or,
with ``experts="per-expert"`` (``mtp_experts`` for the ``mtp.*`` layers, default ``experts``),
one tensor per expert: ``experts.{e}.gate_proj.weight`` = rows ``[0, I)`` of fused
``gate_up_proj[e]``, ``up_proj`` rows ``[I, 2I)``, ``down_proj`` = ``down_proj[e]``. The values
are drawn fused either way, so one seed gives the same model in both layouts.

``zero_rows_from`` (``python -m mtp_jax.tools.random_checkpoint --tokenizer``, which writes the
real Qwen tokenizer beside the weights): rows of ``embed_tokens`` / ``lm_head`` from this id on
are zero, as in the Qwen3.5 family's writer.
"""

from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np

from mtp_jax.models.qwen3_5.random_checkpoint import EXPERT_LAYOUTS
from mtp_jax.models.qwen4_exp import names
from mtp_jax.models.qwen4_exp.config import (Qwen4ExpConfig, head_offsets, head_vocab_sizes,
                                             layer_multipliers)
from mtp_jax.weights.safetensors_write import save_file

_NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _draw(rng, name, shape):
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith("dt_bias"):
        return rng.uniform(-0.5, 0.5, shape)
    if name.endswith("linear_attn.norm.weight"):
        return np.ones(shape)
    if len(shape) == 1:
        return 0.02 * rng.standard_normal(shape)
    std = 1.0 if ("embed_tokens" in name or "ngram_embedding" in name) else shape[-1] ** -0.5
    return std * rng.standard_normal(shape)


def _split_experts(canonical: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """Per-expert tensors (canonical name -> value) of a fused expert tensor."""
    if canonical.endswith("mlp.experts.gate_up_proj"):
        prefix, i = canonical[: -len("gate_up_proj")], value.shape[1] // 2
        out = {}
        for e in range(value.shape[0]):
            out[f"{prefix}{e}.gate_proj.weight"] = value[e, :i].copy()
            out[f"{prefix}{e}.up_proj.weight"] = value[e, i:].copy()
        return out
    prefix = canonical[: -len("down_proj")]
    return {f"{prefix}{e}.down_proj.weight": value[e].copy() for e in range(value.shape[0])}


def write_random_qwen4_exp(config: dict | str, out_dir: str, *, dtype: str = "bfloat16",
                           seed: int = 0, with_mtp: bool = True, experts: str = "fused",
                           mtp_experts: str | None = None,
                           zero_rows_from: int | None = None,
                           max_file_bytes: int | None = None) -> Qwen4ExpConfig:
    """Write ``config.json`` and ``model.safetensors`` into ``out_dir``; returns the config.

    ``experts`` / ``mtp_experts``: ``"fused"`` or ``"per-expert"`` layout of the target /
    ``mtp.*`` experts (``mtp_experts`` defaults to ``experts``). ``zero_rows_from``: rows of
    ``embed_tokens`` / ``lm_head`` from this id on are zero. ``max_file_bytes`` (the tool's
    ``--shard-size-gb``): the one file is not sharded, so a checkpoint larger than this is a
    ``ValueError`` (before anything is drawn), as is a bad option."""
    if dtype not in _NP:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_NP)}.")
    for label, layout in (("experts", experts), ("mtp_experts", mtp_experts or experts)):
        if layout not in EXPERT_LAYOUTS:
            raise ValueError(f"{label}={layout!r} is not a layout; use one of {EXPERT_LAYOUTS}.")
    raw = json.load(open(config)) if isinstance(config, str) else json.loads(json.dumps(config))
    raw = {k: v for k, v in raw.items() if not str(k).startswith("_")}
    cfg = Qwen4ExpConfig.from_dict(raw)
    rng = np.random.default_rng(seed)
    shapes = dict(names.target_tensors(cfg))
    if with_mtp and cfg.has_mtp:
        shapes.update(names.mtp_tensors(cfg))
    if max_file_bytes is not None:
        values = sum(math.prod(s) for s in (*shapes.values(), *names.ple_tensors(cfg).values()))
        total = values * np.dtype(_NP[dtype]).itemsize
        if total > max_file_bytes:
            raise ValueError(f"qwen4_exp random checkpoints are one unsharded file: this one is "
                             f"{total / (1 << 30):.3f} GiB, more than the shard size "
                             f"(shard_size_bytes / --shard-size-gb) of "
                             f"{max_file_bytes / (1 << 30):.3f} GiB; raise it or use a smaller "
                             "config.")
    out = {}
    for n in sorted(shapes):  # draw order (and so every value) independent of the options
        value = _draw(rng, n, shapes[n]).astype(_NP[dtype])
        if zero_rows_from is not None and n in ("embed_tokens.weight", "lm_head.weight"):
            value[zero_rows_from:] = 0
        layout = (mtp_experts or experts) if n.startswith("mtp.") else experts
        if layout == "per-expert" and n.endswith(("mlp.experts.gate_up_proj",
                                                  "mlp.experts.down_proj")):
            for c, v in _split_experts(n, value).items():
                out[names.disk_name(cfg, c)] = v
        else:
            out[names.disk_name(cfg, n)] = value
    for j, layer in enumerate(cfg.ple_layers):
        sizes = head_vocab_sizes(cfg, j)
        p = f"layers.{layer}.ple.ple_embedding."
        bufs = {"layer_multipliers": layer_multipliers(cfg, j),
                "ngram_heads_vocab_sizes": sizes, "ngram_heads_offsets": head_offsets(sizes)}
        for b, v in bufs.items():
            out[names.disk_name(cfg, p + b)] = np.asarray(v, np.int64)
        rows, dim = names.ple_tensors(cfg)[names.ple_table_name(layer)]
        table = _draw(rng, "ngram_embedding", (rows, dim)).astype(_NP[dtype])
        r0 = 0
        for s, r in enumerate(names.shard_rows(rows, cfg.split_ngram_parts)):
            out[names.disk_name(cfg, names.ple_table_name(layer, s))] = table[r0:r0 + r].copy()
            r0 += r
    os.makedirs(out_dir, exist_ok=True)
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if not (with_mtp and cfg.has_mtp):
        tc = raw.get("text_config", raw)
        tc["mtp_num_hidden_layers"] = 0
        tc.pop("mtp", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    return cfg
