"""Load a qwen4_exp checkpoint folder: dense tensors into the Flax model, PLE n-gram tables into
host-side :class:`~mtp_jax.models.qwen4_exp.ple_store.NgramTable` (memory, disk or device
backend; with ``device`` they are also copied to the accelerator and attached to the model as
:class:`~mtp_jax.models.qwen4_exp.ple_device.PLEDevice`), the int64 hash buffers checked
against the config.

``load_qwen4_exp(path)`` returns a :class:`~mtp_jax.models.qwen4_exp.loaded.LoadedQwen4Exp`
(a :class:`~mtp_jax.models.loaded.LoadedModel` with the host tables).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.models.layers.basic import as_data
from mtp_jax.models.loaded import DTYPES, NP_DTYPES, resolve_dtype
from mtp_jax.models.qwen4_exp import names
from mtp_jax.models.qwen4_exp.config import (Qwen4ExpConfig, head_offsets, head_vocab_sizes,
                                             layer_multipliers, ngram_table_rows)
from mtp_jax.models.qwen4_exp import ple_callback, ple_native
from mtp_jax.models.qwen4_exp.kernels import resolve_kernels
from mtp_jax.models.qwen4_exp.loaded import LoadedQwen4Exp, PLEHost, PLETables, ple_rows
from mtp_jax.models.qwen4_exp.model import Qwen4ExpModel
from mtp_jax.models.qwen4_exp.ple_device import PLEDevice
from mtp_jax.models.qwen4_exp.ple_store import NgramTable
from mtp_jax.models.qwen4_exp.slot_states import check_slot_states
from mtp_jax.models.quantized import apply_kept, kept_names, saved_bytes, split_kept
from mtp_jax.weights.quant_config import keeps_quantized, quantization_from_folder
from mtp_jax.weights.quant_tensors import group_quantized, stack_kept
from mtp_jax.weights.safetensors_files import (_FLOAT_DTYPES, CheckpointError, _Files, _read,
                                               checkpoint_files, read_header)

_EXPERT = re.compile(r"^(?P<p>.*)mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                     r"\.weight$")
_TABLE = re.compile(r"^layers\.(?P<l>\d+)\.ple\.ple_embedding\.ngram_embedding"
                    r"(?:\.shard_(?P<s>\d+))?\.weight$")
_BUFFER = re.compile(r"^layers\.(?P<l>\d+)\.ple\.ple_embedding\.(?P<b>layer_multipliers|"
                     r"ngram_heads_vocab_sizes|ngram_heads_offsets)$")


def _param_name(path) -> str:
    return ".".join(str(p) for p in path)


def read_checkpoint(path: str, cfg: Qwen4ExpConfig, expected: dict[str, tuple], *, dtype: str,
                    with_mtp: bool, ple_backend: str = "disk", keep=frozenset()):
    """Read every dense tensor of ``expected`` and the PLE tables / buffers; a quantized
    projection whose name is in ``keep`` comes as its
    :class:`~mtp_jax.weights.quant_tensors.KeptQuant` (where a device form holds it).

    Returns ``(arrays: name -> np.ndarray, ple: list[PLEHost])``. Raises CheckpointError listing
    missing, unexpected, mis-shaped tensors and buffer/config conflicts before reading data.
    """
    files, _ = checkpoint_files(path)
    single, parts, tables, buffers, unexpected = {}, {}, {}, {}, []
    stored = [t for fn in files for t in read_header(os.path.join(path, fn)).values()
              if (c := names.canonical_name(t.name)) is not None
              and (with_mtp or not c.startswith("mtp."))]
    # Quantized weights become logical F32 entries, dequantized by _read.
    for t in group_quantized(stored, quantization_from_folder(path), path):
        disk = t.name
        c = names.canonical_name(disk)
        if c is None or c.endswith("rotary_emb.inv_freq"):
            continue
        if c.startswith("mtp.") and not with_mtp:
            continue
        if c in expected:
            single.setdefault(c, []).append(t)
        elif c.endswith(".weight") and c[:-7] in expected and "mlp.experts." in c:
            single.setdefault(c[:-7], []).append(t)
        elif (m := _EXPERT.match(c)) and (
                m["p"] + ("mlp.experts.down_proj" if m["proj"] == "down_proj"
                          else "mlp.experts.gate_up_proj")) in expected:
            tgt = m["p"] + ("mlp.experts.down_proj" if m["proj"] == "down_proj"
                            else "mlp.experts.gate_up_proj")
            parts.setdefault(tgt, {})[(int(m["e"]), m["proj"])] = t
        elif (m := _TABLE.match(c)) and int(m["l"]) in cfg.ple_layers:
            tables.setdefault(int(m["l"]), {})[-1 if m["s"] is None else int(m["s"])] = t
        elif (m := _BUFFER.match(c)) and int(m["l"]) in cfg.ple_layers:
            buffers[(int(m["l"]), m["b"])] = t
        else:
            unexpected.append(disk)
    problems, plans = [], []
    for c, shape in expected.items():
        s = single.get(c, [])
        if len(s) > 1:
            problems.append(f"{c} stored more than once")
        elif s:
            if s[0].dtype not in _FLOAT_DTYPES:
                problems.append(f"{c} stored as {s[0].dtype} (F16/BF16/F32 supported)")
            elif tuple(s[0].shape) != tuple(shape):
                problems.append(f"{c} has shape {list(s[0].shape)}, config expects {list(shape)}")
            else:
                plans.append((c, s[0], None))
        elif c in parts:
            p = parts[c]
            e = shape[0]
            projs = ("down_proj",) if c.endswith("down_proj") else ("gate_proj", "up_proj")
            gaps = [(i, q) for i in range(e) for q in projs if (i, q) not in p]
            if gaps or len(p) != e * len(projs):
                problems.append(f"{c}: per-expert tensors incomplete (missing {gaps[:4]}, "
                                f"num_experts={cfg.num_experts})")
            else:
                plans.append((c, None, p))
        else:
            problems.append(f"{c} missing")
    ple: list[PLEHost] = []
    for j, layer in enumerate(cfg.ple_layers):
        sh = tables.get(layer, {})
        if not sh:
            problems.append(f"PLE layer {layer + 1} (one-indexed) has no n-gram table "
                            f"(layers.{layer}.ple.ple_embedding.ngram_embedding.shard_*.weight)")
            continue
        if -1 in sh and len(sh) > 1:
            problems.append(f"PLE layer {layer}: both a whole table and shards are stored")
            continue
        order = sorted(sh)
        if order != [-1] and order != list(range(len(order))):
            problems.append(f"PLE layer {layer}: n-gram shards {order} are not 0..n-1")
            continue
        if order != [-1] and len(order) != cfg.split_ngram_parts:
            problems.append(f"PLE layer {layer}: {len(order)} n-gram shards stored but "
                            f"split_ngram_parts is {cfg.split_ngram_parts}")
        shards = [sh[k] for k in order]
        rows = sum(t.shape[0] for t in shards)
        want = ngram_table_rows(cfg, j)
        if rows != want or any(t.shape[1] != cfg.ngram_head_dim for t in shards):
            problems.append(f"PLE layer {layer}: n-gram table is {rows} x "
                            f"{shards[0].shape[1]} but the config gives {want} x "
                            f"{cfg.ngram_head_dim} (ngram_vocab_size_base, heads_per_ngram, "
                            "ngram_size, ple_embed_dim)")
            continue
        derived = {"layer_multipliers": layer_multipliers(cfg, j),
                   "ngram_heads_vocab_sizes": head_vocab_sizes(cfg, j)}
        derived["ngram_heads_offsets"] = head_offsets(derived["ngram_heads_vocab_sizes"])
        vals = {}
        for b, d in derived.items():
            t = buffers.get((layer, b))
            if t is None:
                vals[b] = d  # not stored: use the values the config defines
                continue
            fh = _Files()
            try:
                raw = np.frombuffer(fh.get(t.file), dtype="<i8", count=int(np.prod(t.shape)),
                                    offset=t.start).copy()
            finally:
                fh.close()
            if t.dtype != "I64" or tuple(raw.tolist()) != tuple(d):
                problems.append(f"PLE layer {layer}: stored {b} {raw.tolist()} ({t.dtype}) "
                                f"differs from the config's {list(d)} (seed={cfg.seed}, "
                                f"vocab_size={cfg.vocab_size}, ngram_vocab_size_base="
                                f"{cfg.ngram_vocab_size_base})")
            vals[b] = tuple(int(x) for x in raw)
        table = NgramTable(shards, ple_backend, NP_DTYPES[dtype]) if not problems else None
        ple.append(PLEHost(layer, table, vals["layer_multipliers"],
                           vals["ngram_heads_vocab_sizes"], vals["ngram_heads_offsets"]))
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) not expected by the config: "
                        f"{unexpected[:8]}")
    if problems:
        raise CheckpointError(f"cannot load qwen4_exp checkpoint {path}:\n- "
                              + "\n- ".join(problems))
    out, fh = {}, _Files()
    try:
        for c, t, p in plans:
            shape = expected[c]
            if t is not None and t.quant is not None and c in keep and t.quant.keepable():
                out[c] = t.quant.read_kept(fh)
                continue
            if t is not None:
                out[c] = _read(fh, t).astype(NP_DTYPES[dtype])
                continue
            if c in keep and all(ti.quant is not None and ti.quant.keepable()
                                 for ti in p.values()):
                order = ("down_proj",) if c.endswith("down_proj") else ("gate_proj", "up_proj")
                kept = stack_kept([[p[(e, q)].quant.read_kept(fh) for q in order]
                                   for e in range(shape[0])])
                if kept is not None:
                    out[c] = kept
                    continue
            arr = np.empty(shape, NP_DTYPES[dtype])
            half = shape[1] // 2
            for (e, proj), ti in p.items():
                raw = _read(fh, ti)
                if proj == "down_proj":
                    arr[e] = raw
                elif proj == "gate_proj":
                    arr[e, :half] = raw
                else:
                    arr[e, half:] = raw
            out[c] = arr
    finally:
        fh.close()
    return out, ple


def load_qwen4_exp(path: str, dtype: str | None = "auto", *, with_mtp: bool = True,
                   ple_backend: str = "disk", cfg: Qwen4ExpConfig | None = None,
                   read=None, quantization: str = "auto",
                   read_keeps: bool = False, backends: dict | None = None) -> LoadedQwen4Exp:
    """Load a qwen4_exp checkpoint folder (composite ``model.language_model.*`` or text-only
    ``model.*``). ``ple_backend``: ``"disk"`` (default, memory-mapped tables), ``"memory"``
    (host RAM) or ``"device"`` (also copied to the accelerator, after the weights: the programs
    look their rows up there, no host callback; ValueError when the hash constants break the
    device hash's bounds, :func:`~mtp_jax.models.qwen4_exp.ple_device.check_constants`).
    ``quantization``: how a quantized checkpoint's projections are held
    (:func:`mtp_jax.weights.quant_config.keeps_quantized`; :mod:`mtp_jax.models.quantized`);
    ``read_keeps``: ``read`` takes the names to keep quantized (``keep=``), as
    :func:`read_checkpoint` does.
    ``read``: the tensor reader, :func:`read_checkpoint`'s signature (default: it; a GGUF
    target passes :func:`~mtp_jax.models.qwen4_exp.gguf_loader.read_gguf`).
    ``backends``: ``{op: choice}`` of the kernel backends (``load_model``'s ``*_backend``
    arguments), resolved by :func:`~mtp_jax.models.qwen4_exp.kernels.resolve_kernels` into
    ``cfg.kernels`` before any weight is read (``auto``: the GDN / MoE kernels on a GPU, but
    XLA's MoE where ``quantization`` keeps projections quantized; ConfigError for a choice that
    cannot run)."""
    cfg = cfg or Qwen4ExpConfig.from_folder(path)
    check_slot_states()
    dtype = resolve_dtype(dtype)
    backends = dict(backends or {})
    if keeps_quantized(quantization) and backends.get("moe") in (None, "auto"):
        # kept experts: XLA's forms decode only the chosen experts, where the kernels would
        # read the whole stacks dequantized (layers.mlp.Experts)
        backends["moe"] = "xla"
    cfg = dataclasses.replace(cfg, kernels=resolve_kernels(cfg, dtype, backends))
    with_mtp = with_mtp and cfg.has_mtp
    device = ple_backend == "device"
    source = None if device else ple_callback.reserve()
    module = nnx.eval_shape(lambda: Qwen4ExpModel(cfg, DTYPES[dtype], with_mtp=with_mtp,
                                                  ple_source=source))
    graphdef, abstract = nnx.split(module)
    flat = list(nnx.to_flat_state(abstract))
    expected = {_param_name(p): tuple(v.shape) for p, v in flat}
    want = dict(names.target_tensors(cfg))
    if with_mtp:
        want.update(names.mtp_tensors(cfg))
    assert want == expected, (sorted(set(want) ^ set(expected)),
                              [k for k in want if k in expected and want[k] != expected[k]])
    keep = (kept_names(nnx.merge(graphdef, abstract)) if (read is None or read_keeps)
            and keeps_quantized(quantization) else frozenset())
    reader = read or read_checkpoint
    arrays, ple = (functools.partial(reader, keep=keep) if read is None or read_keeps
                   else reader)(path, cfg, expected, dtype=dtype, with_mtp=with_mtp,
                                ple_backend=ple_backend)
    arrays, kept = split_kept(arrays)
    filled = []
    for p, v in flat:
        name = _param_name(p)
        a = arrays[name]
        filled.append((p, v.replace(jnp.asarray(a) if name in kept
                                    else jnp.asarray(a, dtype=v.dtype))))
    params = nnx.from_flat_state(filled)
    saved = 0
    if kept:
        module = nnx.merge(graphdef, params)
        apply_kept(module, {n: kq.map(jnp.asarray) for n, kq in kept.items()})
        saved = saved_bytes(module)
        graphdef, params = nnx.split(module)
    tables = PLETables(ple)
    if device and ple:  # the tables as program inputs, after the checkpoint's names were checked
        module = nnx.merge(graphdef, params)
        module.ple_device = as_data(PLEDevice(cfg, ple))
        graphdef, params = nnx.split(module)
    elif not device:
        ple_callback.bind(source, tables, functools.partial(ple_rows, cfg))  # the programs' rows
        ple_native.register(source, cfg, tables)  # the same rows, not blocking the launch
    return LoadedQwen4Exp(cfg=cfg, dtype=dtype, graphdef=graphdef, params=params,
                          has_mtp=with_mtp, ple=tables, pack_small_params=False,
                          weight_bytes_saved=saved)
