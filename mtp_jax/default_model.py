"""A small Qwen3.5-MoE checkpoint to run without downloading anything.

:func:`default_model_path` builds it once (a few seconds) under
``$MTP_JAX_CACHE/default-qwen3_5_moe-v2`` (default cache ``~/.cache/mtp_jax``) and returns the
folder. It is a real released-layout checkpoint: composite config (``text_config``), tensors under
``model.language_model.*``, ``lm_head.weight``, ``mtp.*`` (fused experts), bf16, sharded with an
index, plus the real Qwen3.5 tokenizer, chat template and generation config. It exercises every
code path of the engine: GDN and full attention, GQA, partial RoPE, MoE with a shared expert and
MTP.

Weights: ``embed_tokens`` and ``lm_head`` are random (seed 0,
:mod:`mtp_jax.tools.random_checkpoint`); the decoder layers and final norm were trained briefly
on the project's own docs with those two frozen, and the MTP head by ``python -m
mtp_jax.train_mtp`` on the model's own continuations (:mod:`mtp_jax.tools.train_default_model`).
Those trained tensors ship with the package (:data:`TRAINED_WEIGHTS`, about 1 MB), so the build
regenerates the random tables and overwrites the rest. The model recites fragments of the docs,
not language; its MTP head drafts those fragments, so ``python -m mtp_jax.generate`` shows MTP
drafts being accepted (the README says what its accept length means).

Shape (:data:`DEFAULT_CONFIG`): vocab 248320 (the real one), hidden 64, 4 layers
[linear, linear, linear, full], 4 query / 2 KV heads x 32, partial rotary 0.25 (8 dims),
GDN 4 key / 8 value heads x 32, 8 experts top-2 of size 64 plus a shared expert of 64,
one MTP layer, untied lm_head. About 80 MB on disk: 65 MB of weights (almost all embedding and
lm_head) and the 15 MB tokenizer.json.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile

from mtp_jax.home import cache_root

DEFAULT_MODEL_NAME = "default-qwen3_5_moe-v2"
# The trained tensors (bfloat16, on-disk names): the decoder layers and final norm trained on the
# project's docs, and the MTP head trained by ``python -m mtp_jax.train_mtp`` on the model's own
# continuations (mtp_jax/tools/train_default_model.py made it).
TRAINED_WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                               "default_model_weights.safetensors")

_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                    "full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attn_output_gate": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [2, 1, 1],  # sums to rotary_dim / 2 = 4
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "dtype": "bfloat16",
    "bos_token_id": 248044,
    "eos_token_id": 248044,
    "pad_token_id": None,
}

DEFAULT_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": _TEXT_CONFIG,
    "tie_word_embeddings": False,
}


def apply_trained_weights(folder: str, path: str = TRAINED_WEIGHTS) -> None:
    """Overwrite the random checkpoint in ``folder`` with the shipped trained tensors (every
    tensor but ``embed_tokens`` and ``lm_head``, under their on-disk names), shard by shard.
    Raises ``RuntimeError`` naming a shipped tensor the checkpoint lacks or stores otherwise."""
    import json

    import ml_dtypes  # noqa: F401  (registers numpy's bfloat16, which the files use)
    from safetensors.numpy import load_file

    from mtp_jax.weights.safetensors_write import save_file

    trained = load_file(path)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    by_file: dict[str, list[str]] = {}
    for name in trained:
        if name not in weight_map:
            raise RuntimeError(f"{path} holds {name!r}, which the default model does not have; "
                               "rebuild the file with mtp_jax.tools.train_default_model.")
        by_file.setdefault(weight_map[name], []).append(name)
    for fn, names in by_file.items():
        shard = os.path.join(folder, fn)
        tensors = load_file(shard)
        for name in names:
            a, b = tensors[name], trained[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                raise RuntimeError(f"{path}: {name!r} is {b.dtype} {b.shape}, the default model "
                                   f"stores {a.dtype} {a.shape}.")
            tensors[name] = b
        save_file(tensors, shard, metadata={"format": "pt"})


def default_config() -> dict:
    """A fresh copy of the default model's ``config.json``."""
    return copy.deepcopy(DEFAULT_CONFIG)


def default_model_path(cache_dir: str | None = None) -> str:
    """Folder of the default random checkpoint, building it on first use.

    Built in a temporary sibling folder and renamed into place, so a partial build is never
    seen and concurrent callers agree on one copy. ``cache_dir`` overrides
    :func:`mtp_jax.home.cache_root`. Takes a few seconds the first time (the tokenizer
    conversion dominates).
    """
    root = cache_dir or cache_root()
    final = os.path.join(root, DEFAULT_MODEL_NAME)
    if os.path.isfile(os.path.join(final, "model.safetensors.index.json")):
        return final
    from mtp_jax.tools import qwen_vocab
    from mtp_jax.tools.random_checkpoint import write_random_checkpoint

    os.makedirs(root, exist_ok=True)
    print(f"[model] building the built-in default model in {final} (trained layers and MTP "
          "head, random embedding and LM head; once, under a minute)", file=sys.stderr,
          flush=True)
    qwen_vocab.converted_tokenizer_json(root)  # cached beside the model, reused by other builds
    tmp = tempfile.mkdtemp(dir=root, prefix=f".{DEFAULT_MODEL_NAME}-")
    try:
        write_random_checkpoint(default_config(), tmp, dtype="bfloat16", experts="fused",
                                include_mtp=True, seed=0, tokenizer=True, cache_dir=root)
        apply_trained_weights(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (final exists and is not empty): use its copy.
            if not os.path.isfile(os.path.join(final, "model.safetensors.index.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
