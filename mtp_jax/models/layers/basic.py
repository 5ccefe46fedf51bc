"""Linear, merged linear, embedding and zero-centred RMSNorm modules.

Parameter names and layouts follow the HF checkpoints (``weight [out, in]``) so that a loaded
tensor fills its parameter without transposition. After loading, projections that read the
same input may be merged into one :class:`MergedLinear` (see ``merge_projections`` of the
layers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.models.layers.int8_rows import int8_matmul, quantize_rows
from pallas_kernels.gemv import gemv
from pallas_kernels.norm import add_rms_norm, rms_norm_reference
from pallas_kernels.quant import (QuantFormat, check_parts, concat_parts, dequantize,
                                  quant_gemv, quant_gemv_applies)


def _project(x: jax.Array, m) -> jax.Array:
    """``x [..., in] @ W.T`` of a :class:`Linear` or :class:`MergedLinear` ``m``:
    :func:`gemv` with ``m.backend`` on ``m.weight``; with ``m.quant`` set (a checkpoint's FP8 /
    NVFP4 weights kept quantized) on the weights dequantized to ``m.dtype`` inside the program
    (:func:`pallas_kernels.quant.dequantize`, elementwise, which XLA can fuse into the
    projection), the same values and roundings as a checkpoint dequantized at load, or with
    ``m.backend == "pallas"`` for calls of up to 8 rows in the Triton kernel that dequantizes
    as it reads (:func:`pallas_kernels.quant.quant_gemv`, experimental); with only
    ``m.scale`` set (int8 rows, :func:`quantize_projections`), the int8 rows' product
    (:func:`~mtp_jax.models.layers.int8_rows.int8_matmul`, which ignores ``backend``)."""
    if m.quant is not None:
        scale = None if m.scale is None else m.scale[...]
        scale_2 = None if m.scale_2 is None else m.scale_2[...]
        rows = math.prod(x.shape[:-1])
        if (m.backend == "pallas" and m.quant.kind != "ggml"
                and quant_gemv_applies(m.quant, m.out_features, m.in_features, rows)):
            return quant_gemv(x, m.quant, m.weight[...], scale, scale_2, out_dtype=m.dtype)
        w = dequantize(m.quant, m.weight[...], scale, scale_2, m.dtype)
        return gemv(x, w, backend=m.backend)
    if m.scale is None:
        return gemv(x, m.weight[...], backend=m.backend)
    return int8_matmul(x, m.weight[...], m.scale[...]).astype(x.dtype)


def keep_quantized(m, fmt: QuantFormat, codes, scale, scale_2) -> None:
    """Hold ``m`` (a :class:`Linear` or :class:`MergedLinear`, in place) as checkpoint-quantized
    weights: ``weight`` the codes, ``scale`` / ``scale_2`` the scales, ``quant`` their
    :class:`~pallas_kernels.quant.QuantFormat`; calls dequantize to ``m.dtype``. Raises
    ValueError for arrays that do not match ``fmt`` or the projection's shape."""
    n = check_parts(fmt, codes, scale, scale_2)
    if n != m.out_features or fmt.in_features != m.in_features:
        raise ValueError(f"quantized weights [{n}, {fmt.in_features}] for a projection of "
                         f"[{m.out_features}, {m.in_features}].")
    m.weight = nnx.Param(codes)
    m.scale = None if scale is None else as_data(nnx.Param(scale))
    m.scale_2 = None if scale_2 is None else as_data(nnx.Param(scale_2))
    m.quant = fmt


class Linear(nnx.Module):
    """``y = x @ weight.T`` with ``weight [out_features, in_features]`` (no bias).

    ``backend`` (static): how a call runs (:func:`pallas_kernels.gemv.gemv`: ``"xla"``,
    ``"reduce"``, ``"pallas"`` or ``"fused"``; the loader sets it from
    ``KernelBackends.gemv``). ``scale``: ``None``, or after :func:`quantize_projections` the
    ``[out_features]`` float32 scales of ``weight``'s int8 rows (calls then take the int8
    product and ignore ``backend``). ``quant`` (static): ``None``, or after
    :func:`keep_quantized` the :class:`~pallas_kernels.quant.QuantFormat` of a checkpoint's
    FP8 / NVFP4 weights held as they are stored (``weight`` the codes, ``scale`` / ``scale_2``
    their scales), dequantized to ``dtype`` (the model dtype) in each call."""

    def __init__(self, in_features: int, out_features: int, dtype, backend: str = "xla"):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype))
        self.scale = None
        self.scale_2 = None
        self.quant = None
        self.dtype = jnp.dtype(dtype)
        self.in_features, self.out_features = in_features, out_features
        self.backend = backend

    def __call__(self, x: jax.Array) -> jax.Array:
        return _project(x, self)


class MergedLinear(nnx.Module):
    """Several projections of one input as one matrix: ``weight [sum(sizes), in]``, the
    projections' weights stacked in order; a call returns their outputs split back.

    One GEMM instead of several: at decode and verify (a few rows) each projection is bound by
    reading its weights, and XLA turns the small ones into slow reduction kernels. On the H200
    (bf16, one row) the merged GDN in-projection (qkv, z, b, a) of the Qwen3.5-2B shape took
    17.3 us against 26.7 us as four projections (``docs/benchmarks.md``). Each output column is
    the same dot product as before; only the GEMM's accumulation order may differ (float32 on
    the CPU: differences of a few 1e-6).

    ``backend`` (static): what a call runs (:func:`pallas_kernels.gemv.gemv`: ``"xla"``,
    ``"reduce"``, ``"pallas"`` or ``"fused"``; the loader sets it from ``KernelBackends.gemv``;
    a decoder layer reads ``"fused"`` on its MLP's merged gate/up to run the fused kernel).
    ``scale``, ``scale_2``, ``quant``, ``dtype``: as :class:`Linear`'s (see
    :func:`merge_linears` for quantized projections).
    """

    def __init__(self, weights: Sequence[jax.Array], backend: str = "xla", *,
                 in_features: int | None = None, dtype=None):
        """``weights``: ``[N_j, in]`` arrays of one dtype (e.g. the ``Linear.weight`` values);
        quantized projections pass their codes with ``in_features`` and the model ``dtype``,
        then :func:`keep_quantized`."""
        self.sizes = tuple(int(w.shape[0]) for w in weights)
        self.weight = nnx.Param(jnp.concatenate(list(weights), axis=0))
        self.scale = None
        self.scale_2 = None
        self.quant = None
        self.dtype = jnp.dtype(dtype if dtype is not None else weights[0].dtype)
        self.in_features = in_features if in_features is not None else int(weights[0].shape[1])
        self.out_features = sum(self.sizes)
        self.backend = backend

    def __call__(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """``x [..., in]`` -> one ``[..., N_j]`` per merged projection."""
        return tuple(jnp.split(self.stacked(x), self.offsets[1:], axis=-1))

    def stacked(self, x: jax.Array) -> jax.Array:
        """``x [..., in]`` -> ``[..., sum(sizes)]``, the outputs side by side (projection ``j``
        in the columns from ``offsets[j]``). A kernel that reads its columns of this array in
        place saves the copy XLA makes of a slice passed to a custom call."""
        return _project(x, self)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first output column of each projection."""
        return tuple(int(o) for o in np.cumsum((0,) + self.sizes[:-1]))


def mergeable(linears: Sequence[Linear]) -> bool:
    """Whether :func:`merge_linears` takes ``linears``: all unquantized, or all checkpoint-
    quantized in one form (kind, column block, input size; :func:`~pallas_kernels.quant.
    concat_parts`). A group mixing forms (e.g. a router kept in bf16 beside quantized
    projections) stays unmerged. (int8 rows are not judged here: :func:`merge_linears` refuses
    them.)"""
    forms = {None if m.quant is None else (m.quant.kind, m.quant.block[1], m.quant.in_features,
                                           m.quant.divide, m.quant.ggml_type) for m in linears}
    return len(forms) == 1


def _value(param):
    """``param``'s array, or None for an absent parameter (GGUF rows hold their own scales)."""
    return None if param is None else param[...]


def merge_linears(linears: Sequence[Linear]) -> MergedLinear:
    """A :class:`MergedLinear` of ``linears`` (their weights copied, in order; the first one's
    ``backend``); checkpoint-quantized ones are merged in their quantized form
    (:func:`~pallas_kernels.quant.concat_parts`: the same values). Raises ValueError for int8
    rows (merge before :func:`quantize_projections`) or for projections :func:`mergeable`
    refuses."""
    if any(m.quant is None and m.scale is not None for m in linears):
        raise ValueError("merge_linears: the projections are int8 rows already; merge them "
                         "before quantize_projections.")
    if not mergeable(linears):
        raise ValueError("merge_linears: the projections are held in different forms "
                         f"({[m.quant for m in linears]}); check mergeable() first.")
    first = linears[0]
    if first.quant is None:
        return MergedLinear([m.weight[...] for m in linears], backend=first.backend)
    fmt, (codes, scale, scale_2) = concat_parts(
        [m.quant for m in linears],
        [(m.weight[...], _value(m.scale), _value(m.scale_2)) for m in linears])
    merged = MergedLinear([m.weight[...] for m in linears], backend=first.backend,
                          in_features=first.in_features, dtype=first.dtype)
    keep_quantized(merged, fmt, codes, scale, scale_2)
    return merged


def set_gemv_backend(module, backend: str) -> int:
    """Set ``backend`` on every :class:`Linear`, :class:`MergedLinear` and :class:`Embed` (its
    tied LM head) under ``module`` (in place); returns how many were set. ``backend``:
    ``"xla"``, ``"reduce"``, ``"pallas"`` or ``"fused"`` (:func:`pallas_kernels.gemv.gemv`)."""
    count = 0
    for _, node in nnx.iter_graph(module):
        if isinstance(node, (Linear, MergedLinear, Embed)):
            node.backend = backend
            count += 1
    return count


def quantize_projections(module) -> int:
    """Store every :class:`Linear` and :class:`MergedLinear` under ``module`` (in place) as
    int8 rows with a float32 scale per row
    (:func:`~mtp_jax.models.layers.int8_rows.quantize_rows`): ``weight`` becomes ``[out, in]``
    int8 and ``scale`` ``[out]`` float32, and calls take the int8 product. Other parameters
    (norms, embeddings, the routed experts' 3-D tensors) are left alone. Returns how many
    projections were quantized (already quantized ones are skipped).

    For the MTP draft's subtree only (``model.mtp``, ``speculative_draft_layer_dtype``): code
    that reads a projection's ``weight`` as floats (the LM head's rows for the draft head's
    re-scoring, the fused norm + gate/up kernel of the target) must not meet int8 rows, and
    :func:`merge_linears` refuses quantized ones."""
    count = 0
    quantize = jax.jit(quantize_rows)
    for _, node in nnx.iter_graph(module):
        if isinstance(node, (Linear, MergedLinear)) and node.scale is None and node.quant is None:
            q, scale = quantize(node.weight[...])
            node.weight = nnx.Param(q)
            node.scale = as_data(nnx.Param(scale))
            count += 1
    return count


def as_data(value):
    """Mark a module assigned after construction as data (``nnx.data``, flax >= 0.12): an
    attribute that was ``None`` when the module was built would otherwise stay static."""
    return getattr(nnx, "data", lambda v: v)(value)


def project(x: jax.Array, merged: MergedLinear | None, linears: Sequence) -> tuple:
    """The outputs of ``linears`` on ``x``: from ``merged`` when the layer has merged them,
    else one projection each."""
    if merged is not None:
        return merged(x)
    return tuple(m(x) for m in linears)


class Embed(nnx.Module):
    """Token embedding ``weight [vocab, hidden]``; also the tied ``lm_head`` (``backend``:
    what :meth:`attend` runs, as :class:`Linear`'s)."""

    def __init__(self, vocab: int, hidden: int, dtype, backend: str = "xla"):
        self.weight = nnx.Param(jnp.zeros((vocab, hidden), dtype))
        self.backend = backend

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the embedding matrix: ``[..., H] -> [..., V]`` (tied head)."""
        return gemv(x, self.weight[...], backend=self.backend)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm of the Qwen3.5 family: ``x / rms(x) * (1 + w)``.

    Statistics and the scale in float32, result cast back to ``x.dtype``
    (HF ``Qwen3_5RMSNorm``). ``weight [dim]`` is stored zero-centred. ``backend`` (static,
    ``"xla"`` or ``"pallas"``) is what :meth:`add_norm` runs
    (:func:`pallas_kernels.norm.add_rms_norm`).
    """

    def __init__(self, dim: int, eps: float, dtype, backend: str = "xla"):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps
        self.backend = backend

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm_reference(x, self.weight[...], self.eps)

    def add_norm(self, x: jax.Array, delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """The residual add and this norm of the sum: ``x, delta [..., dim]`` ->
        ``(h = x + delta, norm(h))`` in ``x.dtype`` (``delta=None``: ``h = x``). With the
        ``pallas`` backend one kernel does both; with ``xla`` it is ``x + delta`` and
        :meth:`__call__`."""
        return add_rms_norm(x, delta, self.weight[...], self.eps, backend=self.backend)
