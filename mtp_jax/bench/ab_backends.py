"""``python -m mtp_jax.bench ab``: an A/B of kernel backends (or kernel constants) on the engine's
decode step, every variant in one process.

Each ``--variant NAME:op=backend,...,@module.ATTR=int`` is a model loaded with its own
``--<op>-backend`` values (random weights of ``--config``, ``--dtype``) and, while its programs
are traced, its own integer constants (e.g. ``@pallas_kernels.paged_attention.pallas.NUM_SMS=64``);
each gets an engine with ``--batch`` requests of ``--prompt-len`` tokens, prefilled, and 3
warm-up calls. Then, ``--reps`` times in turn (so that machine drift and context growth fall on
every variant alike), each variant's decode steps (k = 0, ``--steps`` per program call, rounds
overlapped as the engine serves them: :func:`mtp_jax.bench.phases.pipelined_rounds`) until
``--tokens`` steps are timed; a turn's time is the median step.

One row per variant: the best turn's step time (the turns in ``turns_us``, their median in
``median_us``), the bytes a decode step moves at the mean context
(:func:`mtp_jax.bench.floor.round_bytes`) and the fraction of the HBM floor. Every variant is
checked (syntax, op, backend, constant, duplicate names, backends this machine or model cannot
run, e.g. a Pallas kernel without a GPU) before any model loads.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import sys

import jax
import numpy as np

from mtp_jax.bench.floor import round_bytes
from mtp_jax.bench.phases import Ledger, pipelined_rounds, prefill_all
from mtp_jax.bench.report import op_row, shape_name
from mtp_jax.bench.settings import requests
from mtp_jax.bench.subcommand import Refused, Results, config_of, parser, positive, run
from mtp_jax.config import ConfigError, EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.executable_key import CHANGED_CONSTANTS
from mtp_jax.kernels import OPS, KernelBackends, choices_of
from mtp_jax.models.loader import load_model

SUMMARY = ("an A/B of kernel backends or kernel constants on the engine's decode step, "
           "variants timed in turns in one process")
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
        if key[1:] in consts or f"{key}_backend" in backends:
            raise ValueError(f"--variant {text!r}: {key} is given twice; give each op or "
                             "constant once in a variant.")
        if key.startswith("@"):
            consts[key[1:]] = _constant(text, key[1:], value)
        elif key not in OPS:
            raise ValueError(f"--variant {text!r}: {key!r} is not an op; use one of "
                             f"{', '.join(OPS)} (as --<op>-backend), or @module.ATTR.")
        elif value not in choices_of(key):
            raise ValueError(f"--variant {text!r}: {key} backend {value!r} is unknown; use one "
                             f"of {', '.join(choices_of(key))}.")
        else:
            backends[f"{key}_backend"] = value
    return name, backends, consts


def _constant(text: str, path: str, value: str) -> int:
    """The int ``value`` for the existing integer attribute ``module.ATTR`` at ``path``;
    ValueError naming the variant ``text`` otherwise."""
    module, _, attr = path.rpartition(".")
    try:
        mod = importlib.import_module(module)
    except (ImportError, ValueError):
        raise ValueError(f"--variant {text!r}: {path!r} is not an attribute of an importable "
                         "module (e.g. @pallas_kernels.paged_attention.pallas.NUM_SMS=132)."
                         ) from None
    if not hasattr(mod, attr):
        raise ValueError(f"--variant {text!r}: module {module} has no attribute {attr!r}; its "
                         f"integer constants: {', '.join(_int_constants(mod)) or 'none'}.")
    current = getattr(mod, attr)
    if not isinstance(current, int) or isinstance(current, bool):
        raise ValueError(f"--variant {text!r}: {path} is {current!r}, not an int; only integer "
                         "constants can be set.")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"--variant {text!r}: {value!r} for {path} is not an int.") from None
    if number < 0:
        raise ValueError(f"--variant {text!r}: {path}={number} must be >= 0 (a count, a size "
                         "or a switch).")
    return number


def _int_constants(mod) -> list[str]:
    return sorted(k for k, v in vars(mod).items()
                  if k.isupper() and isinstance(v, int) and not isinstance(v, bool))


def set_constants(consts: dict, *, restore: bool = False) -> dict:
    """Set ``module.ATTR`` integers (read when a program is traced); returns the old values.
    The values set are in the key of every program built meanwhile
    (:data:`mtp_jax.engine.executable_key.CHANGED_CONSTANTS`), so a saved program of another
    variant is never loaded for this one; ``restore``: the old values come back, and leave
    the key."""
    old = {}
    for path, value in consts.items():
        module, _, attr = path.rpartition(".")
        mod = importlib.import_module(module)
        old[path] = getattr(mod, attr)
        setattr(mod, attr, value)
        if restore:
            CHANGED_CONSTANTS.pop(path, None)
        else:
            CHANGED_CONSTANTS[path] = value
    return old


def variant(text: str) -> tuple[str, dict, dict]:
    """argparse type of ``--variant`` (:func:`parse_variant`; its message on a bad one)."""
    try:
        return parse_variant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``ab`` flags."""
    p = parser("ab", __doc__)
    p.add_argument("--config", required=True, help="a model config JSON (e.g. configs/*.json)")
    p.add_argument("--variant", type=variant, action="append", required=True,
                   help=f"{VARIANT_SYNTAX}, once per engine (e.g. base: and xla_norm:norm=xla); "
                        f"names must differ; ops: {', '.join(OPS)}")
    p.add_argument("--reps", type=positive(int), default=3, help="turns per variant (default 3)")
    p.add_argument("--tokens", type=positive(int), default=512,
                   help="decode steps timed per turn (default 512)")
    p.add_argument("--steps", type=positive(int), default=4,
                   help="decode steps per program call (default 4)")
    p.add_argument("--prompt-len", type=positive(int), default=1024,
                   help="prompt tokens (default 1024)")
    p.add_argument("--batch", type=positive(int), default=1,
                   help="requests decoded together (default 1)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weights and activations (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="the engines' (default: room for every turn)")
    return p


def check(a) -> object:
    """The config, after every variant's names and backends were checked (:class:`Refused`
    naming the variant and the fix)."""
    names = [v[0] for v in a.variant]
    if len(set(names)) != len(names):
        raise Refused(f"--variant names must differ; got {names}: rename one.")
    cfg = config_of(a.config)
    for name, backends, _ in a.variant:  # backends this machine or model cannot run
        try:
            KernelBackends.for_model(cfg, a.dtype, **backends)
        except ConfigError as e:  # its fix names the CLI flag; here a variant's op=backend
            fix = re.sub(r"--(\w+)-backend ", r"\1=", str(e))
            raise Refused(f"--variant {name}: {fix}") from None
    return cfg


def ready_engine(a, cfg, name: str, backends: dict, consts: dict):
    """A variant's engine with its requests prefilled and 3 warm-up calls made (its programs
    traced with ``consts`` set, then the constants restored)."""
    print(f"ab: building variant {name!r} (load, prefill, 3 warm-up calls)", file=sys.stderr,
          flush=True)
    old = set_constants(consts)
    try:
        model = load_model(cfg=cfg, dtype=a.dtype, dummy_weight=True, with_mtp=False,
                           **backends)
        room = a.prompt_len + (a.reps + 1) * (a.tokens + 64 * a.steps) + 256
        eng = Engine(model, EngineConfig(
            max_running_requests=a.batch, max_model_len=a.max_model_len or room,
            chunked_prefill_size=a.prompt_len, dtype=a.dtype, enable_prefix_cache=False,
            num_scheduler_steps=a.steps), SpeculativeConfig(algorithm="none"))
        reqs = requests(a.batch, a.prompt_len, 10**6, cfg.vocab_size, 0)
        prefill_all(eng, reqs, Ledger(), "warmup", None)
        for _ in range(3):
            eng.scheduler.run_round(reqs)
        jax.block_until_ready(eng.pools)
    finally:
        set_constants(old, restore=True)  # compiled: later variants start from the defaults
    return eng, reqs


def bench(a, results: Results) -> None:
    """Every variant, in turns (see the module docstring)."""
    cfg = check(a)
    runs = {name: ready_engine(a, cfg, name, backends, consts)
            for name, backends, consts in a.variant}
    turns = {name: [] for name in runs}
    context = {name: [] for name in runs}
    for _ in range(a.reps):
        for name, (eng, reqs) in runs.items():
            run_ = pipelined_rounds(eng, reqs, lambda got: len(got) * a.steps >= a.tokens)
            turns[name].append(statistics.median(run_["times"]) / a.steps)
            context[name] += run_["positions"]
    itemsize = 4 if a.dtype == "float32" else 2
    shape = shape_name(a.config)
    for name, backends, consts in a.variant:
        by = round_bytes(cfg, a.batch, 0, round(float(np.mean(context[name]))), itemsize)
        results.add(op_row(
            "decode step", f"{shape} B={a.batch} {a.steps}/call", name, min(turns[name]),
            by["total"], hbm_tbps=a.hbm_tbps, turns_us=[t * 1e6 for t in turns[name]],
            median_us=statistics.median(turns[name]) * 1e6,
            tokens_per_s=a.batch / min(turns[name]), backends=backends, constants=consts))


def main(argv=None) -> int:
    """``python -m mtp_jax.bench ab``; 0, or 2 for refused variants."""
    return run("ab", build_parser(), bench, argv)
