"""The persistent XLA compilation cache: compiled programs saved on disk and reused by the next
process, so a second start-up loads them instead of compiling (jax's
``jax_compilation_cache_dir``; https://docs.jax.dev/en/latest/persistent_compilation_cache.html).

:func:`enable_compilation_cache` is called by ``LLM(..., compilation_cache_dir=...)``,
``python -m mtp_jax.generate --compilation-cache-dir DIR`` and ``python -m mtp_jax.bench
--compilation-cache-dir DIR``. The folder, in order of precedence:

1. the value passed (the flag / keyword);
2. ``$MTP_JAX_COMPILATION_CACHE``;
3. a folder jax already uses (``JAX_COMPILATION_CACHE_DIR`` or an earlier call in this process);
4. ``$MTP_JAX_CACHE/xla``, by default ``~/.cache/mtp_jax/xla``.

``none`` or ``off`` (any case) turns the cache off. Every program is cached: the thresholds
``jax_persistent_cache_min_compile_time_secs`` (default 1 s) and
``jax_persistent_cache_min_entry_size_bytes`` are set to cache any compile time and any size.

jax opens the cache folder once, at the first compile after it is set. Switching to another
folder (or to ``none``) after that resets jax's cache (``reset_cache``): programs compiled so far
stay compiled in this process, the ones compiled from then on are read from and written to the
new folder; a :class:`CompilationCacheWarning` says so. The cache is trusted code: do not point
it at a folder others can write to.
"""

from __future__ import annotations

import os
import tempfile
import warnings

ENV = "MTP_JAX_COMPILATION_CACHE"
OFF_VALUES = ("none", "off")
_FIX = (f"pass --compilation-cache-dir DIR (LLM(compilation_cache_dir=...), or set ${ENV}) with "
        "a writable folder, or 'none' to turn the cache off")


class CompilationCacheWarning(UserWarning):
    """The cache moved to another folder, or the default folder is unusable (cache off)."""


def default_cache_dir() -> str:
    """``$MTP_JAX_CACHE/xla``, by default ``~/.cache/mtp_jax/xla`` (not created here)."""
    from mtp_jax.home import cache_root

    return os.path.join(cache_root(), "xla")


def _jax_state():
    """``(folder jax is configured with or None, whether jax opened its cache already)``."""
    import jax
    from jax._src import compilation_cache as cc

    folder = jax.config.jax_compilation_cache_dir
    opened = bool(getattr(cc, "_cache_initialized", False) or getattr(cc, "_cache", None))
    return folder, opened


def resolve_cache_dir(path: str | None = None) -> tuple[str | None, bool]:
    """The folder to use and whether the user chose it (``(None, True)``: cache off).

    ``path``: the flag / keyword value, ``None`` for the default (see the module docstring).
    """
    explicit = True
    if path is None:
        path = os.environ.get(ENV) or None
    if path is None:
        explicit = False
        path = _jax_state()[0] or default_cache_dir()
    if str(path).strip().lower() in OFF_VALUES:
        return None, True
    if not str(path).strip():
        from mtp_jax.config import ConfigError

        raise ConfigError(f"compilation cache folder {path!r} is empty; {_FIX}.")
    return os.path.abspath(os.path.expanduser(str(path))), explicit


def check_writable(folder: str) -> None:
    """Create ``folder`` if needed and check a file can be written in it.

    Raises :class:`mtp_jax.config.ConfigError` naming the folder, the reason and the flag.
    """
    from mtp_jax.config import ConfigError

    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"the compilation cache folder {folder!r} is not writable "
                          f"({e.strerror or e}); {_FIX}.") from None


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turn on jax's persistent compilation cache at ``path`` (see the module docstring for
    the default and ``none``/``off``). Returns the folder in use, or ``None`` when off.

    Calling it again with the same folder changes nothing. Another folder after jax opened the
    cache: jax's cache is reset and moves there, with a :class:`CompilationCacheWarning`.

    Raises :class:`mtp_jax.config.ConfigError` when a folder that was asked for (argument or
    ``$MTP_JAX_COMPILATION_CACHE``) cannot be created or written; an unusable *default* folder
    only warns and leaves the cache off, so a read-only home does not stop the engine.
    """
    import jax

    folder, explicit = resolve_cache_dir(path)
    current, opened = _jax_state()
    if folder is not None:
        try:
            check_writable(folder)
        except ValueError as e:
            if explicit:
                raise
            warnings.warn(f"{e} The compilation cache stays off.", CompilationCacheWarning,
                          stacklevel=2)
            folder = None
    if folder is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no minimum
    if folder == current:
        return folder
    if opened:
        from jax._src import compilation_cache as cc

        reset = getattr(cc, "reset_cache", None)
        if reset is None:  # not expected in jax 0.11 / 0.12
            raise RuntimeError(f"jax already opened the compilation cache at {current!r} and "
                               f"this jax {jax.__version__} cannot switch it to {folder!r}; "
                               "pass the same --compilation-cache-dir for the whole process.")
        reset()
        where = f"to {folder!r}" if folder else "off"
        warnings.warn(f"the persistent compilation cache moves from {current!r} {where}: "
                      "programs compiled so far stay compiled in this process; programs compiled "
                      "from now on are " + ("read from and written to the new folder." if folder
                                            else "not cached."),
                      CompilationCacheWarning, stacklevel=2)
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder


def active_cache_dir() -> str | None:
    """The folder jax's persistent cache uses now (``None`` when off)."""
    import jax

    if not jax.config.jax_enable_compilation_cache:
        return None
    return _jax_state()[0]
