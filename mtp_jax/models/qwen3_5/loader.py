"""Load a Qwen3.5-family checkpoint (``qwen3_5``, ``qwen3_5_moe``) into a
:class:`~mtp_jax.models.loaded.LoadedModel`: the family's ``load`` of its registry entry.

The model is built abstractly, filled name for name from the safetensors reader (or random
weights), then its projections that read one input are merged (one GEMM per group; see
docs/design.md, "Merged projections") and the one-row projection backend is set. The research
programs (``forward``, ``mtp_forward``) run the model over a scratch paged KV and GDN state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.linear_state import LinearState
from mtp_jax.cache.paged import AttentionBatch, PagedKV
from mtp_jax.config import ConfigError, ModelConfig
from mtp_jax.kernels import KernelBackends
from mtp_jax.models.entry import LoadRequest
from mtp_jax.models.layers.basic import set_gemv_backend
from mtp_jax.models.quantized import apply_kept, kept_names, saved_bytes, split_kept
from mtp_jax.models.loaded import DTYPES, NP_DTYPES, LoadedModel
from mtp_jax.models.params import abstract_model, expected_tensors, fill_state, random_arrays
from mtp_jax.models.qwen3_5.model import Qwen35Model
from mtp_jax.weights.quant_config import keeps_quantized, quantization_from_folder
from mtp_jax.weights.safetensors_reader import load_tensors

__all__ = ["build", "load"]


def build(cfg: ModelConfig, dtype, with_mtp: bool) -> Qwen35Model:
    """The family's module: target and (with ``with_mtp``) the MTP draft."""
    return Qwen35Model(cfg, dtype, with_mtp=with_mtp)


def _scratch_batch(b: int, t: int, page_size: int = 16):
    """Pages 1.. for each row (page 0 is the trash page) and positions 0..T-1."""
    per_row = -(-t // page_size)
    table = 1 + jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return AttentionBatch(pos, jnp.ones((b, t), bool), table), 1 + b * per_row


def _forward_fn(graphdef, params, ids):
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b, t = ids.shape
    batch, num_pages = _scratch_batch(b, t)
    dtype = model.embed_tokens.weight.dtype
    kv = PagedKV.zeros(len(cfg.full_layer_ids), num_pages, 16, cfg.num_key_value_heads,
                       cfg.head_dim, dtype)
    gdn = LinearState.zeros(len(cfg.linear_layer_ids), b, cfg.linear_num_value_heads,
                            cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                            cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, dtype)
    hidden, _, _ = model(ids, batch, kv, gdn, "prefill")
    return model.logits(hidden), hidden


def _mtp_forward_fn(graphdef, params, hidden, next_ids):
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b, t = next_ids.shape
    batch, num_pages = _scratch_batch(b, t)
    dtype = model.embed_tokens.weight.dtype
    kv = PagedKV.zeros(cfg.mtp_num_hidden_layers, num_pages, 16, cfg.num_key_value_heads,
                       cfg.head_dim, dtype)
    z, _ = model.mtp(model.embed_tokens, hidden, next_ids, batch, kv)
    return model.logits(z), z


def _read_arrays(path: str, cfg: ModelConfig, expected: dict, request: LoadRequest,
                 keep=None) -> dict:
    """The checkpoint's tensors as device arrays in the expected dtypes (quantized ones
    dequantized, except the projections ``keep`` accepts: those come as
    :class:`~mtp_jax.weights.quant_tensors.KeptQuant`); the (small) draft from
    ``request.draft_path`` first, so its errors come before the target's weights are read. The
    draft folder is read under the target's quantization config."""
    shapes = {n: s for n, (s, _) in expected.items()}
    put = lambda a: jax.device_put(a, request.device)
    np_dtype = NP_DTYPES[request.dtype]
    if request.draft_path is None or not request.with_mtp:
        arrays = load_tensors(path, cfg, shapes, dtype=np_dtype, put=put,
                              include_mtp=request.with_mtp, keep_quantized=keep)
    else:
        target = {n: s for n, s in shapes.items() if not n.startswith("mtp.")}
        draft = {n: s for n, s in shapes.items() if n.startswith("mtp.")}
        quant = quantization_from_folder(path)  # the draft is read under the target's
        arrays = load_tensors(request.draft_path, cfg, draft, dtype=np_dtype, put=put,
                              include_mtp=True, only_mtp=True, desc="Loading draft",
                              quant=quant, keep_quantized=keep)
        arrays.update(load_tensors(path, cfg, target, dtype=np_dtype, put=put,
                                   include_mtp=False, quant=quant, keep_quantized=keep))
    # A few parameters (GDN A_log, dt_bias) are float32 whatever the model dtype.
    return {n: a if not hasattr(a, "astype") or a.dtype == expected[n][1]
            else a.astype(expected[n][1]) for n, a in arrays.items()}


def load(path: str | None, cfg: ModelConfig, request: LoadRequest) -> LoadedModel:
    """Build and fill the model (``request``: :class:`~mtp_jax.models.entry.LoadRequest`,
    already checked against the family's entry). Raises ``ConfigError`` for a kernel backend
    that cannot run, ``CheckpointError`` for bad files (before any tensor data is read)."""
    dtype, with_mtp = request.dtype, request.with_mtp
    if with_mtp and not cfg.has_mtp:  # a separate draft folder supplies the layer
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=1)
    b = request.backend_choices
    cfg = dataclasses.replace(cfg, kernels=KernelBackends.for_model(
        cfg, dtype, attention_backend=b.get("attention", "auto"),
        gdn_backend=b.get("gdn", "auto"), moe_backend=b.get("moe", "auto"),
        norm_backend=b.get("norm", "auto"), gemv_backend=b.get("gemv", "auto")))
    if cfg.kernels.gemv == "fused" and not request.merge_projections:
        raise ConfigError("gemv_backend 'fused' runs on the MLPs' merged gate/up projection, but "
                          "merge_projections is False (the bench's --no-merge-projections); "
                          "merge them or use --gemv-backend reduce.")
    graphdef, abstract = abstract_model(build, cfg, DTYPES[dtype], with_mtp)
    expected = expected_tensors(abstract)
    keep = (kept_names(nnx.merge(graphdef, abstract))
            if keeps_quantized(request.quantization) else frozenset())
    arrays = (random_arrays(expected, request.seed) if request.dummy_weight
              else _read_arrays(path, cfg, expected, request, keep.__contains__))
    arrays, kept = split_kept(arrays)
    params = fill_state(abstract, arrays)
    del arrays
    saved = 0
    if kept or request.merge_projections or cfg.kernels.gemv != "xla":
        # Only the module refers to the weights from here, so each group's old weights are
        # freed as soon as its merged copy exists: the peak is one group above the model.
        module = nnx.merge(graphdef, params)
        del params
        apply_kept(module, kept)
        del kept
        if request.merge_projections:
            module.merge_projections()
        set_gemv_backend(module, cfg.kernels.gemv)
        saved = saved_bytes(module)
        graphdef, params = nnx.split(module)
    return LoadedModel(cfg=cfg, dtype=dtype, graphdef=graphdef, params=params, has_mtp=with_mtp,
                       pack_small_params=request.pack_small_params, weight_bytes_saved=saved,
                       # Jitted per model: their compilations go with it.
                       forward_program=jax.jit(_forward_fn, static_argnums=(0,)),
                       mtp_forward_program=jax.jit(_mtp_forward_fn, static_argnums=(0,)))
