"""Checks of the MTP draft's routed experts, made from the headers when the draft is loaded.

The reader takes MTP routed experts unquantized (F16, BF16, F32), either stacked
(``mlp.experts.gate_up_proj [E, 2I, H]`` + ``mlp.experts.down_proj [E, H, I]``) or per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``). Layouts it cannot read (per-expert NVFP4,
per-tensor or block FP8, other quantized forms, an incomplete or unknown stacked layout) are
refused here with one message naming the tensors, before any tensor data is read. Shapes that
disagree with the config are reported by the reader's general checks (with the config keys).
"""

from __future__ import annotations

import math
import os
import re

from mtp_jax.config import ModelConfig
from mtp_jax.weights.safetensors_files import CheckpointError, TensorInfo

_FLOATS = ("F16", "BF16", "F32", "F64")
_FP8 = ("F8_E4M3", "F8_E5M2")
_AUX = ("weight_scale_inv", "weight_scale_2", "weight_scale", "input_scale", "weight_global_scale",
        "weight_packed", "weight_shape", "scales", "qzeros", "g_idx", "qweight")
_EXPERT = re.compile(r"^(?P<layer>mtp\.layers\.\d+\.)mlp\.experts\.(?P<rest>.+)$")
_PER_EXPERT = re.compile(r"^(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<what>.+)$")
_HOW_TO_FIX = ("Use a checkpoint whose mtp.* tensors are unquantized (e.g. the BF16 release), or "
               "pass --speculative-draft-model-path (speculative_draft_model_path) to a folder "
               "holding unquantized mtp.* tensors; or run with --speculative-algorithm none.")
_SUPPORTED = ("the reader takes MTP routed experts unquantized (F16, BF16, F32), stacked "
              "(mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I]) or per "
              "expert (mlp.experts.{e}.gate_proj/up_proj/down_proj.weight)")


def _desc(t: TensorInfo, name: str) -> str:
    return f"{name!r} {t.dtype} [{', '.join(map(str, t.shape))}] in {os.path.basename(t.file)}"


def _few(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def _quant_layout(weight: TensorInfo, aux: dict[str, TensorInfo], per_expert: bool) -> str:
    scale = aux.get("weight_scale")
    where = "per-expert " if per_expert else "stacked "
    if weight.dtype in ("U8", "I8") and (("weight_scale_2" in aux)
                                          or (scale is not None and scale.dtype in _FP8)):
        return where + "NVFP4"
    if weight.dtype in _FP8:
        if scale is not None and math.prod(scale.shape) <= 1:
            return where + "per-tensor FP8"
        if "weight_scale_inv" in aux or scale is not None:
            return where + "block-scaled FP8"
        return where + "FP8"
    return where + f"quantized ({weight.dtype})"


def check_mtp_experts(folder: str, cfg: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    """Refuse MTP routed-expert layouts the reader does not handle.

    ``tensors``: canonical ``mtp.*`` name -> header entry, for every ``mtp.*`` tensor stored in
    ``folder``. Raises :class:`CheckpointError` naming the tensors; returns None otherwise.
    """
    layers: dict[str, dict[str, TensorInfo]] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m:
            layers.setdefault(m["layer"], {})[m["rest"]] = t
    quant: list[tuple[str, str]] = []  # (layout, description)
    stacked_problems: list[str] = []
    for layer, rest in sorted(layers.items()):
        # Group weights with their auxiliary (scale) tensors.
        groups: dict[str, dict[str, TensorInfo]] = {}
        for r, t in rest.items():
            base, _, last = r.rpartition(".")
            if last in _AUX and base:
                groups.setdefault(base + ".weight", {})[last] = t
            elif r.endswith(tuple("_" + a for a in ("scale", "scale_inv", "scales"))):
                groups.setdefault(r.rsplit("_scale", 1)[0], {})["weight_scale"] = t
            else:
                groups.setdefault(r, {})["__weight__"] = t
        for r, g in sorted(groups.items()):
            w = g.get("__weight__")
            aux = {k: v for k, v in g.items() if k != "__weight__"}
            if w is None:
                w = aux.get("weight_packed") or aux.get("qweight")
            if w is None or (w.dtype in _FLOATS and not aux):
                continue
            if w.dtype in _FLOATS and all(k == "input_scale" for k in aux):
                continue
            layout = _quant_layout(w, aux, bool(_PER_EXPERT.match(r)))
            extra = "" if not aux else " with " + ", ".join(
                f"{k} {v.dtype} [{', '.join(map(str, v.shape))}]" for k, v in sorted(aux.items()))
            quant.append((layout, _desc(w, f"{layer}mlp.experts.{r}") + extra))
        if quant or not cfg.is_moe:
            continue
        stacked = {r.removesuffix(".weight"): t for r, t in rest.items()
                   if not r[:1].isdigit() and r.rpartition(".")[2] not in _AUX}
        if not stacked:
            continue
        per = {m["proj"] for r in rest if (m := _PER_EXPERT.match(r))}
        has = {"gate_up_proj": "gate_up_proj" in stacked or {"gate_proj", "up_proj"} <= per,
               "down_proj": "down_proj" in stacked or "down_proj" in per}
        unknown = sorted(set(stacked) - {"gate_up_proj", "down_proj"})
        missing = [k for k, ok in has.items() if not ok]
        if unknown or missing:
            found = [_desc(t, f"{layer}mlp.experts.{r}") for r, t in sorted(stacked.items())]
            why = []
            if missing:
                why.append("no " + " and no ".join(f"{layer}mlp.experts.{k}" for k in missing))
            if unknown:
                why.append("stacked name(s) the reader does not know: "
                           + ", ".join(f"{layer}mlp.experts.{k}" for k in unknown))
            stacked_problems.append(f"{layer}mlp.experts has {_few(found)} but "
                                    + "; ".join(why))
    if quant:
        layouts = sorted({lay for lay, _ in quant})
        raise CheckpointError(
            f"cannot load the MTP draft from {folder}: its routed experts are stored as "
            f"{' and '.join(layouts)} ({len(quant)} tensor(s), e.g. "
            f"{_few([d for _, d in quant], 3)}), a layout this reader does not handle; "
            f"{_SUPPORTED}. {_HOW_TO_FIX}")
    if stacked_problems:
        raise CheckpointError(
            f"cannot load the MTP draft from {folder}: stacked MTP experts need both "
            f"gate_up_proj and down_proj: {'; '.join(stacked_problems)}. {_SUPPORTED} "
            f"(num_experts={cfg.num_experts}, moe_intermediate_size={cfg.moe_intermediate_size}, "
            f"hidden_size={cfg.hidden_size}). The draft checkpoint is incomplete or in another "
            "layout; fetch the missing tensor(s) or use the original checkpoint.")
