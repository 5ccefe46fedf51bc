"""Random-weight qwen4_exp checkpoints in the released layout (tests, benchmarks).

``write_random_qwen4_exp(config, out_dir)`` writes ``config.json`` and ``model.safetensors``
(composite ``model.language_model.*`` names when the config has a ``text_config``): dense
tensors with fused experts, every PLE table split into ``split_ngram_parts`` shards
``...ngram_embedding.shard_{j}.weight`` (torch.chunk sizes, as transformers saves them), the
int64 hash buffers derived from the config, and the ``mtp.*`` tensors. Matrices ``N(0, 1/fan_in)``
(embeddings and n-gram rows ``N(0, 1)``), zero-centred norms ``N(0, 0.02)``, GDN output norm
ones, ``A_log = log U(1, 16)``, ``dt_bias ~ U(-0.5, 0.5)``. Small shapes only (one file, held
in host memory while written).
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from mtp_jax.models.qwen4_exp import names
from mtp_jax.models.qwen4_exp.config import (Qwen4ExpConfig, head_offsets, head_vocab_sizes,
                                             layer_multipliers)

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


def write_random_qwen4_exp(config: dict | str, out_dir: str, *, dtype: str = "bfloat16",
                           seed: int = 0, with_mtp: bool = True) -> Qwen4ExpConfig:
    raw = json.load(open(config)) if isinstance(config, str) else json.loads(json.dumps(config))
    raw = {k: v for k, v in raw.items() if not str(k).startswith("_")}
    cfg = Qwen4ExpConfig.from_dict(raw)
    rng = np.random.default_rng(seed)
    shapes = dict(names.target_tensors(cfg))
    if with_mtp and cfg.has_mtp:
        shapes.update(names.mtp_tensors(cfg))
    out = {}
    for n in sorted(shapes):
        out[names.disk_name(cfg, n)] = _draw(rng, n, shapes[n]).astype(_NP[dtype])
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
