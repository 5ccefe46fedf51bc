"""What every subcommand of ``python -m mtp_jax.bench`` shares: its parser (name, help text, the
output flags), comma-list argument types, the GPU check with its one-line refusal, and the
results (:class:`Results`: op rows of :func:`mtp_jax.bench.report.op_row`, the JSON file
rewritten after each row, the markdown table on stdout at the end).

A subcommand module defines ``SUMMARY`` (one line for the subcommand list), ``build_parser()``
and ``main(argv) -> int``, which calls :func:`run`: 0 done, 2 refused (bad values, or a GPU
path on a machine without one: one ``error:`` line naming the flag and the fix).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Callable

import jax

from mtp_jax.bench import report
from mtp_jax.bench.floor import load_config
from mtp_jax.config import ConfigError

PROG = "python -m mtp_jax.bench"


class Refused(Exception):
    """Values this machine cannot run (a Pallas kernel without a GPU, ...): the message names
    the flag and the fix; :func:`run` prints it as one ``error:`` line and returns 2."""


def plain_text(doc: str | None) -> str | None:
    """A docstring for ``--help``: reST roles (``:mod:`x``` -> ``x``) and inline-literal
    backticks removed."""
    if doc is None:
        return None
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", doc).replace("``", "")


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (``python -m mtp_jax.bench NAME``), ``doc`` its help
    text, with ``--out`` and ``--hbm-tbps``."""
    p = argparse.ArgumentParser(prog=f"{PROG} {name}", description=plain_text(doc),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--out", default=f"bench-{name}.json",
                   help="JSON results, rewritten after each row (default %(default)s)")
    p.add_argument("--hbm-tbps", type=positive(float), default=4.2,
                   help="HBM bandwidth of the floor, TB/s (default %(default)s: the H200's)")
    return p


def positive(kind: type) -> Callable[[str], float]:
    """argparse type: a number of ``kind`` above 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be above 0")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def int_list(text: str) -> list[int]:
    """argparse type: ``"1,8,32"`` -> ``[1, 8, 32]``, each at least 1."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers "
                                         "(e.g. 1,8,32)") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def name_list(choices) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated list of names from ``choices``, in the order given."""
    def parse(text: str) -> list[str]:
        names = [v for v in text.split(",") if v]
        bad = [v for v in names if v not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)} "
                                             "(comma-separated)")
        return list(dict.fromkeys(names))
    parse.__name__ = "list"
    return parse


def config_of(path: str):
    """:func:`mtp_jax.bench.floor.load_config`, its errors (no file, not JSON, unknown family,
    bad field) raised as :class:`Refused` naming ``--config``."""
    try:
        return load_config(path)
    except (OSError, ValueError) as e:
        raise Refused(f"--config {path}: {e}") from None


def platform() -> str:
    """The JAX backend (``"gpu"``, ``"cpu"``, ...)."""
    return jax.default_backend()


def on_gpu() -> bool:
    """Whether JAX runs on a (CUDA) GPU."""
    return platform() in ("gpu", "cuda")


def require_gpu(what: str, fix: str,
                why: str = "the Pallas kernels use the Triton lowering") -> None:
    """Raise :class:`Refused` without a GPU: ``what`` (the flag or op) needs one (``why``);
    ``fix`` says what to do instead."""
    if not on_gpu():
        raise Refused(f"{what} needs a CUDA GPU ({why}) but JAX runs on {platform()!r}; "
                      f"{fix}.")


def pick_variants(name: str, asked: list[str] | None, everything: list[str],
                  gpu_only: tuple[str, ...]) -> list[str]:
    """The variants to time: ``asked`` (``--variants``), or ``everything`` when not given.
    Without a GPU, asked GPU-only variants raise :class:`Refused`; unasked ones are dropped
    with a note on stderr (the XLA variants run alone)."""
    xla = [v for v in (asked or everything) if v not in gpu_only]
    if on_gpu():
        return list(asked or everything)
    if asked is not None:
        bad = [v for v in asked if v in gpu_only]
        if bad:
            cpu = xla or [v for v in everything if v not in gpu_only]
            require_gpu(f"{name} --variants {','.join(bad)}",
                        f"pass --variants {','.join(cpu)} to time the XLA variants only, or "
                        "run on a GPU machine")
        return list(asked)
    if xla != list(everything):
        print(f"note: {name}: no GPU (JAX runs on {platform()!r}): timing the XLA variants only "
              f"({', '.join(xla)}); the Pallas ones need a CUDA GPU.", file=sys.stderr)
    return xla


class Results:
    """The op rows of one subcommand run: each :meth:`add` prints a progress line (stderr) and
    rewrites ``--out`` (``{"meta": run metadata, "results": [rows]}``); :meth:`table` is the
    markdown table."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.out = args.out
        self.meta = report.run_metadata(dict(vars(args)), None, None)
        self.meta["subcommand"] = name
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        """Keep ``row``, print its progress line, rewrite the JSON."""
        self.rows.append(row)
        print(report.op_progress(row), file=sys.stderr, flush=True)
        self.write()

    def write(self) -> None:
        """Rewrite ``--out`` with the metadata and the rows so far."""
        with open(self.out, "w") as f:
            json.dump({"meta": self.meta, "results": self.rows}, f, indent=1)

    def table(self) -> str:
        """The rows as markdown (:func:`mtp_jax.bench.report.op_table`) and the run's line."""
        m = self.meta
        commit = m["git_commit"] or "unknown commit"
        return (f"{report.op_table(self.rows)}\n\n{m['date_utc']}, {commit}"
                f"{' (dirty)' if m['git_dirty'] else ''}, jax {m['jax_version']}, "
                f"{m['device_kind']}, XLA_FLAGS={m['xla_flags']!r}")


def run(name: str, p: argparse.ArgumentParser, body: Callable[[argparse.Namespace, Results],
                                                               None], argv=None) -> int:
    """Parse ``argv`` (argparse exits with status 2 on a bad value), run ``body(args,
    results)`` and print the table. Returns 0, or 2 when ``body`` raised :class:`Refused`,
    ``ConfigError`` or ``OSError`` (printed as one ``error:`` line)."""
    args = p.parse_args(argv)
    results = Results(name, args)
    try:
        body(args, results)
    except (Refused, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not results.rows:
        print(f"note: {name}: no row was timed (every case was skipped).", file=sys.stderr)
        return 0
    results.write()
    print(results.table())
    return 0
