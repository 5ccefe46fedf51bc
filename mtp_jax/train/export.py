"""Write a trained MTP head to disk: a complete checkpoint beside its source, or a draft folder.

The trainer holds the head as ``{canonical mtp.* name: float32 array}``
(:mod:`mtp_jax.weights.names`; routed experts fused, ``gate_up_proj [E, 2I, H]`` gate rows
first, ``down_proj [E, H, I]``). :func:`write_draft_checkpoint` stores them as the SOURCE
checkpoint stores its own ``mtp.*`` (:func:`plan_mtp_tensors`): routed experts fused (keeping
a ``.weight`` suffix) or per expert (``...experts.{e}.{gate,up,down}_proj.weight``, sliced from
the fused arrays), each tensor in its stored dtype (BF16, F16, F32). A tensor the source lacks
(a fresh head) or stores quantized gets the dtype of ``embed_tokens`` and the expert layout of
the target's own layers; ``dtype=`` overrides every dtype.

A complete checkpoint (``draft_only=False``) is::

    out/config.json            the source's, mtp_num_hidden_layers = the layers written
    out/mtp.safetensors        the trained head
    out/<shard>                -> absolute symlink to the source's shard holding no mtp.*
    out/<shard>                rewritten: the source's shard minus its mtp.* (raw bytes copied;
                               the reader reads every tensor of a shard, so no duplicates)
    out/model.safetensors.index.json   every tensor -> its file
    out/<other files>          copies (tokenizer, chat template, generation config, ...)

``draft_only=True`` writes ``config.json`` and ``mtp.safetensors`` only, a folder for
``speculative_draft_model_path`` (:func:`mtp_jax.models.checks.check_draft_folder`).
Everything is written into a temporary sibling folder renamed to ``out`` at the end.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import tempfile

import ml_dtypes
import numpy as np

from mtp_jax.config import ConfigError, read_config_json
from mtp_jax.models.registry import entry_of, read_config
from mtp_jax.weights.names import canonical_name
from mtp_jax.weights.safetensors_files import INDEX_FILE, checkpoint_files, read_header
from mtp_jax.weights.safetensors_write import save_file

__all__ = ["write_draft_checkpoint", "mtp_tensor_shapes", "with_mtp_layer", "check_tensors",
           "Stored", "plan_mtp_tensors", "draft_config", "copy_without"]

MTP_FILE = "mtp.safetensors"
NP_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
             "F32": np.dtype(np.float32)}
DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# Weight files of other formats are not copied into a complete checkpoint.
_WEIGHT_EXTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")
# The expert layouts of the target's own layers (canonical names), for a fresh head.
_FUSED = re.compile(r"^layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)"
                    r"(?P<suffix>\.weight)?$")
_PER_EXPERT = re.compile(r"^layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj"
                         r"\.weight$")
_COPY_CHUNK = 64 << 20


def with_mtp_layer(cfg):
    """``cfg`` with at least one MTP layer (a fresh head on a checkpoint that declares none)."""
    if cfg.mtp_num_hidden_layers >= 1:
        return cfg
    return dataclasses.replace(cfg, mtp_num_hidden_layers=1)


def mtp_tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Canonical ``mtp.*`` name -> shape that ``cfg``'s family expects (its registry entry's
    ``tensor_shapes``), with at least one MTP layer."""
    cfg = with_mtp_layer(cfg)
    shapes = entry_of(cfg).tensor_shapes(cfg, True)
    return {n: tuple(int(d) for d in s) for n, s in shapes.items() if n.startswith("mtp.")}


def check_tensors(cfg, tensors: dict) -> None:
    """Every expected ``mtp.*`` tensor is given, with its shape, float and finite; nothing
    else is given. Raises :class:`ConfigError` naming the tensors."""
    expected = mtp_tensor_shapes(cfg)
    problems = []
    missing = sorted(set(expected) - set(tensors))
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        problems.append(f"not mtp.* tensors of this config: {', '.join(extra)}")
    for name in sorted(set(expected) & set(tensors)):
        a = np.asarray(tensors[name])
        if a.shape != expected[name]:
            problems.append(f"{name} has shape {list(a.shape)}, the config expects "
                            f"{list(expected[name])}")
        elif not (np.issubdtype(a.dtype, np.floating) or a.dtype in NP_DTYPES.values()):
            problems.append(f"{name} has dtype {a.dtype}, not a float dtype")
        elif not np.isfinite(a).all():
            problems.append(f"{name} holds NaN or inf values (did training diverge?)")
    if problems:
        raise ConfigError(
            f"the MTP tensors to export do not match the {cfg.model_type} config "
            f"(hidden_size={cfg.hidden_size}, mtp_num_hidden_layers="
            f"{with_mtp_layer(cfg).mtp_num_hidden_layers}): " + "; ".join(problems)
            + ". Pass the draft's tensors as trained for this checkpoint (canonical names, "
            "experts fused).")


def _check_out(out: str) -> None:
    """Refuse an ``out`` that is a file or a folder with something in it."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        what = "a file" if not os.path.isdir(out) else "a folder that is not empty"
        raise ConfigError(f"output path {out!r} is {what}; pass a new folder (or an empty "
                          "one), or remove it first.")


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor of ``mtp.safetensors``: its on-disk name and dtype, and where its values come
    from: ``canonical`` whole, or expert ``expert``'s ``part`` (``gate``, ``up``, ``down``)."""

    name: str
    dtype: str
    canonical: str
    expert: int | None = None
    part: str | None = None

    def array(self, tensors: dict) -> np.ndarray:
        """The array stored as :attr:`name`, in :attr:`dtype`: the canonical tensor, or one
        expert's gate or up rows ``[I, H]`` or its down matrix ``[H, I]``."""
        a = np.asarray(tensors[self.canonical])
        if self.part is not None:
            half = a.shape[1] // 2
            a = {"gate": a[self.expert, :half], "up": a[self.expert, half:],
                 "down": a[self.expert]}[self.part]
        return np.ascontiguousarray(a.astype(NP_DTYPES[self.dtype]))


def plan_mtp_tensors(expected: dict[str, tuple[int, ...]], stored: dict[str, str],
                     dtype: str | None = None) -> list[Stored]:
    """The tensors of ``mtp.safetensors`` for the canonical ``expected`` shapes, laid out as
    ``stored`` (the source's on-disk name -> safetensors dtype, e.g. ``"BF16"``) stores them;
    ``dtype`` (``"bfloat16"``, ...) overrides the stored dtypes. Experts of an MTP layer: the
    source's fused (or fused ``.weight``) or per-expert names, else the target layers' layout.
    Raises :class:`ConfigError` for an unknown ``dtype``."""
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ConfigError(f"export dtype {dtype!r} is not supported; use one of "
                          f"{', '.join(DTYPE_NAMES)} (or None: the source's dtypes).")
    override = DTYPE_NAMES.get(dtype)
    canon = {canonical_name(d): (d, t) for d, t in stored.items()}
    canon.pop(None, None)
    embed = canon.get("embed_tokens.weight", (None, "F32"))[1]
    default = override or (embed if embed in NP_DTYPES else "F32")

    def dtype_of(c: str) -> str:
        t = canon.get(c, (None, None))[1]
        return override or (t if t in NP_DTYPES else default)

    target = [c for c in canon if not c.startswith("mtp.")]
    target_fused = [m for c in target if (m := _FUSED.match(c))]
    target_suffix = ".weight" if target_fused and target_fused[0]["suffix"] else ""
    target_per_expert = not target_fused and any(_PER_EXPERT.match(c) for c in target)
    out: list[Stored] = []
    for c, shape in expected.items():
        proj = next((p for p in ("gate_up_proj", "down_proj")
                     if c.endswith(f"mlp.experts.{p}")), None)
        if proj is None:
            out.append(Stored(c, dtype_of(c), c))
            continue
        base = c[: -len(proj)]  # "mtp.layers.0.mlp.experts."
        parts = ("gate", "up") if proj == "gate_up_proj" else ("down",)
        first = [f"{base}{e}.{parts[0]}_proj.weight" for e in range(shape[0])]
        if c in canon or c + ".weight" in canon:
            name = c if c in canon else c + ".weight"
            out.append(Stored(name, dtype_of(name), c))
        elif any(n in canon for n in first) or (
                not any(n.startswith(base) for n in canon) and target_per_expert):
            d = dtype_of(next((n for n in first if n in canon), first[0]))
            out += [Stored(f"{base}{e}.{p}_proj.weight", d, c, e, p)
                    for e in range(shape[0]) for p in parts]
        else:
            out.append(Stored(c + target_suffix, default, c))
    return out


def draft_config(raw: dict, num_layers: int) -> dict:
    """A copy of the source's ``config.json`` dict with ``mtp_num_hidden_layers`` =
    ``num_layers`` in its text config (``text_config`` of a composite, else the top level)."""
    out = copy.deepcopy(raw)
    text = out.get("text_config")
    if isinstance(text, dict):
        text["mtp_num_hidden_layers"] = num_layers
        if "mtp_num_hidden_layers" in out:  # a composite that repeats it at the top
            out["mtp_num_hidden_layers"] = num_layers
    else:
        out["mtp_num_hidden_layers"] = num_layers
    return out


def _is_mtp(disk: str) -> bool:
    return (canonical_name(disk) or "").startswith("mtp.")


def _file_metadata(path: str) -> dict | None:
    """The ``__metadata__`` of a safetensors file (its header was already validated)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)).get("__metadata__")


def copy_without(src: str, dst: str, keep: list) -> int:
    """Write ``dst``: the safetensors file ``src`` holding only the tensors ``keep``
    (:class:`~mtp_jax.weights.safetensors_files.TensorInfo` of ``src``), their bytes copied
    unchanged, the file's ``__metadata__`` kept. Returns the tensor bytes written."""
    keep = sorted(keep, key=lambda t: t.start)
    header: dict = {}
    meta = _file_metadata(src)
    if meta is not None:
        header["__metadata__"] = meta
    offset = 0
    for t in keep:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.end - t.start]}
        offset += t.end - t.start
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(len(blob).to_bytes(8, "little") + blob)
        for t in keep:
            fin.seek(t.start)
            left = t.end - t.start
            while left:
                chunk = fin.read(min(left, _COPY_CHUNK))
                if not chunk:
                    raise OSError(f"{src} ended inside tensor {t.name!r}")
                fout.write(chunk)
                left -= len(chunk)
    return offset


def _write_target(source: str, tmp: str, headers: dict, mtp_bytes: int, mtp_file: str,
                  mtp_names: list[str]) -> None:
    """Shards (linked or rewritten), the index and the source's other small files."""
    weight_map = {n: mtp_file for n in mtp_names}
    total = mtp_bytes
    for fn, header in headers.items():
        keep = [t for n, t in header.items() if not _is_mtp(n)]
        if not keep:
            continue  # a shard of mtp.* only: replaced by mtp_file
        dst = os.path.join(tmp, fn)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if len(keep) == len(header):
            os.symlink(os.path.abspath(os.path.join(source, fn)), dst)
            total += sum(t.end - t.start for t in keep)
        else:
            total += copy_without(os.path.join(source, fn), dst, keep)
        weight_map.update({t.name: fn for t in keep})
    with open(os.path.join(tmp, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(
            weight_map.items()))}, f, indent=2)
        f.write("\n")
    for fn in sorted(os.listdir(source)):
        path = os.path.join(source, fn)
        if (os.path.isfile(path) and fn not in ("config.json", INDEX_FILE)
                and not fn.endswith(_WEIGHT_EXTS) and not os.path.exists(os.path.join(tmp, fn))):
            shutil.copyfile(path, os.path.join(tmp, fn))


def _usual_modes(folder: str) -> None:
    """The modes a plain ``mkdir`` / ``open`` give under the umask: ``mkdtemp`` makes the
    folder 0700 and safetensors writes its file 0600."""
    umask = os.umask(0o22)
    os.umask(umask)  # read it back
    os.chmod(folder, 0o777 & ~umask)
    for fn in os.listdir(folder):
        path = os.path.join(folder, fn)
        if os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, 0o666 & ~umask)


def write_draft_checkpoint(source: str | None, cfg, tensors: dict[str, np.ndarray], out: str, *,
                           draft_only: bool = False, dtype: str | None = None) -> str:
    """Write the trained MTP head ``tensors`` beside the checkpoint ``source``; returns ``out``.

    Args:
      source: the checkpoint folder the head was trained for (its names, dtypes, config and,
        unless ``draft_only``, its target shards); None only with ``draft_only`` (then no
        config.json, names ``mtp.*`` with experts fused, dtype ``dtype`` or float32).
      cfg: the model config the head follows (a config with no MTP layer gets one).
      tensors: canonical ``mtp.*`` name -> float array (see :func:`mtp_tensor_shapes`).
      out: a new (or empty) folder.
      draft_only: write ``config.json`` + ``mtp.safetensors`` only.
      dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` for every tensor written.
    Raises:
      ConfigError: ``out`` not new or empty, tensors missing / extra / of wrong shapes or not
        finite, a ``cfg`` that does not match the source's config, a bad ``dtype``; all before
        anything is written. CheckpointError: unreadable source files.
    """
    out = os.path.abspath(os.fspath(out))
    _check_out(out)
    check_tensors(cfg, tensors)
    expected = mtp_tensor_shapes(cfg)
    num_layers = with_mtp_layer(cfg).mtp_num_hidden_layers
    if source is None:
        if not draft_only:
            raise ConfigError("a complete checkpoint is written beside its source checkpoint; "
                              "pass the source folder, or draft_only=True.")
        headers, raw = {}, None
    else:
        source = os.fspath(source)
        raw = read_config_json(source)
        src_shapes = mtp_tensor_shapes(dataclasses.replace(
            read_config(source), mtp_num_hidden_layers=num_layers))
        if src_shapes != expected:
            diff = sorted(n for n in set(src_shapes) | set(expected)
                          if src_shapes.get(n) != expected.get(n))
            raise ConfigError(f"the config the head was trained with does not match "
                              f"{source}/config.json (tensors differ: {', '.join(diff[:5])}); "
                              "export into the checkpoint the head was trained on.")
        headers = {fn: read_header(os.path.join(source, fn))
                   for fn in checkpoint_files(source)[0]}
    stored = {n: t.dtype for h in headers.values() for n, t in h.items()}
    plan = plan_mtp_tensors(expected, stored, dtype)
    kept = {fn for fn, h in headers.items() if not all(_is_mtp(n) for n in h)}
    mtp_file = MTP_FILE if draft_only or MTP_FILE not in kept else "mtp-trained.safetensors"

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        arrays = {s.name: s.array(tensors) for s in plan}
        # safetensors' numpy API writes ml_dtypes.bfloat16 arrays as BF16 (checked with 0.8:
        # it takes the dtype's numpy name); some older versions refuse them.
        save_file(arrays, os.path.join(tmp, mtp_file), metadata={"format": "pt"})
        if raw is not None:
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                json.dump(draft_config(raw, num_layers), f, indent=2)
                f.write("\n")
        if not draft_only:
            _write_target(source, tmp, headers, sum(a.nbytes for a in arrays.values()),
                          mtp_file, list(arrays))
        _usual_modes(tmp)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
