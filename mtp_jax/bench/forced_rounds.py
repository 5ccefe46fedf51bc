"""Forced-draft rounds of the engine benchmark (:mod:`mtp_jax.bench.forced` says what is
forced and why): the round program's own greedy continuation with every draft rejected
(:func:`rejected_drafts_reference`) and the timed rounds at a forced accept length
(:func:`forced_decode`), their drafts written on the device between two rounds in flight."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.bench.forced import (accept_fraction, commits_of_round, compare_to_reference,
                                  force_on_device)
from mtp_jax.bench.phases import (Ledger, context_span, pipelined_rounds, prefill_all,
                                  release_all, round_timing)
from mtp_jax.bench.settings import Settings
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request


def _drafts_writer(eng: Engine, reqs: list[Request], reference) -> Callable[[int], float]:
    """``force_m(m)``: writes the next round's drafts of ``reqs`` on the device, the first
    ``m`` right by ``reference`` and the rest wrong (:func:`force_on_device`); returns the
    host seconds of the dispatch."""
    slots = jnp.asarray([r.slot for r in reqs], jnp.int32)
    ref = jnp.asarray(np.asarray([list(x) for x in reference], np.int32))
    vocab = jnp.int32(eng.model.cfg.vocab_size)

    def force_m(m: int) -> float:
        t0 = time.perf_counter()
        nt = force_on_device(eng.pools.next_tokens, eng.pools.step, slots, ref, jnp.int32(m),
                             vocab)
        eng.device.pools = dataclasses.replace(eng.pools, next_tokens=nt)
        return time.perf_counter() - t0

    return force_m


def _prefill_and_force(eng: Engine, reqs: list[Request], reference, k: int, m: int,
                       ledger: Ledger, programs: tuple[str, str] | None) -> Callable[[int], float]:
    """Prefill ``reqs`` and write their first round's drafts (``m`` right); returns the
    :func:`_drafts_writer` for the rounds after. ``programs``: as
    :func:`rejected_drafts_reference` (the prefill's and the overwrite's first calls are
    recorded when given)."""
    prefill_all(eng, reqs, ledger, "warmup", programs[0] if programs else None)
    force_m = _drafts_writer(eng, reqs, reference)
    with ledger.phase("warmup", f"force_on_device[B={len(reqs)},k={k}]" if programs else None):
        force_m(m)
        jax.block_until_ready(eng.pools.next_tokens)
    return force_m


def rejected_drafts_reference(eng: Engine, reqs: list[Request], reference, k: int,
                              s: Settings, ledger: Ledger,
                              programs: tuple[str, str] | None) -> list[list[int]]:
    """The round program's own greedy continuation: prefill ``reqs``, then rounds whose drafts
    are all wrong by ``reference`` (the plain-decoding continuation), so that each commits one
    token, the target's choice at verify row 0, until every request holds ``reference_len``
    tokens (untimed, under ``warmup``). ``programs``: names of the prefill and round programs
    when this is their first call (recorded with their compile counts), else ``None``.

    With an exact engine this equals ``reference`` in float32. In 16-bit dtypes the verify's
    (k+1)-row matmuls may round a near-tie of a random-weight model differently from the
    decode step's one row, and the two continuations part there. The forced runs compare
    against this continuation, computed by the same round program whatever the accept length,
    so that such a near-tie neither hides a real mismatch nor ends their accept lengths; the
    comparison with plain decoding is reported apart (``decode_match``)."""
    force_m = _prefill_and_force(eng, reqs, reference, k, 0, ledger, programs)
    first = True
    while min(len(r.output_ids) for r in reqs) < s.reference_len:
        with ledger.phase("warmup", programs[1] if programs and first else None):
            eng.scheduler.run_round(reqs)
        with ledger.phase("warmup"):
            force_m(0)
        first = False
    out = [list(r.output_ids[:s.reference_len]) for r in reqs]
    release_all(eng, reqs)
    return out


def forced_decode(eng: Engine, reqs: list[Request], reference, accept_length: float, k: int,
                  s: Settings, ledger: Ledger) -> dict:
    """Prefill ``reqs``, then forced rounds at ``accept_length``: ``warmup_rounds`` untimed,
    then timed until each request committed ``decode_tokens`` tokens (the programs' first
    calls are :func:`rejected_drafts_reference`'s)."""
    a = accept_fraction(accept_length, k)
    force_m = _prefill_and_force(eng, reqs, reference, k, commits_of_round(a, 0) - 1, ledger,
                                 None)
    force_s: list[float] = []
    for i in range(s.warmup_rounds):
        with ledger.phase("warmup"):
            eng.scheduler.run_round(reqs)
        with ledger.phase("warmup"):
            # the alternation restarts with the timed phase: its R rounds commit floor(a R)
            force_m(commits_of_round(a, i + 1 if i + 1 < s.warmup_rounds else 0) - 1)

    def force(i: int) -> None:  # drafts of timed round i, after round i - 1 (both in flight)
        force_s.append(force_m(commits_of_round(a, i) - 1))

    tally = [0] * len(reqs)  # tokens each request committed so far (kept incrementally: the
    # check runs inside the timed loop)

    def counted(results: list[dict]) -> bool:
        for i, r in enumerate(reqs):
            tally[i] += len(results[-1].get(r, ()))
        return min(tally) >= s.decode_tokens

    with ledger.phase("timed"):
        run = pipelined_rounds(eng, reqs, counted, force)
    times, host, positions, wall = run["times"], run["host"], run["positions"], run["wall"]
    commits = [float(np.mean([len(new.get(r, ())) for r in reqs])) for new in run["results"]]
    done = [sum(len(new.get(r, ())) for new in run["results"]) for r in reqs]
    timing = round_timing(times, host)
    measured = float(np.mean(commits))
    check = compare_to_reference([r.output_ids for r in reqs], reference)
    release_all(eng, reqs)
    return {"accept_length": accept_length, "accept_length_measured": measured, **timing,
            "_times": times, "_host": host, "context": context_span(positions),
            "overwrite_ms": float(np.median(force_s) * 1e3) if force_s else 0.0,
            "tokens_per_s_e2e": sum(done) / wall, "wall_s": wall,
            "tokens_per_s_derived": measured * len(reqs) / (timing["round_ms"] / 1e3),
            **check}
