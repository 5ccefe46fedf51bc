"""A program's PLE rows looked up on the host from inside the program (``jax.pure_callback``).

The n-gram tables never go to the accelerator, so the rows of a round's tokens (the pending
token and the drafts the previous round left on the device) are read by a host callback inside
the round program, from the slot's n-gram context state and those tokens. The host then need
not read a round's result before it dispatches the next one: rounds overlap and run several
per call like every family's (``num_scheduler_steps``); what the device waits for per round is
the lookup itself.

A model names its tables by a small int (``Qwen4ExpModel.ple_source``, static in its graphdef)
bound here to its tables and the lookup over them; the registry holds the tables weakly, so
they go with the last loaded model that holds them. Programs with a host callback cannot be serialized, so an engine on
such a model compiles its programs in every process (the executable cache skips them).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.models.qwen4_exp import ple_native

__all__ = ["reserve", "bind", "rows_on_host"]

_SOURCES: dict[int, tuple[weakref.ref, Callable]] = {}
_IDS = itertools.count(1)


def reserve() -> int:
    """A new source id, to build a model with before its lookup exists (:func:`bind`)."""
    return next(_IDS)


def bind(source: int, tables, lookup: Callable) -> None:
    """Bind ``source`` to ``lookup(tables, contexts [B, N-1] int64, ids [B, T] int64) -> rows
    [B, T, E] float32``; ``tables`` (weakly referenced) is what the lookup reads."""
    _SOURCES[source] = (weakref.ref(tables), lookup)


def _lookup(source: int, contexts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    ref, fn = _SOURCES.get(source, (None, None))
    tables = ref() if ref is not None else None
    if tables is None:
        raise RuntimeError(f"PLE source {source} has no live tables: the model whose n-gram "
                           "tables it names was dropped; keep the loaded model alive while its "
                           "programs run.")
    return np.asarray(fn(tables, np.asarray(contexts, np.int64), np.asarray(ids, np.int64)),
                      np.float32)


def rows_on_host(source: int, contexts: jax.Array, ids: jax.Array, width: int) -> jax.Array:
    """The PLE rows ``[B, T, width]`` float32 of ``ids [B, T]`` after ``contexts [B, N-1]``,
    from the lookup bound to ``source``, read on the host while the program runs: by the
    native FFI lookup when ``source`` is registered with it (:mod:`~mtp_jax.models.qwen4_exp.
    ple_native`, the default on a GPU), else by ``jax.pure_callback``."""
    if ple_native.registered(source):  # the same rows without blocking the launch
        return ple_native.rows(source, contexts, ids, width)
    shape = jax.ShapeDtypeStruct((*ids.shape, width), jnp.float32)
    return jax.pure_callback(functools.partial(_lookup, source), shape, contexts, ids)
