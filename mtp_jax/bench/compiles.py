"""Count XLA compilations and persistent-cache hits through ``jax.monitoring``.

jax records one ``/jax/core/compile/backend_compile_duration`` event (with its seconds) per
executable it builds, whether compiled or loaded from the persistent compilation cache, and one
``/jax/compilation_cache/cache_hits`` event per load from that cache (jax 0.11.2 and 0.12; calls
served by a jit's in-memory cache record neither). Listeners are registered once per process
and only bump counters; :class:`CompileWatch` reads the counters before and after a block.
"""

from __future__ import annotations

import dataclasses
import threading
import time

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_counts = {"compiles": 0, "compile_s": 0.0, "cache_hits": 0}
_installed = False


def _on_duration(event: str, duration: float, *args, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _counts["compiles"] += 1
            _counts["compile_s"] += float(duration)


def _on_event(event: str, *args, **kwargs) -> None:
    if event == CACHE_HIT_EVENT:
        with _lock:
            _counts["cache_hits"] += 1


def install() -> None:
    """Register the listeners (once per process)."""
    global _installed
    if _installed:
        return
    import jax.monitoring as monitoring

    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)
    _installed = True


def snapshot() -> dict:
    with _lock:
        return dict(_counts)


@dataclasses.dataclass
class CompileWatch:
    """Compilations inside a ``with`` block.

    After the block: ``seconds`` (wall time of the block), ``compiles`` (executables built:
    compiled or loaded from the persistent cache), ``cache_hits`` (of those, loaded from the
    cache), ``compile_s`` (seconds jax spent building them).
    """

    seconds: float = 0.0
    compiles: int = 0
    cache_hits: int = 0
    compile_s: float = 0.0

    def __enter__(self) -> "CompileWatch":
        install()
        self._before = snapshot()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        after = snapshot()
        self.compiles = after["compiles"] - self._before["compiles"]
        self.cache_hits = after["cache_hits"] - self._before["cache_hits"]
        self.compile_s = after["compile_s"] - self._before["compile_s"]

    def add(self, other: "CompileWatch") -> None:
        """Accumulate another watch's counts and seconds into this one."""
        self.seconds += other.seconds
        self.compiles += other.compiles
        self.cache_hits += other.cache_hits
        self.compile_s += other.compile_s

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "compiles": self.compiles,
                "cache_hits": self.cache_hits, "compile_s": self.compile_s}
