"""Rewrite a float checkpoint folder as a quantized one (any family; tests and benchmarks).

``quantize_folder(folder, scheme)`` quantizes the projection weights of every safetensors file
in ``folder`` in place (:mod:`mtp_jax.tools.quantize_weights`) and adds the matching
``quantization_config`` to ``config.json``, laid out as the released checkpoints are
(:mod:`mtp_jax.weights.quant_tensors` documents the stored names). Quantized: 2-D ``*.weight``
projections and routed experts (stacked: ``X`` + ``X_scale_inv`` etc.; per expert: ordinary
linears). Kept as stored, as in released checkpoints: embeddings, ``lm_head``, norms, the MoE
router and shared-expert gate, GDN ``conv1d`` / ``in_proj_a`` / ``in_proj_b`` / ``A_log`` /
``dt_bias``, hyper-connection mixers and PLE tensors (qwen4_exp), the MTP input projections
(``mtp.fc``, ``mtp.fc_embedding``, ``mtp.fc_hidden``) unless ``quantize_mtp_fc``, and for NVFP4
any weight whose input size is not a multiple of 16.

``mtp_scheme`` quantizes the ``mtp.*`` tensors differently: ``"none"`` keeps them as stored (an
NVFP4 trunk with BF16 MTP, as released), another scheme writes a ModelOpt ``MIXED_PRECISION``
config listing every quantized module (e.g. an NVFP4 trunk with block-FP8 MTP experts).
"""

from __future__ import annotations

import json
import os

import numpy as np

from mtp_jax.tools.quantize_weights import SCHEMES, quantize
from mtp_jax.weights.safetensors_files import (_Files, checkpoint_files, read_header,
                                               read_stored)
from mtp_jax.weights.safetensors_write import save_file

__all__ = ["quantize_folder", "SCHEMES"]

_KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_expert_gate", "conv1d",
         "in_proj_a", "in_proj_b", "hyper_connection", "ple.", "ngram")
_STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_DOTTED = {"weight": "weight", "scale_inv": "weight_scale_inv", "scale": "weight_scale",
           "scale_2": "weight_scale_2", "global_scale": "weight_global_scale"}
_MODELOPT_ALGO = {"fp8-block": "FP8_BLOCK_SCALES", "modelopt-fp8": "FP8",
                  "modelopt-nvfp4": "NVFP4"}


def _canonical(name: str) -> str:
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _scheme_for(name: str, shape: tuple, scheme: str, mtp_scheme: str | None,
                quantize_mtp_fc: bool) -> str | None:
    """The scheme a stored tensor is written in (None: kept as stored)."""
    c = _canonical(name)
    stacked = c.endswith(_STACKED) and len(shape) == 3
    if not stacked and not (c.endswith(".weight") and len(shape) == 2):
        return None
    if c.startswith("mtp.fc"):
        if not quantize_mtp_fc:
            return None
    elif any(k in c for k in _KEEP):
        return None
    s = mtp_scheme if (c.startswith("mtp.") and mtp_scheme is not None) else scheme
    if s == "none" or ("nvfp4" in s and shape[-1] % 16):
        return None
    return s


def _stored_names(name: str, scheme: str, roles: dict) -> dict[str, np.ndarray]:
    """Stored name -> array for one quantized tensor (dotted ``X.weight_*`` names, or the
    stacked experts' ``X_*``)."""
    out = {}
    stacked = not name.endswith(".weight")
    for role, arr in roles.items():
        if role == "input":
            suffix = "input_global_scale" if scheme == "ct-nvfp4" else "input_scale"
        elif scheme == "ct-nvfp4" and role == "weight":
            suffix = "weight_packed"
        else:
            suffix = _DOTTED[role]
        if stacked:
            out[name if suffix == "weight" else f"{name}_{suffix.removeprefix('weight_')}"] = arr
        else:
            out[name[: -len("weight")] + suffix] = arr
    return out


def _config(scheme: str, mtp_scheme: str | None, written: dict[str, str],
            block: tuple[int, int]) -> dict:
    """The ``quantization_config`` of a written checkpoint (``written``: module -> scheme)."""
    if mtp_scheme not in (None, "none", scheme):
        if scheme == "ct-nvfp4" or mtp_scheme == "ct-nvfp4":
            raise ValueError("a mixed checkpoint is written as ModelOpt MIXED_PRECISION, which "
                             "has no compressed-tensors format; use modelopt-* or fp8-block.")
        layers = {m: {"quant_algo": _MODELOPT_ALGO[s], **({"group_size": 16} if "nvfp4" in s
                                                           else {})}
                  for m, s in sorted(written.items())}
        return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                "quantized_layers": layers, "producer": {"name": "mtp_jax random_checkpoint"}}
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    if scheme == "modelopt-fp8":
        return {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}
    if scheme == "modelopt-nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "ignore": ["lm_head"]}
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
               "symmetric": True, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": dict(weights, dynamic="local")}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


def quantize_folder(folder: str, scheme: str, *, mtp_scheme: str | None = None,
                    quantize_mtp_fc: bool = False, block: tuple[int, int] = (128, 128)) -> str:
    """Quantize the checkpoint in ``folder`` in place (see the module doc); returns it.
    Raises ValueError for an unknown scheme or an impossible mix."""
    for label, s in (("scheme", scheme), ("mtp_scheme", mtp_scheme)):
        if s is not None and s not in SCHEMES + (("none",) if label == "mtp_scheme" else ()):
            raise ValueError(f"{label} {s!r} is unknown; use one of {SCHEMES}"
                             + (" or 'none'" if label == "mtp_scheme" else "") + ".")
    files, wm = checkpoint_files(folder)
    written: dict[str, str] = {}
    total = 0
    for fn in files:
        path = os.path.join(folder, fn)
        fh, out = _Files(), {}
        try:
            for name, t in read_header(path).items():
                x = np.array(read_stored(fh, t))
                s = _scheme_for(name, t.shape, scheme, mtp_scheme, quantize_mtp_fc)
                if s is None:
                    out[name] = x
                    continue
                roles = quantize(x.astype(np.float64), s, block)
                written[name.removesuffix(".weight")] = s
                out.update(_stored_names(name, s, roles))
        finally:
            fh.close()
        save_file(out, path + ".tmp", metadata={"format": "pt"})
        os.replace(path + ".tmp", path)
        total += sum(a.nbytes for a in out.values())
        if wm is not None:
            wm = {k: v for k, v in wm.items() if v != fn} | {k: fn for k in out}
    if wm is not None:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2)
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    raw["quantization_config"] = _config(scheme, mtp_scheme, written, block)
    with open(cfg_path, "w") as f:
        json.dump(raw, f, indent=2)
    return folder
