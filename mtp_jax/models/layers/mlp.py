"""SwiGLU MLP and the sparse MoE block with a gated shared expert (Qwen3.5-MoE).

MoE routing (HF ``Qwen3_5MoeSparseMoeBlock``): ``p = softmax(x @ gate.T)`` in float32, the
top ``num_experts_per_tok`` experts, weights renormalised to sum 1 when ``norm_topk_prob``;
``y = sum_e w_e * expert_e(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``.
Expert weights are fused: ``gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]``.

With :data:`FOLD_SHARED_EXPERT` set, ``SparseMoE.merge_projections`` stacks the shared expert
onto the routed ones as expert ``E`` (its intermediate size must equal the routed experts') and
every token routes to it with weight ``sigmoid(shared_expert_gate(x))``: the same sum, one
gather-reduce pair instead of a separate shared-expert MLP (its own kernels at decode); its
gated output is added to the routed ones in float32 and rounded once with them (the separate
form rounds the gated output and the sum in the model dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.models.layers.basic import Linear, as_data, merge_linears, mergeable, project
from pallas_kernels.moe import moe_experts_weighted
from pallas_kernels.moe.routed import moe_routed, routed_supported
from pallas_kernels.moe.router import MAX_EXPERTS, route_topk
from pallas_kernels.quant import KeptArray, QuantFormat, check_parts

# 1: merge_projections() folds the shared expert into the routed experts (module docstring):
# the 35B-A3B decode step 3% faster on an H100, its k = 3 round the same (docs/benchmarks.md,
# session 61).
FOLD_SHARED_EXPERT = 1
# 1: with the pallas MoE backend, a folded block's few-token calls (decode, verify) route inside
# two kernels (pallas_kernels.moe.routed) instead of the router kernel, XLA's gather-reduces, the
# SwiGLU and the weighted sum. Off: on an H100 it made the 35B-A3B decode step (8-layer cut) 16%
# slower, 990.5 against 851.9 us (docs/benchmarks.md, session 64).
ROUTED_DECODE = 0
SHARED_EXPERT_TENSORS = ".mlp.shared_expert."  # checkpoint names of the shared expert's tensors


def folds_shared_expert(cfg) -> bool:
    """Whether ``merge_projections`` folds a MoE config's shared expert into its routed experts
    (:data:`FOLD_SHARED_EXPERT` and equal intermediate sizes), so that its projections are no
    longer 2-D ``Linear`` s (e.g. for an int8 draft layer's bytes). A checkpoint holding them
    quantized keeps them apart all the same (:meth:`SparseMoE._foldable`)."""
    return (bool(FOLD_SHARED_EXPERT) and bool(getattr(cfg, "num_experts", 0))
            and getattr(cfg, "shared_expert_intermediate_size", None)
            == getattr(cfg, "moe_intermediate_size", None))


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

    def append_expert(self, gate_up: jax.Array, down: jax.Array) -> None:
        """Stack one more expert (``gate_up [2I, H]``, ``down [H, I]``) as expert ``E`` (in
        place). Raises ValueError for kept-quantized stacks or shapes that do not fit."""
        (_, (e, i2, h)), (_, down_shape) = self.shapes
        if self.quant:
            raise ValueError("append_expert: the experts are kept quantized.")
        if gate_up.shape != (i2, h) or down.shape != down_shape[1:]:
            raise ValueError(f"append_expert: gate_up {gate_up.shape} / down {down.shape} do "
                             f"not fit experts of gate_up {(i2, h)} / down {down_shape[1:]}.")
        self.gate_up_proj = nnx.Param(jnp.concatenate([self.gate_up_proj[...],
                                                       gate_up[None]]))
        self.down_proj = nnx.Param(jnp.concatenate([self.down_proj[...], down[None]]))
        self.shapes = (("gate_up_proj", (e + 1, i2, h)),
                       ("down_proj", (e + 1, *down_shape[1:])))

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
        (:class:`mtp_jax.models.layers.basic.MergedLinear`; the four are removed). With
        :data:`FOLD_SHARED_EXPERT` and a foldable shared expert (:meth:`_foldable`) the shared
        expert becomes routed expert ``E`` instead and ``in_proj`` merges the two gates."""
        se = self.shared_expert
        if self.in_proj is not None or se is None:
            return
        if FOLD_SHARED_EXPERT and self._foldable():
            gate_up = jnp.concatenate([se.gate_proj.weight[...], se.up_proj.weight[...]])
            self.experts.append_expert(gate_up, se.down_proj.weight[...])
            self.in_proj = as_data(merge_linears([self.gate, self.shared_expert_gate]))
            self.gate = self.shared_expert_gate = self.shared_expert = None
            return
        parts = [self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj]
        if mergeable(parts):
            self.in_proj = as_data(merge_linears(parts))
            self.gate = self.shared_expert_gate = se.gate_proj = se.up_proj = None

    def _foldable(self) -> bool:
        """The shared expert can be routed expert ``E``: its intermediate size is the routed
        experts', and it, the gates and the experts are all held unquantized."""
        se = self.shared_expert
        linears = [self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj, se.down_proj]
        plain = all(m is not None and m.quant is None and m.scale is None for m in linears)
        inter = dict(self.experts.shapes)["down_proj"][-1]
        return plain and not self.experts.quant and se.gate_proj.out_features == inter

    def _router_backend(self) -> str:
        e = self.num_experts
        fits = e & (e - 1) == 0 and e <= MAX_EXPERTS
        return "pallas" if self.backend == "pallas" and fits else "xla"

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        se = self.shared_expert
        if se is None:  # folded: the shared expert is routed expert E, gated by column E
            logits = self.in_proj.stacked(x2)
            if self._routes_in_kernels(x2.shape[0]):
                return moe_routed(x2, logits, self.experts.gate_up_proj[...],
                                  self.experts.down_proj[...], top_k=self.top_k,
                                  normalize=self.norm_topk_prob, shared=True).reshape(shape)
            weights, ids = self._route(logits)
            shared_gate = jax.nn.sigmoid(logits[:, self.num_experts:].astype(jnp.float32))
            ids = jnp.concatenate([ids, jnp.full_like(ids[:, :1], self.num_experts)], axis=1)
            weights = jnp.concatenate([weights.astype(jnp.float32), shared_gate], axis=1)
            return self.experts(x2, ids, weights).reshape(shape)
        if self.in_proj is None:
            logits, shared_gate, gate, up = project(
                x2, None, (self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj))
        else:
            proj = self.in_proj.stacked(x2)
            _, shared_gate, gate, up = jnp.split(proj, self.in_proj.offsets[1:], axis=-1)
            logits = proj  # the router reads its first E columns in place (no sliced copy)
        weights, ids = self._route(logits)
        routed = self.experts(x2, ids, weights)
        shared = se.activate(gate, up) * jax.nn.sigmoid(
            shared_gate.astype(jnp.float32)).astype(x2.dtype)
        return (routed + shared).reshape(shape)

    def _routes_in_kernels(self, tokens: int) -> bool:
        """A folded block's call of ``tokens`` rows takes :func:`moe_routed`: with
        :data:`ROUTED_DECODE`, the pallas backend, unquantized experts, fewer (token, expert)
        pairs than stored experts (decode and verify rows) and a shape the kernels serve."""
        (_, (stored, two_i, hidden)), _ = self.experts.shapes
        return (bool(ROUTED_DECODE) and self.backend == "pallas" and not self.experts.quant
                and tokens * (self.top_k + 1) < stored
                and routed_supported(self.num_experts, hidden, two_i // 2))

    def _route(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Routing weights and expert ids ``[N, top_k]`` from ``logits [N, >= E]`` (the router
        reads the first E columns)."""
        return route_topk(logits, self.top_k, normalize=self.norm_topk_prob,
                          backend=self._router_backend(), num_experts=self.num_experts)
