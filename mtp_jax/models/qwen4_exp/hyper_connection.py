"""Hyper-connections ("Gated Residual") of qwen4_exp: ``hc_count`` residual streams.

The residual ``h [..., hc*H]`` holds ``hc`` streams of width ``H``. Around every block::

    hn  = hc_norm(h)                                  # zero-centred RMSNorm per stream
    mix = sigmoid(up(silu(down(hn) / hc)))            # [hc*H], low-rank r
    x   = mean_s(mix_s * hn_s)                        # block input [H]
    inj = 2 * sigmoid(block_inject(hn) / hc)          # [hc]
    h   = h + inj_s * block(x)   for every stream s

The final ``hyper_connection_mixer`` (and the MTP head's own) has no inject and returns ``x``.
Source: HF transformers ``qwen4_exp`` (``Qwen4ExpTextGatedResidual``), MODEL_FACTS.md.

With ``backend="pallas"`` (``--norm-backend``; the loader sets it) calls of at most
:data:`pallas_kernels.hyper.MAX_ROWS` rows run the mix, with the previous block's inject folded
in (:meth:`GatedResidual.mix`), as two Triton kernels (:mod:`pallas_kernels.hyper.mix`); other
calls, and weights held quantized, take the XLA composition below. After
:meth:`GatedResidual.merge_projections` (the loader's default; XLA backend only) the low-rank
down projection and the inject projection, which both read ``hn``, are one matrix
(``down_inject``): one one-row GEMM a mix in place of two.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.models.layers.basic import Linear, as_data, merge_linears, mergeable, rms_normalize
from pallas_kernels.hyper import hyper_mix, supports


class GroupedRMSNorm(nnx.Module):
    """Zero-centred RMSNorm with statistics per group of ``group`` channels:
    ``x_g / rms(x_g) * (1 + w)``; ``weight [dim]`` (dim = groups * group)."""

    def __init__(self, dim: int, group: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.group, self.eps = group, eps

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        y = rms_normalize(x.reshape(*shape[:-1], -1, self.group), self.eps).reshape(shape)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedResidual(nnx.Module):
    """The mix before a block (or, ``inject=False``, the final mixer). ``backend`` (static):
    ``"xla"`` or ``"pallas"`` (see the module docstring)."""

    def __init__(self, hc: int, hidden: int, lowrank: int, eps: float, dtype,
                 inject: bool = True, backend: str = "xla"):
        w = hc * hidden
        self.hc, self.hidden, self.lowrank, self.eps = hc, hidden, lowrank, eps
        self.backend = backend
        self.hc_norm = GroupedRMSNorm(w, hidden, eps, dtype)
        self.input_mix_weight_down = Linear(w, lowrank, dtype)
        self.input_mix_weight_up = Linear(lowrank, w, dtype)
        self.block_inject_weight = Linear(w, hc, dtype) if inject else None
        # MergedLinear of (input_mix_weight_down, block_inject_weight) after
        # merge_projections()
        self.down_inject = None

    def merge_projections(self) -> None:
        """Merge ``input_mix_weight_down`` and ``block_inject_weight`` into one ``down_inject``
        (:class:`~mtp_jax.models.layers.basic.MergedLinear`; the two are removed). Only with
        the ``xla`` backend (the Pallas mix reads them apart) and an inject; idempotent."""
        parts = [self.input_mix_weight_down, self.block_inject_weight]
        if (self.down_inject is None and self.backend == "xla" and parts[1] is not None
                and parts[0] is not None and mergeable(parts)):
            self.down_inject = as_data(merge_linears(parts))
            self.input_mix_weight_down = self.block_inject_weight = None

    def __call__(self, h: jax.Array):
        """``h [..., hc*H]`` -> ``(x [..., H], inj [..., hc] or None)``."""
        _, x, inj = self.mix(h, None)
        return x, inj

    def _kernel_applies(self, h: jax.Array) -> bool:
        if self.down_inject is not None:
            return False
        rows = math.prod(h.shape[:-1])
        linears = [self.input_mix_weight_down, self.input_mix_weight_up]
        if self.block_inject_weight is not None:
            linears.append(self.block_inject_weight)
        return (self.backend == "pallas" and supports(rows, self.hc, self.hidden, self.lowrank)
                and all(m.quant is None and m.scale is None for m in linears))

    def mix(self, h: jax.Array, pending=None):
        """``h [..., hc*H]`` with ``pending = (inj_prev [..., hc], y_prev [..., H])`` (the
        previous block's inject, applied first) or ``None`` -> ``(h after the inject, x [...,
        H], inj [..., hc] or None)``."""
        if self._kernel_applies(h):
            w_inj = self.block_inject_weight
            return hyper_mix(h, pending, self.hc_norm.weight[...],
                             self.input_mix_weight_down.weight[...],
                             None if w_inj is None else w_inj.weight[...],
                             self.input_mix_weight_up.weight[...], hc=self.hc, eps=self.eps)
        if pending is not None:
            h = inject(h, *pending)
        return (h, *self._mix_xla(h))

    def _mix_xla(self, h: jax.Array):
        hn = self.hc_norm(h)
        if self.down_inject is not None:
            down, inj = self.down_inject(hn)
        else:
            down = self.input_mix_weight_down(hn)
            inj = None if self.block_inject_weight is None else self.block_inject_weight(hn)
        mix = jax.nn.sigmoid(self.input_mix_weight_up(jax.nn.silu(down / self.hc)))
        lead = h.shape[:-1]
        x = jnp.mean(mix.reshape(*lead, self.hc, self.hidden)
                     * hn.reshape(*lead, self.hc, self.hidden), axis=-2)
        if inj is None:
            return x, None
        return x, 2.0 * jax.nn.sigmoid(inj / self.hc)


def inject(h: jax.Array, inj: jax.Array, y: jax.Array) -> jax.Array:
    """``h + inj_s * y`` on every stream: ``h [..., hc*H]``, ``inj [..., hc]``, ``y [..., H]``."""
    add = inj[..., :, None] * y[..., None, :]
    return h + add.reshape(h.shape).astype(h.dtype)
