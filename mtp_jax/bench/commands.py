"""``python -m mtp_jax.bench [SUBCOMMAND] [flags]``: which subcommand runs.

No subcommand (the first argument a flag, or nothing) or ``engine``: the engine benchmark
(:mod:`mtp_jax.bench.cli`), with the flags docs/benchmarks.md documents; ``--help`` there lists
the subcommands first. The others (:data:`SUBCOMMANDS`) time one op or compare engines, each
with its own ``--help``.
"""

from __future__ import annotations

import sys
import textwrap

from mtp_jax.bench import ab_backends, cli, prefill_burst, prefix_hits, profile_round, qwen4_smoke
from mtp_jax.bench.ops import attention, draft_head, gdn, gemv, moe, sampling

SUBCOMMANDS = {"engine": cli, "attention": attention, "gdn": gdn, "moe": moe, "gemv": gemv,
               "sampling": sampling, "draft-head": draft_head, "ab": ab_backends,
               "profile": profile_round, "prefix-hits": prefix_hits,
               "prefill-burst": prefill_burst, "qwen4-smoke": qwen4_smoke}


def subcommand_list() -> str:
    """The subcommands, one entry each with its summary (the head of ``--help``)."""
    out = ["Subcommands (python -m mtp_jax.bench SUBCOMMAND --help: its flags and what it "
           "measures):", ""]
    for name, module in SUBCOMMANDS.items():
        out += textwrap.wrap(module.SUMMARY, 94, initial_indent=f"  {name:<14}",
                             subsequent_indent=" " * 16)
    out += ["", "Without a subcommand, or with engine: the engine benchmark, below.", "", ""]
    return "\n".join(out)


def main(argv=None, engine_doc: str | None = None) -> int:
    """Run the subcommand that ``argv`` names (default: the engine benchmark with ``argv``);
    returns its exit status: 0, 1 (the engine benchmark's failed checks) or 2 (bad arguments,
    an unknown subcommand, a refused GPU path)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        name, rest = argv[0], argv[1:]
        if name not in SUBCOMMANDS:
            print(f"error: unknown subcommand {name!r}; use one of "
                  f"{', '.join(SUBCOMMANDS)} (python -m mtp_jax.bench --help lists them).",
                  file=sys.stderr)
            return 2
        if name != "engine":
            return SUBCOMMANDS[name].main(rest)
        argv = rest
    return cli.main(argv, description=subcommand_list() + (engine_doc or ""))
