"""``load_model``: read a checkpoint folder of any registered family (or draw random weights).

The family is the registry's (:mod:`mtp_jax.models.registry`), chosen from ``config.json``;
every model-side check runs first (:mod:`mtp_jax.models.checks`), then the family's loader
(:attr:`ModelEntry.load`) builds and fills the model. What it returns is the family's loaded
form (a :class:`~mtp_jax.models.loaded.LoadedModel` for the Qwen3.5 family), whose ``forward``
and ``mtp_forward`` are jit-able functions of token ids and hidden states.
"""

from __future__ import annotations

import dataclasses
import os

from mtp_jax.config import ConfigError
from mtp_jax.models.checks import (check_backends, check_draft_folder, check_draft_source,
                                   check_family, check_request, read_model_config)
from mtp_jax.models.entry import LoadRequest
from mtp_jax.models.loaded import resolve_dtype
from mtp_jax.weights.hub import download_repo
from mtp_jax.weights.quant_config import check_quantization_mode

__all__ = ["load_model", "load_request"]


def load_request(dtype: str, *, with_mtp: bool, draft_path: str | None = None,
                 dummy_weight: bool = False, seed: int = 0, device=None,
                 backends: dict | None = None, merge_projections: bool = True,
                 pack_small_params: bool = False, ple_backend: str | None = None,
                 quantization: str = "auto") -> LoadRequest:
    """A :class:`~mtp_jax.models.entry.LoadRequest` from ``load_model``'s arguments (family
    options that were not given are left out)."""
    options = tuple((k, v) for k, v in (("ple_backend", ple_backend),) if v is not None)
    return LoadRequest(dtype=dtype, with_mtp=with_mtp, draft_path=draft_path,
                       dummy_weight=dummy_weight, seed=seed, device=device,
                       backends=tuple(sorted((backends or {}).items())),
                       merge_projections=merge_projections,
                       pack_small_params=pack_small_params, quantization=quantization,
                       options=options)


def load_model(path: str | None = None, dtype: str | None = "auto", *, with_mtp: bool = True,
               dummy_weight: bool = False, seed: int = 0, cfg=None, device=None,
               draft_path: str | None = None, attention_backend: str = "auto",
               gdn_backend: str = "auto", moe_backend: str = "auto",
               merge_projections: bool = True, pack_small_params: bool = False,
               norm_backend: str = "auto", gemv_backend: str = "auto",
               ple_backend: str | None = None, quantization: str = "auto"):
    """Load a checkpoint folder of any registered family.

    Args:
      path: HF checkpoint folder (``config.json`` + ``*.safetensors``).
      dtype: ``"auto"`` (bf16 on GPU, f32 on CPU), ``"bfloat16"``, ``"float16"``, ``"float32"``.
      with_mtp: also load the ``mtp.*`` draft (only when the config declares an MTP layer, or
        ``draft_path`` gives one).
      dummy_weight: random weights instead of the checkpoint's (for benchmarks/tests; families
        whose entry allows it).
      cfg: an already parsed config (skips reading ``config.json``; with ``dummy_weight`` no
        path is needed).
      draft_path: a separate folder (or a Hugging Face repo id, downloaded) to read the ``mtp.*``
        tensors from (default: ``path``).
      attention_backend, gdn_backend, moe_backend: ``"auto"``, ``"xla"`` or ``"pallas"``, the
        implementation of paged attention, the GDN decode/verify/commit step form and the MoE
        experts and router (:class:`mtp_jax.kernels.KernelBackends`; on a GPU ``auto`` takes
        the kernels, the attention and MoE ones in 16-bit dtypes only, and XLA for GDN layers
        whose head sizes the kernels cannot take).
      norm_backend: the same for the decoder layers' residual add + RMSNorm
        (:mod:`pallas_kernels.norm`; on a GPU ``auto`` takes the kernel for hidden sizes up to
        :data:`mtp_jax.kernels.AUTO_NORM_MAX_HIDDEN`, XLA above).
      gemv_backend: the same for the projections (and LM head) of one-row calls
        (:mod:`pallas_kernels.gemv`: ``xla``, ``reduce``, ``pallas`` or ``fused``: ``reduce``
        with each one-row dense MLP's add + norm, gate/up and SwiGLU as one kernel,
        :mod:`pallas_kernels.gemv.norm_gemv`, needing merged projections; ``auto`` takes
        ``reduce`` on a GPU, else XLA).
      merge_projections: after loading, stack the projections that read one input into one
        matrix each (one GEMM per group, faster decode); ``False`` keeps one parameter per
        checkpoint tensor, under its canonical name.
      pack_small_params: the engine's programs take the small parameters (norm weights)
        packed into one buffer per dtype (:attr:`LoadedModel.pack_small_params`); experimental,
        for an A/B of the host cost per argument buffer (``bench --pack-small-params``).
      ple_backend: qwen4_exp only: where the PLE n-gram tables live, ``"disk"`` (memory-mapped),
        ``"memory"`` (host RAM), ``"device"`` (copied to the accelerator; the programs look
        their rows up inside the program, no host callback; the tables must fit:
        ``rows * ngram_head_dim`` values of ``dtype`` per PLE layer) or ``"auto"`` / None
        (the default: ``device`` on an accelerator where they take at most a quarter of its
        memory, else ``disk``; :func:`mtp_jax.models.qwen4_exp.entry.ple_backend_for`).
      quantization: how a quantized checkpoint's projections (block FP8, ModelOpt FP8 / NVFP4,
        compressed-tensors NVFP4; :mod:`mtp_jax.weights.quant_tensors`) are held:
        ``"dequantize"``: dequantized to ``dtype`` at load (the reference); ``"keep"``: kept
        as stored (FP8 codes with their block scales, packed NVFP4) and dequantized inside
        each program, on any backend; ``"auto"``: today ``dequantize``
        (:func:`mtp_jax.weights.quant_config.keeps_quantized`; docs/quantization.md).
    Raises:
      ConfigError: bad config or settings (before any tensor is read; see
      :mod:`mtp_jax.models.checks`);
      CheckpointError: bad files or missing/unexpected tensors (before any tensor data is read,
      the draft's before the target's).
    """
    backends = dict(attention=attention_backend, gdn=gdn_backend, moe=moe_backend,
                    norm=norm_backend, gemv=gemv_backend)
    check_backends(backends)  # the choices first, before the model family or its files
    check_quantization_mode(quantization)
    if cfg is None:
        cfg = read_model_config(path, mtp=with_mtp, draft_path=draft_path)
    if draft_path is not None and not with_mtp:
        raise ConfigError(f"speculative_draft_model_path (--speculative-draft-model-path) "
                          f"{draft_path!r} was given but speculative_algorithm is 'none'; it only "
                          "applies with speculative_algorithm='mtp'. Drop the path or use "
                          "--speculative-algorithm mtp.")
    with_mtp = with_mtp and (cfg.has_mtp or draft_path is not None)
    family = check_family(cfg, "mtp" if with_mtp else "none")
    if path is None and not dummy_weight:
        raise ConfigError("load_model needs a checkpoint path to read weights from (or "
                          "dummy_weight=True with a cfg).")
    request = load_request(resolve_dtype(dtype), with_mtp=with_mtp, draft_path=draft_path,
                           dummy_weight=dummy_weight, seed=seed, device=device,
                           backends=backends, merge_projections=merge_projections,
                           pack_small_params=pack_small_params, ple_backend=ple_backend,
                           quantization=quantization)
    check_request(cfg, request)
    if with_mtp and draft_path is not None:
        check_draft_source(cfg, draft_path, target=path)
        if not dummy_weight and not os.path.exists(draft_path):  # a repo id: download it
            request = dataclasses.replace(request, draft_path=download_repo(draft_path))
            check_draft_folder(cfg, request.draft_path)
    return family.load(path, cfg, request)
