"""A checkpoint's ``quantization_config``, parsed and checked at config time (no tensor read).

:func:`quantization_from_folder` reads ``config.json``'s ``quantization_config`` (at the top
level or in ``text_config``), else a ModelOpt ``hf_quant_config.json`` (its ``quantization``
object); :func:`parse_quantization` checks the dict. The result, :class:`QuantConfig`, says which
stored formats the weights may use; the reader decides each tensor's format from what is stored
and checks it against this (:mod:`mtp_jax.weights.quant_tensors`).

Stored formats (names used in messages, by the reader and by ``random_checkpoint --quantize``):

* ``fp8-block``: HF block FP8 (``quant_method: fp8`` with ``weight_block_size``; ModelOpt
  ``FP8_BLOCK_SCALES`` in a mixed config);
* ``modelopt-fp8``: per-tensor FP8 (ModelOpt ``quant_algo: FP8``; HF ``fp8`` without a block size);
* ``modelopt-nvfp4``: ModelOpt NVFP4 (``quant_algo: NVFP4``, group 16);
* ``ct-nvfp4``: compressed-tensors ``nvfp4-pack-quantized`` (strategy ``tensor_group``, group 16).

Unknown methods, algorithms, formats and keys are :class:`~mtp_jax.config.ConfigError`\\ s naming
the value; nothing is silently ignored. A quantized KV cache (``kv_cache_quant_algo`` /
``kv_cache_scheme``) is accepted with a warning: the KV cache stays in the model dtype and the
``k_scale`` / ``v_scale`` tensors are not used. Exclude lists (``ignore``,
``modules_to_not_convert``, ``exclude_modules``) are not used: released ones are incomplete, so
an unquantized tensor is accepted anywhere.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import warnings
from typing import Any

from mtp_jax.config import ConfigError

__all__ = ["QuantConfig", "FORMATS", "NO_QUANT", "QUANTIZATION_MODES", "check_quantization_mode",
           "parse_quantization", "quantization_from_raw", "quantization_from_folder"]

FORMATS = ("fp8-block", "modelopt-fp8", "modelopt-nvfp4", "ct-nvfp4")
NVFP4_GROUP = 16
_FIX = ("Use an unquantized (BF16) checkpoint, or one in a format mtp_jax reads: HF block FP8 "
        "(quant_method fp8), ModelOpt FP8 / NVFP4 / MIXED_PRECISION (quant_method modelopt) or "
        "compressed-tensors nvfp4-pack-quantized.")
_KEYS = {
    "fp8": {"quant_method", "fmt", "activation_scheme", "weight_block_size",
            "modules_to_not_convert", "ignored_layers", "dequantize"},
    "modelopt": {"quant_method", "quant_algo", "group_size", "kv_cache_quant_algo", "ignore",
                 "exclude_modules", "quantized_layers", "producer", "config_groups",
                 "kv_cache_scheme", "quantization_status"},
    "compressed-tensors": {"quant_method", "format", "config_groups", "ignore",
                           "quantization_status", "kv_cache_scheme", "global_compression_ratio",
                           "sparsity_config", "version", "transform_config", "provider"},
}
_MODELOPT_ALGOS = {"FP8": "modelopt-fp8", "NVFP4": "modelopt-nvfp4",
                   "FP8_BLOCK_SCALES": "fp8-block"}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What a checkpoint's quantization config allows.

    method: ``quant_method`` (``None``: no quantization config, every tensor must be stored
    unquantized); formats: the stored formats allowed (:data:`FORMATS`); block: the FP8
    ``weight_block_size`` ``(rows, cols)``; group: the NVFP4 group size; modules: a ModelOpt
    mixed config's ``((module name or pattern, format), ...)``; kv_cache: the declared KV-cache
    quantization (not applied); source: where it was read (for messages)."""

    method: str | None = None
    formats: tuple[str, ...] = ()
    block: tuple[int, int] = (128, 128)
    group: int = NVFP4_GROUP
    modules: tuple[tuple[str, str], ...] = ()
    kv_cache: str | None = None
    source: str = "config.json"

    def describe(self) -> str:
        if self.method is None:
            return f"{self.source} declares no quantization_config (an unquantized checkpoint)"
        return (f"{self.source} declares quant_method {self.method!r} (stored formats allowed: "
                f"{', '.join(self.formats)})")

    def conflict(self, module: str, fmt: str) -> str | None:
        """Why ``module`` (its stored name without ``.weight``) may not be stored as ``fmt``;
        None when it may."""
        for pattern, want in self.modules:
            if _matches(module, pattern):
                if want != fmt:
                    return (f"stored as {fmt} but {self.source}'s quantized_layers give "
                            f"{pattern!r} the format {want}")
                return None
        if fmt not in self.formats:
            return f"stored as {fmt} but {self.describe()}"
        return None


NO_QUANT = QuantConfig()

# ``quantization`` (LLM, load_model) / ``--quantization``: how quantized weights are held.
# "dequantize": dequantized to the model dtype at load (the reference path); "keep": the
# projections kept as stored (FP8 codes with block scales, packed NVFP4) and dequantized inside
# each program (routed experts too; the untied LM head stays dequantized); "auto":
# the path measured best, today "dequantize" everywhere (but where only the kept weights fit
# the device: mtp_jax.engine.load_plan): on the H200, XLA does not fuse the
# in-program dequantization into the projections, and the 27B with kept FP8 weights decodes at
# 0.54x its bf16 speed (docs/benchmarks.md, session 32), so "keep" is smaller, not faster.
AUTO_KEEPS_ON: tuple[str, ...] = ()  # backends on which "auto" means "keep"
QUANTIZATION_MODES = ("auto", "dequantize", "keep")


def check_quantization_mode(mode) -> str:
    """``mode`` if it is one of :data:`QUANTIZATION_MODES`, else a ConfigError naming it."""
    if mode not in QUANTIZATION_MODES:
        raise ConfigError(f"quantization (--quantization) {mode!r} is unknown; use 'auto' (the "
                          "default: 'dequantize', or 'keep' where only kept weights fit), "
                          "'dequantize' (dequantized to the model dtype at load) or 'keep' "
                          "(kept quantized on any backend; docs/quantization.md).")
    return mode


def keeps_quantized(mode: str, backend: str | None = None) -> bool:
    """Whether ``mode`` (:data:`QUANTIZATION_MODES`) keeps quantized projections quantized on
    ``backend`` (default: jax's default backend)."""
    check_quantization_mode(mode)
    if mode == "auto":
        import jax

        return (backend or jax.default_backend()) in AUTO_KEEPS_ON
    return mode == "keep"


def _matches(module: str, pattern: str) -> bool:
    for prefix in ("", "model.language_model.", "model."):
        name = module[len(prefix):] if prefix and module.startswith(prefix) else module
        if name == pattern or fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def _bad(source: str, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{source}: quantization_config {key} {value!r} {why}. {_FIX}")


def _check_keys(q: dict, method: str, source: str) -> None:
    unknown = sorted(set(q) - _KEYS[method])
    if unknown:
        raise ConfigError(f"{source}: quantization_config (quant_method {method!r}) has key(s) "
                          f"{unknown} that mtp_jax does not implement (it knows "
                          f"{sorted(_KEYS[method])}); a field it cannot honour is not ignored. "
                          f"{_FIX}")


def _kv_cache(value: Any, source: str, key: str) -> str | None:
    if value in (None, "", {}):
        return None
    warnings.warn(f"{source}: {key} {value!r} declares a quantized KV cache; mtp_jax keeps the "
                  "KV cache in the model dtype and does not read k_scale / v_scale tensors.",
                  stacklevel=3)
    return str(value)


def _parse_fp8(q: dict, source: str) -> QuantConfig:
    if q.get("fmt", "e4m3") != "e4m3":
        raise _bad(source, "fmt", q["fmt"], "is not supported (only e4m3 weights are read)")
    if q.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise _bad(source, "activation_scheme", q["activation_scheme"],
                   "is unknown (dynamic or static)")
    block = q.get("weight_block_size")
    if block is None:
        return QuantConfig("fp8", ("modelopt-fp8",), source=source)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _bad(source, "weight_block_size", block, "is not two positive integers")
    return QuantConfig("fp8", ("fp8-block",), block=(block[0], block[1]), source=source)


def _modelopt_format(algo: Any, group: Any, source: str, key: str) -> str:
    if algo not in _MODELOPT_ALGOS:
        raise _bad(source, key, algo, f"is not one mtp_jax reads ({', '.join(_MODELOPT_ALGOS)}"
                   ", MIXED_PRECISION)")
    if algo == "NVFP4" and group not in (None, NVFP4_GROUP):
        raise _bad(source, "group_size", group, f"is not supported for NVFP4 (only "
                   f"{NVFP4_GROUP})")
    return _MODELOPT_ALGOS[algo]


def _parse_modelopt(q: dict, source: str) -> QuantConfig:
    algo = q.get("quant_algo")
    kv = _kv_cache(q.get("kv_cache_quant_algo") or q.get("kv_cache_scheme"), source,
                   "kv_cache_quant_algo")
    if algo != "MIXED_PRECISION":
        fmt = _modelopt_format(algo, q.get("group_size"), source, "quant_algo")
        return QuantConfig("modelopt", (fmt,), kv_cache=kv, source=source)
    layers = q.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        raise _bad(source, "quantized_layers", layers, "must map module names to "
                   "{quant_algo, group_size} for quant_algo MIXED_PRECISION")
    modules = []
    for name, spec in layers.items():
        if not isinstance(spec, dict):
            raise _bad(source, f"quantized_layers[{name!r}]", spec, "is not an object")
        modules.append((name, _modelopt_format(spec.get("quant_algo"), spec.get("group_size"),
                                               source, f"quantized_layers[{name!r}].quant_algo")))
    formats = tuple(f for f in FORMATS if f in {m[1] for m in modules})
    return QuantConfig("modelopt", formats, modules=tuple(modules), kv_cache=kv, source=source)


def _check_ct_group(name: str, group: Any, source: str) -> None:
    w = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(w, dict):
        raise _bad(source, f"config_groups[{name!r}]", group, "has no 'weights' object")
    want = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP}
    for key, value in want.items():
        if w.get(key) != value:
            raise _bad(source, f"config_groups[{name!r}].weights.{key}", w.get(key),
                       f"is not supported (nvfp4-pack-quantized needs {value!r})")
    if group.get("format") not in (None, "nvfp4-pack-quantized"):
        raise _bad(source, f"config_groups[{name!r}].format", group["format"],
                   "is not supported (only nvfp4-pack-quantized)")


def _parse_ct(q: dict, source: str) -> QuantConfig:
    if q.get("format") != "nvfp4-pack-quantized":
        raise _bad(source, "format", q.get("format"), "is not supported (mtp_jax reads "
                   "compressed-tensors format nvfp4-pack-quantized only)")
    for key in ("sparsity_config", "transform_config"):
        if q.get(key) not in (None, {}, ""):
            raise _bad(source, key, q[key], "is not implemented (no sparse or transformed "
                       "weights)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _bad(source, "config_groups", groups, "must hold at least one group")
    for name, group in groups.items():
        _check_ct_group(name, group, source)
    kv = _kv_cache(q.get("kv_cache_scheme"), source, "kv_cache_scheme")
    return QuantConfig("compressed-tensors", ("ct-nvfp4",), kv_cache=kv, source=source)


_PARSERS = {"fp8": _parse_fp8, "modelopt": _parse_modelopt, "compressed-tensors": _parse_ct}


def parse_quantization(q: Any, source: str = "config.json") -> QuantConfig:
    """Check a ``quantization_config`` dict (None: unquantized). Raises ConfigError naming an
    unknown ``quant_method``, algorithm, format or key, and the fix."""
    if q is None:
        return dataclasses.replace(NO_QUANT, source=source)
    if not isinstance(q, dict):
        raise _bad(source, "", q, "is not a JSON object")
    method = q.get("quant_method")
    if method not in _PARSERS:
        raise ConfigError(f"{source}: quantization_config quant_method {method!r} is not "
                          f"supported; mtp_jax reads {', '.join(map(repr, _PARSERS))}. {_FIX}")
    _check_keys(q, method, source)
    return _PARSERS[method](q, source)


def quantization_from_raw(raw: dict, hf_quant: dict | None = None) -> QuantConfig:
    """The QuantConfig of a parsed ``config.json`` (``quantization_config`` at the top level or
    in ``text_config``), else of a ModelOpt ``hf_quant_config.json`` dict ``hf_quant``."""
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    text = raw.get("text_config") if isinstance(raw, dict) else None
    if q is None and isinstance(text, dict):
        q = text.get("quantization_config")
    if q is not None or hf_quant is None:
        return parse_quantization(q, "config.json")
    inner = hf_quant.get("quantization") if isinstance(hf_quant, dict) else None
    if not isinstance(inner, dict):
        raise ConfigError("hf_quant_config.json has no 'quantization' object; fetch it again or "
                          "remove it.")
    q = {"quant_method": "modelopt", **{k: v for k, v in inner.items()}}
    return parse_quantization(q, "hf_quant_config.json")


def quantization_from_folder(folder: str, raw: dict | None = None) -> QuantConfig:
    """The QuantConfig of a checkpoint folder (``raw``: its already parsed config.json; a
    folder without config.json is unquantized)."""
    if raw is None:
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            return NO_QUANT  # a bare tensor folder (a draft folder, a test's files)
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot parse {path}: {e}") from e
    hf = os.path.join(folder, "hf_quant_config.json")
    hf_quant = None
    if os.path.isfile(hf):
        try:
            with open(hf, encoding="utf-8") as f:
                hf_quant = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot parse {hf}: {e}") from e
    return quantization_from_raw(raw, hf_quant)
