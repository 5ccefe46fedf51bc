"""The engine's compiled programs, kept in memory by shape and saved to disk, so that the next
start-up loads them without tracing or lowering.

jax's persistent compilation cache (:mod:`mtp_jax.compile_cache`) saves XLA's work only: a hit
still traces the Python program, lowers it to StableHLO and hashes the module to find the
entry, seconds per program for a 2B model. Here a compiled program is saved with
``jax.experimental.serialize_executable.serialize`` under a key computed from its inputs'
shapes and everything tracing depends on (:mod:`mtp_jax.engine.executable_key`), and the next
process rebuilds it with ``deserialize_and_load`` from that key alone.

Where: the subfolder ``executables`` of jax's compilation cache folder, so the same switch
turns both on and off (``--compilation-cache-dir none``: nothing is read or written; the
programs are still compiled ahead of time and kept in memory). The file format:
:mod:`mtp_jax.engine.executable_store`. Like jax's cache, the folder is trusted code (loading
an entry unpickles it): do not point it at a folder others can write to.

Calls go through a dict keyed by ``(program, batch layout, variant, pool shapes)`` to a
``jax.stages.Compiled``, whose call is jax's C++ dispatch path, like a jitted function's
(measured on CPU: +1.5 us per call over the jitted function, of about 60 us). Programs missing
from the dict are loaded or built one by one as they are called, or all at once by
:meth:`ExecutableTable.build` (traced in turn, each compiled on one of :func:`compile_workers`
threads while the next is traced: XLA releases the GIL while it compiles;
:mod:`mtp_jax.engine.startup`), or by :meth:`ExecutableTable.build_in_background`, which
returns at once: a call whose program is still being built waits for that program only.

Two things loading skips that must be done here (jax 0.11.2 and 0.12): LAPACK, behind CPU
custom calls, is initialized lazily while lowering (:func:`initialize_custom_call_libraries`);
and an executable jax loaded from its own cache does not serialize into a runnable copy on
CPU, so programs are compiled with jax's cache bypassed (:func:`without_jax_cache`). A load
is reported to ``jax.monitoring`` as jax reports a hit of its own cache
(:func:`~mtp_jax.engine.executable_store.report_load`), so :mod:`mtp_jax.bench.compiles` counts
it as a persistent-cache hit. A start-up's first programs may have been loaded ahead, beside
the tokenizer's read (:mod:`mtp_jax.engine.executable_prefetch`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time
import weakref

from mtp_jax.engine import executable_key as ek
from mtp_jax.engine import executable_prefetch as prefetch
from mtp_jax.engine.executable_key import (abstract_pools, input_devices, keeps_pool_shapes,
                                          pools_signature)
from mtp_jax.engine.executable_store import (FORMAT, THREADS_ENV, ExecutableCacheWarning,
                                             ExecutableStore, bypassed_cache_dir, compile_workers,
                                             initialize_custom_call_libraries, report_load,
                                             without_jax_cache)

__all__ = ["ExecutableTable", "ExecutableStore", "ExecutableCacheWarning", "Call", "Record",
           "cache_dir", "compile_workers", "SUBFOLDER", "SWITCH_ENV", "THREADS_ENV"]

SUBFOLDER = "executables"
SWITCH_ENV = "MTP_JAX_EXECUTABLE_CACHE"  # "0": no executable is saved or loaded here
DONATED = (1,)  # the pools; part of every key (the programs' jit donates them)


def cache_dir() -> str | None:
    """``<jax compilation cache folder>/executables``, or ``None`` when that cache is off or
    ``$MTP_JAX_EXECUTABLE_CACHE`` is ``0`` (:data:`SWITCH_ENV`: jax's own cache stays on, the
    programs are still compiled ahead and kept in memory, nothing is serialized)."""
    from mtp_jax.compile_cache import active_cache_dir

    if os.environ.get(SWITCH_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    # while a build bypasses jax's cache (without_jax_cache), the folder it will restore
    folder = bypassed_cache_dir() or active_cache_dir()
    return None if folder is None else os.path.join(folder, SUBFOLDER)


@dataclasses.dataclass
class Call:
    """One program call: ``fn(leaves, pools, buf, layout=layout, variant=variant)`` (``fn``
    jitted with the pools donated; ``layout``: the packed batch's, ``variant``: the call's
    static choices, a frozen dataclass); ``key``: its in-memory key in the table that saw it."""

    name: str
    fn: object
    leaves: tuple
    pools: object
    buf: object
    layout: object
    variant: object
    key: tuple

    def describe(self) -> str:
        shapes = ",".join("x".join(map(str, s)) for s, _ in self.layout[1][:1])
        return f"{self.name}[{shapes}] " + ek.static_description(self.static())

    def static(self) -> dict:
        """The variant's fields by name."""
        return dataclasses.asdict(self.variant)


@dataclasses.dataclass
class Record:
    """How one program came to be in memory (seconds; 0 where the step did not run)."""

    program: str
    source: str  # "disk" (loaded) | "built" (traced, lowered, compiled)
    key: str
    trace_s: float = 0.0
    lower_s: float = 0.0
    compile_s: float = 0.0
    load_s: float = 0.0
    save_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.trace_s + self.lower_s + self.compile_s + self.load_s + self.save_s


class ExecutableTable:
    """The compiled programs of one model by in-memory key (:meth:`call`), loaded from or saved to
    :func:`cache_dir` when that is on.

    Counters: ``loads`` (programs read from disk), ``traces`` (programs traced and lowered),
    ``compiles`` (programs compiled by XLA; jax's own persistent cache is bypassed while they
    compile, see :func:`without_jax_cache`), ``saves`` (files written), ``waited_s`` (seconds
    calls spent getting a program that was not in memory: building it, or waiting for the
    build that had it). ``records``: a
    :class:`Record` per program, in the order they came into memory.

    Thread use: :meth:`call` and :meth:`build` from one thread (the engine's); builds started
    by :meth:`build_in_background` run on their own threads and hand each program over as it
    is ready.
    """

    def __init__(self, graphdef, persist: bool = True):
        ek.source_digest()  # now, close to when the model's code was imported
        self._graphdef = graphdef
        self.persist = persist  # False: never read or written on disk (host callbacks)
        self._model_digest: str | None = None
        self._params_sig: tuple | None = None  # (leaves, digest), by identity
        # key -> (Compiled, whether its output pools keep the input pools' shapes)
        self._compiled: dict[tuple, tuple] = {}
        self._signatures: dict[tuple, int] = {}  # pools_signature -> small id (cheap to hash)
        self._last: tuple = (None, None)  # (pools a call returned, their signature id)
        self._recording: list[Call] | None = None
        self._lock = threading.Lock()
        self._building: dict[tuple, concurrent.futures.Future] = {}  # key -> done when built
        self._queued: set = set()  # the futures of _building no build has started on yet
        self._threads: list[threading.Thread] = []
        self._cancel = threading.Event()  # set: background builds trace nothing more
        self.loads = self.traces = self.compiles = self.saves = 0
        self.waited_s = 0.0
        self.records: list[Record] = []

    def __len__(self) -> int:
        return len(self._compiled)

    def stats(self) -> dict:
        return {"programs": len(self), "loads": self.loads, "traces": self.traces,
                "compiles": self.compiles, "saves": self.saves, "building": self.building(),
                "waited_s": round(self.waited_s, 3)}

    def _pools_id(self, pools) -> int:
        """A small id of the pools' shapes; free for the pools the last call returned."""
        last, sid = self._last
        if pools is last:
            return sid
        return self._signatures.setdefault(pools_signature(pools), len(self._signatures))

    # ---- calls -----------------------------------------------------------------------------
    def call(self, name: str, fn, leaves, pools, buf, layout, variant):
        """``fn(leaves, pools, buf, layout=layout, variant=variant)`` through the compiled
        program of its key: program, batch layout (structure, shapes, dtypes), variant and pool
        shapes (the parameters are the model's, fixed per table). A miss waits for the build
        that has the program in hand, or builds or loads it now. While :meth:`recording`,
        nothing runs: a call missing from memory is recorded, and every call returns
        ``(None, pools)`` (pools untouched). Raises what building its program raised."""
        sid = self._pools_id(pools)
        key = (name, layout, variant, sid)
        entry = self._compiled.get(key)
        if self._recording is not None:  # a dry run: no program runs, no pool is donated
            if entry is None:
                self._recording.append(Call(name, fn, leaves, pools, buf, layout, variant, key))
            return None, pools
        if entry is None:
            t0 = time.perf_counter()
            try:
                entry = self._entry(Call(name, fn, leaves, pools, buf, layout, variant, key))
            finally:
                self.waited_s += time.perf_counter() - t0
        out = entry[0](leaves, pools, buf)
        if entry[1]:
            self._last = (out[1], sid)
        return out

    def _entry(self, c: Call) -> tuple:
        """The compiled program of ``c``: waited for while a build is working on it (a failed
        build raises its error once; the next call builds again), else built now: also when a
        build has it queued but not started (the call takes it over rather than wait behind
        other programs) or dropped it."""
        with self._lock:
            fut = self._building.get(c.key)
            if fut is not None and fut in self._queued:  # not started: taken over
                self._queued.discard(fut)
                del self._building[c.key]
                fut.set_exception(_Dropped())
                fut = None
        if fut is None:
            self.build([c])
            return self._compiled[c.key]
        try:
            fut.result()
        except _Dropped:  # a background build gave it up: build it now
            self.build([c])
        except BaseException:
            self._forget(c, fut)
            raise
        return self._compiled[c.key]

    @contextlib.contextmanager
    def recording(self):
        """Within the block no program runs: calls return ``(None, pools)`` and those missing
        from memory are recorded; yields the list of recorded :class:`Call`s. For a dry run of
        a warm-up whose outputs are only passed on, followed by :meth:`build`."""
        calls: list[Call] = []
        self._recording = calls
        try:
            yield calls
        finally:
            self._recording = None

    # ---- keys ------------------------------------------------------------------------------
    def disk_key(self, c: Call, environment: str) -> str:
        """The key of :mod:`mtp_jax.engine.executable_key` for call ``c``."""
        if self._model_digest is None:
            self._model_digest = ek.model_digest(self._graphdef)
        if self._params_sig is None or self._params_sig[0] is not c.leaves:
            self._params_sig = (c.leaves, ek.tree_signature(c.leaves))
        return ek.digest(FORMAT, environment, self._model_digest, c.name,
                         ek.static_description(dict(c.static(), layout=c.layout)),
                         f"donated={DONATED}", self._params_sig[1], ek.tree_signature(c.pools),
                         ek.leaf_signature(c.buf))

    # ---- building --------------------------------------------------------------------------
    def build(self, calls: list[Call], workers: int | None = None) -> None:
        """Put the program of every call in memory: already there, loaded from disk (on
        ``workers`` threads), or traced and lowered in turn, each compiled on one of
        ``workers`` threads (default :func:`compile_workers`) while the next is traced, then
        saved. Programs a background build has in hand are waited for. Raises the error of the
        first program that failed (the others are built)."""
        store, pending = self._schedule(calls)
        self._run(store, pending, workers)
        for c in calls:
            if c.key not in self._compiled:
                self._entry(c)

    def build_in_background(self, calls: list[Call], workers: int | None = None) -> int:
        """Start building the programs of ``calls`` (as :meth:`build`, in the calls' order) on
        a thread of its own and return at once the number it builds; a later call of one of
        them waits for that program only. The calls' pools are kept as shapes, so later calls
        may donate them. :meth:`wait` waits for the thread; at interpreter exit,
        :func:`_wait_at_exit` waits for what it has lowered (so that it is saved) and drops
        the rest."""
        if not self.wait(timeout=0):  # a cancel in force applies to running builds only
            self._cancel.clear()
        store, pending = self._schedule(calls, abstract=True)
        if pending:
            thread = threading.Thread(target=self._run, args=(store, pending, workers, True),
                                      name="mtp_jax-program-build", daemon=True)
            thread.start()
            self._threads.append(thread)
            _BUILDING_TABLES.add(self)
        return len(pending)

    def building(self) -> int:
        """Programs a build has in hand (scheduled, not yet in memory)."""
        return len(self._building)

    def wait(self, cancel: bool = False, timeout: float | None = None) -> bool:
        """Wait until no background build runs (at most ``timeout`` seconds); returns whether
        none does. ``cancel``: the programs those builds are not compiling yet are dropped (a
        later call builds its own), so only those being compiled finish (and are saved). A
        program that failed raises at its call."""
        if cancel:
            self._cancel.set()
        end = None if timeout is None else time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        if not self._threads:
            self._cancel.clear()
        return not self._threads

    def _schedule(self, calls: list[Call], abstract: bool = False) -> tuple:
        """``(store, [(call, disk key, future)])`` for the calls neither in memory nor in a
        build's hands (each now in :attr:`_building`); ``abstract``: the calls' pools as
        shapes (:func:`abstract_pools`). With a store each program is claimed for its load
        (a call that needs it waits for that load; :meth:`_load` queues it again when it is
        not saved), else queued (a call that comes first builds it itself)."""
        folder = cache_dir() if self.persist else None
        store = ExecutableStore(folder) if folder is not None else None
        environment = ek.environment_digest() if store is not None else ""
        pending = []
        with self._lock:
            for c in calls:
                if c.key in self._compiled or c.key in self._building:
                    continue
                fut = concurrent.futures.Future()
                self._building[c.key] = fut
                if store is None:
                    self._queued.add(fut)
                dkey = self.disk_key(c, environment) if store is not None else ""
                if abstract:
                    c = dataclasses.replace(c, pools=abstract_pools(c.pools))
                pending.append((c, dkey, fut))
        if store is not None and pending:  # the next start-up loads these first
            prefetch.note_first(folder, [(c.name, k) for c, k, _ in pending],
                                input_devices(pending[0][0].pools))
        return store, pending

    def _run(self, store, pending: list, workers: int | None, background: bool = False) -> None:
        """Load (in parallel), else trace and lower in turn and compile on ``workers`` threads,
        every scheduled program; each future is done when its program is in memory, or holds
        the error that stopped it; ``background``: a program that fails is dropped instead
        (:meth:`_drop`; the call that needs it builds it, and meets a lasting error there)."""
        if not pending:
            return
        requeued: list = []  # the programs loads did not find, queued anew (_load)
        try:
            workers = max(1, compile_workers() if workers is None else workers)
            # at most one lowered program waits per worker, so a cancel drops what is not
            # being compiled yet (and lowered modules do not pile up in memory)
            ahead = threading.Semaphore(workers + 1)
            # the cache stays bypassed until the pool has finished every compile
            with without_jax_cache(store is not None), \
                    concurrent.futures.ThreadPoolExecutor(workers) as pool:
                loads = [None] * len(pending)
                if store is not None:
                    initialize_custom_call_libraries()  # once, before any thread loads
                    loads = [pool.submit(self._load, store, *item, background, requeued)
                             for item in pending]
                for (c, dkey, fut), load in zip(pending, loads):
                    if load is not None:
                        fut = load.result()  # None: loaded (or dropped); else queued anew
                    if fut is None or not self._start(fut):
                        continue  # loaded or dropped, or taken over by its call
                    ahead.acquire()
                    if background and self._cancel.is_set():
                        ahead.release()
                        self._drop(c, fut)
                        continue
                    try:
                        lowered, rec = self._lower(c, dkey)
                    except BaseException as e:  # noqa: BLE001 (handed to the call that waits)
                        ahead.release()
                        self._fail(c, fut, e, background)
                        continue
                    pool.submit(self._compile, store, c, dkey, lowered, rec, fut, background,
                                ahead)
            error = RuntimeError("the program's build ended without a result")
        except BaseException as e:  # noqa: BLE001 (the pool or cache itself failed)
            error = e
        for c, _, fut in pending + requeued:  # none left unsettled: a waiting call would hang
            if not fut.done():
                self._fail(c, fut, error, background)

    def _start(self, fut) -> bool:
        """Claim the program of ``fut`` for this build; False when its call took it over."""
        with self._lock:
            if fut not in self._queued:
                return False
            self._queued.discard(fut)
            return True

    def _fail(self, c: Call, fut, error: BaseException, background: bool) -> None:
        """``c``'s build failed: the error to its waiters, or (``background``) dropped: out
        of :attr:`_building`, and a call waiting for it builds it (:class:`_Dropped`)."""
        if background:
            self._forget(c, fut)
            error = _Dropped()
        with self._lock:
            if not fut.done():
                fut.set_exception(error)

    def _drop(self, c: Call, fut) -> None:
        """Give up ``c``'s program (``wait(cancel=True)``)."""
        self._fail(c, fut, _Dropped(), True)

    def _forget(self, c: Call, fut) -> None:
        """``c``'s program out of :attr:`_building` (if ``fut`` is still its build there)."""
        with self._lock:
            self._queued.discard(fut)
            if self._building.get(c.key) is fut:
                del self._building[c.key]

    def _finish(self, c: Call, compiled, fut) -> None:
        """Put ``compiled`` in memory under ``c``'s key and release those waiting for it."""
        with self._lock:
            self._compiled[c.key] = (compiled,
                                     keeps_pool_shapes(compiled, pools_signature(c.pools)))
            self._queued.discard(fut)
            if self._building.get(c.key) is fut:
                del self._building[c.key]
            if not fut.done():
                fut.set_result(None)

    def _load(self, store, c: Call, dkey: str, fut, background: bool = False,
              requeued: list | None = None):
        """Load ``c``'s program from ``store`` (claimed by this load since :meth:`_schedule`:
        a call that needs it meanwhile waits for it rather than loading it a second time
        beside it); None when loaded, or dropped (a cancelled background build). When it is
        not there (or unreadable) ``fut`` is dropped, so its waiters build it themselves,
        and a new future, queued for the build, is returned (and added to ``requeued``)."""
        if background and self._cancel.is_set():
            self._drop(c, fut)
            return None
        t0, devices = time.perf_counter(), input_devices(c.pools)
        compiled = prefetch.take(dkey, devices)  # loaded ahead by the start-up, else now
        if compiled is None:
            compiled = store.load(c.name, dkey, devices)
        if compiled is None:
            with self._lock:  # queued anew, for the build or a call to claim
                new = None
                if self._building.get(c.key) is fut:
                    new = self._building[c.key] = concurrent.futures.Future()
                    self._queued.add(new)
                    if requeued is not None:
                        requeued.append((c, dkey, new))
                if not fut.done():  # its waiting calls build it themselves (_entry)
                    fut.set_exception(_Dropped())
            return new
        seconds = time.perf_counter() - t0
        with self._lock:
            self.loads += 1
            self.records.append(Record(c.describe(), "disk", dkey[:16], load_s=seconds))
        report_load(seconds)
        self._finish(c, compiled, fut)
        return None

    def _lower(self, c: Call, dkey: str) -> tuple:
        t0 = time.perf_counter()
        # from shapes: a loaded program's outputs carry layouts that jax 0.12.1 types (scan)
        traced = c.fn.trace(*map(abstract_pools, (c.leaves, c.pools, c.buf)), layout=c.layout,
                            variant=c.variant)
        t1 = time.perf_counter()
        lowered = traced.lower()
        with self._lock:
            self.traces += 1
        return lowered, Record(c.describe(), "built", dkey[:16], trace_s=t1 - t0,
                               lower_s=time.perf_counter() - t1)

    def _compile(self, store, c: Call, dkey: str, lowered, rec: Record, fut,
                 background: bool = False, ahead: threading.Semaphore | None = None) -> None:
        """Compile ``lowered`` (on a worker thread; dropped instead when the build was
        cancelled meanwhile), hand it over, then save it; then release ``ahead``."""
        try:
            self._compile_one(store, c, dkey, lowered, rec, fut, background)
        finally:
            if ahead is not None:
                ahead.release()

    def _compile_one(self, store, c: Call, dkey: str, lowered, rec: Record, fut,
                     background: bool) -> None:
        if background and self._cancel.is_set():
            self._drop(c, fut)
            return
        t0 = time.perf_counter()
        try:
            compiled = lowered.compile()
        except BaseException as e:  # noqa: BLE001 (handed to the call that waits)
            self._fail(c, fut, e, background)
            return
        rec.compile_s = time.perf_counter() - t0
        with self._lock:
            self.compiles += 1
        self._finish(c, compiled, fut)  # a call waiting for it runs while it is saved
        if store is not None:
            t0 = time.perf_counter()
            saved = store.save(c.name, dkey, compiled, c.describe())
            rec.save_s = time.perf_counter() - t0
            with self._lock:
                self.saves += saved
        with self._lock:
            self.records.append(rec)


class _Dropped(Exception):
    """A background build gave the program up (it failed there, or ``wait(cancel=True)``)."""


_BUILDING_TABLES: "weakref.WeakSet[ExecutableTable]" = weakref.WeakSet()


@atexit.register
def _wait_at_exit() -> None:
    """At interpreter exit: every table's background build finishes what it has lowered (its
    threads are daemons, which would otherwise be stopped inside XLA) and drops the rest."""
    for table in list(_BUILDING_TABLES):
        table.wait(cancel=True)
