"""Random-weight checkpoints of any registered family's shape, in its released on-disk layout.

    python -m mtp_jax.tools.random_checkpoint --config configs/Qwen3.5-35B-A3B.json --out DIR \
        [--dtype bfloat16|float32|float16] [--experts fused|per-expert] \
        [--mtp-experts fused|per-expert] [--no-mtp] [--shard-size-gb 2] [--seed 0] [--tokenizer]
        [--quantize fp8-block|modelopt-fp8|modelopt-nvfp4|ct-nvfp4] [--quantize-mtp-fc]
        [--mtp-quantize none|SCHEME]
    python -m mtp_jax.tools.random_checkpoint --config CFG --out DIR --format gguf \
        [--gguf-expert-type TYPE] [--gguf-dense-type TYPE] [--no-mtp] [--seed 0] [--tokenizer]
    (either form: [--overwrite] to replace a checkpoint already in DIR)

The family is the registry's (from ``config.json``'s ``model_type``); its entry's
``write_random`` writes ``config.json`` and the weights (the Qwen3.5 family's streaming sharded
writer: :mod:`mtp_jax.models.qwen3_5.random_checkpoint`, which documents the layout and the
init; qwen4_exp's: :mod:`mtp_jax.models.qwen4_exp.random_checkpoint`). With ``--tokenizer``
the real Qwen vocabulary and chat template are written beside the weights
(:mod:`mtp_jax.tools.qwen_vocab`) and the logit rows past its 248,077 ids are zero, so the
random model rarely picks an id that decodes to nothing. With ``--quantize`` the written
weights are then quantized in place, with the matching ``quantization_config``
(:mod:`mtp_jax.tools.quantize_checkpoint`; ``--mtp-quantize`` for a mixed checkpoint,
``--quantize-mtp-fc`` to quantize the MTP input projections too).

With ``--format gguf`` (qwen4_exp configs) it writes a Flash-Next GGUF target ``DIR/model.gguf``
and a Strata MTP pack ``DIR/mtp.gguf`` instead, routed experts in ``--gguf-expert-type`` and
the other matrices in ``--gguf-dense-type`` (:mod:`mtp_jax.tools.random_gguf`); the
safetensors-only options are refused with it.

A ``DIR`` that already holds a checkpoint (``config.json``, ``*.safetensors`` or ``*.gguf``) is
refused unless ``--overwrite`` is given, which deletes the old checkpoint's files first (those,
the safetensors index and the tokenizer files), so none of them is left beside the new one.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from mtp_jax.config import ConfigError, config_dict
from mtp_jax.models.qwen3_5.random_checkpoint import DTYPES, EXPERT_LAYOUTS
from mtp_jax.models.registry import entry_for_raw
from mtp_jax.tools import qwen_vocab
from mtp_jax.tools.quantize_checkpoint import SCHEMES, quantize_folder

__all__ = ["write_random_checkpoint", "check_out", "main"]


def write_random_checkpoint(config: dict | str, out_dir: str, dtype: str = "bfloat16",
                            experts: str = "fused", mtp_experts: str | None = None,
                            include_mtp: bool = True, shard_size_bytes: int = 2 << 30,
                            seed: int = 0, tokenizer: bool = False,
                            workers: int | None = None, cache_dir: str | None = None,
                            quantize: str | None = None, mtp_quantize: str | None = None,
                            quantize_mtp_fc: bool = False) -> str:
    """Write a random-weight checkpoint of ``config``'s shape into ``out_dir``; returns it.

    ``config`` is a dict, a ``config.json`` path or a folder holding one. ``experts`` /
    ``mtp_experts`` pick the MoE layout of the target / ``mtp.*`` layers (``mtp_experts``
    defaults to ``experts``). ``include_mtp=False`` leaves out ``mtp.*`` (config.json still
    declares them, as some re-exports do). ``tokenizer=True`` adds the real Qwen tokenizer
    files (see :mod:`mtp_jax.tools.qwen_vocab`) and needs ``vocab_size >= 248077``; the
    converted tokenizer.json is cached in ``cache_dir`` (default
    :func:`mtp_jax.home.cache_root`). ``workers`` generator threads (default: CPUs, at most 8).
    ``quantize``: a scheme of :data:`~mtp_jax.tools.quantize_weights.SCHEMES` the projections
    are then stored in (``mtp_quantize``: another one, or ``"none"``, for ``mtp.*``;
    ``quantize_mtp_fc``: quantize the MTP input projections too), see
    :func:`~mtp_jax.tools.quantize_checkpoint.quantize_folder`.

    Raises ``ConfigError`` for an unsupported config, ``ValueError`` for a bad option.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    if quantize is None and (mtp_quantize is not None or quantize_mtp_fc):
        raise ValueError("mtp_quantize (--mtp-quantize) and quantize_mtp_fc "
                         "(--quantize-mtp-fc) need quantize (--quantize SCHEME).")
    if quantize is not None and quantize not in SCHEMES:
        raise ValueError(f"quantize {quantize!r} is unknown; use one of {SCHEMES}.")
    raw = config_dict(config)
    entry = entry_for_raw(raw)
    if entry.write_random is None:
        raise ConfigError(f"model_type {entry.model_type!r} registers no random-checkpoint "
                          "writer; write its checkpoint another way.")
    zero_from = None
    if tokenizer:
        n_tok = len(qwen_vocab.load_ranks()) + len(qwen_vocab.special_tokens())
        vocab = entry.config_class.from_dict(raw).vocab_size
        if vocab < n_tok:
            raise ValueError(f"tokenizer=True (--tokenizer) writes the real Qwen vocabulary "
                             f"({n_tok} ids) but the config's vocab_size is {vocab}; use a "
                             f"config with vocab_size >= {n_tok} (the released ones have 248320), "
                             "or drop it.")
        zero_from = n_tok  # logit rows past the tokenizer's ids (none when vocab == n_tok)
    entry.write_random(raw, out_dir, dtype=dtype, experts=experts, mtp_experts=mtp_experts,
                       include_mtp=include_mtp, shard_size_bytes=shard_size_bytes, seed=seed,
                       zero_rows_from=zero_from, workers=workers)
    if quantize is not None:
        quantize_folder(out_dir, quantize, mtp_scheme=mtp_quantize,
                        quantize_mtp_fc=quantize_mtp_fc)
    if tokenizer:
        qwen_vocab.write_tokenizer_files(out_dir, cache_dir=cache_dir)
    return out_dir


_GGUF_ONLY = ("gguf_expert_type", "gguf_dense_type")
_SAFETENSORS_ONLY = ("dtype", "experts", "mtp_experts", "shard_size_gb", "workers", "quantize",
                     "mtp_quantize", "quantize_mtp_fc")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_CHECKPOINT_FILES = ("config.json", "*.safetensors", "*.gguf")
_REPLACED_FILES = _CHECKPOINT_FILES + ("*.safetensors.index.json", "tokenizer.json",
                                       "tokenizer_config.json", "generation_config.json")


def _files(out: str, patterns) -> list[str]:
    return sorted({f for p in patterns for f in glob.glob(os.path.join(glob.escape(out), p))})


def check_out(out: str, overwrite: bool) -> None:
    """Make ``out`` ready for a new checkpoint: with ``overwrite``, delete the files of one
    already there (``config.json``, ``*.safetensors`` and their index, ``*.gguf``, the tokenizer
    files); other files stay.

    Raises:
      ValueError: ``out`` already holds a checkpoint and ``overwrite`` is off (the message
        names the folder, its files and the fix: ``--overwrite`` or another folder).
    """
    found = [os.path.basename(f) for f in _files(out, _CHECKPOINT_FILES)]
    if found and not overwrite:
        raise ValueError(f"--out {out} already holds a checkpoint ({', '.join(found[:4])}"
                         f"{', ...' if len(found) > 4 else ''}); writing into it would replace "
                         "or mix with its files. Pass --overwrite to replace it, or another "
                         "--out folder.")
    if found:
        for f in _files(out, _REPLACED_FILES):
            os.remove(f)


def _check_format_options(args) -> None:
    """ValueError for an option of the other format (naming it), set to its default value
    otherwise."""
    wrong = _SAFETENSORS_ONLY if args.format == "gguf" else _GGUF_ONLY
    given = [_flag(n) for n in wrong if getattr(args, n) not in (None, False)]
    if given:
        raise ValueError(f"{', '.join(given)} {'do' if len(given) > 1 else 'does'} not apply to "
                         f"--format {args.format}; "
                         + ("the GGUF types are --gguf-expert-type and --gguf-dense-type."
                            if args.format == "gguf" else "add --format gguf to write GGUFs."))
    if args.format == "gguf":
        args.gguf_expert_type = args.gguf_expert_type or "Q8_0"
        args.gguf_dense_type = args.gguf_dense_type or "BF16"
    else:
        args.dtype, args.experts = args.dtype or "bfloat16", args.experts or "fused"
        args.shard_size_gb = 2.0 if args.shard_size_gb is None else args.shard_size_gb


def _parser() -> argparse.ArgumentParser:
    from mtp_jax.tools.gguf_blocks import TYPES

    ap = argparse.ArgumentParser(prog="python -m mtp_jax.tools.random_checkpoint",
                                 description="Write a random-weight checkpoint of a "
                                             "registered family.",
                                 allow_abbrev=False)
    ap.add_argument("--config", required=True,
                    help="config.json, or a folder holding one (a checkpoint's, e.g. a test "
                         "fixture under tests/fixtures/ for a small model; configs/*.json are "
                         "the released shapes, gigabytes each)")
    ap.add_argument("--out", required=True,
                    help="output folder (one that already holds a checkpoint is refused "
                         "without --overwrite)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace a checkpoint already in --out: its config.json, "
                         "*.safetensors (and index), *.gguf and tokenizer files are deleted "
                         "first")
    ap.add_argument("--format", default="safetensors", choices=("safetensors", "gguf"),
                    help="safetensors (an HF folder, default) or gguf (qwen4_exp only: a "
                         "Flash-Next GGUF target model.gguf and a Strata MTP pack mtp.gguf)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="stored dtype (default bfloat16; safetensors)")
    ap.add_argument("--experts", default=None, choices=EXPERT_LAYOUTS,
                    help="MoE experts stored fused ([E, 2I, H] / [E, H, I]) or one tensor per "
                         "expert (default fused; safetensors)")
    ap.add_argument("--mtp-experts", default=None, choices=EXPERT_LAYOUTS,
                    help="layout of the mtp.* experts (default: --experts)")
    ap.add_argument("--no-mtp", action="store_true",
                    help="leave out the mtp.* tensors (config.json still declares the MTP "
                         "layer, as some re-exports do: run the checkpoint with "
                         "--speculative-algorithm none); with --format gguf: no mtp.gguf")
    ap.add_argument("--shard-size-gb", type=float, default=None,
                    help="GiB per safetensors shard (default 2)")
    ap.add_argument("--seed", type=int, default=0,
                    help="values are a function of the seed and the tensor name (default "
                         "%(default)s)")
    ap.add_argument("--tokenizer", action="store_true",
                    help="also write the real Qwen tokenizer and chat template (needs the "
                         "config's vocab_size >= 248077, as the released configs have); with "
                         "--format gguf as the GGUF's tokenizer.* metadata")
    ap.add_argument("--workers", type=int, default=None,
                    help="generator threads (default: the CPUs, at most 8)")
    ap.add_argument("--quantize", default=None, choices=SCHEMES,
                    help="store the projections quantized in this format, with the matching "
                         "quantization_config (default: not quantized)")
    ap.add_argument("--mtp-quantize", default=None, choices=("none",) + SCHEMES,
                    help="another format for the mtp.* tensors (a ModelOpt MIXED_PRECISION "
                         "checkpoint), or none to keep them unquantized (default: --quantize)")
    ap.add_argument("--quantize-mtp-fc", action="store_true",
                    help="also quantize the MTP input projections (mtp.fc; mtp.fc_embedding "
                         "and mtp.fc_hidden on qwen4_exp), kept unquantized by default as in "
                         "released checkpoints")
    ap.add_argument("--gguf-expert-type", default=None, choices=TYPES,
                    help="--format gguf: type of the routed experts, target and pack (default "
                         "Q8_0); rows that are not whole blocks of it fall back to Q8_0 / F32")
    ap.add_argument("--gguf-dense-type", default=None, choices=TYPES,
                    help="--format gguf: type of the target's other matrices (default BF16; "
                         "norms, convolutions and routers are F32; the n-gram table and the "
                         "pack's matrices take it when it is a float type, else BF16)")
    return ap


def _write(args) -> list[str]:
    if args.format == "gguf":
        from mtp_jax.tools.random_gguf import describe, write_random_gguf
        summaries = write_random_gguf(args.config, args.out,
                                      expert_type=args.gguf_expert_type,
                                      dense_type=args.gguf_dense_type,
                                      include_mtp=not args.no_mtp, seed=args.seed,
                                      tokenizer=args.tokenizer)
        return [describe(s) for s in summaries]
    return [write_random_checkpoint(args.config, args.out, dtype=args.dtype,
                                    experts=args.experts, mtp_experts=args.mtp_experts,
                                    include_mtp=not args.no_mtp,
                                    shard_size_bytes=int(args.shard_size_gb * (1 << 30)),
                                    seed=args.seed, tokenizer=args.tokenizer,
                                    workers=args.workers, quantize=args.quantize,
                                    mtp_quantize=args.mtp_quantize,
                                    quantize_mtp_fc=args.quantize_mtp_fc)]


def _check_config_path(path: str) -> None:
    """ValueError naming ``--config`` when it is neither a file nor a folder with config.json."""
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json")):
        return
    what = "a folder without config.json" if os.path.isdir(path) else "no such file"
    raise ValueError(f"--config {path}: {what}; pass a model config JSON (e.g. "
                     "configs/Qwen3.5-2B.json) or a checkpoint folder holding config.json.")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    existed = os.path.exists(args.out)
    try:
        _check_config_path(args.config)
        _check_format_options(args)
        check_out(args.out, args.overwrite)
        lines = _write(args)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        if not existed and os.path.isdir(args.out) and not os.listdir(args.out):
            os.rmdir(args.out)  # a refused run leaves no empty folder behind
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
