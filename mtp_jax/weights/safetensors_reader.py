"""Read an HF safetensors checkpoint folder into canonical, converted arrays.

The format (headers, files, raw bytes) is :mod:`mtp_jax.weights.safetensors_files`. Tensor
bytes are reached through a read-only ``mmap`` of each file and
converted with ``astype`` one tensor at a time, so the host holds about one converted tensor (or
one expert stack being assembled) beyond what ``put`` keeps. Parsing the header ourselves gives
bfloat16 support through ``ml_dtypes`` on every ``safetensors`` version (its numpy framework does
not handle BF16 reliably) and lets a truncated or corrupt file fail with a message naming it.

Everything that can be checked from the headers (missing, duplicate, unexpected tensors, shapes,
stored dtypes, incomplete expert sets) is checked before any tensor data is read.

Stored layouts accepted (see ``mtp_jax.weights.names`` for the canonical names):

* prefixes ``model.language_model.`` (composite) and ``model.`` (text-only); ``model.visual.*``
  and other towers are skipped, as are ``*.rotary_emb.inv_freq`` buffers and an ``lm_head.weight``
  stored by a checkpoint whose config ties embeddings;
* MoE experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj
  [E, H, I]``; the same names with a ``.weight`` suffix are accepted too, as some re-exports add
  it) or per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``), stacked here into the fused
  form with gate rows first; layouts may differ between layers of one checkpoint;
* stored dtypes F16, BF16, F32 (and F64), and the quantized formats of
  :mod:`mtp_jax.weights.quant_tensors` (block FP8, ModelOpt FP8 / NVFP4, compressed-tensors
  NVFP4), dequantized at load; other quantized forms (int, GPTQ, AWQ) are refused with a
  message naming the tensor.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
from tqdm import tqdm

from mtp_jax.config import ModelConfig
from mtp_jax.weights import names as _names
from mtp_jax.weights.draft_checks import check_mtp_experts
from mtp_jax.weights.quant_config import QuantConfig, quantization_from_folder
from mtp_jax.weights.quant_tensors import group_quantized, stack_kept
from mtp_jax.weights.safetensors_files import (_FLOAT_DTYPES, INDEX_FILE, CheckpointError,
                                               TensorInfo, _Files, _read, checkpoint_files,
                                               read_header)

__all__ = ["load_tensors"]

_LIST_LIMIT = 20

_EXPERT_RE = re.compile(
    r"^(?P<p>.*)mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_QUANT_AUX_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale",
                       ".weight_packed", ".weight_global_scale", ".qweight", ".scales",
                       ".qzeros", ".g_idx")


def _few(items: Iterable[str], limit: int = _LIST_LIMIT) -> str:
    items = list(items)
    s = ", ".join(items[:limit])
    if len(items) > limit:
        s += f", ... ({len(items) - limit} more)"
    return s


def _where(t: TensorInfo) -> str:
    return f"{t.name!r} in {os.path.basename(t.file)}"


def _config_keys(canonical: str) -> tuple[str, ...]:
    """ModelConfig fields that determine the shape of a canonical tensor."""
    n = canonical
    if n.startswith("mtp.") and n.count(".") <= 2:  # mtp.fc / mtp norms
        return ("hidden_size",)
    if n in ("embed_tokens.weight", "lm_head.weight"):
        return ("vocab_size", "hidden_size")
    table = [
        ("self_attn.q_proj.", ("num_attention_heads", "head_dim", "hidden_size")),
        ("self_attn.k_proj.", ("num_key_value_heads", "head_dim", "hidden_size")),
        ("self_attn.v_proj.", ("num_key_value_heads", "head_dim", "hidden_size")),
        ("self_attn.o_proj.", ("hidden_size", "num_attention_heads", "head_dim")),
        ("self_attn.q_norm.", ("head_dim",)),
        ("self_attn.k_norm.", ("head_dim",)),
        ("linear_attn.in_proj_qkv.", ("linear_num_key_heads", "linear_key_head_dim",
                                      "linear_num_value_heads", "linear_value_head_dim",
                                      "hidden_size")),
        ("linear_attn.conv1d.", ("linear_num_key_heads", "linear_key_head_dim",
                                 "linear_num_value_heads", "linear_value_head_dim",
                                 "linear_conv_kernel_dim")),
        ("linear_attn.in_proj_z.", ("linear_num_value_heads", "linear_value_head_dim",
                                    "hidden_size")),
        ("linear_attn.out_proj.", ("hidden_size", "linear_num_value_heads",
                                   "linear_value_head_dim")),
        ("linear_attn.in_proj_a.", ("linear_num_value_heads", "hidden_size")),
        ("linear_attn.in_proj_b.", ("linear_num_value_heads", "hidden_size")),
        ("linear_attn.A_log", ("linear_num_value_heads",)),
        ("linear_attn.dt_bias", ("linear_num_value_heads",)),
        ("linear_attn.norm.", ("linear_value_head_dim",)),
        ("mlp.experts.", ("num_experts", "moe_intermediate_size", "hidden_size")),
        ("mlp.shared_expert_gate.", ("hidden_size",)),
        ("mlp.shared_expert.", ("shared_expert_intermediate_size", "hidden_size")),
        ("mlp.gate.weight", ("num_experts", "hidden_size")),
        ("mlp.", ("intermediate_size", "hidden_size")),
    ]
    for key, fields in table:
        if key in n:
            return fields
    return ("hidden_size",)


def _keys_text(cfg: ModelConfig, canonical: str) -> str:
    return ", ".join(f"{k}={getattr(cfg, k)}" for k in _config_keys(canonical))


def _shape_text(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

@dataclass
class _Plan:
    canonical: str
    shape: tuple[int, ...]
    single: TensorInfo | None = None
    # per-expert parts: (expert index, row slice start, row slice stop, tensor)
    parts: list[tuple[int, int, int, TensorInfo]] | None = None

    def first(self) -> TensorInfo:
        return self.single if self.single is not None else min(
            (p[3] for p in self.parts), key=lambda t: (t.file, t.start))


def _kept_experts(fh, pl: _Plan):
    """Per-expert quantized matrices of one stack read in the device form and stacked
    (:func:`~mtp_jax.weights.quant_tensors.stack_kept`); None when some part is stored
    unquantized or in a form the device forms cannot stack (it is dequantized instead)."""
    if any(t.quant is None or not t.quant.keepable() for _, _, _, t in pl.parts):
        return None
    experts: dict[int, list] = {}
    for e, r0, _, t in sorted(pl.parts, key=lambda q: (q[0], q[1])):
        experts.setdefault(e, []).append(t.quant.read_kept(fh))
    return stack_kept([experts[e] for e in sorted(experts)])


def load_tensors(folder: str, cfg: ModelConfig, expected: dict[str, tuple[int, ...]], *,
                 dtype, put: Callable[[np.ndarray], Any] | None = None, include_mtp: bool,
                 only_mtp: bool = False, desc: str = "Loading",
                 quant: QuantConfig | None = None,
                 keep_quantized: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Load every tensor of ``expected`` (canonical name -> shape) from a safetensors folder.

    ``dtype``: numpy dtype the arrays are converted to (``np.float32``, ``ml_dtypes.bfloat16``,
    ``np.float16``). ``put``: applied to each finished numpy array (e.g. ``jax.device_put``); its
    result is what the returned dict holds (default: the numpy array). ``include_mtp``: when
    False, ``mtp.*`` tensors on disk are ignored (their data is never read) and ``expected`` must
    hold none. ``only_mtp``: read only the ``mtp.*`` tensors and ignore every other tensor in
    the folder (a separate draft checkpoint). Per-expert MoE tensors are stacked into the canonical fused form.
    ``quant``: the quantization config the stored formats are checked against (default: the
    folder's own, :func:`~mtp_jax.weights.quant_config.quantization_from_folder`; a separate
    draft folder is read with the target's). Quantized weights (block FP8, ModelOpt FP8 /
    NVFP4, compressed-tensors NVFP4; :mod:`mtp_jax.weights.quant_tensors`) are dequantized
    to ``dtype`` here, except those whose canonical name ``keep_quantized`` accepts and whose
    stored form a device form holds (:meth:`~mtp_jax.weights.quant_tensors.QuantParts.
    keepable`): those come back as :class:`~mtp_jax.weights.quant_tensors.KeptQuant` (codes
    and scales, each passed through ``put``).

    Raises :class:`CheckpointError` listing every problem found in the headers (missing,
    duplicate, unexpected tensors, shape or dtype mismatches, incomplete expert sets) before any
    tensor data is read.
    """
    dtype = np.dtype(dtype)
    put = put if put is not None else (lambda a: a)
    expected = {k: tuple(int(d) for d in v) for k, v in expected.items()}
    if not include_mtp:
        bad = [k for k in expected if k.startswith("mtp.")]
        if bad:
            raise ValueError(f"include_mtp=False but expected holds mtp.* tensors: {_few(bad)}")

    def wanted(disk: str) -> str | None:
        c = _names.canonical_name(disk)
        if c is None or c.endswith("rotary_emb.inv_freq"):
            return None
        if c.startswith("mtp.") and not include_mtp:
            return None
        if only_mtp and not c.startswith("mtp."):
            return None
        if (c == "lm_head.weight" and cfg.tie_word_embeddings
                and "lm_head.weight" not in expected):
            return None  # a tied checkpoint that also stores the (identical) head
        return c

    # ---- which files to open --------------------------------------------------------------
    files, wm = checkpoint_files(folder)
    if wm is not None:
        need = sorted({f for d, f in wm.items() if wanted(d) is not None})
        missing_shards = [f for f in need if not os.path.isfile(os.path.join(folder, f))]
        if missing_shards:
            per = {f: [d for d, g in wm.items() if g == f and wanted(d) is not None]
                   for f in missing_shards}
            detail = "; ".join(f"{f} (holds {len(v)} needed tensors, e.g. {v[0]!r})"
                               for f, v in per.items())
            raise CheckpointError(
                f"{os.path.join(folder, INDEX_FILE)} names shard(s) missing from {folder}: "
                f"{detail}. The download is incomplete; fetch the missing shard(s).")
        files = need

    # ---- headers -> candidates ------------------------------------------------------------
    single: dict[str, list[TensorInfo]] = {}
    parts: dict[str, dict[tuple[int, str], list[TensorInfo]]] = {}
    unexpected: list[TensorInfo] = []
    index_mismatch: list[str] = []
    mtp_stored: dict[str, TensorInfo] = {}
    stored: list[TensorInfo] = []
    for fn in files:
        header = read_header(os.path.join(folder, fn))
        if wm is not None:
            index_mismatch += [f"{d!r} (index says {fn})" for d, f in wm.items()
                               if f == fn and d not in header and wanted(d) is not None]
        stored += header.values()
    if quant is None:
        quant = quantization_from_folder(folder)
    # Tensors never read (another tower, mtp.* without MTP) are not grouped or checked.
    stored = [t for t in stored if wanted(t.name) is not None]
    for t in group_quantized(stored, quant, folder):
        disk = t.name
        c = wanted(disk)
        if c is None:
            continue
        if c.startswith("mtp."):
            mtp_stored[c] = t
        if c in expected:
            single.setdefault(c, []).append(t)
            continue
        if (c.endswith(".weight") and c[:-7].endswith(_FUSED_SUFFIXES)
                and c[:-7] in expected):
            single.setdefault(c[:-7], []).append(t)
            continue
        m = _EXPERT_RE.match(c)
        if m:
            proj = m["proj"]
            target = m["p"] + ("mlp.experts.down_proj" if proj == "down_proj"
                               else "mlp.experts.gate_up_proj")
            if target in expected and len(expected[target]) == 3:
                parts.setdefault(target, {}).setdefault((int(m["e"]), proj), []).append(t)
                continue
        unexpected.append(t)

    # ---- checks ---------------------------------------------------------------------------
    if include_mtp and any(k.startswith("mtp.") for k in expected):
        check_mtp_experts(folder, cfg, mtp_stored)
    problems: list[str] = []
    duplicates: list[str] = []
    missing: list[str] = []
    expert_gaps: list[str] = []
    shape_errors: list[str] = []
    dtype_errors: list[str] = []
    plans: list[_Plan] = []

    def check_dtype(t: TensorInfo, canonical: str) -> bool:
        if t.dtype in _FLOAT_DTYPES:
            return True
        dtype_errors.append(f"{_where(t)} (for {canonical}) is stored as {t.dtype}")
        return False

    for c, shape in expected.items():
        s, p = single.get(c, []), parts.get(c, {})
        if len(s) > 1:
            duplicates.append(f"{c} is stored more than once: " + ", ".join(_where(t) for t in s))
            continue
        if s and p:
            other = next(iter(p.values()))[0]
            duplicates.append(f"{c} is stored both fused as {_where(s[0])} and per expert "
                              f"(e.g. {_where(other)})")
            continue
        if s:
            t = s[0]
            if not check_dtype(t, c):
                continue
            if t.shape != shape:
                shape_errors.append(
                    f"{_where(t)} (canonical {c}) has shape {_shape_text(t.shape)} but the "
                    f"config expects {_shape_text(shape)} (from {_keys_text(cfg, c)})")
                continue
            plans.append(_Plan(c, shape, single=t))
            continue
        if not p:
            missing.append(c)
            continue
        # per-expert stack
        n_exp = shape[0]
        fused_down = c.endswith("down_proj")
        projs = ("down_proj",) if fused_down else ("gate_proj", "up_proj")
        part_shape = shape[1:] if fused_down else (shape[1] // 2, shape[2])
        ok = True
        chosen: list[tuple[int, int, int, TensorInfo]] = []
        for (e, proj), ts in sorted(p.items()):
            if len(ts) > 1:
                duplicates.append(f"expert {e} {proj} of {c} is stored more than once: "
                                  + ", ".join(_where(t) for t in ts))
                ok = False
                continue
            t = ts[0]
            if e >= n_exp:
                unexpected.append(t)  # reported with the unexpected tensors (num_experts)
                ok = False
                continue
            if not check_dtype(t, c):
                ok = False
                continue
            if t.shape != part_shape:
                shape_errors.append(
                    f"{_where(t)} (expert {e} of {c}) has shape {_shape_text(t.shape)} but "
                    f"stacking into {_shape_text(shape)} needs {_shape_text(part_shape)} "
                    f"(from {_keys_text(cfg, c)})")
                ok = False
                continue
            row0 = part_shape[0] if proj == "up_proj" else 0
            chosen.append((e, row0, row0 + part_shape[0], t))
        for proj in projs:
            gaps = [e for e in range(n_exp) if (e, proj) not in p]
            if gaps:
                expert_gaps.append(f"{c}: per-expert {proj} missing for expert(s) "
                                   f"{_few(str(e) for e in gaps)} of {n_exp} "
                                   f"(num_experts={cfg.num_experts})")
                ok = False
        if ok:
            plans.append(_Plan(c, shape, parts=chosen))

    if dtype_errors:
        problems.append(
            f"{len(dtype_errors)} tensor(s) have a stored dtype this reader does not convert "
            f"(it reads F16, BF16, F32; quantized formats such as FP8 or NVFP4 are not supported "
            f"by this reader yet): {_few(dtype_errors)}")
    if duplicates:
        problems.append(f"{len(duplicates)} tensor(s) found more than once: {_few(duplicates)}")
    if missing:
        hint = ""
        if all(m.startswith("mtp.") for m in missing):
            hint = (" The checkpoint seems to hold no (complete) MTP weights; run without MTP "
                    "(speculative_algorithm='none') or pass a draft model path.")
        elif "lm_head.weight" in missing and len(missing) == 1:
            hint = (" If the checkpoint ties its embeddings, config.json should set "
                    "tie_word_embeddings=true.")
        problems.append(f"{len(missing)} expected tensor(s) missing: {_few(missing)}.{hint}")
    if shape_errors:
        problems.append(f"{len(shape_errors)} tensor(s) have the wrong shape (does config.json "
                        f"match the checkpoint?): {_few(shape_errors)}")
    if expert_gaps:
        problems.append(f"incomplete per-expert weights: {_few(expert_gaps)}")
    def is_mtp(t: TensorInfo) -> bool:
        return (_names.canonical_name(t.name) or "").startswith("mtp.")

    mtp_unexp = [t for t in unexpected if is_mtp(t)]
    other_unexp = [t for t in unexpected if not is_mtp(t)]
    if mtp_unexp:
        problems.append(
            f"{len(mtp_unexp)} mtp.* tensor(s) in the checkpoint were not consumed (does "
            f"mtp_num_hidden_layers={cfg.mtp_num_hidden_layers} / num_experts={cfg.num_experts} "
            f"match the checkpoint?): {_few(_where(t) for t in mtp_unexp)}")
    if other_unexp:
        quant = any(t.name.endswith(_QUANT_AUX_SUFFIXES) for t in other_unexp + mtp_unexp)
        qhint = (" Names like *.weight_scale* indicate a quantized checkpoint; quantized formats "
                 "are not supported by this reader yet.") if quant else ""
        problems.append(
            f"{len(other_unexp)} tensor(s) in the checkpoint are not expected by the config "
            f"(a config/checkpoint mismatch, e.g. num_hidden_layers={cfg.num_hidden_layers}, "
            f"layer_types, num_experts={cfg.num_experts}, tie_word_embeddings="
            f"{cfg.tie_word_embeddings}): {_few(_where(t) for t in other_unexp)}.{qhint}")
    if index_mismatch:
        problems.append(f"{INDEX_FILE} lists tensor(s) that are not in the shard it names: "
                        f"{_few(index_mismatch)}")
    if problems:
        raise CheckpointError(f"cannot load checkpoint {folder}:\n- " + "\n- ".join(problems))

    # ---- read, convert, put ---------------------------------------------------------------
    plans.sort(key=lambda pl: (pl.first().file, pl.first().start))
    last_use: dict[str, int] = {}  # unmap each file once the last tensor using it is read
    for n, pl in enumerate(plans):
        for t in ([pl.single] if pl.single is not None else [q[3] for q in pl.parts]):
            last_use[t.file] = n
    done_after: dict[int, list[str]] = {}
    for f, n in last_use.items():
        done_after.setdefault(n, []).append(f)
    out: dict[str, Any] = {}
    fh = _Files()
    try:
        with tqdm(total=len(expected), desc=desc, unit="tensor", disable=None) as bar:
            for n, pl in enumerate(plans):
                q = pl.single.quant if pl.single is not None else None
                if (q is not None and keep_quantized is not None and q.keepable()
                        and keep_quantized(pl.canonical)):
                    out[pl.canonical] = q.read_kept(fh).map(put)
                    bar.update(1)
                    for f in done_after.get(n, ()):
                        fh.close(f)
                    continue
                if pl.single is not None:
                    raw = _read(fh, pl.single)
                    arr = raw.astype(dtype, copy=True)
                    del raw
                elif keep_quantized is not None and keep_quantized(pl.canonical) and (
                        kept := _kept_experts(fh, pl)) is not None:
                    out[pl.canonical] = kept.map(put)
                    bar.update(1)
                    for f in done_after.get(n, ()):
                        fh.close(f)
                    continue
                else:
                    arr = np.empty(pl.shape, dtype)
                    for e, r0, r1, t in sorted(pl.parts, key=lambda q: (q[3].file, q[3].start)):
                        raw = _read(fh, t)
                        arr[e, r0:r1] = raw
                        del raw
                out[pl.canonical] = put(arr)
                del arr
                for f in done_after.get(n, ()):
                    fh.close(f)
                bar.update(1)
    finally:
        fh.close()
    assert len(out) == len(expected), sorted(set(expected) - set(out))
    return out
