"""Random-weight checkpoints of any Qwen3.5-family shape, in the released on-disk layout.

    python -m mtp_jax.tools.random_checkpoint --config configs/Qwen3.5-35B-A3B.json --out DIR \
        [--dtype bfloat16|float32|float16] [--experts fused|per-expert] \
        [--mtp-experts fused|per-expert] [--no-mtp] [--shard-size-gb 2] [--seed 0] [--tokenizer]

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

With ``tokenizer=True`` the real Qwen vocabulary is written beside the weights and the logit rows
past the tokenizer's 248,077 ids (the padding up to ``vocab_size``) are zero, so the random model
rarely picks an id that decodes to nothing.
"""

from __future__ import annotations

import argparse
import sys
import concurrent.futures
import dataclasses
import json
import math
import os
import struct
import zlib
from typing import Any, Iterator

import numpy as np

from mtp_jax.config import ModelConfig
from mtp_jax.weights import names

CHUNK_ELEMENTS = 1 << 22  # values generated at once per worker (16 MiB of float32)
EMBED_STD = 1.0
LOGIT_STD = 4.0
NORM_STD = 0.02
DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
EXPERT_LAYOUTS = ("fused", "per-expert")


def strip_private_keys(obj: Any) -> Any:
    """Copy of a JSON value with every dict key starting with ``_`` removed, recursively."""
    if isinstance(obj, dict):
        return {k: strip_private_keys(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [strip_private_keys(v) for v in obj]
    return obj


def load_config(config: dict | str) -> dict:
    """A config dict from a dict, a ``config.json`` path or a checkpoint folder; ``_`` keys
    stripped."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or a path, got {type(config).__name__}")
    return strip_private_keys(config)


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
    """The parsed config and every tensor to write, in file order (target, then ``mtp.*``)."""
    raw = load_config(config)
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


def _write_qwen4_exp(raw: dict, out_dir: str, *, dtype: str, experts: str, tokenizer: bool,
                     include_mtp: bool, seed: int) -> str:
    """qwen4_exp checkpoints (n-gram tables sharded as released) come from the family's own
    writer, which holds the model in host memory: small shapes only, fused experts, no
    tokenizer yet."""
    from mtp_jax.models.qwen4_exp.random_checkpoint import write_random_qwen4_exp

    if experts != "fused" or tokenizer:
        raise ValueError("for qwen4_exp configs random_checkpoint writes fused experts and no "
                         "tokenizer for now; drop --experts per-expert / --tokenizer.")
    write_random_qwen4_exp(raw, out_dir, dtype=dtype, seed=seed, with_mtp=include_mtp)
    return out_dir


def write_random_checkpoint(config: dict | str, out_dir: str, dtype: str = "bfloat16",
                            experts: str = "fused", mtp_experts: str | None = None,
                            include_mtp: bool = True, shard_size_bytes: int = 2 << 30,
                            seed: int = 0, tokenizer: bool = False,
                            workers: int | None = None, cache_dir: str | None = None) -> str:
    """Write a random-weight checkpoint of ``config``'s shape into ``out_dir``; returns it.

    ``config`` is a dict, a ``config.json`` path or a folder holding one. ``experts`` /
    ``mtp_experts`` pick the MoE layout of the target / ``mtp.*`` layers (``mtp_experts``
    defaults to ``experts``). ``include_mtp=False`` leaves out ``mtp.*`` (config.json still
    declares them, as some re-exports do). ``tokenizer=True`` adds the real Qwen tokenizer
    files (see :mod:`mtp_jax.tools.qwen_vocab`) and needs ``vocab_size >= 248077``; the
    converted tokenizer.json is cached in ``cache_dir`` (default
    :func:`mtp_jax.tools.cache_root`). ``workers`` generator threads (default: CPUs, at most 8).

    Raises ``ConfigError`` for an unsupported config, ``ValueError`` for a bad option.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    if shard_size_bytes <= 0:
        raise ValueError(f"shard_size_bytes {shard_size_bytes} must be positive.")
    raw = load_config(config)
    from mtp_jax.models.qwen4_exp.config import is_qwen4_exp

    if is_qwen4_exp(raw):
        return _write_qwen4_exp(raw, out_dir, dtype=dtype, experts=experts, tokenizer=tokenizer,
                                include_mtp=include_mtp, seed=seed)
    zero_from = None
    if tokenizer:
        from mtp_jax.tools import qwen_vocab

        n_tok = len(qwen_vocab.load_ranks()) + len(qwen_vocab.special_tokens())
        vocab = ModelConfig.from_dict(raw).vocab_size
        if vocab < n_tok:
            raise ValueError(f"tokenizer=True writes the real Qwen vocabulary ({n_tok} ids) but "
                             f"the config's vocab_size is {vocab}; use vocab_size 248320.")
        zero_from = n_tok if vocab > n_tok else None
    cfg, plans = plan_checkpoint(raw, experts, mtp_experts, include_mtp, seed, zero_from)
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
    if tokenizer:
        from mtp_jax.tools import qwen_vocab

        qwen_vocab.write_tokenizer_files(out_dir, cache_dir=cache_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mtp_jax.tools.random_checkpoint",
                                 description="Write a random-weight Qwen3.5-family checkpoint.")
    ap.add_argument("--config", required=True, help="config.json (or a folder holding one)")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--experts", default="fused", choices=EXPERT_LAYOUTS)
    ap.add_argument("--mtp-experts", default=None, choices=EXPERT_LAYOUTS,
                    help="layout of the mtp.* experts (default: --experts)")
    ap.add_argument("--no-mtp", action="store_true",
                    help="leave out the mtp.* tensors (config.json still declares the MTP "
                         "layer, as some re-exports do: run the checkpoint with "
                         "--speculative-algorithm none)")
    ap.add_argument("--shard-size-gb", type=float, default=2.0, help="GiB per shard")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", action="store_true",
                    help="also write the real Qwen tokenizer and chat template")
    ap.add_argument("--workers", type=int, default=None, help="generator threads")
    args = ap.parse_args(argv)
    try:
        out = write_random_checkpoint(args.config, args.out, dtype=args.dtype,
                                      experts=args.experts, mtp_experts=args.mtp_experts,
                                      include_mtp=not args.no_mtp,
                                      shard_size_bytes=int(args.shard_size_gb * (1 << 30)),
                                      seed=args.seed, tokenizer=args.tokenizer,
                                      workers=args.workers)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
