"""A start-up's first programs loaded from the executable cache while the tokenizer is read.

A cached start-up (issue 32 item 5) reads the checkpoint's tokenizer before any weight loads
(``tokenizers`` builds Qwen's 248k-token BPE holding the GIL: 1.1 s on a 2-core CPU), and only
once the model and the engine exist can the
:class:`~mtp_jax.engine.executable_cache.ExecutableTable` compute its programs' keys and load
them (XLA deserializes with the GIL released: 0.3 to 0.6 s a program there, the prefill with
the MTP draft's the longest). So :func:`start`, which ``LLM`` calls before it reads the
tokenizer, loads, in turn on a thread of its own, the programs that the last start-up with the
same settings scheduled first (the *hint*: one entry per settings and version of the code in
:data:`HINT_FILE` of the executables folder, written by :func:`note_first`): the first load
runs beside the tokenizer's parse. The table takes each by its key (:func:`take`) instead of
reading it from disk. The hint says only what to load early: a program is used under its own
key alone, so a stale hint costs a load on a spare thread, never a wrong program. Loading
skips :func:`~mtp_jax.engine.executable_store.initialize_custom_call_libraries` (it holds the
GIL); the table runs it before it hands any program out, as for its own loads.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import json
import os
import tempfile
import threading

from mtp_jax.engine import executable_key as ek
from mtp_jax.engine.executable_store import ExecutableStore

__all__ = ["HINT_FILE", "MAX_SETTINGS", "START_WAIT_S", "start", "take", "note_first"]

HINT_FILE = "first-programs.json"
MAX_SETTINGS = 16  # settings whose hints the file keeps (the most recent)
START_WAIT_S = 0.25  # at most this long, start() waits for the first load to begin


class _Session:
    """The programs one start-up loads ahead: ``futures`` by disk key (each done with the
    ``Compiled`` or None), loaded onto the devices of ids ``device_ids``."""

    def __init__(self, folder: str, settings: str, hint: dict | None):
        self.folder, self.settings, self.hint = folder, settings, hint
        self.device_ids = hint.get("devices") if hint else None
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.noted = False
        self.stop = threading.Event()  # set: the loads not begun are given up
        self.thread: threading.Thread | None = None

    def run(self, items: list, begun: threading.Event) -> None:
        """Load ``items`` (``(name, disk key, future)``) in turn, each into its future (a
        cancelled one is skipped; once :meth:`close` is called, the rest are cancelled)."""
        store = ExecutableStore(self.folder)
        for name, dkey, fut in items:
            if self.stop.is_set():
                fut.cancel()
            elif fut.set_running_or_notify_cancel():
                begun.set()
                fut.set_result(_load(store, name, dkey, self.device_ids))
        begun.set()

    def close(self) -> None:
        """Give up the loads not begun and wait for the one under way."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


_SESSION: _Session | None = None
_LOCK = threading.Lock()


def _key(settings: str) -> str:
    """The hint's key of ``settings``: with the source and versions the programs' keys hold
    (a hint per version of the code, so that checkouts sharing a cache do not evict each
    other's)."""
    return ek.digest(settings, ek.source_digest(), ek.versions())[:32]


def _read_hints(folder: str) -> dict:
    try:
        with open(os.path.join(folder, HINT_FILE), encoding="utf-8") as f:
            hints = json.load(f)
        return hints if isinstance(hints, dict) else {}
    except (OSError, ValueError):
        return {}


def start(folder: str | None, settings: str) -> None:
    """Begin loading, on a thread of its own, the programs the hint of ``settings`` (a
    description of everything the start-up's programs depend on before the weights load)
    names for ``folder`` (the executables folder; None: cache off, nothing is loaded). Waits
    until the first load has begun (at most :data:`START_WAIT_S`), so that it runs beside
    the tokenizer's parse. Ends the session of an earlier start."""
    global _SESSION
    with _LOCK:
        old, _SESSION = _SESSION, None
    if old is not None:
        old.close()
    if folder is None:
        return
    key = _key(settings)
    hint = _read_hints(folder).get(key)
    programs = hint.get("programs") if isinstance(hint, dict) else None
    session = _Session(folder, key, hint if programs else None)
    if programs:
        items = [(str(name), str(dkey), concurrent.futures.Future()) for name, dkey in programs]
        session.futures = {dkey: fut for _, dkey, fut in items}
        begun = threading.Event()
        session.thread = threading.Thread(target=session.run, args=(items, begun),
                                          name="mtp_jax-program-prefetch", daemon=True)
        session.thread.start()
        begun.wait(START_WAIT_S)
    with _LOCK:
        _SESSION = session


@atexit.register
def _close_at_exit() -> None:
    """At interpreter exit: no new load begins, and the one under way ends (the thread is a
    daemon, which would otherwise be stopped inside XLA)."""
    session = _SESSION
    if session is not None:
        session.close()


def _load(store: ExecutableStore, name: str, dkey: str, device_ids):
    """One program of the hint, loaded onto the devices of ``device_ids`` (None: where it
    does not load)."""
    import jax

    try:
        devices = None
        if device_ids is not None:
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in device_ids]
        return store.load(name, dkey, devices, initialize=False)
    except Exception:  # noqa: BLE001 (a hint's load may fail: the table loads it itself)
        return None


def take(dkey: str, devices) -> object | None:
    """The program of disk key ``dkey`` loaded ahead onto ``devices`` (waiting for its load
    when it is under way), or None: not in the session, loaded onto other devices, or not
    loadable. Each program is handed out once."""
    with _LOCK:
        session = _SESSION
        fut = session.futures.pop(dkey, None) if session is not None else None
    if fut is None:
        return None
    ids = None if devices is None else [d.id for d in devices]
    if ids != session.device_ids:
        return None
    try:
        return fut.result()
    except concurrent.futures.CancelledError:  # the session ended before its load began
        return None


def note_first(folder: str, programs: list[tuple[str, str]], devices) -> None:
    """The first build scheduled after :func:`start` names its ``programs`` (``(name, disk
    key)``, in the order it builds them, on ``devices``): the hint of the session's settings
    becomes that list (for the next start-up), and the programs loaded ahead that it does not
    name are dropped. Only the first call of a session counts; a folder other than the
    session's is ignored."""
    with _LOCK:
        session = _SESSION
        if session is None or session.noted or session.folder != folder or not programs:
            return
        session.noted = True
        wanted = {dkey for _, dkey in programs}
        for dkey in [k for k in session.futures if k not in wanted]:
            session.futures.pop(dkey).cancel()
    ids = None if devices is None else [d.id for d in devices]
    hint = {"devices": ids, "programs": [[name, dkey] for name, dkey in programs]}
    if hint != session.hint:  # the same start-up as last time: nothing to write
        _write_hint(folder, session.settings, hint)


def _write_hint(folder: str, key: str, hint: dict) -> None:
    """Set the hint of ``key`` in :data:`HINT_FILE` (atomically; the :data:`MAX_SETTINGS`
    most recent kept). An unwritable folder is left alone (the table warns about it)."""
    hints = _read_hints(folder)
    hints.pop(key, None)
    hints[key] = hint
    hints = dict(list(hints.items())[-MAX_SETTINGS:])
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(hints, f)
        os.replace(tmp, os.path.join(folder, HINT_FILE))
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
