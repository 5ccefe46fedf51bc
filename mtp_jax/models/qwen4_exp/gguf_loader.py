"""Load a Flash-Next (``qwen4exp``) GGUF target, with a Strata MTP pack as its draft.

``load_qwen4_exp_gguf(path, cfg, ...)`` is :func:`~mtp_jax.models.qwen4_exp.loader.load_qwen4_exp`
with :func:`read_gguf` as its reader. The config comes from the GGUF's metadata
(:mod:`~mtp_jax.models.qwen4_exp.gguf_config`; with a pack, its MTP layer count from
:func:`~mtp_jax.models.qwen4_exp.strata_pack.check_pack`). Every tensor name, type and shape
(target and pack) is checked before any tensor data is read.

Weights are dequantized to the model dtype at load (``gguf.quants`` for ggml's block types, the
module :mod:`mtp_jax.weights.q2_0` for Q2_0): GPU kernels that read the packed types are a later
step. The GGUF conventions (norms stored ``1 + w`` except ``ssm_norm``, tiled GDN value heads,
``ssm_a = -exp(A_log)``, split indexer and experts) are undone by
:mod:`~mtp_jax.models.qwen4_exp.gguf_names`. The PLE n-gram table (``per_layer_token_embd``,
F32 / F16 / BF16) is served from the file: the ``disk`` backend maps it in place, ``memory``
copies it. llama.cpp's ``nextn`` blocks are skipped, never read as a draft.
"""

from __future__ import annotations

import functools

import numpy as np

from mtp_jax.config import ConfigError
from mtp_jax.models.loaded import DTYPES, NP_DTYPES
from mtp_jax.models.qwen4_exp import gguf_names, names
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.models.qwen4_exp.gguf_config import ARCH, PLE_TABLE, config_from_gguf
from mtp_jax.models.qwen4_exp.loaded import PLEHost
from mtp_jax.models.qwen4_exp.ple_store import NgramTable
from mtp_jax.models.qwen4_exp.strata_pack import check_pack, pack_tensors
from mtp_jax.weights.gguf_reader import GGUFFile, GGUFTensor, open_gguf, read_tensor, type_name
from mtp_jax.weights.quant_tensors import KeptQuant
from mtp_jax.weights.safetensors_files import CheckpointError, TensorInfo
from pallas_kernels.quant import QuantFormat
from pallas_kernels.quant.ggml import GGML_BLOCKS, row_bytes

_TABLE_DTYPES = {0: "F32", 1: "F16", 30: "BF16"}


def gguf_config(path: str, draft_path: str | None = None) -> Qwen4ExpConfig:
    """The target's config (header only); with ``draft_path`` (a Strata pack) the MTP layer
    count and shapes are the pack's, checked against the target."""
    g = open_gguf(path)
    if g.architecture != ARCH:
        raise ConfigError(f"{path} is a GGUF of architecture {g.architecture!r}, not {ARCH!r}.")
    cfg = config_from_gguf(g)
    if draft_path is not None:
        cfg = check_pack(open_gguf(draft_path), cfg, repr(draft_path))
    return cfg


def _target_plan(g: GGUFFile, cfg: Qwen4ExpConfig, expected: dict) -> list:
    stored = set(g.tensors)
    plans, problems, used = [], [], {PLE_TABLE}
    for c, shape in expected.items():
        if c.startswith("mtp."):
            continue
        r = gguf_names.target_recipe(c, stored)
        missing = [s for s in r.sources if s not in stored]
        used.update(r.sources)
        if missing:
            problems.append(f"{', '.join(missing)} missing (for {c})")
            continue
        got = gguf_names.result_shape(cfg, r.kind, [g.tensors[s].shape for s in r.sources])
        if tuple(got) != tuple(shape):
            problems.append(f"{', '.join(r.sources)} give {c} shape {list(got)}, the metadata "
                            f"gives {list(shape)}")
        plans.append(r)
    extra = [n for n in stored - used if not gguf_names.is_nextn(n, cfg.num_hidden_layers)]
    if extra:
        problems.append(f"{len(extra)} tensor(s) not expected by the metadata: {sorted(extra)[:8]}")
    if problems:
        raise CheckpointError(f"cannot load the qwen4exp GGUF {g.path}:\n- "
                              + "\n- ".join(problems[:16]))
    return plans


def _ple(g: GGUFFile, cfg: Qwen4ExpConfig, backend: str, dtype) -> list[PLEHost]:
    if not cfg.ple_layers:
        return []
    meta, t = g.metadata, g.tensors[PLE_TABLE]
    mult = tuple(int(v) for v in meta.get(f"{ARCH}.ple.layer_multipliers", []))
    sizes = tuple(int(v) for v in meta.get(f"{ARCH}.ple.head_vocab_sizes", []))
    offs = tuple(int(v) for v in meta.get(f"{ARCH}.ple.head_offsets", []))
    running = tuple(int(v) for v in np.cumsum((0,) + sizes)[:-1])
    if (len(mult) != cfg.ngram_size or len(sizes) != cfg.ngram_heads or offs != running
            or sum(sizes) > t.shape[0]):
        raise CheckpointError(f"{g.path}: the PLE hash constants do not fit (layer_multipliers "
                              f"{len(mult)} for ngram_size {cfg.ngram_size}; head_vocab_sizes "
                              f"{len(sizes)} for {cfg.ngram_heads} heads; head_offsets {offs} vs "
                              f"the running sums {running}; table rows {t.shape[0]}).")
    if t.type_id not in _TABLE_DTYPES:
        raise CheckpointError(f"{g.path}: the n-gram table {PLE_TABLE} is stored as {t.type}; "
                              "mtp_jax serves F32/F16/BF16 tables only for now (a quantized "
                              "table needs a row-wise dequantizing lookup, not written yet).")
    info = TensorInfo(PLE_TABLE, g.path, _TABLE_DTYPES[t.type_id], tuple(t.shape), t.offset,
                      t.offset + t.nbytes)
    return [PLEHost(cfg.ple_layers[0], NgramTable([info], backend, dtype), mult, sizes, offs)]


def _read_one(g: GGUFFile, cfg, r, raw_norms: bool, out_dtype) -> np.ndarray:
    parts = [read_tensor(g, g.tensors[s]) for s in r.sources]
    value = gguf_names.convert(cfg, r.kind, parts, raw_norms=raw_norms)
    if r.kind == "a_log" and not np.all(np.isfinite(value)):
        raise CheckpointError(f"{g.path}: {r.sources[0]} must hold -exp(A_log) < 0; it has "
                              "values >= 0, so A_log cannot be recovered (a corrupt file?).")
    return value.astype(out_dtype)


def _kept(g: GGUFFile, sources: list[GGUFTensor]) -> KeptQuant | None:
    """The sources' rows as packed ggml blocks (:mod:`pallas_kernels.quant.ggml`), stacked by
    rows (gate then up), or None when a source is not of one kept block type."""
    types = {type_name(t.type_id) for t in sources}
    if len(types) != 1 or next(iter(types)) not in GGML_BLOCKS:
        return None
    kind = types.pop()
    k = sources[0].shape[-1]
    fmt = QuantFormat("ggml", (1, GGML_BLOCKS[kind][0]), k, ggml_type=kind)
    rows = [np.asarray(g.data[t.offset:t.offset + t.nbytes]).reshape(
        *t.shape[:-1], row_bytes(kind, k)) for t in sources]
    return KeptQuant(fmt, np.concatenate(rows, axis=-2) if len(rows) > 1 else np.array(rows[0]),
                     None)


def read_gguf(path: str, cfg: Qwen4ExpConfig, expected: dict[str, tuple], *, dtype: str,
              with_mtp: bool, ple_backend: str = "disk", draft_path: str | None = None,
              keep=frozenset()):
    """The reader :func:`~mtp_jax.models.qwen4_exp.loader.load_qwen4_exp` calls for a GGUF:
    ``(arrays: canonical name -> np.ndarray [dtype], ple: [PLEHost])``. The target's and the
    pack's names and shapes are checked first; then data is read and dequantized, but for the
    names in ``keep`` (projections and expert stacks) stored as is (a ``plain`` recipe, or gate
    and up stacked) in one of the block types :mod:`pallas_kernels.quant.ggml` decodes: those
    come as :class:`~mtp_jax.weights.quant_tensors.KeptQuant` of packed rows."""
    g = open_gguf(path)
    plans = _target_plan(g, cfg, expected)
    pack, pack_names = None, {}
    if with_mtp:
        if draft_path is None:
            raise ConfigError(f"{path} is a GGUF target with no MTP draft: pass a Strata MTP "
                              "pack as --speculative-draft-model-path "
                              "(speculative_draft_model_path=...), or "
                              "--speculative-algorithm none.")
        pack = open_gguf(draft_path)
        check_pack(pack, cfg, repr(draft_path))
        pack_names = pack_tensors(pack)
    out_dtype = NP_DTYPES[dtype]
    ple = _ple(g, cfg, ple_backend, out_dtype)
    arrays = {}
    for r in plans:
        kept = (_kept(g, [g.tensors[s] for s in r.sources])
                if r.canonical in keep and r.kind in ("plain", "concat1") else None)
        arrays[r.canonical] = kept if kept is not None else _read_one(g, cfg, r, False,
                                                                      out_dtype)
    for c in expected:
        if c.startswith("mtp."):
            kept = _kept(pack, [pack_names[c]]) if c in keep else None
            arrays[c] = (kept if kept is not None
                         else read_tensor(pack, pack_names[c]).astype(out_dtype))
    return arrays, ple


def load_qwen4_exp_gguf(path: str, cfg: Qwen4ExpConfig, dtype: str, *, with_mtp: bool,
                        draft_path: str | None, ple_backend: str = "disk",
                        quantization: str = "auto", backends: dict | None = None):
    """Load a qwen4exp GGUF target (``cfg`` from :func:`gguf_config`, with the pack's MTP
    layers when ``draft_path`` is given) as a
    :class:`~mtp_jax.models.qwen4_exp.loaded.LoadedQwen4Exp`; ``quantization`` as for
    safetensors (``"keep"``: the routed experts and plain projections stay packed),
    ``backends`` (the kernel choices) as for :func:`load_qwen4_exp`."""
    from mtp_jax.models.qwen4_exp.loader import load_qwen4_exp
    if with_mtp and not cfg.has_mtp:
        cfg = gguf_config(path, draft_path)
    read = functools.partial(read_gguf, draft_path=draft_path)
    return load_qwen4_exp(path, dtype, with_mtp=with_mtp, ple_backend=ple_backend, cfg=cfg,
                          read=read, quantization=quantization, read_keeps=True,
                          backends=backends)


def gguf_kept_bytes_saved(path: str, *, itemsize: int, with_mtp: bool,
                          draft_path: str | None = None) -> int:
    """Bytes ``quantization="keep"`` saves on the device for the GGUF target at ``path`` (and,
    with ``with_mtp``, its Strata pack ``draft_path``) against the model dtype of ``itemsize``
    bytes: each tensor :func:`read_gguf` would keep packed (a name
    :func:`~mtp_jax.models.quantized.kept_names` allows, stored as is or as gate and up, in a
    block type :mod:`pallas_kernels.quant.ggml` decodes) holds its ggml bytes instead of
    ``numel * itemsize``. Reads the headers only (and builds the model abstractly)."""
    from flax import nnx

    from mtp_jax.models.qwen4_exp.model import Qwen4ExpModel
    from mtp_jax.models.quantized import kept_names

    with_mtp = with_mtp and draft_path is not None
    cfg = gguf_config(path, draft_path if with_mtp else None)
    g = open_gguf(path)
    expected = dict(names.target_tensors(cfg))
    if with_mtp:
        expected.update(names.mtp_tensors(cfg))
    keep = kept_names(nnx.eval_shape(
        lambda: Qwen4ExpModel(cfg, DTYPES["float32"], with_mtp=with_mtp, ple_source=None)))

    def saved(name: str, sources: list[GGUFTensor]) -> int:
        kinds = {type_name(t.type_id) for t in sources}
        if name not in keep or len(kinds) != 1 or kinds.pop() not in GGML_BLOCKS:
            return 0
        return int(np.prod(expected[name])) * itemsize - sum(t.nbytes for t in sources)

    total = sum(saved(r.canonical, [g.tensors[s] for s in r.sources])
                for r in _target_plan(g, cfg, expected) if r.kind in ("plain", "concat1"))
    if with_mtp:
        pack_names = pack_tensors(open_gguf(draft_path))
        total += sum(saved(c, [pack_names[c]]) for c in expected if c.startswith("mtp."))
    return total
