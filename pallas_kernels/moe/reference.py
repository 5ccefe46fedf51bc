"""XLA reference of the routed experts of a sparse MoE block (the test oracle).

Each (token, expert) pair computes the SwiGLU expert of HF ``Qwen3_5MoeExperts``:
``y = down_e(silu(gate_e x) * up_e x)`` with the fused weights ``gate_up [E, 2I, H]`` (gate rows
first, then up rows) and ``down [E, H, I]``. Matmuls accumulate in float32; the activation ``h``
is rounded to the weights' dtype before the down projection (as HF's bf16 forward does), the
output to ``x.dtype``. Plain loops over the pairs' gathered weights: slow, obviously correct.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_moe_shapes(x, expert_ids, gate_up, down) -> tuple[int, int, int, int, int]:
    """Validates the operand shapes; returns ``(N, top_k, E, H, I)``.

    Raises:
      ValueError: naming the offending shape when the operands do not fit together.
    """
    if x.ndim != 2 or expert_ids.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
        raise ValueError(f"MoE experts need x [N, H], expert_ids [N, top_k], gate_up [E, 2I, H] "
                         f"and down [E, H, I]; got {x.shape}, {expert_ids.shape}, "
                         f"{gate_up.shape}, {down.shape}.")
    n, h = x.shape
    e, two_i, h2 = gate_up.shape
    i = two_i // 2
    if expert_ids.shape[0] != n:
        raise ValueError(f"expert_ids has {expert_ids.shape[0]} rows but x has {n}; give one "
                         "row of expert ids per token.")
    if h2 != h or two_i % 2 or down.shape != (e, h, i):
        raise ValueError(f"gate_up {gate_up.shape} and down {down.shape} do not fit x {x.shape}: "
                         f"expected gate_up [E, 2I, {h}] and down [E, {h}, I].")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids must be integers, got {expert_ids.dtype}.")
    return n, expert_ids.shape[1], e, h, i


def moe_experts_reference(x: jax.Array, expert_ids: jax.Array, gate_up: jax.Array,
                          down: jax.Array) -> jax.Array:
    """Routed SwiGLU experts, one output row per (token, expert) pair.

    Args:
      x: ``[N, H]`` token activations.
      expert_ids: ``[N, top_k]`` int, the expert of each pair, in ``[0, E)``.
      gate_up: ``[E, 2I, H]`` fused gate (rows ``:I``) and up (rows ``I:``) projections.
      down: ``[E, H, I]`` down projection.
    Returns:
      ``[N, top_k, H]`` in ``x.dtype``: ``down_e @ (silu(gate_e @ x) * (up_e @ x))``.
    Raises:
      ValueError: on operands whose shapes do not fit together.
    """
    n, top_k, _, _, i = check_moe_shapes(x, expert_ids, gate_up, down)
    wgu = gate_up[expert_ids].astype(jnp.float32)  # [N, k, 2I, H]
    wd = down[expert_ids].astype(jnp.float32)  # [N, k, H, I]
    xf = x.astype(gate_up.dtype).astype(jnp.float32)
    gu = jnp.einsum("nkoh,nh->nko", wgu, xf, precision=jax.lax.Precision.HIGHEST)
    gate, up = gu[..., :i], gu[..., i:]
    h = (gate * jax.nn.sigmoid(gate) * up).astype(down.dtype).astype(jnp.float32)
    y = jnp.einsum("nkhi,nki->nkh", wd, h, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)
