"""SwiGLU MLP and the sparse MoE block with a gated shared expert (Qwen3.5-MoE).

MoE routing (HF ``Qwen3_5MoeSparseMoeBlock``): ``p = softmax(x @ gate.T)`` in float32, the
top ``num_experts_per_tok`` experts, weights renormalised to sum 1 when ``norm_topk_prob``;
``y = sum_e w_e * expert_e(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``.
Expert weights are fused: ``gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.models.layers.basic import Linear, as_data, merge_linears, mergeable, project
from pallas_kernels.moe import moe_experts_weighted
from pallas_kernels.moe.router import MAX_EXPERTS, route_topk
from pallas_kernels.quant import KeptArray, QuantFormat, check_parts


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, dtype):
        self.gate_proj = Linear(hidden, intermediate, dtype)
        self.up_proj = Linear(hidden, intermediate, dtype)
        self.down_proj = Linear(intermediate, hidden, dtype)
        self.gate_up_proj = None  # MergedLinear of (gate, up) after merge_projections()

    def merge_projections(self) -> None:
        """Merge ``gate_proj, up_proj`` into one ``gate_up_proj``
        (:class:`mtp_jax.models.layers.basic.MergedLinear`; the two are removed)."""
        if (self.gate_up_proj is None and self.gate_proj is not None
                and mergeable([self.gate_proj, self.up_proj])):
            self.gate_up_proj = as_data(merge_linears([self.gate_proj, self.up_proj]))
            self.gate_proj = self.up_proj = None

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = project(x, self.gate_up_proj, (self.gate_proj, self.up_proj))
        return self.activate(gate, up)

    def activate(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """``down(silu(gate) * up)`` from the gate and up projections' outputs."""
        return self.down_proj(jax.nn.silu(gate) * up)


class Experts(nnx.Module):
    """Routed SwiGLU experts; the computation is
    :func:`pallas_kernels.moe.moe_experts_weighted` (the routing-weighted sum of each token's
    experts).

    ``backend`` (static): ``"xla"`` or ``"pallas"`` (Triton kernels, GPU only). With
    ``pallas``, calls with fewer (token, expert) pairs than experts (decode and verify rows)
    still take the XLA gather-reduce form: on the H200 (Qwen3.6-35B-A3B shape, batch 1) the
    decode step took 3.47 ms with it against 3.94 ms with the few-pairs kernels of
    :mod:`pallas_kernels.moe.few` (reachable through ``moe_experts_weighted(backend="pallas")``);
    larger calls (prefill) take the grouped matmuls (6.3x the XLA prefill rate on that shape).

    Kept quantized (:func:`keep_quantized_experts`; a checkpoint's FP8 / NVFP4 experts with
    ``quantization="keep"``): ``gate_up_proj`` / ``down_proj`` hold the codes, ``quant`` pairs
    each with its :class:`~pallas_kernels.quant.QuantFormat` and ``scales`` holds their scales.
    The XLA forms gather the chosen experts' codes and dequantize only those
    (:class:`~pallas_kernels.quant.KeptArray`), the same values as experts dequantized at
    load; the Pallas grouped kernels (prefill) get the whole stack dequantized first.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype,
                 backend: str = "xla"):
        self.gate_up_proj = nnx.Param(jnp.zeros((num_experts, 2 * intermediate, hidden), dtype))
        self.down_proj = nnx.Param(jnp.zeros((num_experts, hidden, intermediate), dtype))
        self.backend = backend
        self.dtype = jnp.dtype(dtype)
        self.shapes = (("gate_up_proj", (num_experts, 2 * intermediate, hidden)),
                       ("down_proj", (num_experts, hidden, intermediate)))
        self.quant = ()  # ((name, QuantFormat), ...) of the stacks kept quantized
        self.scales = None  # nnx.Dict of {name: scale} and {name + "_2": scale_2}

    def stack(self, name: str):
        """``"gate_up_proj"`` or ``"down_proj"``: the array, or a
        :class:`~pallas_kernels.quant.KeptArray` when it is kept quantized."""
        param = getattr(self, name)
        fmt = dict(self.quant).get(name)
        if fmt is None:
            return param[...]
        read = lambda key: None if self.scales.get(key) is None else self.scales[key][...]
        return KeptArray(fmt, param[...], read(name), read(name + "_2"), self.dtype)

    def __call__(self, x: jax.Array, expert_ids: jax.Array, weights: jax.Array) -> jax.Array:
        """``x [N, H]``, ``expert_ids / weights [N, top_k]`` -> ``[N, H]`` weighted sum."""
        few = expert_ids.size < dict(self.shapes)["gate_up_proj"][0]
        backend = "xla" if few else self.backend
        gate_up, down = self.stack("gate_up_proj"), self.stack("down_proj")
        if backend != "xla":  # the kernels read arrays: the whole stacks dequantized
            gate_up, down = (w[...] if isinstance(w, KeptArray) else w for w in (gate_up, down))
        return moe_experts_weighted(x, expert_ids, weights, gate_up, down, backend=backend)


def keep_quantized_experts(m: Experts, name: str, fmt: QuantFormat, codes, scale,
                           scale_2) -> None:
    """Hold ``m``'s ``name`` (``"gate_up_proj"`` or ``"down_proj"``, in place) as stacked
    quantized experts (codes and scales with the leading ``E`` axis). Raises ValueError for
    arrays that do not match ``fmt`` or the stack's shape."""
    shape = dict(m.shapes)[name]
    n = check_parts(fmt, codes, scale, scale_2)
    if (*codes.shape[:-2], n, fmt.in_features) != shape:
        raise ValueError(f"quantized experts {(*codes.shape[:-2], n, fmt.in_features)} for "
                         f"{name} {shape}.")
    setattr(m, name, nnx.Param(codes))
    scales = {} if m.scales is None else dict(m.scales)
    if scale is not None:
        scales[name] = nnx.Param(scale)
    if scale_2 is not None:
        scales[name + "_2"] = nnx.Param(scale_2)
    m.scales = as_data(nnx.Dict(scales))
    m.quant = tuple((n, f) for n, f in m.quant if n != name) + ((name, fmt),)


class SparseMoE(nnx.Module):
    """Routed experts plus the gated shared expert. With the ``pallas`` MoE backend the routing
    (softmax, top-k, renormalisation) is one Triton kernel
    (:func:`pallas_kernels.moe.router.route_topk`) when the expert count is a power of two up
    to 1024 (every released shape), else XLA's softmax and top-k."""

    def __init__(self, cfg: ModelConfig, dtype, backend: str = "xla"):
        h = cfg.hidden_size
        self.backend = backend
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(h, cfg.num_experts, dtype)
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size, dtype,
                               backend=backend)
        self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, dtype)
        self.shared_expert_gate = Linear(h, 1, dtype)
        self.num_experts = cfg.num_experts
        # MergedLinear of (gate, shared_expert_gate, shared gate_proj, shared up_proj) after
        # merge_projections().
        self.in_proj = None

    def merge_projections(self) -> None:
        """Merge the router ``gate``, ``shared_expert_gate`` and the shared expert's
        ``gate_proj`` / ``up_proj`` (all read the layer input) into one ``in_proj``
        (:class:`mtp_jax.models.layers.basic.MergedLinear`; the four are removed)."""
        se = self.shared_expert
        parts = [self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj]
        if self.in_proj is None and mergeable(parts):
            self.in_proj = as_data(merge_linears(parts))
            self.gate = self.shared_expert_gate = se.gate_proj = se.up_proj = None

    def _router_backend(self) -> str:
        e = self.num_experts
        fits = e & (e - 1) == 0 and e <= MAX_EXPERTS
        return "pallas" if self.backend == "pallas" and fits else "xla"

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        se = self.shared_expert
        if self.in_proj is None:
            logits, shared_gate, gate, up = project(
                x2, None, (self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj))
        else:
            proj = self.in_proj.stacked(x2)
            _, shared_gate, gate, up = jnp.split(proj, self.in_proj.offsets[1:], axis=-1)
            logits = proj  # the router reads its first E columns in place (no sliced copy)
        weights, ids = route_topk(logits, self.top_k, normalize=self.norm_topk_prob,
                                  backend=self._router_backend(), num_experts=self.num_experts)
        routed = self.experts(x2, ids, weights)
        shared = se.activate(gate, up) * jax.nn.sigmoid(
            shared_gate.astype(jnp.float32)).astype(x2.dtype)
        return (routed + shared).reshape(shape)
