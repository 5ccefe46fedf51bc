"""Which kernels a qwen4_exp (Qwen3.8-Flash-Next) load runs: the GDN and MoE Pallas (Triton)
kernels on a GPU, the hyper-connection kernels when asked for, XLA for everything else.

Its GDN layers and MoE blocks are the shared ones (:mod:`mtp_jax.models.layers.gdn`,
:class:`~mtp_jax.models.layers.mlp.SparseMoE`), so ``--gdn-backend pallas`` and
``--moe-backend pallas`` run the kernels the Qwen3.5 family runs. ``auto`` takes them on a GPU
where :meth:`KernelBackends.resolve` would for Qwen3.5 (16-bit MoE weights, GDN head sizes the
fused kernels take) and the MoE tiles fit (:func:`moe_misfit`): measured on the H200 at the
Flash-Next shape cut to 8 layers / 64 experts (docs/benchmarks.md, session 33), 596 against
573 tokens/s at batch 1 and 2,321 against 942 at batch 8. ``--norm-backend`` picks the
hyper-connections' inject, norms and mix (:mod:`pallas_kernels.hyper`: two Triton kernels a
block for calls of up to 8 rows). ``--gemv-backend`` picks the form of one-row projections:
``auto`` is ``reduce`` on a GPU (XLA's multiply-reduce form, as for Qwen3.5: the GDN and QSA
projections here have the Qwen3.5-4B's input width, 2560, where that form is the measured
default; :mod:`pallas_kernels.gemv`), ``xla`` XLA's GEMM; the experimental Triton GEMV and the
``fused`` dense-MLP kernel are refused. QSA attention has no kernel in this family: ``pallas``
for it is refused.
"""

from __future__ import annotations

import dataclasses

from mtp_jax.config import ConfigError
from mtp_jax.kernels import KernelBackends, check_kernel_ops, gdn_dims_of
from pallas_kernels.hyper import unsupported as hyper_unsupported

__all__ = ["KERNEL_OPS", "hyper_misfit", "resolve_kernels"]

KERNEL_OPS = ("gdn", "moe", "norm", "gemv")  # the registry entry's kernel_ops
# Whether ``auto`` takes the hyper-connection kernels on a GPU: no; on an H100 they won 9% a mix
# at one row but nothing in the engine, and lost at 4 and 8 rows (docs/benchmarks.md, session 37).
AUTO_HYPER_ON_GPU = False


def hyper_misfit(cfg) -> str | None:
    """Why the hyper-connection kernels cannot take ``cfg`` (the value and the rule), or
    ``None`` when they can (:func:`pallas_kernels.hyper.unsupported`)."""
    return hyper_unsupported(1, cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank)


def moe_misfit(cfg) -> str | None:
    """Why the MoE kernels cannot take ``cfg``'s experts, or ``None`` when they can: their
    tiles are powers of two >= 16 dividing the hidden and expert intermediate sizes."""
    for name in ("hidden_size", "moe_intermediate_size"):
        if getattr(cfg, name) % 16:
            return f"{name} {getattr(cfg, name)} is not a multiple of 16"
    return None


def resolve_kernels(cfg, dtype: str | None, backends: dict | None = None,
                    platform: str | None = None) -> KernelBackends:
    """The :class:`~mtp_jax.kernels.KernelBackends` of a qwen4_exp load: for ``gdn`` / ``moe``
    the choice in ``backends`` (``{op: choice}``, ``load_model``'s ``*_backend`` arguments),
    ``auto`` resolved as :meth:`KernelBackends.resolve` does (``pallas`` on a GPU where the
    kernels take the model) but XLA where the MoE tiles do not fit; for ``norm`` (the
    hyper-connection kernels) ``auto`` is ``pallas`` on a GPU where :func:`hyper_misfit` is
    ``None`` and :data:`AUTO_HYPER_ON_GPU` is set; for ``gemv`` ``auto`` is ``reduce`` on a
    GPU (:data:`mtp_jax.kernels.AUTO_ON_GPU`); ``xla`` for every other op. ``platform``: as
    :meth:`KernelBackends.resolve` (default: JAX's).

    Raises ConfigError for a non-XLA choice for another op (naming it), for ``gemv``
    ``pallas`` or ``fused``, and for ``pallas``
    where :meth:`KernelBackends.resolve` refuses it (no GPU, float32 MoE, GDN head sizes the
    fused kernels cannot take), the MoE kernels cannot tile the experts or the
    hyper-connection kernels cannot take the shape."""
    chosen = {op: v for op, v in (backends or {}).items() if v is not None}
    check_kernel_ops(cfg.model_type, KERNEL_OPS, chosen)
    pick = {op: chosen.get(op, "auto") for op in KERNEL_OPS}
    misfit = moe_misfit(cfg)
    if pick["moe"] == "pallas" and misfit:
        raise ConfigError(f"moe_backend 'pallas' cannot run this model: {misfit} (the Triton "
                          "kernels' tiles); use --moe-backend xla or auto.")
    if pick["moe"] == "auto" and misfit:
        pick["moe"] = "xla"  # auto takes what runs
    hyper = hyper_misfit(cfg)
    if pick["gemv"] in ("pallas", "fused"):
        why = {"pallas": "the experimental Triton GEMV is not wired into this family",
               "fused": "it fuses a dense MLP; qwen4_exp has mixture-of-experts blocks only"}
        raise ConfigError(f"gemv_backend {pick['gemv']!r} is not supported for qwen4_exp "
                          f"({why[pick['gemv']]}); use gemv_backend='reduce', 'xla' or 'auto' "
                          "(--gemv-backend reduce, xla or auto).")
    if pick["norm"] == "pallas" and hyper:
        raise ConfigError(f"norm_backend 'pallas' cannot run this model: {hyper}; use "
                          "--norm-backend xla or auto.")
    out = KernelBackends.resolve("xla", pick["gdn"], pick["moe"], platform=platform,
                                 dtype=dtype, gdn_dims=gdn_dims_of(cfg),
                                 norm="xla" if hyper else pick["norm"],
                                 hidden_size=None, gemv=pick["gemv"], dense_mlp=False)
    if pick["norm"] == "auto" and AUTO_HYPER_ON_GPU and not hyper and _on_gpu(platform):
        out = dataclasses.replace(out, norm="pallas")
    return out


def _on_gpu(platform: str | None) -> bool:
    if platform is None:
        import jax

        platform = jax.default_backend()
    return platform in ("gpu", "cuda")
