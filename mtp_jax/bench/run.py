"""One benchmark row: a (model, batch, k) engine driven step by step (:func:`bench_one`).

The phases it drives are :mod:`mtp_jax.bench.phases` (engine, prefills, decode steps, the
overlapped round loop) and :mod:`mtp_jax.bench.forced_rounds` (forced drafts); the shared
settings and requests are :mod:`mtp_jax.bench.settings`.

Phases, with XLA compilations counted in each (:mod:`mtp_jax.bench.compiles`):

* ``engine_setup``: the engine and its pools;
* ``engine_warmup`` (``Settings.engine_warmup`` only): ``Engine.warmup()``, every prefill and
  batch bucket of the engine compiled as a server start-up does (the programs' first calls
  below then find them compiled);
* ``warmup``: every request's prefill (the first one times the prefill program's first call),
  the prefill-throughput calls, the warm-up rounds (the first one times the round program's
  first call) and, for k > 0, the first forced-draft call;
* ``timed``: the decode (must compile nothing);
* ``reference``: the plain-decoding reference of a k > 0 row when k = 0 was not benchmarked.

k = 0: ``decode_tokens`` timed decode steps. k > 0: first the round program's own greedy
continuation (:func:`~mtp_jax.bench.forced_rounds.rejected_drafts_reference`: every draft
wrong, untimed), compared with plain decoding; then for each forced accept length, a fresh
prefill of the same prompts and forced rounds (:mod:`mtp_jax.bench.forced`) against that
continuation, until every request has committed ``decode_tokens`` tokens in the timed phase.
Timed rounds run as the engine runs them with ``overlap_schedule``
(:func:`~mtp_jax.bench.phases.pipelined_rounds`): round i + 1 is dispatched before round i's
result is read, and a round's time is the interval between two results. The forced drafts of
round i + 1 are written on the device between the two dispatches
(:func:`~mtp_jax.bench.forced.force_on_device`); its device time is inside the round times
(a few microseconds) and its host dispatch time is reported apart (``overwrite_ms``). A k > 0
row with several rounds per call (:func:`~mtp_jax.bench.phases.drafted_rounds`) keeps the MTP
drafts as drafted.

Sampled rows (``Settings.temperature`` > 0, with ``top_p`` / ``top_k``): every request samples
(seeded), so the programs' sampling variant runs (filtering, draws, and for k > 0 rejection
sampling of the drafts). k = 0 times decode steps as above; k > 0 takes the drafts as drafted
(:func:`drafted_rounds`, at any rounds per call: nothing can be forced into a sampled
acceptance). No exactness is checked on them (a sample has no single right continuation; the
sampling tests check the distributions); the round time does not depend on acceptance.
"""

from __future__ import annotations

import gc

import jax
import numpy as np

from mtp_jax.bench.floor import round_bytes
from mtp_jax.bench.forced import accept_fraction, compare_to_reference
from mtp_jax.bench.forced_rounds import forced_decode, rejected_drafts_reference
from mtp_jax.bench.phases import (Ledger, bucket_names, drafted_rounds, make_engine,
                                  measure_prefill, pipelined_rounds, plain_decode, prefill_all,
                                  release_all, round_timing)
from mtp_jax.bench.settings import Settings, requests
from mtp_jax.engine.warmup import batch_buckets, prefill_buckets

# Names other modules and tests import from here (the row's phases live in phases.py and
# forced_rounds.py; tests patch plain_reference and rejected_drafts_reference on this module).
__all__ = ["Ledger", "Settings", "bench_one", "drafted_rounds", "forced_decode", "make_engine",
           "pipelined_rounds", "plain_decode", "plain_reference", "rejected_drafts_reference",
           "requests"]


def plain_reference(model, batch: int, s: Settings, ledger: Ledger) -> list[list[int]]:
    """Plain-decoding (k = 0) continuations of the benchmark prompts, ``reference_len``
    tokens each (untimed; compiles counted under ``reference``)."""
    with ledger.phase("reference"):
        eng = make_engine(model, batch, 0, s)
    reqs = requests(batch, s.prompt_len, 10**9, model.cfg.vocab_size, 0)
    prefill_all(eng, reqs, ledger, "reference", None)
    plain_decode(eng, reqs, s, ledger, None, warm="reference", timed=None)
    out = [list(r.output_ids[:s.reference_len]) for r in reqs]
    release_all(eng, reqs)
    del eng
    gc.collect()
    return out


def bench_one(model, batch: int, k: int, s: Settings, refs: dict,
              steps: int = 1) -> dict:
    """Benchmark one (batch, k) with ``steps`` rounds per program call; returns the result.

    ``refs``: the continuations of this batch's prompts shared by its rows, filled in here:
    ``"plain"`` (plain decoding: from the k = 0 row, or decoded first for a k > 0 row) and,
    for each k > 0 with a forced row (one round per call), ``k``: the round program's own
    greedy continuation (:func:`rejected_drafts_reference`). A k > 0 row with ``steps`` > 1
    (:func:`drafted_rounds`) is compared with both (with the second when its forced row ran
    first, as the CLI orders them).
    """
    cfg = model.cfg
    ledger = Ledger()
    if k and not s.sampled and "plain" not in refs:
        refs["plain"] = plain_reference(model, batch, s, ledger)
    with ledger.phase("engine_setup"):
        eng = make_engine(model, batch, k, s, steps)
    names = bucket_names(eng, batch, k, s)
    res: dict = {"batch": batch, "k": k, "prompt_len": s.prompt_len,
                 "prefill_chunk": s.chunk_size,
                 "decode_tokens": s.decode_tokens, "steps_per_call": eng.rounds_per_call,
                 "prefix_cache": s.prefix_cache,
                 "draft_vocab_size": s.draft_vocab_size if k else None,
                 "draft_head_dtype": s.draft_head_dtype if k else None,
                 "draft_layer_dtype": s.draft_layer_dtype if k else None,
                 "sampling": ({"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
                              if s.sampled else None)}
    if s.engine_warmup:
        with ledger.phase("engine_warmup") as w:
            eng.warmup()
        buckets = {"prefill": prefill_buckets(eng.scheduler.settings.chunk_size,
                                              eng.max_model_len),
                   "batch": batch_buckets(eng.book.max_requests)}
        res["engine_warmup"] = {"buckets": buckets, **w.as_dict()}
    reqs = requests(batch, s.prompt_len, 10**9, cfg.vocab_size, 0,
                    s.sampling_params(10**9) if s.sampled else None)
    if s.sampled:
        prefill_all(eng, reqs, ledger, "warmup", names[0])
        with ledger.phase("warmup"):
            prefill_s = measure_prefill(eng, s, cfg.vocab_size)
        row = _sampled_row(eng, reqs, k, s, ledger, names)
        release_all(eng, reqs)
    elif k and eng.rounds_per_call == 1:
        row, prefill_s = _forced_row(eng, reqs, k, s, refs, ledger, names)
    else:
        prefill_all(eng, reqs, ledger, "warmup", names[0])
        with ledger.phase("warmup"):
            prefill_s = measure_prefill(eng, s, cfg.vocab_size)
        row = (_plain_row if k == 0 else _drafted_row)(eng, reqs, k, s, refs, ledger, names)
        release_all(eng, reqs)
    res.update(row)
    res["prefill_s"] = prefill_s
    res["prefill_tokens_per_s"] = s.prompt_len / prefill_s
    itemsize = 2 if model.dtype != "float32" else 4
    by = round_bytes(cfg, batch, k, round(res["context"]["mean"]), itemsize,
                     draft_vocab_size=res["draft_vocab_size"],
                     draft_head_dtype=res["draft_head_dtype"],
                     draft_layer_dtype=res["draft_layer_dtype"],
                     **_quantized_floor(model))
    floor = by["total"] / (s.hbm_tbps * 1e12)
    res["bytes"] = {name: float(v) for name, v in by.items()}
    res["floor_ms"] = floor * 1e3
    res["fraction_of_floor"] = floor / (res["round_ms"] / 1e3)
    res["programs"] = ledger.programs
    res["compiles"] = {name: w.as_dict() for name, w in ledger.phases.items()}
    res["compiles_timed"] = ledger.compiles("timed")
    res["compiles_warmup"] = ledger.compiles("warmup")
    res["startup_s"] = float(sum(p["first_call_s"] for p in ledger.programs))
    built = sum(p["compiles"] for p in ledger.programs)
    hits = sum(p["cache_hits"] for p in ledger.programs)
    res["startup_from_cache"] = ("none" if built == 0 else "cached" if hits == built
                                 else "cold" if hits == 0 else "mixed")
    res["compiled_programs"] = eng.compiled_program_count()
    stats = jax.devices()[0].memory_stats() or {}
    res["peak_device_bytes"] = stats.get("peak_bytes_in_use")
    del eng
    gc.collect()
    return res


def _plain_row(eng, reqs, k, s, refs, ledger, names) -> dict:
    """k = 0 (``reqs`` prefilled): :func:`plain_decode`; its continuation becomes the batch's
    plain reference unless one is there."""
    run = plain_decode(eng, reqs, s, ledger, names[1])
    refs.setdefault("plain", [list(r.output_ids[:s.reference_len]) for r in reqs])
    # exact None: plain decoding is the reference itself
    return {**run, "tokens_per_s": len(reqs) / (run["round_ms"] / 1e3), "exact": None}


def _derived(run: dict, batch: int, k: int, accept_lengths) -> dict[str, float]:
    """Tokens/s at each accept length a k-draft round can commit (1 to k + 1): accept length
    x batch / the median round time (which does not depend on acceptance)."""
    return {str(al): al * batch / (run["round_ms"] / 1e3) for al in accept_lengths
            if 1 <= al <= k + 1}


def _sampled_row(eng, reqs, k, s, ledger, names) -> dict:
    """A sampled row (``reqs`` prefilled): k = 0, :func:`plain_decode`; k > 0,
    :func:`drafted_rounds` (the measured accept length is the random model's) and the derived
    tokens/s at the accept lengths a round can commit. ``exact`` is None (not checked)."""
    if not k:
        run = plain_decode(eng, reqs, s, ledger, names[1], fill_reference=False)
        return {**run, "tokens_per_s": len(reqs) / (run["round_ms"] / 1e3), "exact": None}
    run = drafted_rounds(eng, reqs, s, ledger, names[1])
    return {**run, "exact": None,
            "tokens_per_s_at_accept_length": _derived(run, len(reqs), k, s.accept_lengths)}


def _drafted_row(eng, reqs, k, s, refs, ledger, names) -> dict:
    """k > 0 with several rounds per call (``reqs`` prefilled): :func:`drafted_rounds`, the
    derived tokens/s at the accept lengths a round can commit, and the committed tokens
    against plain decoding (``decode_match``) and the forced row's continuation
    (``rounds_match``, when that row ran)."""
    run = drafted_rounds(eng, reqs, s, ledger, names[1])
    row = {**run,
           "tokens_per_s_at_accept_length": _derived(run, len(reqs), k, s.accept_lengths)}
    outputs = [list(r.output_ids) for r in reqs]
    row["decode_match"] = compare_to_reference(_cut(outputs, refs["plain"]), refs["plain"])
    if k in refs:
        row["rounds_match"] = compare_to_reference(_cut(outputs, refs[k]), refs[k])
        row["rounds_exact"] = row["rounds_match"]["exact"]
    row["exact"] = row.get("rounds_exact", True) and row["decode_match"]["exact"]
    return row


def _forced_row(eng, reqs, k, s, refs, ledger, names) -> tuple[dict, float]:
    """k > 0, one round per call: the rounds' own continuation
    (:func:`rejected_drafts_reference`, stored as ``refs[k]``), then :func:`forced_decode` at
    each accept length that k can force. Returns ``(row, prefill seconds)``."""
    vocab = eng.model.cfg.vocab_size
    rounds_ref = rejected_drafts_reference(eng, reqs, refs["plain"], k, s, ledger, names)
    refs[k] = rounds_ref
    forced, skipped, prefill_s = [], [], None
    for al in s.accept_lengths:
        try:
            accept_fraction(al, k)
        except ValueError as e:
            skipped.append({"accept_length": al, "reason": str(e)})
            continue
        reqs = requests(len(reqs), s.prompt_len, 10**9, vocab, 0)
        forced.append(forced_decode(eng, reqs, rounds_ref, al, k, s, ledger))
        if prefill_s is None:
            with ledger.phase("warmup"):
                prefill_s = measure_prefill(eng, s, vocab)
    if not forced:
        raise ValueError(f"no accept length of {list(s.accept_lengths)} can be forced with "
                         f"k={k} (each must be in [1, {k + 1}]).")
    pooled = [t for f in forced for t in f.pop("_times")]
    row = round_timing(pooled, [t for f in forced for t in f.pop("_host")])
    row["context"] = {"start": min(f["context"]["start"] for f in forced),
                      "end": max(f["context"]["end"] for f in forced),
                      "mean": float(np.mean([f["context"]["mean"] for f in forced]))}
    row["tokens_per_s_at_accept_length"] = {
        str(f["accept_length"]): f["accept_length"] * len(reqs) / (row["round_ms"] / 1e3)
        for f in forced}
    row["forced"] = forced
    row["skipped_accept_lengths"] = skipped
    row["rounds_exact"] = all(f["exact"] for f in forced)
    row["decode_match"] = compare_to_reference(rounds_ref, refs["plain"])
    row["exact"] = row["rounds_exact"] and row["decode_match"]["exact"]
    return row, prefill_s


def _quantized_floor(model) -> dict:
    """``round_bytes`` keywords for weights held quantized (``bench --quantization``): the
    ``(target, draft)`` bytes a read of the projections saves and the routed experts' bytes
    ratio; none for a model without them."""
    if not getattr(model, "weight_bytes_saved", 0):
        return {}
    from mtp_jax.models.quantized import experts_bytes_ratio, saved_bytes_by_part

    module = model.module()
    return {"quantized_saving": saved_bytes_by_part(module),
            "experts_ratio": experts_bytes_ratio(module)}


def _cut(outputs: list[list[int]], reference: list[list[int]]) -> list[list[int]]:
    """Each output cut to its reference's length (a drafted row may run past it)."""
    return [out[:len(ref)] for out, ref in zip(outputs, reference)]
