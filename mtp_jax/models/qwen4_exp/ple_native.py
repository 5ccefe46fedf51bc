"""PLE rows looked up on the host by a native XLA FFI call that does not block the launch.

``jax.pure_callback`` (:mod:`~mtp_jax.models.qwen4_exp.ple_callback`) runs on the thread that
launches the program: XLA waits there for the device to reach the callback, runs it, and only
then launches the rest of the program, so with host tables the device idles for that launch
(about 1 ms of a 1.5 ms decode step of the cut Flash-Next shape on the H200,
docs/benchmarks.md, session 26). ``ple_lookup.cc`` beside this file is a custom call that, on
a GPU, only enqueues on the program's stream a copy of the ids to pinned host memory, a host
function (``cuLaunchHostFunc``) that hashes them and gathers the rows, and the copy of the rows
back; the launching thread goes straight on. On the CPU the same lookup runs in the call.

The rows are the numpy path's bit for bit (:func:`~mtp_jax.models.qwen4_exp.loaded.ple_rows`):
the same int64 hash, the same stored bytes and the same conversion.

``MTP_JAX_PLE_LOOKUP`` picks the form: ``auto`` (default: native on a GPU when it builds,
the callback on the CPU), ``native`` (also on the CPU; the callback where it cannot build),
``callback``. The library is built once per source text and jaxlib with the C++ compiler
(``$CXX`` or ``g++``) into ``$MTP_JAX_CACHE/native`` and loaded with ``ctypes``; without a
compiler the callback serves, and :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
import weakref

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mtp_jax.home import cache_root

__all__ = ["CHOICES", "choice", "library", "unavailable_reason", "register", "registered",
           "rows"]

CHOICES = ("auto", "native", "callback")
TARGET = "mtp_jax_ple_lookup"
_SOURCE = os.path.join(os.path.dirname(__file__), "ple_lookup.cc")
_DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 1,
                np.dtype(np.float16): 2}
_STATE: dict = {}  # "lib" (ctypes.CDLL) or "error" (str), once tried
_REGISTERED: set[int] = set()


def choice() -> str:
    """``$MTP_JAX_PLE_LOOKUP`` (default ``auto``). Raises ValueError for another value."""
    got = os.environ.get("MTP_JAX_PLE_LOOKUP", "auto").strip().lower() or "auto"
    if got not in CHOICES:
        raise ValueError(f"MTP_JAX_PLE_LOOKUP={got!r} is unknown; use one of "
                         f"{', '.join(CHOICES)} (native: the FFI lookup that does not block "
                         "the launch; callback: jax.pure_callback).")
    return got


def _wanted() -> bool:
    c = choice()
    return c == "native" or (c == "auto" and jax.default_backend() != "cpu")


def _build(dest: str) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set $CXX or install g++)")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(dest))
    os.close(fd)
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
           _SOURCE, "-o", tmp, "-ldl"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, dest)  # atomic: a concurrent build leaves one whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The built library with its FFI targets registered with jax, or None (then
    :func:`unavailable_reason` says why). Built and registered once per process."""
    if "lib" in _STATE or "error" in _STATE:
        return _STATE.get("lib")
    try:
        text = open(_SOURCE, "rb").read()
        key = hashlib.sha256(text + jax.ffi.include_dir().encode()
                             + jax.__version__.encode()).hexdigest()[:16]
        path = os.path.join(cache_root(), "native", f"ple_lookup-{key}.so")
        if not os.path.exists(path):
            _build(path)
        lib = ctypes.CDLL(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.MtpPleLookupCpu),
                                    platform="cpu")
        if any(d.platform == "gpu" for d in jax.devices()):
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.MtpPleLookupCuda),
                                        platform="CUDA")
        lib.mtp_ple_register.restype = ctypes.c_int
        lib.mtp_ple_lookup_host.restype = ctypes.c_int
        _STATE["lib"] = lib
    except Exception as e:  # noqa: BLE001 - any failure leaves the callback serving
        _STATE["error"] = f"{type(e).__name__}: {e}"
    return _STATE.get("lib")


def unavailable_reason() -> str | None:
    """Why :func:`library` is None (after a try), else None."""
    return _STATE.get("error")


def _i64(values) -> ctypes.Array:
    a = np.ascontiguousarray(np.asarray(values, np.int64).reshape(-1))
    return (ctypes.c_int64 * a.size)(*a.tolist())


def register(source: int, cfg, ple) -> bool:
    """Register ``ple`` (:class:`~mtp_jax.models.qwen4_exp.loaded.PLETables`, the tables
    the callback of ``source`` reads) with the native lookup, when :func:`choice` wants it
    here and the library builds. Returns whether :func:`rows` now serves ``source``: False also
    for tables without stored parts (the random model's stand-ins), a dtype other than
    float32 / bfloat16 / float16, a table part that is not one contiguous ``[rows, dim]``
    array, or hash constants that reach past a table (rows the C++ could not check). The
    registration ends when ``ple`` is collected. Warns (once) when the native lookup is wanted
    but the library cannot be built."""
    if not ple or not _wanted():
        return False
    if library() is None:
        if not _STATE.get("warned"):
            _STATE["warned"] = True
            warnings.warn(f"the native PLE lookup is unavailable ({unavailable_reason()}); "
                          "jax.pure_callback looks the n-gram rows up instead (the same rows, "
                          "slower on a GPU: docs/design.md). Install g++ (or set $CXX) to "
                          "build it, or set MTP_JAX_PLE_LOOKUP=callback to silence this.",
                          stacklevel=2)
        return False
    lib = _STATE["lib"]
    tables = [p.table for p in ple]
    if not _readable(ple, tables):
        return False  # the callback serves (and raises IndexError for rows past a table)
    parts = [t.parts for t in tables]
    stored = np.dtype(parts[0][0][0].dtype)
    ptrs = [a.ctypes.data for ps, _ in parts for a in ps]
    got = lib.mtp_ple_register(
        ctypes.c_int64(source), ctypes.c_int32(cfg.ngram_size),
        ctypes.c_int32(cfg.heads_per_ngram), ctypes.c_int64(cfg.eos_token_id),
        ctypes.c_int32(tables[0].dim), ctypes.c_int32(_DTYPE_CODES[stored]),
        ctypes.c_int32(_DTYPE_CODES[np.dtype(tables[0].out_dtype)]), ctypes.c_int32(len(ple)),
        _i64([list(p.multipliers)[:cfg.ngram_size] for p in ple]),
        _i64([p.vocab_sizes for p in ple]), _i64([p.offsets for p in ple]),
        (ctypes.c_int32 * len(parts))(*[len(ps) for ps, _ in parts]),
        (ctypes.c_uint64 * len(ptrs))(*ptrs),
        _i64([s for _, ss in parts for s in np.asarray(ss).tolist()]))
    if got != 0:
        return False
    _REGISTERED.add(source)
    weakref.finalize(ple, _unregister, lib, source)
    return True


def _readable(ple, tables) -> bool:
    """Whether the C++ lookup reads ``tables`` as the numpy one does: stored parts (not the
    random model's stand-ins), one stored dtype, one out dtype and one row width for all,
    contiguous ``[rows, dim]`` parts, and hash constants within each table."""
    if not all(hasattr(t, "parts") for t in tables):
        return False
    parts = [t.parts[0] for t in tables]
    stored = {np.dtype(a.dtype) for ps in parts for a in ps}
    out = {np.dtype(t.out_dtype) for t in tables}
    return (len(stored) == 1 and len(out) == 1 and len({t.dim for t in tables}) == 1
            and stored <= set(_DTYPE_CODES) and out <= set(_DTYPE_CODES)
            and all(a.flags.c_contiguous and a.ndim == 2 and a.shape[1] == t.dim
                    for ps, t in zip(parts, tables) for a in ps)
            and all(max(o + v for o, v in zip(p.offsets, p.vocab_sizes))
                    <= sum(a.shape[0] for a in ps) for p, ps in zip(ple, parts)))


def _unregister(lib, source: int) -> None:
    _REGISTERED.discard(source)
    lib.mtp_ple_unregister(ctypes.c_int64(source))


def registered(source: int) -> bool:
    """Whether :func:`rows` serves ``source``."""
    return source in _REGISTERED


def rows(source: int, contexts: jax.Array, ids: jax.Array, width: int) -> jax.Array:
    """The PLE rows ``[B, T, width]`` float32 of ``ids [B, T]`` after ``contexts [B, N-1]``
    (int; held as int32) from the tables registered as ``source``, by the FFI call."""
    shape = jax.ShapeDtypeStruct((*ids.shape, width), jnp.float32)
    return jax.ffi.ffi_call(TARGET, shape)(jnp.asarray(contexts, jnp.int32),
                                           jnp.asarray(ids, jnp.int32),
                                           source=np.int64(source))


def host_rows(source: int, contexts: np.ndarray, ids: np.ndarray, width: int) -> np.ndarray:
    """:func:`rows` on host arrays, through the library's own entry (for tests): ``[B, T,
    width]`` float32. Raises KeyError for a source that is not registered."""
    ctx = np.ascontiguousarray(contexts, np.int32)
    ids = np.ascontiguousarray(ids, np.int32)
    out = np.empty((*ids.shape, width), np.float32)
    got = _STATE["lib"].mtp_ple_lookup_host(
        ctypes.c_int64(source), ctx.ctypes.data_as(ctypes.c_void_p),
        ids.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(ids.shape[0]),
        ctypes.c_int64(ids.shape[1]), out.ctypes.data_as(ctypes.c_void_p))
    if got != 0:
        raise KeyError(f"PLE source {source} is not registered with the native lookup")
    return out
