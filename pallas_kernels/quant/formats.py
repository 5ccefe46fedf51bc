"""Quantized weights as the engine keeps them on the device, and their dequantization (XLA).

Two forms hold every quantized projection ``W [N, K]`` of the checkpoint formats the reader
takes (``docs/quantization.md``; ``/work/shared/FORMATS.md``):

``fp8``
    ``codes [N, K]`` float8_e4m3fn, ``scale [ceil(N / bn), ceil(K / bk)]`` float32 and a static
    ``block = (bn, bk)``: ``W[r, c] = codes[r, c] * scale[r // bn, c // bk]``. HF block FP8
    keeps its ``weight_scale_inv`` and ``weight_block_size`` (partial edge blocks included);
    ModelOpt per-tensor FP8 becomes one scale per row (``block = (1, K)``), which lets
    projections of different scales be merged into one matrix.
``nvfp4``
    ``codes [N, K / 2]`` uint8 (two e2m1 codes per byte, column ``2j`` in the low nibble),
    ``scale [N, K / 16]`` float8_e4m3fn, ``scale_2 [N]`` float32:
    ``W[r, c] = e2m1(code[r, c]) * scale[r, c // 16] * scale_2[r]`` (ModelOpt's
    ``weight_scale_2``), or ``/ scale_2[r]`` with ``divide`` (compressed-tensors'
    ``weight_global_scale``). ``scale_2`` holds the matrix's one value on each of its rows so
    that merged projections keep their own.

Exactness: :func:`dequantize` multiplies in float32 in the order the reference does
(:mod:`mtp_jax.weights.quant_math`, float64 then float32): every product but the last is exact
in float32 (an e4m3 code has 4 significant bits, e2m1 2, their scale product at most 5, a
float32 scale 24, so a product fits 29 bits < float64's 53), so float32's one rounding of the
last product equals the reference's float64-then-float32. The quotient by compressed-tensors'
global scale is not: XLA's simplifier turns the division by the broadcast ``scale_2`` into a
product with its rounded reciprocal (seen on the CPU), one float32 ulp off the reference for
about a fifth of the weights (the Triton kernel, :mod:`pallas_kernels.quant.gemv`, divides
correctly rounded). The result is then rounded to the model dtype, as the dequantized
checkpoint is.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = ["KINDS", "NVFP4_GROUP", "QuantFormat", "KeptArray", "dequantize", "decode_e2m1",
           "stored_bytes", "check_parts", "concat_parts"]

KINDS = ("fp8", "nvfp4", "ggml")
NVFP4_GROUP = 16  # input columns per NVFP4 scale


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """Static description of one kept-quantized projection (hashable: part of a traced
    program).

    kind: ``"fp8"``, ``"nvfp4"`` or ``"ggml"``; block: ``(bn, bk)``, rows and columns per fp8
    scale (``(1, 16)`` for nvfp4, ``(1, values per block)`` for ggml); divide: nvfp4 only,
    ``W = ... / scale_2`` (compressed-tensors) instead of ``* scale_2``; in_features: ``K``,
    the logical input size; ggml_type: ggml only, the block type
    (:data:`pallas_kernels.quant.ggml.GGML_BLOCKS`; the rows' raw bytes are the codes and
    hold their own scales)."""

    kind: str
    block: tuple[int, int]
    in_features: int
    divide: bool = False
    ggml_type: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"QuantFormat kind {self.kind!r} is unknown; use one of {KINDS}.")
        if self.kind == "nvfp4" and (self.block != (1, NVFP4_GROUP)
                                     or self.in_features % NVFP4_GROUP):
            raise ValueError(f"QuantFormat nvfp4 needs block (1, {NVFP4_GROUP}) and in_features "
                             f"a multiple of {NVFP4_GROUP}; got {self.block}, "
                             f"{self.in_features}.")

    def shapes(self, n: int) -> dict[str, tuple[tuple[int, ...], object]]:
        """``{part: (shape, dtype)}`` of a ``[n, in_features]`` projection's device arrays."""
        k = self.in_features
        if self.kind == "ggml":
            from pallas_kernels.quant.ggml import row_bytes

            return {"codes": ((n, row_bytes(self.ggml_type, k)), jnp.uint8)}
        if self.kind == "fp8":
            bn, bk = self.block
            return {"codes": ((n, k), jnp.float8_e4m3fn),
                    "scale": ((-(-n // bn), -(-k // bk)), jnp.float32)}
        return {"codes": ((n, k // 2), jnp.uint8),
                "scale": ((n, k // NVFP4_GROUP), jnp.float8_e4m3fn),
                "scale_2": ((n,), jnp.float32)}


def stored_bytes(fmt: QuantFormat, n: int, count: int = 1) -> int:
    """Device bytes of ``count`` ``[n, in_features]`` matrices held in ``fmt``."""
    return count * sum(math.prod(s) * jnp.dtype(d).itemsize for s, d in fmt.shapes(n).values())


def check_parts(fmt: QuantFormat, codes, scale, scale_2) -> int:
    """The projection's output size ``N`` when the arrays have ``fmt``'s shapes and dtypes
    (with the same leading axes on every part, e.g. ``[E]`` for stacked experts); ValueError
    naming the part otherwise."""
    n, lead = int(codes.shape[-2]), tuple(codes.shape[:-2])
    want = {name: (lead + shape, dtype) for name, (shape, dtype) in fmt.shapes(n).items()}
    for name, arr in (("codes", codes), ("scale", scale), ("scale_2", scale_2)):
        if name not in want:
            if arr is not None:
                raise ValueError(f"{fmt.kind} weights have no {name}; got {arr.shape}.")
            continue
        shape, dtype = want[name]
        if arr is None or tuple(arr.shape) != shape or arr.dtype != jnp.dtype(dtype):
            got = None if arr is None else (tuple(arr.shape), str(arr.dtype))
            raise ValueError(f"{fmt} {name}: expected {shape} {jnp.dtype(dtype)}, got {got}.")
    return n


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """4-bit e2m1 codes (uint8 values 0..15: sign bit 3, exponent bits 1-2, mantissa bit 0) ->
    float32 values in {0, 0.5, 1, 1.5, 2, 3, 4, 6} with the sign; elementwise (no table)."""
    c = codes.astype(jnp.int32)
    e = (c >> 1) & 3
    m = (c & 1).astype(jnp.float32)
    pow2 = jnp.where(e == 3, 4.0, jnp.where(e == 2, 2.0, 1.0))
    mag = jnp.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    return jnp.where((c & 8) != 0, -mag, mag)


def _expand(scale: jax.Array, block: tuple[int, int], n: int, k: int) -> jax.Array:
    """``scale [..., ceil(n/bn), ceil(k/bk)]`` -> ``[..., n, k]`` (each block's value on its
    elements)."""
    bn, bk = block
    s = scale
    if bn != 1:
        s = jnp.repeat(s, bn, axis=-2, total_repeat_length=s.shape[-2] * bn)[..., :n, :]
    if bk != k:
        s = jnp.repeat(s, bk, axis=-1, total_repeat_length=s.shape[-1] * bk)[..., :k]
    return s


def dequantize(fmt: QuantFormat, codes: jax.Array, scale: jax.Array, scale_2, dtype) -> jax.Array:
    """The projection ``W [..., N, K]`` in ``dtype`` from its device parts (see the module
    docstring), with any leading axes (stacked or gathered experts) on every part;
    elementwise, so XLA fuses it into the consumer where it can."""
    k = fmt.in_features
    n = codes.shape[-2]
    if fmt.kind == "ggml":
        from pallas_kernels.quant.ggml import dequantize_rows

        return dequantize_rows(fmt.ggml_type, codes, k).astype(dtype)
    if fmt.kind == "fp8":
        w = codes.astype(jnp.float32) * _expand(scale, fmt.block, n, k)
        return w.astype(dtype)
    vals = jnp.stack([decode_e2m1(codes & 0x0F), decode_e2m1(codes >> 4)], axis=-1)
    vals = vals.reshape(*codes.shape[:-1], k)
    w = vals * _expand(scale.astype(jnp.float32), fmt.block, n, k)
    s2 = scale_2[..., None]
    w = w / s2 if fmt.divide else w * s2
    return w.astype(dtype)


@dataclasses.dataclass(frozen=True)
class KeptArray:
    """Stacked quantized matrices (routed experts ``[E, N, K]``) inside a traced program:
    ``fmt`` and the parts with the leading axis on each. Indexing the leading axis
    (``w[ids]``) gathers the codes and scales of the chosen matrices and dequantizes only
    those, to ``dtype``; ``shape`` and ``dtype`` are the dequantized array's, so code written
    for a ``[E, N, K]`` array (gather, then compute) runs on it unchanged."""

    fmt: QuantFormat
    codes: jax.Array
    scale: jax.Array | None
    scale_2: jax.Array | None
    dtype: object

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.codes.shape[:-1], self.fmt.in_features)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, ids) -> jax.Array:
        take = lambda a: None if a is None else a[ids]
        return dequantize(self.fmt, self.codes[ids], take(self.scale), take(self.scale_2),
                          self.dtype)


def concat_parts(fmts: list[QuantFormat], parts: list[tuple]) -> tuple[QuantFormat, tuple]:
    """One ``(fmt, (codes, scale, scale_2))`` holding several projections of one input stacked
    in order (their rows concatenated), with the same values. fp8 parts of one block whose row
    counts (all but the last) are multiples of ``bn`` keep their blocks; otherwise their scales
    are repeated per row (``block = (1, bk)``, exact, ``bn`` times the scale bytes). Raises
    ValueError for parts of different kinds, column blocks, input sizes or ``divide``."""
    first = fmts[0]
    same = {(f.kind, f.block[1], f.in_features, f.divide, f.ggml_type) for f in fmts}
    if len(same) != 1:
        raise ValueError(f"concat_parts: the projections are held in different forms {fmts}; "
                         "only one form merges.")
    codes = jnp.concatenate([p[0] for p in parts], axis=0)
    if first.kind == "ggml":  # rows hold their own scales
        return first, (codes, None, None)
    if first.kind == "nvfp4":
        return first, (codes, jnp.concatenate([p[1] for p in parts], axis=0),
                       jnp.concatenate([p[2] for p in parts], axis=0))
    bns = {f.block[0] for f in fmts}
    aligned = len(bns) == 1 and all(p[0].shape[0] % first.block[0] == 0 for p in parts[:-1])
    if aligned:
        return first, (codes, jnp.concatenate([p[1] for p in parts], axis=0), None)
    rows = [jnp.repeat(p[1], f.block[0], axis=0)[:p[0].shape[0]] for f, p in zip(fmts, parts)]
    fmt = dataclasses.replace(first, block=(1, first.block[1]))
    return fmt, (codes, jnp.concatenate(rows, axis=0), None)
