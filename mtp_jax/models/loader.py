"""Build a model, fill it from a checkpoint folder (or random weights), and the research API.

``load_model(path, dtype)`` returns a :class:`LoadedModel` whose ``forward`` and
``mtp_forward`` are jit-able functions of token ids and hidden states (no cache to manage).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mtp_jax.cache.linear_state import LinearState
from mtp_jax.cache.paged import AttentionBatch, PagedKV
from mtp_jax.checks import check_before_load, check_draft_folder  # noqa: F401 (re-export)
from mtp_jax.config import ConfigError, ModelConfig, SpecConfig
from mtp_jax.kernels import KernelBackends
from mtp_jax.models.layers.basic import set_gemv_backend
from mtp_jax.models.registry import model_spec
from mtp_jax.weights.safetensors_reader import load_tensors

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def resolve_dtype(dtype: str | None) -> str:
    """``None``/``"auto"``: bfloat16 on an accelerator, float32 on CPU."""
    if dtype in (None, "auto"):
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    name = getattr(jnp.dtype(dtype), "name", str(dtype)) if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ConfigError(f"dtype (--dtype) {dtype!r} is not supported; use auto (bfloat16 on a "
                          "GPU, float32 on CPU), bfloat16, float16 or float32.")
    return name


def param_name(path) -> str:
    return ".".join(str(p) for p in path)


def abstract_model(cfg: ModelConfig, dtype: str, with_mtp: bool):
    """``(graphdef, abstract state)`` of the model, no memory allocated."""
    spec = model_spec(cfg)
    module = nnx.eval_shape(lambda: spec.build(cfg, DTYPES[dtype], with_mtp))
    return nnx.split(module)


def expected_tensors(abstract_state) -> dict[str, tuple[tuple[int, ...], object]]:
    """Canonical name -> (shape, dtype) of every parameter."""
    return {param_name(p): (tuple(v.shape), v.dtype)
            for p, v in nnx.to_flat_state(abstract_state)}


def fill_state(abstract_state, arrays: dict[str, jax.Array]):
    """Replace every abstract parameter by ``arrays[name]``."""
    flat = [(p, v.replace(arrays[param_name(p)])) for p, v in nnx.to_flat_state(abstract_state)]
    return nnx.from_flat_state(flat)


def random_arrays(expected, seed: int = 0) -> dict[str, jax.Array]:
    """Random weights (``--dummy-weight``), drawn on the device one tensor at a time: matrices
    ``N(0, 1/fan_in)`` (embeddings ``N(0, 1)``), zero-centred norms ``N(0, 0.02)``, the GDN
    output norm ones, ``A_log = log U(1, 16)``, ``dt_bias ~ U(-1, 1) / 2``."""
    key = jax.random.key(seed)
    out = {}
    for i, (name, (shape, dtype)) in enumerate(sorted(expected.items())):
        k = jax.random.fold_in(key, i)
        if name.endswith("A_log"):
            a = jnp.log(jax.random.uniform(k, shape, jnp.float32, 1.0, 16.0))
        elif name.endswith("dt_bias"):
            a = jax.random.uniform(k, shape, jnp.float32, -0.5, 0.5)
        elif name.endswith("linear_attn.norm.weight"):
            a = jnp.ones(shape, jnp.float32)
        elif len(shape) == 1:
            a = 0.02 * jax.random.normal(k, shape, jnp.float32)
        else:
            std = 1.0 if "embed_tokens" in name else shape[-1] ** -0.5
            a = std * jax.random.normal(k, shape, dtype)
        out[name] = a.astype(dtype)
    return out


@dataclasses.dataclass
class LoadedModel:
    """A model with its parameters.

    Attributes:
      cfg: the :class:`ModelConfig`.
      dtype: ``"float32" | "bfloat16" | "float16"``.
      graphdef, params: the split nnx model; programs take ``params`` and merge inside jit.
      has_mtp: whether the ``mtp.*`` draft was loaded.
      pack_small_params: the engine's programs take the small parameters packed into one
        buffer per dtype (:mod:`mtp_jax.engine.param_packing`; fewer argument buffers per
        call) instead of one buffer each.
    """

    cfg: ModelConfig
    dtype: str
    graphdef: object
    params: object
    has_mtp: bool
    pack_small_params: bool = False

    @functools.cached_property
    def _packing(self):
        from mtp_jax.engine.param_packing import ParamPacking

        return ParamPacking.plan(self.params) if self.pack_small_params else None

    @functools.cached_property
    def programs(self):
        """The engine's compiled programs for this model (shared by every engine on it)."""
        from mtp_jax.engine.programs import make_programs

        return make_programs(self.graphdef, self.params, self._packing)

    @functools.cached_property
    def param_leaves(self) -> tuple:
        """The programs' parameter arguments: the leaves, or their packed form."""
        leaves = tuple(jax.tree_util.tree_leaves(self.params))
        return leaves if self._packing is None else self._packing.pack(leaves)

    def module(self, params=None):
        return nnx.merge(self.graphdef, self.params if params is None else params)

    @functools.cached_property
    def _forward(self):
        return jax.jit(_forward_fn, static_argnums=(0,))

    @functools.cached_property
    def _mtp_forward(self):
        return jax.jit(_mtp_forward_fn, static_argnums=(0,))

    def forward(self, input_ids, params=None):
        """Full forward without a cache.

        Args: ``input_ids [B, T]`` int; ``params``: a pytree shaped like :attr:`params` to run
        with instead (e.g. the argument of your own ``jax.jit`` or ``jax.grad`` function:
        ``jax.jit(lambda p, ids: m.forward(ids, params=p))``; a function that closes over
        ``m.params`` instead bakes them into its program as constants).
        Returns: ``(logits [B, T, V] float32, hidden_states [B, T, H])``, hidden after the final
        norm (what the LM head reads), in the model dtype.
        """
        ids = jnp.asarray(input_ids, jnp.int32)
        if ids.ndim != 2:
            raise ValueError(f"forward takes input_ids [B, T]; got shape {ids.shape}. Add a batch "
                             "axis (e.g. ids[None]).")
        return self._forward(self.graphdef, self.params if params is None else params, ids)

    def mtp_forward(self, hidden_states, next_token_ids, params=None):
        """Teacher-forced MTP draft rows at positions ``0..T-1``.

        Args: ``hidden_states [B, T, H]`` (target hidden after the final norm, or a previous
        ``mtp_hidden`` row for a chained step), ``next_token_ids [B, T]`` (token t+1 per row),
        ``params`` as for :meth:`forward`.
        Returns: ``(logits [B, T, V] float32, mtp_hidden [B, T, H])`` (``mtp_hidden`` after
        ``mtp.norm``). Raises ``ValueError`` when the model was loaded without its draft.
        """
        if not self.has_mtp:
            raise ValueError("this model was loaded without its mtp.* draft; use "
                             "load_model(path, with_mtp=True).")
        hidden = jnp.asarray(hidden_states)
        nxt = jnp.asarray(next_token_ids, jnp.int32)
        if hidden.ndim != 3 or nxt.shape != hidden.shape[:2]:
            raise ValueError(f"mtp_forward takes hidden_states [B, T, H] and next_token_ids "
                             f"[B, T]; got {hidden.shape} and {nxt.shape}.")
        return self._mtp_forward(self.graphdef, self.params if params is None else params,
                                 hidden, nxt)


def _merge_projections(module) -> None:
    """Merge the model's projections in place (models without ``merge_projections``: none)."""
    merge = getattr(module, "merge_projections", None)
    if merge is not None:
        merge()


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


def load_model(path: str | None = None, dtype: str | None = "auto", *, with_mtp: bool = True,
               dummy_weight: bool = False, seed: int = 0, cfg: ModelConfig | None = None,
               device=None, draft_path: str | None = None, attention_backend: str = "auto",
               gdn_backend: str = "auto", moe_backend: str = "auto",
               merge_projections: bool = True, pack_small_params: bool = False,
               norm_backend: str = "auto", gemv_backend: str = "auto") -> LoadedModel:
    """Load a Qwen3.5-family checkpoint folder.

    Args:
      path: HF checkpoint folder (``config.json`` + ``*.safetensors``).
      dtype: ``"auto"`` (bf16 on GPU, f32 on CPU), ``"bfloat16"``, ``"float16"``, ``"float32"``.
      with_mtp: also load the ``mtp.*`` draft (only when the config declares an MTP layer).
      dummy_weight: random weights instead of the checkpoint's (for benchmarks/tests).
      draft_path: a separate folder to read the ``mtp.*`` tensors from (default: ``path``).
      attention_backend, gdn_backend, moe_backend: ``"auto"``, ``"xla"`` or ``"pallas"``, the
        implementation of paged attention, the GDN decode/verify/commit step form and the MoE
        experts and router (:class:`mtp_jax.kernels.KernelBackends`; on a GPU ``auto`` takes
        the kernels, the attention and MoE ones in 16-bit dtypes only, and XLA for GDN layers
        whose head sizes the kernels cannot take).
      norm_backend: the same for the decoder layers' residual add + RMSNorm
        (:mod:`pallas_kernels.norm`; on a GPU ``auto`` takes the kernel for hidden sizes up to
        :data:`mtp_jax.kernels.AUTO_NORM_MAX_HIDDEN`, XLA above).
      gemv_backend: the same for the projections (and LM head) of one-row calls
        (:mod:`pallas_kernels.gemv`: ``xla``, ``reduce``, ``pallas`` or ``fused``: ``reduce``
        with each one-row dense MLP's add + norm, gate/up and SwiGLU as one kernel,
        :mod:`pallas_kernels.gemv.norm_gemv`, needing merged projections; ``auto`` takes
        ``reduce`` on a GPU, else XLA).
      merge_projections: after loading, stack the projections that read one input into one
        matrix each (``Qwen35Model.merge_projections``: one GEMM per group, faster decode);
        ``False`` keeps one parameter per checkpoint tensor, under its canonical name.
      pack_small_params: the engine's programs take the small parameters (norm weights)
        packed into one buffer per dtype (:attr:`LoadedModel.pack_small_params`); experimental,
        for an A/B of the host cost per argument buffer (``bench --pack-small-params``).
    Raises:
      ConfigError: bad config (before any tensor is read; see :mod:`mtp_jax.checks`);
      CheckpointError: bad files or missing/unexpected tensors (before any tensor data is read,
      the draft's before the target's).
    """
    # The choices are checked first, before the model family or its files are looked at.
    KernelBackends.resolve(attention_backend, gdn_backend, moe_backend, norm=norm_backend,
                           gemv=gemv_backend)
    if cfg is None and path is not None:  # qwen4_exp: its own loader (PLE tables stay on host)
        from mtp_jax.models.qwen4_exp.config import folder_is_qwen4_exp

        if folder_is_qwen4_exp(path):
            asked = {f"{op}_backend": v for op, v in (
                ("attention", attention_backend), ("gdn", gdn_backend), ("moe", moe_backend),
                ("norm", norm_backend), ("gemv", gemv_backend)) if v not in (None, "auto", "xla")}
            if asked:  # auto: XLA for this family (its loader sets no kernel backend)
                raise ConfigError(f"qwen4_exp runs the XLA kernels only for now, but {asked} "
                                  "was asked for; use the xla (or auto) backends.")
            from mtp_jax.models.qwen4_exp.loader import load_via_load_model

            return load_via_load_model(path, dtype, with_mtp=with_mtp, dummy_weight=dummy_weight,
                                       draft_path=draft_path)
    if cfg is None:
        from mtp_jax.checks import read_model_config

        cfg = read_model_config(path, mtp=with_mtp)
    with_mtp = with_mtp and (cfg.has_mtp or draft_path is not None)
    spec = SpecConfig(algorithm="mtp" if with_mtp else "none", draft_model_path=draft_path)
    cfg = check_before_load(path, spec=spec, cfg=cfg, dummy_weight=dummy_weight,
                            dummy_draft_ok=True)
    dtype = resolve_dtype(dtype)
    if path is None and not dummy_weight:
        raise ConfigError("load_model needs a checkpoint path to read weights from (or "
                          "dummy_weight=True with a cfg).")
    if with_mtp and draft_path is not None and not dummy_weight:
        from mtp_jax.weights.hub import download_repo

        if not os.path.exists(draft_path):  # a repo id (check_before_load refused other paths)
            draft_path = download_repo(draft_path)
            check_draft_folder(cfg, draft_path)
    if with_mtp and not cfg.has_mtp:
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=1)
    cfg = dataclasses.replace(cfg, kernels=KernelBackends.for_model(
        cfg, dtype, attention_backend=attention_backend, gdn_backend=gdn_backend,
        moe_backend=moe_backend, norm_backend=norm_backend, gemv_backend=gemv_backend))
    if cfg.kernels.gemv == "fused" and not merge_projections:
        raise ConfigError("gemv_backend 'fused' runs on the MLPs' merged gate/up projection, but "
                          "merge_projections is False (the bench's --no-merge-projections); "
                          "merge them or use --gemv-backend reduce.")
    graphdef, abstract = abstract_model(cfg, dtype, with_mtp)
    expected = expected_tensors(abstract)
    if dummy_weight:
        arrays = random_arrays(expected, seed)
    else:
        shapes = {n: s for n, (s, _) in expected.items()}
        put = lambda a: jax.device_put(a, device)
        if draft_path is None or not with_mtp:
            arrays = load_tensors(path, cfg, shapes, dtype=_NP_DTYPES[dtype], put=put,
                                  include_mtp=with_mtp)
        else:
            # The (small) draft first: its errors come before the target's weights are read.
            target = {n: s for n, s in shapes.items() if not n.startswith("mtp.")}
            draft = {n: s for n, s in shapes.items() if n.startswith("mtp.")}
            arrays = load_tensors(draft_path, cfg, draft, dtype=_NP_DTYPES[dtype], put=put,
                                  include_mtp=True, only_mtp=True, desc="Loading draft")
            arrays.update(load_tensors(path, cfg, target, dtype=_NP_DTYPES[dtype], put=put,
                                       include_mtp=False))
        # A few parameters (GDN A_log, dt_bias) are float32 whatever the model dtype.
        arrays = {n: a if a.dtype == expected[n][1] else a.astype(expected[n][1])
                  for n, a in arrays.items()}
    params = fill_state(abstract, arrays)
    del arrays
    if merge_projections or cfg.kernels.gemv != "xla":
        # Only the module refers to the weights from here, so each group's old weights are
        # freed as soon as its merged copy exists: the peak is one group above the model.
        module = nnx.merge(graphdef, params)
        del params
        if merge_projections:
            _merge_projections(module)
        set_gemv_backend(module, cfg.kernels.gemv)
        graphdef, params = nnx.split(module)
    return LoadedModel(cfg=cfg, dtype=dtype, graphdef=graphdef, params=params, has_mtp=with_mtp,
                       pack_small_params=pack_small_params)
