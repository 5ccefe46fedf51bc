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
programs are still compiled ahead of time and kept in memory). One file per program,
``<name>-<key>.exe``: a magic line, the sha256 of the body, and the body (a pickle of the
serialized executable with its input/output pytree structures). A file that is truncated,
altered, from another format or unreadable is ignored with an :class:`ExecutableCacheWarning`,
removed, and the program rebuilt. Like jax's cache, the folder is trusted code (loading an
entry unpickles it): do not point it at a folder others can write to.

Calls go through a dict keyed by ``(program, batch layout, variant, pool shapes)`` to a
``jax.stages.Compiled``, whose call is jax's C++ dispatch path, like a jitted function's
(measured on CPU: +1.5 us per call over the jitted function, of about 60 us). Programs missing
from the dict are loaded or built one by one as they are called, or all at once by
:meth:`ExecutableTable.build` (traced in turn, compiled on :func:`compile_workers` threads:
XLA releases the GIL while it compiles; :mod:`mtp_jax.engine.startup`).

Two things loading skips that must be done here (jax 0.11.2 and 0.12): LAPACK, behind CPU
custom calls, is initialized lazily while lowering (:func:`initialize_custom_call_libraries`);
and an executable jax loaded from its own cache does not serialize into a runnable copy on
CPU, so programs are compiled with jax's cache bypassed (:func:`_without_jax_cache`). A load
is reported to ``jax.monitoring`` as jax reports a hit of its own cache (:func:`_report_load`),
so :mod:`mtp_jax.bench.compiles` counts it as a persistent-cache hit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import os
import pickle
import tempfile
import time
import warnings

import jax

from mtp_jax.engine import executable_key as ek

SUBFOLDER = "executables"
FORMAT = "mtp_jax-executable-v1"
MAGIC = (FORMAT + "\n").encode()
SUFFIX = ".exe"
THREADS_ENV = "MTP_JAX_COMPILE_THREADS"
SWITCH_ENV = "MTP_JAX_EXECUTABLE_CACHE"  # "0": no executable is saved or loaded here
MIN_CPUS_FOR_THREADS = 8
DONATED = (1,)  # the pools; part of every key (the programs' jit donates them)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax's event names
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class ExecutableCacheWarning(UserWarning):
    """A saved executable was unreadable (ignored, removed, rebuilt) or could not be saved."""


def cache_dir() -> str | None:
    """``<jax compilation cache folder>/executables``, or ``None`` when that cache is off or
    ``$MTP_JAX_EXECUTABLE_CACHE`` is ``0`` (:data:`SWITCH_ENV`: jax's own cache stays on, the
    programs are still compiled ahead and kept in memory, nothing is serialized)."""
    from mtp_jax.compile_cache import active_cache_dir

    if os.environ.get(SWITCH_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    folder = active_cache_dir()
    return None if folder is None else os.path.join(folder, SUBFOLDER)


def compile_workers() -> int:
    """Threads that compile programs missing from the cache: ``$MTP_JAX_COMPILE_THREADS`` when
    set, else ``min(4, cpus // 4)`` with at least :data:`MIN_CPUS_FOR_THREADS` cpus and 1
    below (threads were slower than one compile at a time on a 2-core machine)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            from mtp_jax.config import ConfigError

            raise ConfigError(f"${THREADS_ENV}={raw!r} must be an integer >= 1 (threads that "
                              "compile programs); unset it for the default.") from None
        return max(1, n)
    cpus = os.cpu_count() or 1
    return min(4, cpus // 4) if cpus >= MIN_CPUS_FOR_THREADS else 1


def initialize_custom_call_libraries() -> None:
    """Initialize what jax initializes while lowering a program, which loading one skips: on
    CPU the LAPACK functions behind custom calls such as ``lapack_strsm_ffi`` (the GDN chunked
    prefill's triangular solve); run without it, a loaded program crashes the process.
    ``jax.export`` does the same before it runs a deserialized module."""
    from jax._src.lax import linalg

    linalg.initialize_lapack()  # idempotent; present in jax 0.11.2 and 0.12


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


def pools_signature(pools) -> tuple:
    """The shapes of the pools' leaves, in order (their dtypes follow the model)."""
    return tuple([x.shape for x in jax.tree_util.tree_leaves(pools)])


def input_devices(tree) -> list | None:
    """The devices of a pytree's first array leaf, by id (what a program on it runs on)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return sorted(sharding.device_set, key=lambda d: d.id)
    return None


def _keeps_pool_shapes(compiled, signature: tuple) -> bool:
    """Whether ``compiled``'s output pools (its second output) have the input pools' shapes."""
    try:
        return pools_signature(compiled.out_info[1]) == signature
    except Exception:  # noqa: BLE001 (no output info: never assume)
        return False


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


class ExecutableStore:
    """The files of one cache folder (see the module docstring for the format)."""

    def __init__(self, folder: str):
        self.folder = folder
        self._unwritable_warned = False

    def path(self, name: str, key: str) -> str:
        return os.path.join(self.folder, f"{name}-{key}{SUFFIX}")

    def _discard(self, path: str, reason: str) -> None:
        warnings.warn(f"executable cache entry {path!r} is unreadable ({reason}); it is ignored "
                      "and the program rebuilt.", ExecutableCacheWarning, stacklevel=4)
        with contextlib.suppress(OSError):
            os.remove(path)

    def load(self, name: str, key: str, devices=None):
        """The ``jax.stages.Compiled`` saved under ``key``, loaded onto ``devices`` (those of
        its inputs; default all of the backend's), or ``None`` (absent, or unreadable: warned
        and removed)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        initialize_custom_call_libraries()
        path = self.path(name, key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._discard(path, f"cannot read: {e.strerror or e}")
            return None
        head = len(MAGIC) + 32
        if not data.startswith(MAGIC) or len(data) < head:
            self._discard(path, "not an executable cache file of this format")
            return None
        body = data[head:]
        if hashlib.sha256(body).digest() != data[len(MAGIC):head]:
            self._discard(path, "checksum mismatch: truncated or altered")
            return None
        try:
            rec = pickle.loads(body)
            if rec.get("key") != key:
                raise ValueError("stored key differs from its file name")
            return deserialize_and_load(rec["payload"], rec["in_tree"], rec["out_tree"],
                                        execution_devices=devices)
        except Exception as e:  # noqa: BLE001 (any failure means: rebuild it)
            self._discard(path, f"{type(e).__name__}: {e}")
            return None

    def save(self, name: str, key: str, compiled, description: str) -> bool:
        """Write ``compiled`` under ``key`` (atomically: a temporary file, then a rename).
        Returns False (with a warning) when it cannot be serialized or written."""
        from jax.experimental.serialize_executable import serialize

        try:
            payload, in_tree, out_tree = serialize(compiled)
            body = pickle.dumps({"format": FORMAT, "key": key, "program": description,
                                 "payload": payload, "in_tree": in_tree, "out_tree": out_tree},
                                protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"program {description} cannot be serialized ({type(e).__name__}: "
                          f"{e}); it is not saved and will be compiled again next time.",
                          ExecutableCacheWarning, stacklevel=3)
            return False
        tmp = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(tmp, self.path(name, key))
            return True
        except OSError as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
            if not self._unwritable_warned:
                self._unwritable_warned = True
                warnings.warn(f"the executable cache folder {self.folder!r} is not writable "
                              f"({e.strerror or e}); programs are not saved. Pass "
                              "--compilation-cache-dir DIR with a writable folder, or 'none'.",
                              ExecutableCacheWarning, stacklevel=3)
            return False


class ExecutableTable:
    """The compiled programs of one model by in-memory key (:meth:`call`), loaded from or saved to
    :func:`cache_dir` when that is on.

    Counters: ``loads`` (programs read from disk), ``traces`` (programs traced and lowered),
    ``compiles`` (programs compiled by XLA; jax's own persistent cache is bypassed while they
    compile, see :func:`_without_jax_cache`), ``saves`` (files written). ``records``: a
    :class:`Record` per program, in order.
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
        self.loads = self.traces = self.compiles = self.saves = 0
        self.records: list[Record] = []

    def __len__(self) -> int:
        return len(self._compiled)

    def stats(self) -> dict:
        return {"programs": len(self), "loads": self.loads, "traces": self.traces,
                "compiles": self.compiles, "saves": self.saves}

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
        shapes (the parameters are the model's, fixed per table). A miss builds or loads it.
        While :meth:`recording`, nothing runs: a call missing from memory is recorded, and
        every call returns ``(None, pools)`` (pools untouched)."""
        sid = self._pools_id(pools)
        key = (name, layout, variant, sid)
        entry = self._compiled.get(key)
        if self._recording is not None:  # a dry run: no program runs, no pool is donated
            if entry is None:
                self._recording.append(Call(name, fn, leaves, pools, buf, layout, variant, key))
            return None, pools
        if entry is None:
            self.build([Call(name, fn, leaves, pools, buf, layout, variant, key)])
            entry = self._compiled[key]
        out = entry[0](leaves, pools, buf)
        if entry[1]:
            self._last = (out[1], sid)
        return out

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
    def _add(self, key: tuple, compiled, pools) -> None:
        self._compiled[key] = (compiled, _keeps_pool_shapes(compiled, pools_signature(pools)))

    def build(self, calls: list[Call], workers: int | None = None) -> None:
        """Put the program of every call in memory: already there, loaded from disk (on
        ``workers`` threads), or traced and lowered in turn and compiled on ``workers`` threads
        (default :func:`compile_workers`), then saved."""
        folder = cache_dir() if self.persist else None
        store = ExecutableStore(folder) if folder is not None else None
        environment = ek.environment_digest() if store is not None else ""
        workers = compile_workers() if workers is None else workers
        pending, seen = [], set()
        for c in calls:
            if c.key in self._compiled or c.key in seen:
                continue
            seen.add(c.key)
            pending.append((c, self.disk_key(c, environment) if store is not None else ""))
        loaded = [None] * len(pending)
        if store is not None:
            initialize_custom_call_libraries()  # once, before any thread loads

            def load(item):
                t0 = time.perf_counter()
                compiled = store.load(item[0].name, item[1], input_devices(item[0].pools))
                return compiled, time.perf_counter() - t0
            loaded = _map(load, pending, workers)
        todo = []
        for (c, key), got in zip(pending, loaded):
            if got is not None and got[0] is not None:
                compiled, seconds = got
                self.loads += 1
                self._add(c.key, compiled, c.pools)
                self.records.append(Record(c.describe(), "disk", key[:16], load_s=seconds))
                _report_load(seconds)
                continue
            t0 = time.perf_counter()
            traced = c.fn.trace(c.leaves, c.pools, c.buf, layout=c.layout, variant=c.variant)
            t1 = time.perf_counter()
            lowered = traced.lower()
            self.traces += 1
            todo.append((c, c.key, key, lowered,
                         Record(c.describe(), "built", key[:16], trace_s=t1 - t0,
                                lower_s=time.perf_counter() - t1)))
        if not todo:
            return
        with _without_jax_cache(store is not None):
            done = _map(lambda t: _timed_compile(t[3]), todo, workers)
        for (c, mkey, key, _, rec), (compiled, seconds) in zip(todo, done):
            self.compiles += 1
            self._add(mkey, compiled, c.pools)
            rec.compile_s = seconds
            if store is not None:
                t0 = time.perf_counter()
                self.saves += store.save(c.name, key, compiled, c.describe())
                rec.save_s = time.perf_counter() - t0
            self.records.append(rec)


@contextlib.contextmanager
def _without_jax_cache(active: bool):
    """jax's persistent compilation cache off (and reset) inside the block when ``active``.

    The programs saved here must be fresh compiles: an executable that jax loaded from its own
    cache serializes into a copy that fails when run on XLA:CPU (jax 0.11.2 and 0.12: "Function
    ... not found"). Programs are saved to the executable cache instead of jax's.
    """
    from jax._src import compilation_cache as cc

    if not active or not jax.config.jax_enable_compilation_cache:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        cc.reset_cache()


def _report_load(seconds: float) -> None:
    """Tell ``jax.monitoring`` listeners about a load as jax tells them about a hit of its own
    persistent cache: a backend-compile duration and a cache hit (what
    :mod:`mtp_jax.bench.compiles` counts as an executable "loaded from the persistent cache")."""
    import jax.monitoring as monitoring

    monitoring.record_event_duration_secs(BACKEND_COMPILE_EVENT, seconds)
    monitoring.record_event(CACHE_HIT_EVENT)


def _map(fn, items: list, workers: int) -> list:
    """``[fn(x) for x in items]``, on up to ``workers`` threads when there are several items
    (XLA releases the GIL while it compiles or loads)."""
    if workers > 1 and len(items) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(workers, len(items))) as pool:
            return list(pool.map(fn, items))
    return [fn(x) for x in items]


def _timed_compile(lowered):
    t0 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t0
