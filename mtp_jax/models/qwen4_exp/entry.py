"""The registry entry of Qwen3.8-Flash-Next (``qwen4_exp``).

Slot states and their verify handlers are declared in
:mod:`mtp_jax.models.qwen4_exp.slot_states` (GDN recurrent: replay of the accepted rows; GDN
conv, PLE conv window and n-gram context: shift registers; QSA open index group: group ring).
Plain decoding runs the same hooks with every row accepted. QSA raw index keys are paged like KV
(same page ids) and roll back by position, so they need no slot state. A declaration without a
handler is a :class:`~mtp_jax.config.ConfigError` when the registry is built.

Served by the batched engine like every family: continuous batching, chunked prefill, the
prefix cache, MTP and external drafts. Its state pools are
:func:`~mtp_jax.models.qwen4_exp.pools.make_qwen4_pools`. With ``ple_backend`` ``disk``
(memory-mapped) or ``memory`` the PLE tables stay on the host: the rows of a program's tokens
are looked up there by a host callback inside the program
(:mod:`~mtp_jax.models.qwen4_exp.ple_callback`), so its rounds overlap the host and run several
per call like every family's. With ``device`` they are copied to the accelerator and looked up
inside the program (:mod:`~mtp_jax.models.qwen4_exp.ple_device`, no host callback). ``auto``
(the default) takes ``device`` on an accelerator where the tables fit in a quarter of its
memory, else ``disk`` (:func:`ple_backend_for`).

Kernels (:mod:`~mtp_jax.models.qwen4_exp.kernels`): the GDN and MoE ops take ``pallas`` on a GPU
(``auto`` too, where the kernels take the model); ``norm`` is the hyper-connections' kernels
(opt-in: ``auto`` is XLA, the kernels measured no faster in the engine); QSA attention and the one-row
projections run on XLA (``pallas`` for them is refused before any weight loads).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from flax import nnx

from mtp_jax.models.entry import LoadRequest, ModelEntry, SlotState
from mtp_jax.models.layers.basic import set_gemv_backend
from mtp_jax.models.loaded import NP_DTYPES, resolve_dtype
from mtp_jax.models.qwen4_exp import names
from mtp_jax.models.qwen4_exp.config import MODEL_TYPES, Qwen4ExpConfig, ple_table_bytes
from mtp_jax.models.qwen4_exp.dummy import read_random
from mtp_jax.models.qwen4_exp.gguf_loader import load_qwen4_exp_gguf
from mtp_jax.models.qwen4_exp.kernels import KERNEL_OPS
from mtp_jax.models.qwen4_exp.loader import LoadedQwen4Exp, load_qwen4_exp
from mtp_jax.models.qwen4_exp.model import Qwen4ExpModel
from mtp_jax.models.qwen4_exp.ple_device import choose_backend
from mtp_jax.models.qwen4_exp.ple_store import PLE_CHOICES
from mtp_jax.models.qwen4_exp.pools import make_qwen4_pools
from mtp_jax.models.qwen4_exp.random_checkpoint import write_random_qwen4_exp
from mtp_jax.models.qwen4_exp.slot_states import check_slot_states
from mtp_jax.weights.gguf_header import folder_pack, gguf_draft_file, gguf_file

__all__ = ["ENTRY", "make_entry"]


def build(cfg: Qwen4ExpConfig, dtype, with_mtp: bool) -> Qwen4ExpModel:
    return Qwen4ExpModel(cfg, dtype, with_mtp=with_mtp)


def load(path: str, cfg: Qwen4ExpConfig, request: LoadRequest) -> LoadedQwen4Exp:
    """:func:`~mtp_jax.models.qwen4_exp.loader.load_qwen4_exp` for ``load_model`` (the entry's
    capabilities were checked before: no draft folder, kernels for GDN, MoE, norm and gemv; the
    kernel choices are resolved there, before any weight is read); a GGUF target reads its
    Strata pack from the draft path, or from its folder when none is given
    (:func:`~mtp_jax.weights.gguf_header.folder_pack`); with ``dummy_weight``
    random weights and synthetic PLE tables (:mod:`~mtp_jax.models.qwen4_exp.dummy`), with
    ``pack_small_params`` the programs take the small parameters packed; with
    ``merge_projections`` (the default) the projections that read one input merged
    (:func:`merged`)."""
    backend = ple_backend_for(cfg, request.dtype, request.option_values.get("ple_backend"))
    kernels = request.backend_choices
    if request.dummy_weight:
        model = load_qwen4_exp(path, request.dtype, with_mtp=request.with_mtp,
                               ple_backend=backend, cfg=cfg, backends=kernels,
                               read=functools.partial(read_random, seed=request.seed))
    elif (g := gguf_file(path)) is not None:  # a Flash-Next GGUF, with a Strata pack as draft
        draft = request.draft_path
        draft = (gguf_draft_file(draft) if draft is not None  # a file, or a folder's pack
                 else folder_pack(path) if request.with_mtp else None)
        model = load_qwen4_exp_gguf(g, cfg, request.dtype, with_mtp=request.with_mtp,
                                    draft_path=draft, ple_backend=backend,
                                    quantization=request.quantization, backends=kernels)
    else:
        model = load_qwen4_exp(path, request.dtype, with_mtp=request.with_mtp,
                               ple_backend=backend, cfg=cfg, quantization=request.quantization,
                               backends=kernels)
    if request.merge_projections:
        model = merged(model)
    if model.cfg.kernels.gemv != "xla":
        model = with_gemv_backend(model, model.cfg.kernels.gemv)
    if request.pack_small_params:
        model = dataclasses.replace(model, pack_small_params=True)
    return model


def with_gemv_backend(model: LoadedQwen4Exp, backend: str) -> LoadedQwen4Exp:
    """``model`` with every projection's one-row form set to ``backend``
    (:func:`~mtp_jax.models.layers.basic.set_gemv_backend`; ``cfg.kernels.gemv``)."""
    module = nnx.merge(model.graphdef, model.params)
    set_gemv_backend(module, backend)
    graphdef, params = nnx.split(module)
    return dataclasses.replace(model, graphdef=graphdef, params=params)


def merged(model: LoadedQwen4Exp) -> LoadedQwen4Exp:
    """``model`` with the projections that read one input merged
    (:meth:`Qwen4ExpModel.merge_projections`): one GEMM per group in a step, where XLA runs
    small one-row projections as slow reduction kernels (docs/design.md, "Merged
    projections")."""
    module = nnx.merge(model.graphdef, model.params)
    module.merge_projections()
    graphdef, params = nnx.split(module)
    return dataclasses.replace(model, graphdef=graphdef, params=params)


def table_bytes(cfg: Qwen4ExpConfig, dtype: str | None) -> int:
    """Bytes of the PLE n-gram tables held in the model ``dtype`` (0 without PLE layers)."""
    itemsize = np.dtype(NP_DTYPES[resolve_dtype(dtype)]).itemsize
    return ple_table_bytes(cfg, itemsize) if cfg.ple_layers else 0


def ple_backend_for(cfg: Qwen4ExpConfig, dtype: str | None, asked: str | None) -> str:
    """The PLE backend a load with ``ple_backend=asked`` (``None`` or ``"auto"``: the default)
    uses: :func:`~mtp_jax.models.qwen4_exp.ple_device.choose_backend` over
    :func:`table_bytes`."""
    return choose_backend(asked, table_bytes(cfg, dtype))


def tensor_shapes(cfg: Qwen4ExpConfig, with_mtp: bool) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of the dense tensors (the PLE tables are not included)."""
    out = dict(names.target_tensors(cfg))
    if with_mtp:
        out.update(names.mtp_tensors(cfg))
    return out


def write_random(raw: dict, out_dir: str, *, dtype: str = "bfloat16", experts: str = "fused",
                 mtp_experts: str | None = None, include_mtp: bool = True,
                 shard_size_bytes: int = 2 << 30, seed: int = 0,
                 zero_rows_from: int | None = None, workers: int | None = None) -> str:
    """The family's random checkpoint (n-gram tables sharded as released), held in host memory
    and written as one ``model.safetensors``: small shapes only. Experts fused or per expert
    (``experts`` / ``mtp_experts``); ``zero_rows_from``: the tool's ``--tokenizer`` zeroes the
    logit rows past the tokenizer's ids (the tokenizer files are written by the tool)."""
    del workers  # one file, written from memory
    write_random_qwen4_exp(raw, out_dir, dtype=dtype, seed=seed, with_mtp=include_mtp,
                           experts=experts, mtp_experts=mtp_experts,
                           zero_rows_from=zero_rows_from, max_file_bytes=shard_size_bytes)
    return out_dir


def make_entry() -> ModelEntry:
    """The entry, with the slot states of :mod:`~mtp_jax.models.qwen4_exp.slot_states`
    checked (``ConfigError`` for one without a usable verify handler)."""
    return ModelEntry(
        model_type="qwen4_exp", hf_model_types=MODEL_TYPES, config_class=Qwen4ExpConfig,
        build=build, load=load, tensor_shapes=tensor_shapes, drafts=("mtp", "external"),
        slot_states=tuple(SlotState(s.name, s.description, s.handler)
                          for s in check_slot_states()),
        serving="rounds", kernel_ops=KERNEL_OPS, dummy_weight=True, draft_folder=False,
        load_options=(("ple_backend", PLE_CHOICES),), make_pools=make_qwen4_pools,
        write_random=write_random,
        # Its snapshots hold the PLE conv windows, n-gram context and QSA open index groups
        # too, which its prefill does not give at rows inside a chunk: prefill chunks end on
        # snapshot boundaries (the chunk's final states are saved there).
        prefill_snapshots=False)


ENTRY = make_entry()
