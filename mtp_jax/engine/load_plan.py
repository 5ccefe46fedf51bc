"""What a load will hold on the device, decided before any weight is read: the bytes kept
quantized weights save, the PLE tables copied to the device, and what
``quantization="auto"`` means for this checkpoint on this device.

``auto`` dequantizes to the model dtype (the path measured fastest, docs/quantization.md) unless
the dequantized weights do not fit the memory budget while kept ones do: then it keeps them
packed, with a warning naming both sizes. A Flash-Next GGUF of the released size (its routed
experts about 241 GB in bf16, about 50 GB as IQ3_XXS / Q8_0 blocks) runs that way on one GPU
(issue 36 item 3).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

from mtp_jax.config import ConfigError, EngineConfig, SpeculativeConfig
from mtp_jax.engine.serving import check_memory_before_load
from mtp_jax.models.loaded import resolve_dtype

__all__ = ["device_table_bytes", "kept_saving", "check_memory_and_quantization"]


def device_table_bytes(cfg, dtype: str, ple_backend: str | None, dummy_weight: bool) -> int:
    """Device bytes of qwen4_exp's n-gram tables when they go to the device (``ple_backend``
    ``"device"``, or ``"auto"`` / None choosing it); 0 otherwise, and for random weights (their
    synthetic tables are small)."""
    if dummy_weight or not getattr(cfg, "ple_layers", ()):
        return 0
    from mtp_jax.models.qwen4_exp.entry import table_bytes
    from mtp_jax.models.qwen4_exp.ple_device import choose_backend

    size = table_bytes(cfg, dtype)
    return size if choose_backend(ple_backend, size) == "device" else 0


def kept_saving(model, dtype: str, request, dummy_weight: bool) -> int:
    """Bytes the checkpoint's quantized projections would save kept quantized, read from the
    headers: a safetensors folder's (:func:`~mtp_jax.weights.quant_tensors.folder_kept_bytes_saved`)
    or a Flash-Next GGUF target's with its Strata pack
    (:func:`~mtp_jax.models.qwen4_exp.gguf_loader.gguf_kept_bytes_saved`); 0 for random
    weights or a path that is neither."""
    from mtp_jax.weights.gguf_header import folder_pack, gguf_draft_file, gguf_file
    from mtp_jax.weights.quant_tensors import folder_kept_bytes_saved

    if dummy_weight or not isinstance(model, str) or not os.path.exists(model):
        return 0
    itemsize = 4 if resolve_dtype(dtype) == "float32" else 2
    draft = request.draft_path
    target = gguf_file(model)
    if target is not None:
        from mtp_jax.models.qwen4_exp.gguf_loader import gguf_kept_bytes_saved

        draft = (gguf_draft_file(draft) if draft is not None
                 else folder_pack(model) if request.with_mtp else None)
        return gguf_kept_bytes_saved(target, itemsize=itemsize, with_mtp=request.with_mtp,
                                     draft_path=draft)
    if not os.path.isdir(model):
        return 0
    draft = draft if draft and os.path.isdir(draft) else None
    return folder_kept_bytes_saved(model, itemsize, with_mtp=request.with_mtp,
                                   draft_folder=draft)


def _fits(model_cfg, engine_cfg, speculative, saved: int) -> bool:
    try:
        check_memory_before_load(model_cfg, engine_cfg, speculative, weights_saved=saved)
    except ConfigError:
        return False
    return True


def check_memory_and_quantization(model, model_cfg, engine_cfg: EngineConfig,
                                  speculative: SpeculativeConfig, request, dummy_weight: bool,
                                  ple_backend: str | None):
    """The load request to use, its memory checked (``check_memory_before_load``: a
    ``ConfigError`` when the budget cannot hold one full-length request). With
    ``request.quantization == "auto"``: ``"keep"`` when the checkpoint has projections to keep,
    its dequantized weights do not fit and its kept ones do (a ``UserWarning`` says so and
    names both sizes in GB), else ``"dequantize"``."""
    from mtp_jax.weights.quant_config import keeps_quantized

    tables = device_table_bytes(model_cfg, engine_cfg.dtype, ple_backend, dummy_weight)
    keep = keeps_quantized(request.quantization)
    saving = (0 if request.quantization == "dequantize"
              else kept_saving(model, engine_cfg.dtype, request, dummy_weight))
    if request.quantization == "auto" and not keep and saving > 0 \
            and not _fits(model_cfg, engine_cfg, speculative, -tables) \
            and _fits(model_cfg, engine_cfg, speculative, saving - tables):
        from mtp_jax.engine.memory import planned_weights_bytes

        dense = planned_weights_bytes(model_cfg, engine_cfg.dtype, request.with_mtp
                                      and model_cfg.has_mtp, speculative)
        warnings.warn(f"quantization 'auto': the weights dequantized to {engine_cfg.dtype} "
                      f"({dense / 1e9:.1f} GB) do not fit this device's memory budget, kept "
                      f"quantized ({(dense - saving) / 1e9:.1f} GB) they do: keeping them "
                      "packed (quantization='keep', --quantization keep; slower per byte "
                      "than dequantized, docs/quantization.md).", stacklevel=3)
        request, keep = dataclasses.replace(request, quantization="keep"), True
    check_memory_before_load(model_cfg, engine_cfg, speculative,
                             weights_saved=(saving if keep else 0) - tables)
    return request
