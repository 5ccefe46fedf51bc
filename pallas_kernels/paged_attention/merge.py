"""The split merge of the paged attention kernel and the gated-attention output gate, as one
Pallas (Triton lowering) kernel.

:func:`pallas_kernels.paged_attention.pallas.paged_attention_partials` leaves, per (request,
kv head, key split), an unnormalised partial output and its row max and sum (base 2). This
kernel merges the splits with log-sum-exp weights (as
:func:`pallas_kernels.paged_attention.pallas.combine_splits`), rounds the result to the model
dtype, and multiplies it by ``sigmoid(gate)`` rounded to the model dtype, as
:meth:`mtp_jax.models.layers.attention.GatedAttention.gated_output` does before ``o_proj``
(HF ``Qwen3_5Attention``: ``attn_output * sigmoid(gate)``). On the H200 XLA ran these steps as
two kernels per attention layer (docs/benchmarks.md, session 14).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode, whole

F32 = jnp.float32


def _kernel(o_ref, m_ref, l_ref, y_ref, out_ref, *, group: int, head_dim: int, splits: int):
    """One (request, kv head, query row ``r = t * group + g``): query head ``h * group + g``
    of row ``t``."""
    bi, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t, head = r // group, h * group + r % group
    m = [m_ref[bi, h, s, r] for s in range(splits)]
    top = m[0]
    for s in range(1, splits):
        top = jnp.maximum(top, m[s])
    num = jnp.zeros((head_dim,), F32)
    den = jnp.zeros((), F32)
    for s in range(splits):
        w = jnp.exp2(m[s] - top)
        num = num + w * o_ref[bi, h, s, r, :].astype(F32)
        den = den + w * l_ref[bi, h, s, r]
    dtype = out_ref.dtype
    attn = (num / jnp.maximum(den, 1e-30)).astype(dtype)
    gate = y_ref[bi, t, pl.ds(head * 2 * head_dim + head_dim, head_dim)].astype(F32)
    gated = attn.astype(F32) * jax.nn.sigmoid(gate).astype(dtype).astype(F32)
    out_ref[bi, t, pl.ds(head * head_dim, head_dim)] = gated.astype(dtype)


def merge_gate(o: jax.Array, m: jax.Array, l: jax.Array, y: jax.Array, *, t: int,
               num_q_heads: int, interpret: bool | None = None) -> jax.Array:
    """Merge the key splits of the attention kernel's partials and apply the output gate.

    Args:
      o: ``[B, Hkv, S, R, D]`` unnormalised partial outputs (``R >= t * group`` query rows per
        kv head, row ``t_i * group + g``); m, l: ``[B, Hkv, S, R]`` float32 row max and sum of
        the base-2 scores per split (``paged_attention_partials``).
      y: ``[B, T, N]`` the merged q/k/v projection's output; query head ``j``'s gate is
        columns ``j * 2D + D .. j * 2D + 2D`` (each head's ``[query | gate]``).
      t: rows per request ``T``; num_q_heads: ``Hq`` (``group = Hq / Hkv``).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``[B, T, Hq * D]`` in ``y.dtype``: ``round(merged) * round(sigmoid(gate))``, rounded.
    Raises:
      ValueError: shapes that do not fit.
    """
    b, hkv, splits, rows, d = o.shape
    group = num_q_heads // hkv
    if (m.shape != (b, hkv, splits, rows) or l.shape != m.shape or num_q_heads % hkv
            or rows < t * group or y.shape[:2] != (b, t) or y.shape[2] < 2 * num_q_heads * d):
        raise ValueError(f"merge_gate: o {o.shape}, m {m.shape}, l {l.shape}, y {y.shape} do "
                         f"not fit t={t}, Hq={num_q_heads} (o [B,Hkv,S,R>=T*group,D], m/l "
                         "[B,Hkv,S,R], y [B,T,N>=2*Hq*D]).")
    out_shape = jax.ShapeDtypeStruct((b, t, num_q_heads * d), y.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, group=group, head_dim=d, splits=splits),
        grid=(b, hkv, t * group),
        in_specs=[whole(a.shape) for a in (o, m, l, y)],
        out_specs=whole(out_shape.shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret_mode(interpret),
        name="attention_merge_gate",
    )(o, m, l, y)
