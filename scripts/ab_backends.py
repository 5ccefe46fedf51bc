"""A/B of kernel backends in one process (GPU machine helper; not part of the test suite).

Each variant is a model loaded with its own backends (random weights of one config) and an
engine; their decode steps (k = 0, ``--batch`` requests, ``--steps`` per call, overlap scheduling as the
benchmark times them) are timed in turns, ``--reps`` times each, so that machine drift and
context growth fall on every variant alike. Prints each turn's median step (ms) per variant.

Usage: python scripts/ab_backends.py --config configs/Qwen3.5-2B.json \
    --variant base: --variant xla_norm:norm=xla [--reps 3 --tokens 512 --steps 4]
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import jax

from mtp_jax.bench.floor import load_config
from mtp_jax.bench.run import pipelined_rounds, requests
from mtp_jax.config import ConfigError, EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.kernels import OPS, KernelBackends, choices_of
from mtp_jax.models.loader import load_model


VARIANT_SYNTAX = "NAME:[op=backend,...][,@module.ATTR=int,...]"


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """``NAME:op=backend,...,@module.ATTR=int`` -> (name, load_model backends, constants).

    ``op`` is one of :data:`mtp_jax.kernels.OPS` and ``backend`` one of its choices;
    ``module.ATTR`` an existing integer attribute (read when a program is traced).
    Raises ValueError naming the part that does not parse and the syntax."""
    name, colon, rest = text.partition(":")
    if not colon or not name or "=" in name:
        raise ValueError(f"--variant {text!r}: expected {VARIANT_SYNTAX} (a name, then a colon; "
                         "e.g. base: or xla_norm:norm=xla).")
    backends, consts = {}, {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"--variant {text!r}: {item!r} is not key=value ({VARIANT_SYNTAX}).")
        if key.startswith("@"):
            module, _, attr = key[1:].rpartition(".")
            try:
                current = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError, ValueError):
                raise ValueError(f"--variant {text!r}: {key[1:]!r} is not an attribute of an "
                                 "importable module (e.g. @pallas_kernels.paged_attention."
                                 "pallas.NUM_SMS=132).") from None
            if not isinstance(current, int) or isinstance(current, bool):
                raise ValueError(f"--variant {text!r}: {key[1:]} is {current!r}, not an int; "
                                 "only integer constants can be set.")
            try:
                consts[key[1:]] = int(value)
            except ValueError:
                raise ValueError(f"--variant {text!r}: {value!r} for {key[1:]} is not an "
                                 "int.") from None
        elif key not in OPS:
            raise ValueError(f"--variant {text!r}: {key!r} is not an op; use one of "
                             f"{', '.join(OPS)} (as --<op>-backend), or @module.ATTR.")
        elif value not in choices_of(key):
            raise ValueError(f"--variant {text!r}: {key} backend {value!r} is unknown; use one "
                             f"of {', '.join(choices_of(key))}.")
        else:
            backends[f"{key}_backend"] = value
    return name, backends, consts


def set_constants(consts: dict) -> dict:
    """Set ``module.ATTR`` integers (read when a program is traced); returns the old values."""
    old = {}
    for path, value in consts.items():
        module, _, attr = path.rpartition(".")
        mod = importlib.import_module(module)
        old[path] = getattr(mod, attr)
        setattr(mod, attr, value)
    return old


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a model config JSON (e.g. configs/*.json)")
    p.add_argument("--variant", action="append", required=True,
                   help=f"{VARIANT_SYNTAX}, once per engine (e.g. base: and "
                        "xla_norm:norm=xla); names must differ")
    p.add_argument("--reps", type=int, default=3, help="turns per variant (default 3)")
    p.add_argument("--tokens", type=int, default=512,
                   help="decode steps timed per turn (default 512)")
    p.add_argument("--steps", type=int, default=4,
                   help="decode steps per program call (default 4)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--batch", type=int, default=1, help="requests decoded together (default 1)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="the engines' (default: room for every rep)")
    args = p.parse_args()
    try:  # every variant checked before any model loads
        variants = [parse_variant(text) for text in args.variant]
    except ValueError as e:
        p.error(str(e))
    names = [v[0] for v in variants]
    if len(set(names)) != len(names):
        p.error(f"--variant names must differ; got {names}.")
    cfg = load_config(args.config)
    for name, backends, _ in variants:  # backends this machine or model cannot run
        try:
            KernelBackends.for_model(cfg, "bfloat16", **backends)
        except ConfigError as e:
            p.error(f"--variant {name}: {e}")
    runs = {}
    for name, backends, consts in variants:
        old = set_constants(consts)
        model = load_model(cfg=cfg, dtype="bfloat16", dummy_weight=True, **backends)
        eng = Engine(model, EngineConfig(
            max_running_requests=args.batch, max_model_len=args.max_model_len or args.prompt_len
            + (args.reps + 1) * (args.tokens + 64) + 256, chunked_prefill_size=args.prompt_len,
            dtype="bfloat16", enable_prefix_cache=False, num_scheduler_steps=args.steps),
            SpeculativeConfig(algorithm="none"))
        reqs = requests(args.batch, args.prompt_len, 10**6, cfg.vocab_size, 0)
        for r in reqs:
            eng.add_request(r)
        while eng.waiting or eng.prefilling:
            eng.step()
        for _ in range(3):
            eng._run_round(reqs)
        jax.block_until_ready(eng.pools)
        set_constants(old)  # the programs are compiled: later variants start from the defaults
        runs[name] = (eng, reqs)
        print(f"{name}: ready ({backends} {consts})", flush=True)
    table = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, (eng, reqs) in runs.items():
            run = pipelined_rounds(eng, reqs,
                                   lambda got, e=eng: len(got) * args.steps >= args.tokens)
            table[name].append(statistics.median(run["times"]) / args.steps * 1e3)
    for name, ms in table.items():
        print(f"{name:16s} " + " ".join(f"{m:.4f}" for m in ms)
              + f"   best {min(ms):.4f} ms ({args.batch * 1e3 / min(ms):.1f} tokens/s)")


if __name__ == "__main__":
    main()
