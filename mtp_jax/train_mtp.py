"""python -m mtp_jax.train_mtp: train or fine-tune a checkpoint's MTP draft layer (``mtp.*``) by
self-distillation from the frozen target, and write a checkpoint whose draft is the trained one.

The chain is trained as the engine's rounds run it (k steps, the draft's own hidden fed back);
the loss is cross-entropy to the target's greedy tokens (``--loss ce``) or KL to its
distribution (``--loss kl``). See docs/train.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from mtp_jax.train.prepare import TrainSettings


def build_parser() -> argparse.ArgumentParser:
    d = TrainSettings.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m mtp_jax.train_mtp", description=__doc__,
                                allow_abbrev=False)
    p.add_argument("--model", required=True, help="checkpoint folder (HF layout) to train the "
                   "draft of; a checkpoint without mtp.* gets a fresh head")
    p.add_argument("--out", required=True, help="new folder for the trained checkpoint")
    p.add_argument("--data", default=None, help="JSONL, one object per line with 'text', "
                   "'prompt' (a string or chat messages) or 'token_ids'")
    p.add_argument("--self-generate", type=int, default=0, metavar="N",
                   help="continue the first N prompts of --data with the target itself "
                        "(greedy unless --generate-temperature) and train on those texts")
    p.add_argument("--generate-tokens", type=int, default=d["generate_tokens"].default,
                   help="tokens generated per prompt with --self-generate (default %(default)s)")
    p.add_argument("--generate-temperature", type=float, default=0.0,
                   help="sampling temperature of --self-generate (default 0: greedy)")
    p.add_argument("--speculative-num-steps", "-k", dest="k", type=int, default=3,
                   help="chain steps trained, the k the engine will draft (default 3)")
    p.add_argument("--loss", default="ce", choices=["ce", "kl"],
                   help="ce: cross-entropy to the target's greedy token (default); kl: KL to its "
                        "distribution (for sampling at temperature 1)")
    p.add_argument("--step-decay", type=float, default=1.0,
                   help="chain step j's loss weight is decay**j (default 1: equal)")
    for flag, typ, help_ in (
            ("--steps", int, "optimizer steps"), ("--batch-size", int, "rows per step"),
            ("--seq-len", int, "tokens per row (longer texts are cut into windows)"),
            ("--lr", float, "peak learning rate (AdamW, warm-up then cosine)"),
            ("--warmup-steps", int, "linear warm-up steps"),
            ("--weight-decay", float, "AdamW weight decay"),
            ("--clip-norm", float, "global gradient-norm clip"),
            ("--eval-fraction", float, "share of the texts held out for eval"),
            ("--eval-every", int, "steps between eval passes"),
            ("--checkpoint-every", int, "steps between saved train states"),
            ("--seed", int, "data order, eval split and fresh-head seed"),
            ("--chunk", int, "rows per LM-head call in the loss (memory)")):
        name = flag[2:].replace("-", "_")
        p.add_argument(flag, type=typ, default=d[name].default,
                       help=f"{help_} (default %(default)s)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where train states are saved (orbax; default OUT.train)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest train state in --checkpoint-dir")
    p.add_argument("--fresh-head", action="store_true",
                   help="start from a newly initialised head even if the checkpoint has one")
    p.add_argument("--draft-only", action="store_true",
                   help="write only config.json and the mtp.* tensors (a folder for "
                        "--speculative-draft-model-path), not a full checkpoint")
    p.add_argument("--dtype", default="auto",
                   help="target dtype: auto (bfloat16 on a GPU, float32 on CPU), bfloat16, "
                        "float32; the draft trains in float32 and is written in the "
                        "checkpoint's dtype")
    return p


def settings_from_args(a: argparse.Namespace) -> TrainSettings:
    fields = TrainSettings.__dataclass_fields__
    return TrainSettings(**{k: v for k, v in vars(a).items() if k in fields})


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def main(argv=None) -> int:
    from mtp_jax.config import ConfigError

    args = build_parser().parse_args(argv)
    missing = [m for m in ("optax", "orbax.checkpoint") if not _importable(m)]
    if missing:
        print(f"error: train_mtp needs the 'train' extra ({', '.join(missing)} not installed): "
              "scripts/setup_venv.sh train, or pip install -e '.[train]'.", file=sys.stderr)
        return 2
    from mtp_jax.train.run import run

    try:
        summary = run(settings_from_args(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
