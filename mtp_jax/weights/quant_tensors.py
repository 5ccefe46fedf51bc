"""Quantized tensors in safetensors headers: each weight grouped with its scale tensors, its
format decided from what is stored, checked against the config's :class:`QuantConfig`.

:func:`group_quantized` turns a checkpoint's header entries into *logical* entries: a quantized
weight and its companions become one :class:`~mtp_jax.weights.safetensors_files.TensorInfo`
named as the unquantized weight would be, with its logical shape ``[..., out, in]``, dtype
``F32`` and a :class:`QuantParts` in ``quant``; reading it (``safetensors_files._read``)
dequantizes (:mod:`mtp_jax.weights.quant_math`, float64 then float32). Unquantized entries pass
through unchanged. Every problem is found from the headers, before any tensor data is read, and
raised as one :class:`CheckpointError` naming the tensors.

Stored forms (per linear ``X.weight [out, in]``; ``FORMATS.md``):

=================  ==============================================================================
``fp8-block``      ``X.weight`` F8_E4M3, ``X.weight_scale_inv`` F32/BF16/F16 [ceil(out/b0), ceil(in/b1)]
``modelopt-fp8``   ``X.weight`` F8_E4M3, ``X.weight_scale`` one float (``X.input_scale`` unused)
``modelopt-nvfp4`` ``X.weight`` U8 [out, in/2], ``X.weight_scale`` F8_E4M3 [out, in/16],
                   ``X.weight_scale_2`` one float (``X.input_scale`` unused)
``ct-nvfp4``       ``X.weight_packed`` U8 [out, in/2], ``X.weight_scale`` F8_E4M3 [out, in/16],
                   ``X.weight_global_scale`` one float (``X.input_global_scale`` unused)
=================  ==============================================================================

Stacked MoE experts (``...mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, no
``.weight`` suffix) carry the same companions with ``weight_`` dropped: ``X_scale_inv``
(transformers' fused FP8 experts), ``X_scale``, ``X_scale_2``, ``X_packed``, ``X_global_scale``,
``X_input_scale``, ``X_input_global_scale``, ``X_activation_scale``; every scale then has the
leading ``E`` axis (a per-matrix scale: ``E`` values, or one for all). Per-expert tensors are
ordinary linears. ``*.k_scale`` / ``*.v_scale`` are dropped when the config declares a quantized
KV cache (not applied: the KV cache stays in the model dtype).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np

from mtp_jax.weights import quant_math
from mtp_jax.weights.quant_config import QuantConfig
from mtp_jax.weights.safetensors_files import CheckpointError, TensorInfo, read_stored
from pallas_kernels.quant.formats import NVFP4_GROUP, QuantFormat

__all__ = ["QuantParts", "KeptQuant", "group_quantized", "kept_bytes_saved", "stack_kept",
           "folder_kept_bytes_saved"]


@dataclasses.dataclass(frozen=True)
class KeptQuant:
    """A projection read in its quantized device form (:mod:`pallas_kernels.quant.formats`)
    instead of dequantized: ``fmt`` and its ``codes``, ``scale`` and ``scale_2`` (None for
    fp8) arrays (numpy as read; the reader's ``put`` then places them)."""

    fmt: QuantFormat
    codes: object
    scale: object
    scale_2: object = None

    def map(self, fn) -> "KeptQuant":
        """The same with ``fn`` applied to each array (e.g. ``jax.device_put``)."""
        return KeptQuant(self.fmt, fn(self.codes), None if self.scale is None else fn(self.scale),
                         None if self.scale_2 is None else fn(self.scale_2))

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.codes, self.scale, self.scale_2)
                   if a is not None)

# (suffix, role); longest first so ".weight_scale_2" is not read as ".weight_scale".
_DOTTED = ((".weight_global_scale", "global_scale"), (".input_global_scale", "input"),
           (".weight_scale_inv", "scale_inv"), (".weight_scale_2", "scale_2"),
           (".weight_packed", "packed"), (".weight_scale", "scale"), (".input_scale", "input"))
_STACKED = (("_input_global_scale", "input"), ("_activation_scale", "input"),
            ("_global_scale", "global_scale"), ("_input_scale", "input"),
            ("_scale_inv", "scale_inv"), ("_scale_2", "scale_2"), ("_packed", "packed"),
            ("_scale", "scale"))
_STACKED_BASE = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)$")
_FLOAT = ("F16", "BF16", "F32", "F64")
# role -> (required roles, allowed extra roles) per format
_ROLES = {
    "fp8-block": ({"scale_inv"}, {"input"}),
    "modelopt-fp8": ({"scale"}, {"input"}),
    "modelopt-nvfp4": ({"scale", "scale_2"}, {"input"}),
    "ct-nvfp4": ({"packed", "scale", "global_scale"}, {"input"}),
}


@dataclasses.dataclass(frozen=True)
class QuantParts:
    """A quantized weight's stored tensors. fmt: its format; weight: the stored codes
    (F8_E4M3 or packed U8); scales: ``((role, TensorInfo), ...)``; block / group: the FP8 block
    and the NVFP4 group size."""

    fmt: str
    weight: TensorInfo
    scales: tuple[tuple[str, TensorInfo], ...]
    block: tuple[int, int]
    group: int

    def read(self, files) -> np.ndarray:
        """The dequantized weight, float32 ``[..., out, in]``, computed in float64 one matrix
        (one expert) at a time."""
        w = read_stored(files, self.weight)
        s = {role: read_stored(files, t) for role, t in self.scales}
        lead = w.shape[:-2]
        out = np.empty((*lead, w.shape[-2], w.shape[-1] * (2 if "nvfp4" in self.fmt else 1)),
                       np.float32)
        for idx in np.ndindex(*lead):
            out[idx] = self._one(w[idx], {k: _pick(v, idx, lead) for k, v in s.items()})
        return out

    def keepable(self) -> bool:
        """Whether the device forms hold this weight as it is stored: one matrix or a stack of
        them (routed experts ``[E, N, K]``), NVFP4 in groups of :data:`NVFP4_GROUP` columns."""
        return len(self.weight.shape) in (2, 3) and ("nvfp4" not in self.fmt
                                                     or self.group == NVFP4_GROUP)

    def device_format(self) -> QuantFormat:
        """The device form that holds this (:meth:`keepable`) weight."""
        cols = self.weight.shape[-1]
        if self.fmt == "fp8-block":
            return QuantFormat("fp8", tuple(self.block), cols)
        if self.fmt == "modelopt-fp8":
            return QuantFormat("fp8", (1, cols), cols)  # the matrix's one scale on each row
        return QuantFormat("nvfp4", (1, NVFP4_GROUP), 2 * cols, divide=self.fmt == "ct-nvfp4")

    def read_kept(self, files) -> KeptQuant:
        """The stored codes and scales in the device form, leading axes kept (exact: scales
        widened to float32, a per-matrix scale repeated per row). Only for :meth:`keepable`
        weights."""
        w = np.array(read_stored(files, self.weight))
        s = {role: np.array(read_stored(files, t)) for role, t in self.scales}
        lead, n = w.shape[:-2], w.shape[-2]
        fmt = self.device_format()

        def per_row(x: np.ndarray) -> np.ndarray:  # one value per matrix -> lead + (n,)
            v = x.astype(np.float32).reshape(-1)
            v = np.full(lead, v[0], np.float32) if v.size == 1 else v.reshape(lead)
            return np.ascontiguousarray(np.broadcast_to(v[..., None], (*lead, n)))

        if self.fmt == "fp8-block":
            return KeptQuant(fmt, w, s["scale_inv"].astype(np.float32))
        if self.fmt == "modelopt-fp8":
            return KeptQuant(fmt, w, per_row(s["scale"])[..., None])
        return KeptQuant(fmt, w, s["scale"], per_row(s["global_scale" if fmt.divide
                                                       else "scale_2"]))

    def _one(self, w: np.ndarray, s: dict[str, np.ndarray]) -> np.ndarray:
        if self.fmt == "fp8-block":
            return quant_math.dequant_fp8_block(w, s["scale_inv"], self.block)
        if self.fmt == "modelopt-fp8":
            return quant_math.dequant_fp8_tensor(w, s["scale"])
        if self.fmt == "modelopt-nvfp4":
            return quant_math.dequant_nvfp4(w, s["scale"], s["scale_2"], self.group)
        return quant_math.dequant_ct_nvfp4(w, s["scale"], s["global_scale"], self.group)


def _pick(scale: np.ndarray, idx: tuple, lead: tuple) -> np.ndarray:
    """One matrix's part of a scale: index the leading axes, or a per-matrix value."""
    if not lead:
        return scale
    if scale.ndim >= len(lead) + 2:
        return scale[idx]
    flat = scale.reshape(-1)
    return flat[:1] if flat.size == 1 else flat[np.ravel_multi_index(idx, lead)]


def _split(name: str) -> tuple[str, str] | None:
    """(logical weight name, role) of a companion tensor name; None for other names."""
    for suffix, role in _DOTTED:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", role
    for suffix, role in _STACKED:
        if name.endswith(suffix) and _STACKED_BASE.search(name[: -len(suffix)]):
            return name[: -len(suffix)], role
    return None


def _desc(t: TensorInfo) -> str:
    return f"{t.name!r} {t.dtype} [{', '.join(map(str, t.shape))}] in {os.path.basename(t.file)}"


def _format_of(w: TensorInfo, roles: dict[str, TensorInfo]) -> str | None:
    if "packed" in roles:
        return "ct-nvfp4"
    if w.dtype == "F8_E4M3":
        return "fp8-block" if "scale_inv" in roles else "modelopt-fp8"
    if w.dtype == "U8":
        return "modelopt-nvfp4"
    return None


def _check_shapes(fmt: str, w: TensorInfo, roles: dict[str, TensorInfo], q: QuantConfig,
                  lead: tuple) -> list[str]:
    """Scale dtypes and shapes against the weight's; messages name the scale tensor."""
    bad = []
    per_matrix = (1, math.prod(lead))
    if fmt == "fp8-block":
        want = quant_math.block_scale_shape(w.shape, q.block)
        t = roles["scale_inv"]
        if t.shape != want:
            bad.append(f"{_desc(t)} should have shape [{', '.join(map(str, want))}] (blocks "
                       f"{list(q.block)} of {_desc(w)}, partial edge blocks included)")
        if t.dtype not in _FLOAT:
            bad.append(f"{_desc(t)} should be a float tensor")
        return bad
    if fmt != "modelopt-fp8":
        if w.dtype != "U8":
            bad.append(f"{_desc(w)} should be U8 (two e2m1 codes per byte)")
        cols = 2 * w.shape[-1]
        t = roles["scale"]
        want = (*w.shape[:-1], cols // q.group)
        if cols % q.group or t.shape != want:
            bad.append(f"{_desc(t)} should have shape [{', '.join(map(str, want))}] (one scale "
                       f"per {q.group} of the {cols} input columns of {_desc(w)})")
        if t.dtype != "F8_E4M3":
            bad.append(f"{_desc(t)} should be F8_E4M3")
    one = {"modelopt-fp8": "scale", "modelopt-nvfp4": "scale_2", "ct-nvfp4": "global_scale"}[fmt]
    t = roles[one]
    if math.prod(t.shape) not in per_matrix or t.dtype not in _FLOAT:
        bad.append(f"{_desc(t)} should be one float per matrix ({' or '.join(map(str, set(per_matrix)))} "
                   f"values for {_desc(w)})")
    return bad


def _group(name: str, w: TensorInfo | None, roles: dict[str, TensorInfo], q: QuantConfig,
           problems: list[str]) -> TensorInfo | None:
    """The logical entry of one weight and its companions (None after a problem)."""
    if "packed" in roles and w is not None:
        problems.append(f"{name!r} is stored both unpacked ({_desc(w)}) and packed "
                        f"({_desc(roles['packed'])})")
        return None
    w = w if w is not None else roles.get("packed")
    if w is None:
        problems.append(f"{', '.join(_desc(t) for t in roles.values())} found without the "
                        f"weight {name!r} it scales")
        return None
    fmt = _format_of(w, roles)
    if fmt is None:
        problems.append(f"{_desc(w)} is stored unquantized but has scale tensor(s) "
                        f"{', '.join(_desc(t) for t in roles.values())}")
        return None
    need, extra = _ROLES[fmt]
    missing = sorted(need - set(roles))
    stray = sorted(set(roles) - need - extra)
    if missing or stray:
        what = []
        if missing:
            what.append(f"misses its {', '.join(missing)} tensor(s)")
        if stray:
            what.append(f"has {', '.join(_desc(roles[r]) for r in stray)}")
        problems.append(f"{_desc(w)} looks like {fmt} but {' and '.join(what)} (it needs "
                        f"{', '.join(sorted(need))})")
        return None
    conflict = q.conflict(name.removesuffix(".weight"), fmt)
    lead = w.shape[:-2]
    bad = _check_shapes(fmt, w, roles, q, lead) + ([conflict] if conflict else [])
    if bad:
        problems.append(f"{_desc(w)}: " + "; ".join(bad))
        return None
    cols = w.shape[-1] * (2 if "nvfp4" in fmt else 1)
    parts = QuantParts(fmt, w, tuple(sorted((r, t) for r, t in roles.items() if r != "input"
                                            and r != "packed")), q.block, q.group)
    return dataclasses.replace(w, name=name, dtype="F32", shape=(*w.shape[:-1], cols),
                               quant=parts)


def group_quantized(tensors: list[TensorInfo], q: QuantConfig, folder: str) -> list[TensorInfo]:
    """The logical entries of a checkpoint's header entries (every file's), quantized weights
    grouped with their scales and checked against ``q``. Raises :class:`CheckpointError`
    listing every problem (a format the config does not allow, a missing or stray scale, a
    wrong scale shape or dtype, a scale without its weight)."""
    companions: dict[str, dict[str, TensorInfo]] = {}
    plain: list[TensorInfo] = []
    for t in tensors:
        if t.name.endswith((".k_scale", ".v_scale")) and q.kv_cache:
            continue
        split = _split(t.name)
        if split is None:
            plain.append(t)
        else:
            companions.setdefault(split[0], {})[split[1]] = t
    problems: list[str] = []
    out: list[TensorInfo] = []
    for t in plain:
        if t.name in companions:
            g = _group(t.name, t, companions.pop(t.name), q, problems)
            if g is not None:
                out.append(g)
        elif t.dtype in ("F8_E4M3", "F8_E5M2", "U8"):
            problems.append(f"{_desc(t)} is quantized but no scale tensor is stored for it "
                            "(e.g. .weight_scale_inv, .weight_scale, .weight_scale_2)")
        else:
            out.append(t)
    for name, roles in companions.items():
        g = _group(name, None, roles, q, problems)
        if g is not None:
            out.append(g)
    if problems:
        raise CheckpointError(f"cannot load quantized checkpoint {folder} ({q.describe()}):\n- "
                              + "\n- ".join(problems))
    return out


def kept_bytes_saved(entries: list[TensorInfo], itemsize: int,
                     not_kept: tuple[str, ...] = ("lm_head.", "embed_tokens.")) -> int:
    """Device bytes that keeping the quantized projections and experts among ``entries`` (the
    logical entries of :func:`group_quantized`) saves against the model dtype (``itemsize``
    bytes per weight): for the memory check before load, from the headers alone. Entries a
    device form cannot hold and names containing one of ``not_kept`` are not counted. FP8
    scales count one per row (``bn = 1``), the most that merging projections (or stacking an
    expert's gate and up) repeats them, so the saving is never overestimated."""
    from pallas_kernels.quant.formats import stored_bytes

    saved = 0
    for t in entries:
        q = t.quant
        if q is None or not q.keepable() or any(k in t.name for k in not_kept):
            continue
        *lead, n, k = t.shape
        count = math.prod(lead)
        fmt = q.device_format()
        if fmt.kind == "fp8":
            fmt = dataclasses.replace(fmt, block=(1, fmt.block[1]))
        saved += count * n * k * itemsize - stored_bytes(fmt, n, count)
    return saved


def stack_kept(experts: list[list[KeptQuant]]) -> KeptQuant | None:
    """One ``[E, N, K]`` :class:`KeptQuant` from per-expert matrices: ``experts[e]`` the parts
    of expert ``e`` in row order (``gate``, ``up``; or ``down``). FP8 parts whose row blocks
    straddle a part boundary get their scales repeated per row (exact). None when the parts
    are held in different forms (the caller dequantizes them instead)."""
    rows = [_concat_rows(parts) for parts in experts]
    if any(r is None for r in rows) or len({r.fmt for r in rows}) != 1:
        return None
    stack = lambda xs: None if xs[0] is None else np.stack(xs)
    return KeptQuant(rows[0].fmt, stack([r.codes for r in rows]),
                     stack([r.scale for r in rows]), stack([r.scale_2 for r in rows]))


def _concat_rows(parts: list[KeptQuant]) -> KeptQuant | None:
    """Matrices of one input stacked by rows in one device form (numpy; as
    :func:`pallas_kernels.quant.concat_parts`), or None for parts of different forms."""
    first = parts[0].fmt
    if len({(p.fmt.kind, p.fmt.block[1], p.fmt.in_features, p.fmt.divide, p.fmt.ggml_type)
            for p in parts}) != 1:
        return None
    codes = np.concatenate([p.codes for p in parts])
    if first.kind == "ggml":  # rows hold their own scales
        return KeptQuant(first, codes, None)
    if first.kind == "nvfp4":
        return KeptQuant(first, codes, np.concatenate([p.scale for p in parts]),
                         np.concatenate([p.scale_2 for p in parts]))
    bn = first.block[0]
    if all(p.fmt.block[0] == bn for p in parts) and all(
            p.codes.shape[0] % bn == 0 for p in parts[:-1]):
        return KeptQuant(first, codes, np.concatenate([p.scale for p in parts]))
    per_row = [np.repeat(p.scale, p.fmt.block[0], axis=0)[:p.codes.shape[0]] for p in parts]
    return KeptQuant(dataclasses.replace(first, block=(1, first.block[1])), codes,
                     np.concatenate(per_row))


def folder_kept_bytes_saved(folder: str, itemsize: int, *, with_mtp: bool,
                            draft_folder: str | None = None) -> int:
    """:func:`kept_bytes_saved` of a safetensors checkpoint folder read from its headers (no
    tensor data): the target's projections, and with ``with_mtp`` the draft's (from
    ``draft_folder`` when given, read under the target's quantization config). 0 for a folder
    without safetensors files (e.g. a GGUF target)."""
    from mtp_jax.weights.quant_config import quantization_from_folder
    from mtp_jax.weights.safetensors_files import checkpoint_files, read_header

    def headers(path: str, keep) -> list[TensorInfo]:
        try:
            files, _ = checkpoint_files(path)
        except CheckpointError:
            return []
        return [t for fn in files if os.path.isfile(os.path.join(path, fn))
                for t in read_header(os.path.join(path, fn)).values() if keep(t.name)]

    quant = quantization_from_folder(folder)
    if quant.method is None:
        return 0
    is_mtp = lambda name: name.startswith("mtp.") or ".mtp." in name
    target = headers(folder, lambda n: (with_mtp and draft_folder is None) or not is_mtp(n))
    draft = headers(draft_folder, is_mtp) if with_mtp and draft_folder is not None else []
    saved = kept_bytes_saved(group_quantized(target, quant, folder), itemsize)
    if draft:
        saved += kept_bytes_saved(group_quantized(draft, quant, draft_folder), itemsize)
    return saved
