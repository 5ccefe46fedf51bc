"""Which implementation runs each hot op: the XLA reference, the Pallas kernel or (one-row
projections) XLA's multiply-reduce form.

One switch per op (``--attention-backend``, ``--gdn-backend``, ``--moe-backend``,
``--norm-backend``, ``--gemv-backend``), each
``"xla"``, ``"pallas"`` or ``"auto"`` (``gemv`` also takes ``"reduce"``, XLA's multiply-reduce
form of one-row projections, and ``"fused"``, ``reduce`` with a dense MLP's norm, gate/up and
SwiGLU as one kernel: :data:`EXTRA_CHOICES`). ``auto`` picks the Pallas kernel where it
has been checked and measured faster (the ops in :data:`AUTO_PALLAS_ON_GPU`, on a GPU), the
choice in :data:`AUTO_ON_GPU` for the others that have one, the norm kernel for hidden sizes up
to :data:`AUTO_NORM_MAX_HIDDEN`, and XLA elsewhere; the Pallas
kernels use the Triton lowering and need a CUDA GPU.

The choice is static: it is stored in the model config and read by the layers when a program
is traced, so two choices never share a compiled program.
"""

from __future__ import annotations

import dataclasses

from mtp_jax.config import ConfigError

OPS = ("attention", "gdn", "moe", "norm", "gemv")
CHOICES = ("auto", "xla", "pallas")
EXTRA_CHOICES = {"gemv": ("reduce", "fused")}
# attention: measured faster on the H200 in the 2B and 27B decode steps and the 2B k = 3 round,
# neutral in the 35B-A3B step (docs/benchmarks.md, session 12).
AUTO_PALLAS_ON_GPU: tuple[str, ...] = ("gdn", "moe", "attention")
# The fused add + RMSNorm kernel gains at hidden size 2048 (2B -0.07 ms, 35B-A3B -0.09 ms per
# decode step) and loses at 5120 (27B +0.38 ms), so auto takes it up to this size only.
AUTO_NORM_MAX_HIDDEN = 2048
# Measured faster on the H200 than XLA's dot on every one-row projection shape with K <= 8192
# (pallas_kernels/gemv/reduce_form.py; docs/benchmarks.md, session 11).
AUTO_ON_GPU = {"gemv": "reduce"}
SIXTEEN_BIT_ONLY = ("attention", "moe")
OP_DESCRIPTIONS = {"attention": "paged attention (decode/verify rows)",
                   "gdn": "the GDN decode/verify/commit step form",
                   "moe": "the MoE experts and router",
                   "norm": "the decoder layers' residual add + RMSNorm (qwen4_exp: the "
                           "hyper-connections' inject, norms and mix)",
                   "gemv": "the projections and LM head of one-row calls (batch-1 decode with "
                           "speculation off; batch-1 MTP draft steps)"}
EXPERIMENTAL = {
    "gemv": "pallas is experimental: slower than reduce on every shape measured; fused is "
            "experimental: the 2B decode step -0.016 ms on one H200 and +0.024 ms on another "
            "(docs/benchmarks.md)"}
NOTES = {"norm": "qwen4_exp: pallas = its hyper-connections as two Triton kernels a block, auto "
                 "= xla there (no faster in the engine, slower above one row)",
         "gemv": "reduce = XLA's multiply-reduce form of one-row calls with K <= 8192 (XLA's "
                 "GEMM for the others); pallas = a Triton kernel for one-row calls with >= 4096 "
                 "output columns, and for projections kept quantized (--quantization keep) a "
                 "Triton kernel that dequantizes as it reads, for calls of up to 8 rows; "
                 "fused = reduce, with each one-row dense MLP's residual add + "
                 "norm, gate/up projection and SwiGLU as one Triton kernel (qwen3_5; merged "
                 "projections); qwen4_exp takes xla and reduce only"}


def choices_of(op: str) -> tuple[str, ...]:
    """The values ``--<op>-backend`` takes."""
    return CHOICES + EXTRA_CHOICES.get(op, ())


def _either(items: list[str], word: str = "or") -> str:
    """``["a", "b", "c"]`` -> ``"a, b or c"`` (``word="and"``: ``"a, b and c"``)."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {word} " + items[-1]


def add_backend_flags(parser) -> None:
    """Add ``--<op>-backend`` (default ``auto``) for every op in :data:`OPS` to an argparse
    parser, with :func:`backend_help` as help."""
    for op in OPS:
        parser.add_argument(f"--{op}-backend", default="auto", choices=list(choices_of(op)),
                            help=backend_help(op))


def backend_help(op: str) -> str:
    """The ``--<op>-backend`` help text: what the op is and what ``auto`` picks."""
    where = "on a GPU in 16-bit dtypes" if op in SIXTEEN_BIT_ONLY else "on a GPU"
    if op in AUTO_PALLAS_ON_GPU:
        auto = f"auto = pallas {where}, else xla"
    elif op == "norm":
        auto = (f"auto = pallas on a GPU for hidden sizes up to {AUTO_NORM_MAX_HIDDEN} "
                "(measured faster there, slower at 5120), else xla")
    elif op in AUTO_ON_GPU:
        auto = f"auto = {AUTO_ON_GPU[op]} {where}, else xla"
    else:  # no op takes this branch today; a new op starts here until it is measured
        auto = "auto = xla (the kernel is not measured faster yet)"
    notes = [n[op] for n in (NOTES, EXPERIMENTAL) if op in n]
    labels = {"pallas": "pallas (GPU kernels)", "fused": "fused (a GPU kernel)"}
    kinds = _either([labels.get(c, c) for c in choices_of(op) if c != "auto"])
    return f"implementation of {OP_DESCRIPTIONS[op]}: {kinds}; " + "; ".join([auto, *notes])


@dataclasses.dataclass(frozen=True)
class KernelBackends:
    """Resolved backends (``"xla"`` or ``"pallas"``) of the attention, GDN and MoE ops, of
    the decoder layers' residual add + RMSNorm (``norm``) and of the projections of one-row
    calls (``gemv``: also ``"reduce"``)."""

    attention: str = "xla"
    gdn: str = "xla"
    moe: str = "xla"
    norm: str = "xla"
    gemv: str = "xla"

    @classmethod
    def resolve(cls, attention: str | None = "auto", gdn: str | None = "auto",
                moe: str | None = "auto", platform: str | None = None,
                dtype: str | None = None,
                gdn_dims: tuple[int, int, int] | None = None,
                norm: str | None = "auto",
                hidden_size: int | None = None,
                gemv: str | None = "auto",
                head_dim: int | None = None,
                dense_mlp: bool | None = None) -> "KernelBackends":
        """Validate the user's choices and resolve ``auto``.

        ``platform``: the JAX backend (``"gpu"``, ``"cpu"``; default: ``jax.default_backend()``).
        ``dtype``: the model dtype when known; the attention and MoE kernels' tiles are sized
        for 16-bit weights and K/V (float32 ones exceed the H200's shared memory), so ``auto``
        takes XLA for them in float32.
        ``gdn_dims``: the model's ``(linear_key_head_dim, linear_value_head_dim, conv width)``
        when known; sizes the fused GDN kernels cannot take make ``auto`` take XLA for GDN.
        ``hidden_size``: the model's, when known; checked against the norm kernel's pieces.
        ``head_dim``: the attention heads', when known; the attention kernel needs a power of
        two (``auto`` takes XLA otherwise).
        ``dense_mlp``: whether the model's MLPs are dense (not mixture-of-experts), when known;
        ``gemv`` ``fused`` fuses a dense MLP's norm, gate/up and SwiGLU, so it is refused for
        MoE models rather than silently taken as ``reduce``.
        On a GPU ``auto`` takes the norm kernel for a known ``hidden_size`` up to
        :data:`AUTO_NORM_MAX_HIDDEN` (XLA otherwise) and :data:`AUTO_ON_GPU` for ``gemv``.
        Raises ConfigError for an unknown choice, ``pallas`` or ``fused`` without a GPU, a
        16-bit-only kernel asked for with float32, the GDN or norm kernels asked for with sizes
        they cannot take, or ``fused`` for a model without dense MLPs.
        """
        chosen = {"attention": attention, "gdn": gdn, "moe": moe, "norm": norm, "gemv": gemv}
        for op, value in chosen.items():
            if value is None:
                chosen[op] = value = "auto"
            if value not in choices_of(op):
                raise ConfigError(f"{op}_backend {value!r} is unknown; use one of "
                                  f"{', '.join(choices_of(op))} (--{op}-backend).")
        if platform is None:
            import jax

            platform = jax.default_backend()
        on_gpu = platform in ("gpu", "cuda")
        out = {}
        for op, value in chosen.items():
            if value in ("pallas", "fused") and not on_gpu:
                others = _either([c for c in choices_of(op)
                                  if c not in ("pallas", "fused", "auto")] + ["auto"])
                raise ConfigError(f"{op}_backend {value!r} needs a CUDA GPU (the kernels use the "
                                  f"Pallas Triton lowering) but JAX runs on {platform!r}; use "
                                  f"--{op}-backend {others}.")
            wide = dtype == "float32" and op in SIXTEEN_BIT_ONLY
            if value == "pallas" and wide:
                raise ConfigError(f"{op}_backend 'pallas' needs 16-bit weights (its tiles are "
                                  "sized for bfloat16/float16) but dtype is float32; use "
                                  f"--{op}-backend xla or --dtype bfloat16.")
            misfit = _gdn_misfit(gdn_dims) if op == "gdn" and on_gpu else None
            if op == "attention" and head_dim is not None and head_dim & (head_dim - 1):
                misfit = f"head_dim {head_dim} is not a power of two"
                if value == "pallas":
                    raise ConfigError(f"attention_backend 'pallas' cannot run this model: "
                                      f"{misfit} (the Triton kernel's tiles); use "
                                      "--attention-backend xla or auto.")
            if value == "pallas" and misfit:
                raise ConfigError(f"gdn_backend 'pallas' cannot run this model: {misfit} (the "
                                  "Triton kernels need power-of-two blocks); use --gdn-backend "
                                  "xla or auto.")
            if value == "pallas" and op == "norm" and _norm_misfit(hidden_size):
                raise ConfigError(f"norm_backend 'pallas' cannot run this model: hidden_size "
                                  f"{hidden_size} is not 1 to 8 power-of-two pieces of 16 to "
                                  "4096 columns; use --norm-backend xla or auto.")
            if value == "auto" and on_gpu and op in AUTO_ON_GPU:
                value = AUTO_ON_GPU[op]
            if value == "auto" and op == "norm":
                value = ("pallas" if on_gpu and hidden_size is not None
                         and hidden_size <= AUTO_NORM_MAX_HIDDEN
                         and not _norm_misfit(hidden_size) else "xla")
            if value == "auto":
                value = ("pallas" if on_gpu and op in AUTO_PALLAS_ON_GPU and not wide
                         and not misfit else "xla")
            out[op] = value
        if out["gemv"] == "fused" and dense_mlp is False:
            raise ConfigError("gemv_backend 'fused' fuses a dense MLP's residual add + norm, "
                              "gate/up projection and SwiGLU, but this model's MLPs are "
                              "mixture-of-experts; use --gemv-backend reduce or auto.")
        return cls(**out)

    @classmethod
    def for_model(cls, cfg, dtype: str | None, *, attention_backend: str = "auto",
                  gdn_backend: str = "auto", moe_backend: str = "auto",
                  norm_backend: str = "auto", gemv_backend: str = "auto") -> "KernelBackends":
        """:meth:`resolve` with a model config's sizes (its GDN head sizes and hidden size) and
        ``dtype``; the keywords are ``load_model``'s. Raises ConfigError as :meth:`resolve`."""
        return cls.resolve(attention_backend, gdn_backend, moe_backend, dtype=dtype,
                           gdn_dims=gdn_dims_of(cfg), norm=norm_backend,
                           hidden_size=cfg.hidden_size, gemv=gemv_backend,
                           head_dim=getattr(cfg, "head_dim", None),
                           dense_mlp=not getattr(cfg, "is_moe", False))


def check_kernel_ops(model_type: str, kernel_ops: tuple[str, ...], chosen: dict) -> None:
    """Refuse a non-XLA choice (``pallas``, ``reduce``, ``fused``) in ``chosen`` (``{op:
    choice}``) for an op outside ``kernel_ops``, the ops whose GPU kernels the family
    ``model_type`` can run: ConfigError naming the op and saying the family runs it on XLA.
    ``None``, ``auto`` and ``xla`` pass (``auto`` is XLA there)."""
    asked = [(op, v) for op, v in sorted(chosen.items())
             if op not in kernel_ops and v not in (None, "auto", "xla")]
    if not asked:
        return
    ops = _either([op for op, _ in asked])
    kernels = (f"its GPU kernels run {_either(list(kernel_ops), 'and')} only" if kernel_ops
               else "it runs the XLA kernels only for now")
    raise ConfigError(
        f"{model_type} runs {ops} on XLA ({kernels}), but "
        + ", ".join(f"{op}_backend {v!r}" for op, v in asked) + " was asked for; use "
        + " and ".join(f"--{op}-backend xla" for op, _ in asked) + " (or auto).")


def _norm_misfit(hidden_size: int | None) -> bool:
    if hidden_size is None:
        return False
    from pallas_kernels.norm import chunk_of

    return chunk_of(hidden_size) is None


def _gdn_misfit(gdn_dims) -> str | None:
    if gdn_dims is None:
        return None
    from pallas_kernels.gdn.fused import unsupported_shape

    return unsupported_shape(*gdn_dims)


def gdn_dims_of(cfg) -> tuple[int, int, int] | None:
    """``(Dk, Dv, conv width)`` of a model config with GDN layers, else ``None``."""
    if "linear_attention" not in getattr(cfg, "layer_types", ()):
        return None
    return cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_dim


def kernels_of(cfg) -> KernelBackends:
    """The backends stored in a model config (XLA for configs that carry none)."""
    return getattr(cfg, "kernels", None) or KernelBackends()
