"""Resumable train state: orbax checkpoints of a state pytree plus a JSON item of metadata.

Each step is a folder ``<dir>/<step>/`` with two items: ``state`` (any pytree of arrays: the
draft's parameters, the optimizer state, the step counter; ``orbax.checkpoint.args.
StandardSave``) and ``meta`` (a JSON object: the data stream's position, the run's settings,
...). ``meta["run"]``, when present, holds the settings a resume must share with the saved run
(model path, k, sequence length, ...): :func:`restore` refuses another.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp

from mtp_jax.config import ConfigError

__all__ = ["save", "latest", "restore", "check_run"]

_ITEMS = ("state", "meta")


def _manager(directory: str, max_to_keep: int | None = None,
             create: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                 item_names=_ITEMS)


def save(directory: str, step: int, state, meta: dict, *, max_to_keep: int | None = 3) -> None:
    """Save ``state`` (a pytree of arrays) and ``meta`` (JSON-able dict) as ``step``, waiting
    until written; keeps the newest ``max_to_keep`` steps (None: all). A step already saved is
    replaced. Raises :class:`ConfigError` for a ``meta`` that is not JSON-able."""
    try:
        meta = json.loads(json.dumps(meta))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint metadata must be JSON-able (ints, floats, strings, "
                          f"lists, dicts): {e}") from None
    with _manager(directory, max_to_keep, create=True) as mgr:
        if step in mgr.all_steps():
            mgr.delete(step)
        mgr.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))
        mgr.wait_until_finished()


def latest(directory: str) -> int | None:
    """The newest saved step in ``directory`` (None when there is none, or no folder)."""
    if not os.path.isdir(directory):
        return None
    with _manager(directory) as mgr:
        return mgr.latest_step()


def check_run(saved: dict | None, current: dict | None) -> None:
    """Refuse a resume whose run settings differ from the saved run's: a
    :class:`ConfigError` naming each differing key with both values. Compared as JSON (a tuple
    equals a list); either side None skips the check."""
    if saved is None or current is None:
        return
    current = json.loads(json.dumps(current))
    diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if diff:
        detail = "; ".join(f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}" for k in diff)
        raise ConfigError(f"cannot resume: the checkpoint was saved by a run with other "
                          f"settings ({detail}). Resume with the saved settings, or start a "
                          "new run in another output folder.")


def restore(directory: str, abstract_state, step: int | None = None, *,
            run: dict | None = None) -> tuple[object, dict]:
    """``(state, meta)`` of ``step`` (default: the newest) in ``directory``.

    ``abstract_state``: a pytree shaped like the saved state (arrays or
    ``jax.ShapeDtypeStruct``s); the restored state has its structure, shapes and dtypes.
    ``run``: the current run's settings, checked against the saved ``meta["run"]``
    (:func:`check_run`) before the state is read.
    Raises :class:`ConfigError` when there is no checkpoint, the step is not saved, or the run
    settings differ.
    """
    none = (f"no checkpoint to resume from in {directory!r}; start without resuming, or "
            "pass the folder a run saved into.")
    if not os.path.isdir(directory):
        raise ConfigError(none)
    with _manager(directory) as mgr:
        steps = sorted(mgr.all_steps())
        if not steps:
            raise ConfigError(none)
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise ConfigError(f"step {step} is not saved in {directory!r} (saved: {steps}).")
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        check_run(meta.get("run"), run)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                abstract_state)
        state = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))["state"]
    return state, meta
