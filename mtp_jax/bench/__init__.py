"""``python -m mtp_jax.bench`` (or ``python -m mtp_jax.bench engine``): prefill, decode-step and
speculative-round timings on a random-weight model of a real shape, against the HBM floor, with
exactness-confirming forced drafts. (``python -m mtp_jax.bench --help`` lists the other
subcommands, each with its own ``--help``; :mod:`mtp_jax.bench.commands` dispatches.)

For each configuration (``configs/*.json``), batch size, prompt length (``--prompt-len N [N
...]``: long-context rows on one model) and k (0 = speculation off), in the chosen dtype, with
``--decode-tokens`` timed tokens per request, it reports:

* prefill tokens/s at the prompt length (median of ``--prefill-reps`` single-prompt prefills;
  the whole prompt in one call up to 8192 tokens, 2048-token calls above, or
  ``--chunked-prefill-size`` tokens a call);
* the median decode-step (k = 0) or round (k > 0) time over the timed phase, its p10 / p90 and
  the context range covered; rounds run overlapped as the engine serves them (the next round
  dispatched before the previous result is read), and a round's time is the interval between
  two results;
* the bytes a round must move (weights, KV, GDN state, draft weights and KV), the floor at
  ``--hbm-tbps`` and the fraction of it reached;
* k = 0: tokens/s = batch / step time, and end to end (timed tokens / wall time of the loop);
* k > 0: first the round program's own greedy continuation: rounds whose drafts are all
  wrong, so that each commits the target's token at verify row 0 (untimed), compared with
  plain decoding (``decode_match``). Then for each ``--accept-lengths`` value, forced rounds
  whose drafts are overwritten by that continuation with the first m right (m alternating so
  that the mean tokens committed per round is that accept length;
  :mod:`mtp_jax.bench.forced`): the measured accept length, the end-to-end tokens/s (wall
  time of the whole host loop), the derived tokens/s and whether the committed tokens equal
  the continuation exactly. Derived tokens/s = accept length x batch / median round time; the
  table uses the median of every forced run's rounds pooled (a round's time does not depend on
  its acceptance), each forced entry of the JSON (``tokens_per_s_derived``) that run's own
  median. The drafts are overwritten on the device between two rounds in flight. Why this
  reference: accepting drafts should not change the output in any dtype (every round has the
  same shapes), whereas a verify's (k+1)-row matmuls may round a near-tie differently from a
  decode step's one row (16-bit dtypes, random weights); against plain decoding one such
  near-tie would end the forced accept length. The ``exact`` column: ``-`` (k = 0), ``yes``
  (both checks pass), ``rounds yes, decode from N`` (the forced runs pass; the continuation
  parts from plain decoding at token N) or ``NO``. A failed check is printed (``MISMATCH`` /
  ``DIVERGENCE``); in float32 the exit status is then 1, in 16-bit dtypes it is a warning;
* k > 0 with ``--num-scheduler-steps N``, N > 1: a further row with N rounds per program call
  and the drafts as drafted (nothing can be forced inside a call): the round time, tokens/s
  derived from it at the accept lengths, the measured accept length and both exactness
  checks on the committed tokens;
* the first call of every program (prefill bucket, round bucket, forced drafts) in seconds,
  the XLA executables built and how many came from the persistent compilation cache, the
  compile count of the warm-up and of the timed phase (must be 0, else exit status 1);
* peak device memory.

``--draft-vocab-size N``: the k > 0 rows' MTP draft scores only the N lowest token ids
(``speculative_draft_vocab_size``), and the floor counts N rows of the draft's LM head instead of
V; recorded as ``draft_vocab_size`` in each row (``None`` for k = 0). The forced drafts overwrite
the draft's tokens, so the timing shows the cheaper draft at the forced accept lengths.
``--draft-head-dtype int8``: the same for the int8 draft head (``speculative_draft_head_dtype``;
the floor counts V x (H + 4) head bytes per draft step); recorded as ``draft_head_dtype``
(``None``: the model dtype). ``--draft-head-dtype model int8`` runs the k > 0 rows once per
value on one model and machine (the k = 0 rows once): a same-machine A/B.
``--draft-layer-dtype int8``: the draft's projections in int8 (``speculative_draft_layer_dtype``;
the floor counts out x (in + 4) bytes per projection and draft step); recorded as
``draft_layer_dtype``; with several values of both options, k > 0 rows for every (head, layer)
pair. Both default to ``auto``, the engine's default (int8 for a bfloat16 / float16 run on a
GPU, :mod:`mtp_jax.speculative.draft_dtypes`), replaced by what it picks before the rows run.

``--temperature T [T ...]`` (default 0: greedy) with ``--top-p`` / ``--top-k``: a set of rows per
temperature; above 0 every request samples (seeded, request i with seed i), so the programs'
sampling variant is timed (filtering, draws, rejection sampling of the drafts). Sampled k > 0
rows take the drafts as drafted at every ``--num-scheduler-steps`` value (a sampled acceptance
cannot be forced) and report the measured accept length; no exactness is checked on sampled
rows (``exact`` ``-``). Recorded as ``sampling`` (``None`` for greedy rows); the round / step
ratio pairs each k > 0 row with the k = 0 row of the same sampling.

Output: markdown tables on stdout (pasteable into docs/benchmarks.md), progress on stderr,
and a JSON file (``--out``: ``{"meta": {date, commit, jax version, device kind, XLA_FLAGS,
...}, "results": [one object per row]}``), rewritten after each row.
Weights are random and drawn on the device (no checkpoint on disk).
"""

from mtp_jax.bench.floor import (expected_experts, forward_weight_bytes, load_config,
                                 round_bytes)
from mtp_jax.bench.run import Settings, bench_one, requests


def main(argv=None) -> int:
    """``python -m mtp_jax.bench [SUBCOMMAND] ...`` (:func:`mtp_jax.bench.commands.main`): the
    engine benchmark without a subcommand; returns the exit status."""
    from mtp_jax.bench.commands import main as commands_main

    return commands_main(argv, engine_doc=__doc__)


__all__ = ["Settings", "bench_one", "expected_experts", "forward_weight_bytes", "load_config",
           "main", "requests", "round_bytes"]
