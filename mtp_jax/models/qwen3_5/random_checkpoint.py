"""Random-weight checkpoints of any Qwen3.5-family shape, in the released on-disk layout: the
family's writer behind ``python -m mtp_jax.tools.random_checkpoint`` (registry entry
``write_random``).

Writes ``config.json`` (keys starting with ``_`` stripped; ``dtype`` set to the one written),
``model-0000X-of-0000N.safetensors`` and ``model.safetensors.index.json``
(``metadata.total_size`` = tensor bytes). Tensor names follow :mod:`mtp_jax.weights.names`
through ``disk_name``: ``model.language_model.*`` for a composite config, ``model.*`` for a flat
one, ``lm_head.weight`` (untied only) and ``mtp.*`` at the top. MoE experts are fused
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) or per expert
(``experts.{e}.{gate,up}_proj.weight [I, H]``, ``experts.{e}.down_proj.weight [H, I]``).

Streaming: safetensors files are written tensor by tensor, each generated in row chunks of at most
:data:`CHUNK_ELEMENTS` values, so host memory stays a few hundred MB (about 2 x workers x 16 MiB
of chunks) whatever the model size: 340 MB peak RSS for Qwen3.5-2B (3.9 GB written in 25 s on 2
cores, ~100 M values/s; a 27B shape takes ~5 min).

Values are deterministic in ``seed`` and the canonical tensor name only: the same seed gives the
same expert weights in the fused and the per-expert layouts (per-expert ``gate_proj`` of expert e
equals rows ``[0, I)`` of fused ``gate_up_proj[e]``), and the same values whatever the shard
size. Init, chosen so a random model is numerically tame and its greedy argmax has margins
(lm_head logits have std ~ :data:`LOGIT_STD`):

==============================  ====================================================
linear weights, router, experts N(0, 1/fan_in), fan_in = last dim
``embed_tokens``                N(0, :data:`EMBED_STD`)
``lm_head``                     N(0, (LOGIT_STD / sqrt(H))^2)
zero-centred norms (``1 + w``)  N(0, 0.02^2)
``linear_attn.norm.weight``     ones (plain ``w``)
``conv1d.weight [C, 1, K]``     N(0, 1/K)
``A_log``                       log(U(1, 16))               (Mamba2 init)
``dt_bias``                     softplus^-1(dt), log dt ~ U(log 1e-3, log 1e-1)
==============================  ====================================================

With ``zero_rows_from`` (the tool's ``--tokenizer``, which writes the real Qwen vocabulary
beside the weights) the logit rows past the tokenizer's 248,077 ids (the padding up to
``vocab_size``) are zero, so the random model rarely picks an id that decodes to nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import struct
import zlib
from typing import Any, Iterator

import numpy as np

from mtp_jax.config import ModelConfig, config_dict
from mtp_jax.weights import names

CHUNK_ELEMENTS = 1 << 22  # values generated at once per worker (16 MiB of float32)
EMBED_STD = 1.0
LOGIT_STD = 4.0
NORM_STD = 0.02
DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
EXPERT_LAYOUTS = ("fused", "per-expert")


# ---- the plan: which tensors, in which shard, generated how -----------------------------------
@dataclasses.dataclass(frozen=True)
class _Piece:
    """A run of rows of a tensor viewed as 2-D, generated from its own seed key."""

    key: tuple[int, ...]
    rows: int
    cols: int
    row0: int  # first row of this piece in the tensor's 2-D view


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One on-disk tensor: its name, shape, init rule and the pieces it is generated from."""

    name: str  # on-disk name
    canonical: str
    shape: tuple[int, ...]
    init: str  # "normal" | "ones" | "a_log" | "dt_bias"
    std: float
    pieces: tuple[_Piece, ...]
    zero_rows_from: int | None = None  # rows >= this are zero (logit padding)

    def nbytes(self, itemsize: int) -> int:
        return math.prod(self.shape) * itemsize


def _init_rule(cfg: ModelConfig, canonical: str, shape: tuple[int, ...]) -> tuple[str, float]:
    if canonical == "embed_tokens.weight":
        return "normal", EMBED_STD
    if canonical == "lm_head.weight":
        return "normal", LOGIT_STD / math.sqrt(cfg.hidden_size)
    if canonical.endswith("linear_attn.norm.weight"):
        return "ones", 0.0
    if canonical.endswith(".A_log"):
        return "a_log", 0.0
    if canonical.endswith(".dt_bias"):
        return "dt_bias", 0.0
    module = canonical.rsplit(".", 2)[-2] if canonical.endswith(".weight") else ""
    if "norm" in module:
        return "normal", NORM_STD
    return "normal", 1.0 / math.sqrt(shape[-1])  # linears: fan_in; conv1d [C, 1, K]: K


def _name_key(seed: int, canonical: str) -> tuple[int, ...]:
    return (int(seed), zlib.crc32(canonical.encode("utf-8")))


def _plan_tensors(cfg: ModelConfig, canonical_shapes: dict[str, tuple[int, ...]], seed: int,
                  experts: str, zero_rows_from: int | None) -> list[TensorPlan]:
    plans: list[TensorPlan] = []
    for canonical, shape in canonical_shapes.items():
        init, std = _init_rule(cfg, canonical, shape)
        key = _name_key(seed, canonical)
        zero = zero_rows_from if canonical in ("lm_head.weight", "embed_tokens.weight") else None
        if canonical.endswith("mlp.experts.gate_up_proj"):
            e, two_i, h = shape
            i = two_i // 2
            prefix = canonical[: -len("gate_up_proj")]
            if experts == "fused":
                pieces = []
                for x in range(e):
                    pieces.append(_Piece(key + (x, 0), i, h, x * two_i))
                    pieces.append(_Piece(key + (x, 1), i, h, x * two_i + i))
                plans.append(TensorPlan(names.disk_name(cfg, canonical), canonical, shape, init,
                                        std, tuple(pieces)))
            else:
                for x in range(e):
                    for part, proj in ((0, "gate_proj"), (1, "up_proj")):
                        c = f"{prefix}{x}.{proj}.weight"
                        plans.append(TensorPlan(names.disk_name(cfg, c), c, (i, h), init, std,
                                                (_Piece(key + (x, part), i, h, 0),)))
            continue
        if canonical.endswith("mlp.experts.down_proj"):
            e, h, i = shape
            prefix = canonical[: -len("down_proj")]
            if experts == "fused":
                pieces = tuple(_Piece(key + (x, 0), h, i, x * h) for x in range(e))
                plans.append(TensorPlan(names.disk_name(cfg, canonical), canonical, shape, init,
                                        std, pieces))
            else:
                for x in range(e):
                    c = f"{prefix}{x}.down_proj.weight"
                    plans.append(TensorPlan(names.disk_name(cfg, c), c, (h, i), init, std,
                                            (_Piece(key + (x, 0), h, i, 0),)))
            continue
        cols = shape[-1]
        rows = math.prod(shape) // cols
        plans.append(TensorPlan(names.disk_name(cfg, canonical), canonical, tuple(shape), init,
                                std, (_Piece(key, rows, cols, 0),), zero))
    return plans


def plan_checkpoint(config: dict | str, experts: str = "fused", mtp_experts: str | None = None,
                    include_mtp: bool = True, seed: int = 0,
                    zero_rows_from: int | None = None) -> tuple[ModelConfig, list[TensorPlan]]:
    """The parsed config and every tensor to write, in file order (target, then ``mtp.*``);
    ``config``: a dict, a ``config.json`` path or a folder holding one."""
    raw = config_dict(config)
    cfg = ModelConfig.from_dict(raw)
    for label, layout in (("experts", experts), ("mtp_experts", mtp_experts or experts)):
        if layout not in EXPERT_LAYOUTS:
            raise ValueError(f"{label}={layout!r} is not a layout; use one of {EXPERT_LAYOUTS}.")
    plans = _plan_tensors(cfg, names.target_tensors(cfg), seed, experts, zero_rows_from)
    if include_mtp and cfg.has_mtp:
        plans += _plan_tensors(cfg, names.mtp_tensors(cfg), seed, mtp_experts or experts, None)
    return cfg, plans


def shard_plans(plans: list[TensorPlan], itemsize: int,
                shard_size_bytes: int) -> list[list[TensorPlan]]:
    """Greedy split in order: a shard closes before the tensor that would push it past
    ``shard_size_bytes``; a tensor larger than that gets a shard of its own."""
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        n = p.nbytes(itemsize)
        if shards[-1] and size + n > shard_size_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += n
    return [s for s in shards if s]


# ---- generation ---------------------------------------------------------------------------------
def _chunks(plan: TensorPlan) -> Iterator[tuple[tuple[int, ...], int, int, int]]:
    """(seed key, rows, cols, first row in the tensor) of each generated chunk, in file order."""
    for piece in plan.pieces:
        per = max(1, CHUNK_ELEMENTS // piece.cols)
        for j, r0 in enumerate(range(0, piece.rows, per)):
            yield piece.key + (j,), min(per, piece.rows - r0), piece.cols, piece.row0 + r0


def _generate(plan: TensorPlan, key: tuple[int, ...], rows: int, cols: int, row0: int,
              dtype: str) -> bytes | np.ndarray:
    if plan.init == "ones":
        x = np.ones((rows, cols), np.float32)
    else:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(key)))
        if plan.init == "normal":
            x = rng.standard_normal((rows, cols), dtype=np.float32)
            x *= np.float32(plan.std)
        elif plan.init == "a_log":
            x = np.log(rng.uniform(1.0, 16.0, (rows, cols))).astype(np.float32)
        elif plan.init == "dt_bias":
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), (rows, cols)))
            x = np.log(np.expm1(dt)).astype(np.float32)
        else:  # pragma: no cover - plans only carry the kinds above
            raise ValueError(f"unknown init {plan.init!r}")
    if plan.zero_rows_from is not None and row0 + rows > plan.zero_rows_from:
        x[max(0, plan.zero_rows_from - row0):] = 0.0
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    # bfloat16: round to nearest even on the float32 bits, keep the top half.
    u = x.view(np.uint32)
    r = u >> 16
    r &= 1
    r += 0x7FFF
    u += r
    u >>= 16
    return u.astype(np.uint16)


def _write_shard(path: str, plans: list[TensorPlan], dtype: str,
                 pool: concurrent.futures.Executor, workers: int) -> int:
    """Write one safetensors file, streaming; returns its tensor bytes."""
    st_dtype, itemsize = DTYPES[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plans:
        n = p.nbytes(itemsize)
        header[p.name] = {"dtype": st_dtype, "shape": list(p.shape),
                          "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    jobs = [(p, *c) for p in plans for c in _chunks(p)]
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        # Bounded look-ahead: at most 2 * workers chunks in memory.
        for start in range(0, len(jobs), 2 * workers):
            batch = jobs[start:start + 2 * workers]
            for arr in pool.map(lambda j: _generate(*j, dtype), batch):
                f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return offset


def _output_config(raw: dict, dtype: str) -> dict:
    out = json.loads(json.dumps(raw))
    text = out.get("text_config") if isinstance(out.get("text_config"), dict) else out
    for d in {id(text): text, id(out): out}.values():
        for k in ("dtype", "torch_dtype"):
            if k in d:
                d[k] = dtype
    return out


def write_random(raw: dict, out_dir: str, *, dtype: str = "bfloat16", experts: str = "fused",
                 mtp_experts: str | None = None, include_mtp: bool = True,
                 shard_size_bytes: int = 2 << 30, seed: int = 0,
                 zero_rows_from: int | None = None, workers: int | None = None) -> str:
    """Write a random-weight checkpoint of the config dict ``raw``'s shape into ``out_dir``
    (``config.json``, shards, index); returns it. ``experts`` / ``mtp_experts`` pick the MoE
    layout of the target / ``mtp.*`` layers (``mtp_experts`` defaults to ``experts``).
    ``include_mtp=False`` leaves out ``mtp.*`` (config.json still declares them, as some
    re-exports do). ``zero_rows_from``: logit rows from this id on are zero. ``workers``
    generator threads (default: CPUs, at most 8).

    Raises ``ConfigError`` for an unsupported config, ``ValueError`` for a bad option.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    if shard_size_bytes <= 0:
        raise ValueError(f"shard_size_bytes {shard_size_bytes} must be positive.")
    cfg, plans = plan_checkpoint(raw, experts, mtp_experts, include_mtp, seed, zero_rows_from)
    _, itemsize = DTYPES[dtype]
    shards = shard_plans(plans, itemsize, shard_size_bytes)

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(_output_config(raw, dtype), f, indent=2)
        f.write("\n")
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    weight_map: dict[str, str] = {}
    total = 0
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            total += _write_shard(os.path.join(out_dir, fname), shard, dtype, pool, workers)
            weight_map.update({p.name: fname for p in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
    return out_dir
