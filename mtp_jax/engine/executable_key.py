"""What a saved executable depends on: the key of :mod:`mtp_jax.engine.executable_cache`.

A program loaded from disk skips tracing and lowering, so nothing checks that it still matches
the code that would have traced it. Its key therefore names everything tracing, lowering and
compiling read, and a change of any of it is a miss, never a stale hit:

* the source of the ``mtp_jax`` and ``pallas_kernels`` packages (every ``.py`` file, its path
  and bytes) as imported by this process;
* the versions of jax, jaxlib, the PJRT plugins and flax, numpy, ml_dtypes (tracing code);
* the backend: platform, platform version (driver / plugin), every device's id, kind and
  process;
* ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS``;
* module constants that tracing reads and that a tool changed at run time
  (:data:`CHANGED_CONSTANTS`, e.g. ``python -m mtp_jax.bench ab``'s ``@module.ATTR=int``
  variants): the source names their defaults only;
* jax's configuration: every option in ``jax.config.values`` except the ones that only name
  caches, logs, dumps and tracebacks (:data:`CONFIG_SKIP`), plus jax's trace context (the
  options and context managers its own jit cache keys on, e.g. a ``default_matmul_precision``
  context);
* the model: ``repr`` of its nnx graphdef (module tree, static attributes such as the
  :class:`~mtp_jax.config.ModelConfig` with its kernel backends);
* the program: its name, static keywords (sorted), donated arguments, and the pytree
  structure, shapes, dtypes, weak types and shardings of every input.

All strings here are built from ``repr``s with memory addresses (`` at 0x...``) removed, so two
processes with the same inputs get the same key. Also the in-memory side of a program's inputs:
:func:`pools_signature`, :func:`keeps_pool_shapes`, :func:`input_devices` and
:func:`abstract_pools`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re

import numpy as np

PACKAGES = ("mtp_jax", "pallas_kernels")
DISTRIBUTIONS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                 "jax-cuda13-pjrt", "jax-rocm7-plugin", "libtpu", "flax", "numpy", "ml_dtypes")
ENV_VARS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# Options that only name cache folders and thresholds, logging, dumps and tracebacks.
CONFIG_SKIP = ("compilation_cache", "persistent_cache", "log", "dump", "traceback", "pprint",
               "explain_cache_misses", "tracer_error")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# ``module.ATTR`` -> value of the constants a tool set away from their source values while it
# builds programs (kept by that tool, cleared when it restores them); part of every key then.
CHANGED_CONSTANTS: dict[str, object] = {}
# Modules that register jax options when first imported, which can happen after start-up (the
# Pallas interpret mode imports the fuser, which registers pallas_fuser_disable_nested_fuse):
# a process that ran such a kernel would otherwise key its programs apart from a fresh one.
LAZY_CONFIG_MODULES = ("jax.experimental.pallas.fuser",)


def digest(*parts: str) -> str:
    """sha256 hex of the parts, each length-prefixed (so part boundaries count)."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def stable_repr(value) -> str:
    """``repr(value)`` without memory addresses; an object whose repr is only its address
    (``<X object at 0x..>``) is shown by its attributes instead."""
    r = repr(value)
    if " at 0x" not in r:
        return r
    attrs = getattr(value, "__dict__", None)
    if attrs is None:
        attrs = {s: getattr(value, s, None) for s in getattr(type(value), "__slots__", ())}
    return type(value).__qualname__ + _ADDRESS.sub("", repr(sorted(attrs.items())))


def _package_root(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 of every ``.py`` file (relative path and bytes) of :data:`PACKAGES`; computed once
    per process, so it names the code this process imported (an absent package counts as
    absent)."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        root = _package_root(pkg)
        h.update(f"package {pkg} {'absent' if root is None else 'present'}\0".encode())
        if root is None:
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path, "rb") as fh:
                        data = fh.read()
                    rel = os.path.relpath(path, root).replace(os.sep, "/")
                    h.update(f"{pkg}/{rel}\0{len(data)}\0".encode())
                    h.update(data)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def versions() -> str:
    """``name=version`` of :data:`DISTRIBUTIONS` that are installed, plus jax's and jaxlib's
    own version strings."""
    from importlib import metadata

    import jax
    from jax._src import lib

    out = [f"jax.__version__={jax.__version__}",
           f"jaxlib={getattr(lib, 'version_str', getattr(lib, 'jaxlib_version', '?'))}"]
    for name in DISTRIBUTIONS:
        try:
            out.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ";".join(out)


def backend_description() -> str:
    """Platform, platform version and every device (id, kind, process) of the default
    backend, and the process count."""
    import jax

    devices = jax.devices()
    client = devices[0].client
    devs = ",".join(f"{d.id}:{d.device_kind}:{d.process_index}" for d in devices)
    return (f"platform={client.platform};version={client.platform_version};devices={devs};"
            f"processes={jax.process_count()}")


def config_description() -> str:
    """jax's global options (without :data:`CONFIG_SKIP`) and its trace context, after
    importing :data:`LAZY_CONFIG_MODULES` (so that both processes list the same options)."""
    import jax
    from jax._src import config as jcfg

    for name in LAZY_CONFIG_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    values = jax.config.values
    opts = [f"{k}={stable_repr(values[k])}" for k in sorted(values)
            if not any(s in k for s in CONFIG_SKIP)]
    ctx = jcfg.trace_context()
    names = getattr(jcfg, "trace_context_names", None)
    names = names() if callable(names) else names
    if names is not None and len(names) == len(ctx):
        trace = [f"{n}={stable_repr(v)}" for n, v in zip(names, ctx)]
    else:
        trace = [stable_repr(v) for v in ctx]
    return ";".join(opts) + "|trace:" + ";".join(trace)


def environment_parts() -> dict[str, str]:
    """The parts of :func:`environment_digest`, each as text (the source as its digest)."""
    return {"source": source_digest(), "versions": versions(),
            "backend": backend_description(),
            "env": ";".join(f"{k}={os.environ.get(k, '')}" for k in ENV_VARS),
            "constants": ";".join(f"{k}={CHANGED_CONSTANTS[k]!r}"
                                  for k in sorted(CHANGED_CONSTANTS)),
            "config": config_description()}


def environment_digest() -> str:
    """Digest of the source, versions, backend, XLA flags, changed constants and jax
    configuration (read now: options can change within a process).
    :func:`environment_parts` tells which part moved when two processes disagree."""
    return digest(*environment_parts().values())


def leaf_signature(x) -> str:
    """Shape, dtype, weak type and sharding of one input leaf (``host`` for numpy arrays)."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        a = np.asarray(x)
        return f"{a.shape}|{a.dtype.str}|host"
    aval = getattr(x, "aval", None)
    weak = getattr(aval, "weak_type", False)
    sharding = getattr(x, "sharding", None)
    return f"{tuple(x.shape)}|{np.dtype(x.dtype).str}|{weak}|{stable_repr(sharding)}"


def tree_signature(tree) -> str:
    """Digest of a pytree's structure and every leaf's :func:`leaf_signature`."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return digest(stable_repr(treedef), *map(leaf_signature, leaves))


def static_description(static: dict) -> str:
    """The static keywords, sorted by name."""
    return ";".join(f"{k}={stable_repr(static[k])}" for k in sorted(static))


def model_digest(graphdef) -> str:
    """Digest of the model's nnx graphdef (module tree and static attributes, among them the
    model config, kernel backends and dtypes)."""
    return digest(stable_repr(graphdef))


def pools_signature(pools) -> tuple:
    """The shapes of the pools' leaves, in order (their dtypes follow the model)."""
    import jax

    return tuple([x.shape for x in jax.tree_util.tree_leaves(pools)])


def keeps_pool_shapes(compiled, signature: tuple) -> bool:
    """Whether ``compiled``'s output pools (its second output) have the input pools' shapes
    (``signature``: :func:`pools_signature`)."""
    try:
        return pools_signature(compiled.out_info[1]) == signature
    except Exception:  # noqa: BLE001 (no output info: never assume)
        return False


def input_devices(tree) -> list | None:
    """The devices of a pytree's first array leaf, by id (what a program on it runs on)."""
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return sorted(sharding.device_set, key=lambda d: d.id)
    return None


def abstract_pools(pools):
    """``pools`` with every array as a ``jax.ShapeDtypeStruct`` (shape, dtype, sharding, weak
    type): what tracing needs, and nothing a later call can donate away under a build."""
    import jax

    def spec(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                        weak_type=x.aval.weak_type)
        return x
    return jax.tree_util.tree_map(spec, pools)
