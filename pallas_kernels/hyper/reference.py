"""XLA reference of the hyper-connection ("gated residual") mix of qwen4_exp, the oracle of
:mod:`pallas_kernels.hyper.mix`.

``h [..., hc*H]`` holds ``hc`` residual streams of width ``H``. Before a block::

    h   = h + inj_prev_s * y_prev     (optional: the previous block's inject, "pending")
    hn  = h_s / rms(h_s) * (1 + nw)   per stream s (float32, rounded to h's dtype)
    d   = hn @ w_down.T               [r]  (float32 sums, rounded once)
    mix = sigmoid(up(silu(d / hc)))   [hc*H]
    x   = mean_s(mix_s * hn_s)        [H]   the block's input
    inj = 2 * sigmoid(hn @ w_inj.T / hc)   [hc]  (absent without ``w_inj``)

Every elementwise op rounds to h's dtype as XLA rounds the model's composition
(``mtp_jax.models.qwen4_exp.hyper_connection``; HF transformers ``Qwen4ExpTextGatedResidual``,
../shared/MODEL_FACTS.md "Hyper-connection").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def inject_reference(h, inj, y):
    """``h + inj_s * y`` on every stream: ``h [..., hc*H]``, ``inj [..., hc]``, ``y [..., H]``;
    the product and the sum rounded to ``h.dtype``."""
    add = inj[..., :, None].astype(h.dtype) * y[..., None, :].astype(h.dtype)
    return h + add.reshape(h.shape).astype(h.dtype)


def stream_rsqrt(h, hc: int, eps: float):
    """``1 / sqrt(mean(h_s^2) + eps)`` per stream: ``h [..., hc*H]`` -> ``[..., hc]`` float32."""
    hs = h.astype(F32).reshape(*h.shape[:-1], hc, -1)
    return lax.rsqrt(jnp.mean(hs * hs, axis=-1) + eps)


def hyper_mix_reference(h, pending, nw, w_down, w_inj, w_up, *, hc: int, eps: float):
    """The mix above in XLA. ``h [..., hc*H]``; ``pending``: ``(inj_prev [..., hc], y_prev
    [..., H])`` or ``None``; ``nw [hc*H]``; ``w_down [r, hc*H]``, ``w_inj [hc, hc*H]`` or
    ``None``, ``w_up [hc*H, r]`` (HF ``[out, in]``). Returns ``(h, x [..., H], inj [..., hc]
    or None)`` in ``h.dtype`` (``h`` after the pending inject)."""
    dt = h.dtype
    if pending is not None:
        h = inject_reference(h, *pending)
    lead, w = h.shape[:-1], h.shape[-1]
    hidden = w // hc
    rs = stream_rsqrt(h, hc, eps)
    hn = (h.astype(F32).reshape(*lead, hc, hidden) * rs[..., None]).reshape(*lead, w)
    hn = (hn * (1.0 + nw.astype(F32))).astype(dt)
    proj = lambda a, m: jnp.einsum("...k,nk->...n", a, m.astype(dt),
                                   preferred_element_type=F32).astype(dt)
    mix = jax.nn.silu(proj(hn, w_down) / hc)
    mix = jax.nn.sigmoid(proj(mix, w_up))
    x = jnp.mean(mix.reshape(*lead, hc, hidden) * hn.reshape(*lead, hc, hidden), axis=-2)
    if w_inj is None:
        return h, x, None
    return h, x, 2.0 * jax.nn.sigmoid(proj(hn, w_inj) / hc)


__all__ = ["hyper_mix_reference", "inject_reference", "stream_rsqrt"]
