"""The files of the executable cache (:mod:`mtp_jax.engine.executable_cache`): one per
program, ``<name>-<key>.exe``: a magic line, the sha256 of the body, and the body (a pickle of
the serialized executable, ``jax.experimental.serialize_executable``, with its input/output
pytree structures). A file that is truncated, altered, from another format or unreadable is
ignored with an :class:`ExecutableCacheWarning`, removed, and the program rebuilt. Like jax's
cache, the folder is trusted code (loading an entry unpickles it). What saving needs besides:
:func:`initialize_custom_call_libraries` before a load, :func:`without_jax_cache` around a
compile.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import tempfile
import threading
import warnings

import jax

FORMAT = "mtp_jax-executable-v1"
MAGIC = (FORMAT + "\n").encode()
SUFFIX = ".exe"
THREADS_ENV = "MTP_JAX_COMPILE_THREADS"
MIN_CPUS_FOR_THREADS = 8
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax's event names
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class ExecutableCacheWarning(UserWarning):
    """A saved executable was unreadable (ignored, removed, rebuilt) or could not be saved."""


def initialize_custom_call_libraries() -> None:
    """Initialize what jax initializes while lowering a program, which loading one skips: on
    CPU the LAPACK functions behind custom calls such as ``lapack_strsm_ffi`` (the GDN chunked
    prefill's triangular solve); run without it, a loaded program crashes the process.
    ``jax.export`` does the same before it runs a deserialized module."""
    from jax._src.lax import linalg

    linalg.initialize_lapack()  # idempotent; present in jax 0.11.2 and 0.12


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

    def load(self, name: str, key: str, devices=None, initialize: bool = True):
        """The ``jax.stages.Compiled`` saved under ``key``, loaded onto ``devices`` (those of
        its inputs; default all of the backend's), or ``None`` (absent, or unreadable: warned
        and removed). ``initialize=False``: without :func:`initialize_custom_call_libraries`
        (which holds the GIL), for a caller that runs it before the program does."""
        from jax.experimental.serialize_executable import deserialize_and_load

        if initialize:
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


_BYPASS = {"users": 0, "restore": False, "folder": None}
_BYPASS_LOCK = threading.Lock()


@contextlib.contextmanager
def without_jax_cache(active: bool):
    """jax's persistent compilation cache off (and reset) inside the block when ``active``;
    blocks on several threads nest (the cache is back on when the last one ends).

    The programs saved here must be fresh compiles: an executable that jax loaded from its own
    cache serializes into a copy that fails when run on XLA:CPU (jax 0.11.2 and 0.12: "Function
    ... not found"). Programs are saved to the executable cache instead of jax's.
    """
    from jax._src import compilation_cache as cc

    if not active:
        yield
        return
    with _BYPASS_LOCK:
        _BYPASS["users"] += 1
        if _BYPASS["users"] == 1:
            _BYPASS["restore"] = bool(jax.config.jax_enable_compilation_cache)
            _BYPASS["folder"] = jax.config.jax_compilation_cache_dir if _BYPASS["restore"] else None
            if _BYPASS["restore"]:
                jax.config.update("jax_enable_compilation_cache", False)
                cc.reset_cache()
    try:
        yield
    finally:
        with _BYPASS_LOCK:
            _BYPASS["users"] -= 1
            if _BYPASS["users"] == 0 and _BYPASS["restore"]:
                jax.config.update("jax_enable_compilation_cache", True)
                cc.reset_cache()
            if _BYPASS["users"] == 0:
                _BYPASS["folder"] = None


def bypassed_cache_dir() -> str | None:
    """The folder of jax's cache while :func:`without_jax_cache` has it off (the one it will
    turn back on; a build on another thread still reads and saves executables there), else
    None."""
    with _BYPASS_LOCK:
        return _BYPASS["folder"] if _BYPASS["users"] else None


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


def report_load(seconds: float) -> None:
    """Tell ``jax.monitoring`` listeners about a load as jax tells them about a hit of its own
    persistent cache: a backend-compile duration and a cache hit (what
    :mod:`mtp_jax.bench.compiles` counts as an executable "loaded from the persistent cache")."""
    import jax.monitoring as monitoring

    monitoring.record_event_duration_secs(BACKEND_COMPILE_EVENT, seconds)
    monitoring.record_event(CACHE_HIT_EVENT)
