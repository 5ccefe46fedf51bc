"""``SamplingParams.n``: the samples of one prompt, and when samples 1..n-1 join the engine.

The n samples of a prompt are n requests (each its own seed and output). With the prefix
cache on, samples 1..n-1 wait outside the engine until sample 0's prompt is prefilled: its
prompt pages are then in the prefix cache, and their admission reuses them (the KV pages and
the GDN snapshot up to the last snapshot boundary inside the prompt, and the draft KV), so
the prompt is computed once plus what lies past that boundary. A prompt no longer than one
snapshot interval has nothing to share, and its samples join at once (so do all samples
without the prefix cache). Pure functions over the requests; the callers (``LLM`` and the
server's engine thread) hold the waiting ones.
"""

from __future__ import annotations

from mtp_jax.engine.requests import Request

__all__ = ["waits_for_first", "split_ready", "sample_seed"]


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request seeded ``seed``: ``seed + i`` (mod
    2**32)."""
    return (seed + sample_index) % 2**32


def _prompt_ready(first: Request) -> bool:
    return first.finished or first.prefilled >= len(first.prompt_ids)


def waits_for_first(req: Request, prefix) -> bool:
    """Whether ``req`` (a sample of a prompt) should wait before joining the engine:
    ``prefix`` (the engine's :class:`~mtp_jax.engine.prefix.PrefixStore`, or None) is on,
    the prompt is longer than one snapshot interval and sample 0 (``req.first``) has not
    finished its prompt yet."""
    return (req.first is not None and prefix is not None
            and len(req.prompt_ids) > prefix.snapshot_tokens and not _prompt_ready(req.first))


def split_ready(held: list[Request], prefix) -> tuple[list[Request], list[Request]]:
    """``(ready, still_waiting)`` of the waiting samples ``held``."""
    ready = [r for r in held if not waits_for_first(r, prefix)]
    return ready, [r for r in held if waits_for_first(r, prefix)]
