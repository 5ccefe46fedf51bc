"""Build the programs a warm-up will call before it runs, compiling them on threads.

A warm-up (``Engine.warmup``) calls its programs one after another, each waiting for the one
before it (the pools pass from call to call), so run as it is, the programs missing from the
executable cache would be compiled one at a time. :func:`build_ahead` (which ``Engine.warmup``
calls first) runs the warm-up dry, with the program table recording instead of running
(:meth:`ExecutableTable.recording`), then builds what it recorded with :meth:`ExecutableTable.build`: loaded from disk where saved, otherwise
traced and lowered in turn and compiled on :func:`~mtp_jax.engine.executable_cache.compile_workers`
threads (XLA releases the GIL while it compiles). The real warm-up after it finds every program
in memory. With ``background``, the build runs on a thread of its own
(:meth:`ExecutableTable.build_in_background`) and no warm-up call runs: serving starts at once,
and each call waits only for its own program (the first prefill for the prefill program).
"""

from __future__ import annotations

import time
from typing import Callable


def build_ahead(programs, run: Callable[[], object], workers: int | None = None,
                background: bool = False) -> float | None:
    """Run ``run()`` (a warm-up whose program outputs are only passed on, never read) with
    ``programs``' table recording, then build every recorded program, in the order ``run``
    calls them; ``background``: start that build on a thread and return. Returns seconds.

    Does nothing and returns ``None`` when ``programs`` has no executable table.
    """
    table = getattr(programs, "executables", None)
    if table is None:
        return None
    t0 = time.perf_counter()
    with table.recording() as calls:
        run()
    if background:
        table.build_in_background(calls, workers=workers)
    else:
        table.build(calls, workers=workers)
    return time.perf_counter() - t0


def build_warmup_programs(engine, workers: int | None = None, **warmup_kwargs) -> float:
    """:func:`build_ahead` of ``engine.warmup(**warmup_kwargs)``'s calls, without running them;
    a warm-up after it loads nothing and compiles nothing (``Engine.warmup`` does both steps
    itself). Returns seconds."""
    return build_ahead(engine.device.programs, engine.warmup_calls(**warmup_kwargs),
                       workers) or 0.0
