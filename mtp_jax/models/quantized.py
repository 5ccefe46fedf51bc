"""Projections of a quantized checkpoint kept quantized in a loaded model (``quantization=
"keep"``, and ``"auto"`` on a GPU; docs/quantization.md).

The reader hands such a projection over as a :class:`~mtp_jax.weights.quant_tensors.KeptQuant`
(its FP8 codes and block scales, or packed NVFP4 with its scales;
:mod:`pallas_kernels.quant.formats`); :func:`apply_kept` puts it into the model's
:class:`~mtp_jax.models.layers.basic.Linear`, whose calls then dequantize to the model dtype
inside the program. Family-independent: the names are the canonical parameter names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.models.layers.basic import Linear, MergedLinear, keep_quantized
from mtp_jax.models.layers.mlp import Experts, keep_quantized_experts
from mtp_jax.models.params import param_name
from mtp_jax.weights.quant_tensors import KeptQuant
from pallas_kernels.quant import QuantFormat, stored_bytes
from pallas_kernels.quant.ggml import GGML_BLOCKS

__all__ = ["kept_names", "split_kept", "apply_kept", "kept_projections", "kept_experts",
           "saved_bytes", "saved_bytes_by_part", "experts_bytes_ratio", "random_kept",
           "with_random_kept", "RANDOM_FORMATS"]

# Projections read as floats by code other than the projection itself stay dequantized: the
# untied LM head (the draft head re-scores its rows).
NOT_KEPT = ("lm_head.weight",)


EXPERT_STACKS = ("gate_up_proj", "down_proj")


def _linears(module) -> dict[str, Linear]:
    return {param_name(path): node for path, node in nnx.iter_graph(module)
            if isinstance(node, Linear)}


def _experts(module) -> dict[str, Experts]:
    return {param_name(path): node for path, node in nnx.iter_graph(module)
            if isinstance(node, Experts)}


def kept_names(module) -> frozenset[str]:
    """Canonical names of the parameters under ``module`` (an abstract model is fine) that may
    be kept quantized: the ``weight`` of every :class:`Linear` but :data:`NOT_KEPT`, and the
    routed experts' stacks (:data:`EXPERT_STACKS` of every :class:`Experts`)."""
    return frozenset([n + ".weight" for n in _linears(module) if n + ".weight" not in NOT_KEPT]
                     + [f"{n}.{s}" for n in _experts(module) for s in EXPERT_STACKS])


def split_kept(arrays: dict) -> tuple[dict, dict[str, KeptQuant]]:
    """``(arrays with each KeptQuant replaced by its codes, {name: KeptQuant})``: the codes
    fill the parameter until :func:`apply_kept` sets the rest."""
    kept = {n: a for n, a in arrays.items() if isinstance(a, KeptQuant)}
    return {n: (a.codes if n in kept else a) for n, a in arrays.items()}, kept


def apply_kept(module, kept: dict[str, KeptQuant]) -> None:
    """Hold each projection of ``kept`` (canonical weight name -> KeptQuant) quantized in
    ``module`` (in place; :func:`~mtp_jax.models.layers.basic.keep_quantized`). Raises
    ValueError for a name that is not a projection of the module."""
    if not kept:
        return
    linears, experts = _linears(module), _experts(module)
    for name, kq in kept.items():
        owner, _, stack = name.rpartition(".")
        if stack in EXPERT_STACKS and owner in experts:
            keep_quantized_experts(experts[owner], stack, kq.fmt, kq.codes, kq.scale,
                                   kq.scale_2)
            continue
        m = linears.get(name.removesuffix(".weight"))
        if m is None:
            raise ValueError(f"{name} was read quantized but is not a projection of the model.")
        keep_quantized(m, kq.fmt, kq.codes, kq.scale, kq.scale_2)


def kept_projections(module) -> list[tuple[str, object]]:
    """``(name, projection)`` of every projection held quantized under ``module``."""
    return [(param_name(path), node) for path, node in nnx.iter_graph(module)
            if isinstance(node, (Linear, MergedLinear)) and node.quant is not None]


def kept_experts(module) -> list[tuple[str, object]]:
    """``(name, Experts)`` of every routed-experts module under ``module`` with a stack held
    quantized."""
    return [(n, m) for n, m in _experts(module).items() if m.quant]


def _saved(m) -> int:
    dense = m.out_features * m.in_features * jnp.dtype(m.dtype).itemsize
    return dense - stored_bytes(m.quant, m.out_features)


def _saved_experts(m) -> int:
    out = 0
    for name, fmt in m.quant:
        e, n, k = dict(m.shapes)[name]
        out += e * n * k * jnp.dtype(m.dtype).itemsize - stored_bytes(fmt, n, e)
    return out


def _saved_parts(module) -> list[tuple[str, int, bool]]:
    """``(name, bytes saved, routed experts)`` of every quantized projection and stack."""
    return ([(n, _saved(m), False) for n, m in kept_projections(module)]
            + [(n, _saved_experts(m), True) for n, m in kept_experts(module)])


def saved_bytes(module) -> int:
    """Device bytes the quantized projections and expert stacks under ``module`` save against
    the same weights in the model dtype (what the memory plan takes off the dense count)."""
    return sum(b for _, b, _ in _saved_parts(module))


def experts_bytes_ratio(module) -> float:
    """Held bytes of the routed experts over their model-dtype bytes (1.0 when none is kept
    quantized; the bench's floor scales the experts' reads by it)."""
    dense = held = 0
    for _, m in _experts(module).items():
        for name, (e, n, k) in m.shapes:
            size = e * n * k * jnp.dtype(m.dtype).itemsize
            fmt = dict(m.quant).get(name)
            dense += size
            held += size if fmt is None else stored_bytes(fmt, n, e)
    return held / dense if dense else 1.0


def saved_bytes_by_part(module) -> tuple[int, int]:
    """:func:`saved_bytes` split into ``(target, mtp draft)`` (the bench's floor: the target's
    weights are read once a forward, the draft's once a draft call). Routed experts are left
    out: a forward reads only the experts it routes to, which the floor counts apart."""
    parts = [(n.startswith("mtp."), b) for n, b, experts in _saved_parts(module) if not experts]
    return (sum(b for d, b in parts if not d), sum(b for d, b in parts if d))


# Random weights in a quantized form (the bench's --quantization with --dummy-weight): the
# checkpoint format -> the device form's kind, column block and whether it divides.
RANDOM_FORMATS = {"fp8-block": ("fp8", (128, 128), False), "modelopt-fp8": ("fp8", None, False),
                  "modelopt-nvfp4": ("nvfp4", (1, 16), False),
                  "ct-nvfp4": ("nvfp4", (1, 16), True),
                  **{t: ("ggml", (1, v), False) for t, (v, _) in GGML_BLOCKS.items()}}


def random_kept(module, fmt_name: str, seed: int = 0) -> int:
    """Replace every keepable projection and routed-experts stack of ``module`` (in place) by
    random weights held in ``fmt_name``'s device form (:data:`RANDOM_FORMATS`: a checkpoint
    format, or a ggml block type kept packed; NVFP4 and ggml only where the input size is a
    whole number of groups / blocks), drawn on the device with about the dense random weights'
    scale
    (``N(0, 1/fan_in)``); for timing, not for output. Returns how many were replaced. Raises
    ValueError for an unknown format."""
    if fmt_name not in RANDOM_FORMATS:
        raise ValueError(f"random quantized weights: {fmt_name!r} is unknown; use one of "
                         f"{sorted(RANDOM_FORMATS)}.")
    kind, block, divide = RANDOM_FORMATS[fmt_name]
    key = jax.random.key(seed)
    count = _random_experts(module, fmt_name, kind, block, divide,
                            jax.random.fold_in(key, 1 << 20))
    projections = {param_name(path): node for path, node in nnx.iter_graph(module)
                   if isinstance(node, (Linear, MergedLinear))}
    for i, (name, m) in enumerate(sorted(projections.items())):
        if name + ".weight" in NOT_KEPT or m.quant is not None:
            continue
        n, k = m.out_features, m.in_features
        if kind != "fp8" and k % block[1]:
            continue
        fmt = _format(fmt_name, kind, block, divide, k)
        codes, scale, scale_2 = _random_parts(jax.random.fold_in(key, i), kind, fmt, (), n)
        keep_quantized(m, fmt, codes, scale, scale_2)
        count += 1
    return count


def _random_parts(key, kind: str, fmt: QuantFormat, lead: tuple, n: int):
    """Random ``(codes, scale, scale_2)`` of ``lead + [n, K]`` matrices in ``fmt``, about the
    scale of ``N(0, 1/K)`` weights."""
    k = fmt.in_features
    shapes = {p: lead + s for p, (s, _) in fmt.shapes(n).items()}
    if kind == "ggml":  # random blocks whose fp16 scales (d; and dmin of Q4_K) are 1/K
        nbytes = GGML_BLOCKS[fmt.ggml_type][1]
        codes = jax.random.randint(key, shapes["codes"], 0, 256, jnp.int32).astype(jnp.uint8)
        blocks = codes.reshape(*shapes["codes"][:-1], -1, nbytes)
        half = np.frombuffer(np.float16(1.0 / k).tobytes(), np.uint8)
        for start in ((0, 2) if fmt.ggml_type == "Q4_K" else (0,)):
            blocks = blocks.at[..., start:start + 2].set(jnp.asarray(half))
        return blocks.reshape(shapes["codes"]), None, None
    if kind == "fp8":
        codes = jax.random.normal(key, shapes["codes"], jnp.float32).astype(jnp.float8_e4m3fn)
        return codes, jnp.full(shapes["scale"], k ** -0.5, jnp.float32), None
    codes = jax.random.randint(key, shapes["codes"], 0, 256, jnp.int32).astype(jnp.uint8)
    s2 = k ** -0.5
    return (codes, jnp.full(shapes["scale"], 0.5, jnp.float8_e4m3fn),
            jnp.full(shapes["scale_2"], 1.0 / s2 if fmt.divide else s2, jnp.float32))


def _format(fmt_name: str, kind: str, block, divide: bool, k: int) -> QuantFormat:
    return QuantFormat(kind, block or (1, k), k, divide=divide,
                       ggml_type=fmt_name if kind == "ggml" else "")


def _random_experts(module, fmt_name: str, kind: str, block, divide: bool, key) -> int:
    """:func:`random_kept` for the routed experts' stacks; returns how many were replaced."""
    count = 0
    for i, (_, m) in enumerate(sorted(_experts(module).items())):
        for j, (name, (e, n, k)) in enumerate(m.shapes):
            if dict(m.quant).get(name) is not None or k % (block or (1, 1))[1] and kind != "fp8":
                continue
            fmt = _format(fmt_name, kind, block, divide, k)
            parts = _random_parts(jax.random.fold_in(key, 2 * i + j), kind, fmt, (e,), n)
            keep_quantized_experts(m, name, fmt, *parts)
            count += 1
    return count


def with_random_kept(model, fmt_name: str, seed: int = 0):
    """A copy of a :class:`~mtp_jax.models.loaded.LoadedModel` of random weights whose
    projections are random weights held in ``fmt_name``'s device form (:func:`random_kept`),
    with its ``weight_bytes_saved``; ``model`` is left as it was."""
    import dataclasses

    module = model.module()
    random_kept(module, fmt_name, seed)
    graphdef, params = nnx.split(module)
    return dataclasses.replace(model, graphdef=graphdef, params=params, derived={},
                               weight_bytes_saved=saved_bytes(module))
