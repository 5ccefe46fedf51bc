"""The qwen4_exp entry of :mod:`mtp_jax.models.registry`: builder and per-request slot states.

The slot states and their verify handlers are declared in
:mod:`mtp_jax.models.qwen4_exp.slot_states` (GDN recurrent: replay of the accepted rows; GDN conv,
PLE conv window and n-gram context: shift registers; QSA open index group: group ring). Plain
decoding runs the same hooks with every row accepted. QSA raw index keys are paged like KV (same
page ids) and roll back by position, so they need no slot state. A declaration without a handler
is a :class:`~mtp_jax.config.ConfigError` when the registry is built and when a checkpoint loads.

Drafts: none registered yet for the engine (``mtp_forward`` exists for research use; the
speculative engine path for this family is a later issue), so speculation is refused at config
time rather than failing later.
"""

from __future__ import annotations


def _build(cfg, dtype, with_mtp: bool):
    from mtp_jax.models.qwen4_exp.model import Qwen4ExpModel

    return Qwen4ExpModel(cfg, dtype, with_mtp=with_mtp)


def registry_entry(ModelSpec, SlotState):
    """``ModelSpec`` for qwen4_exp, built with the registry's own classes (no import cycle).
    Raises ConfigError if a declared slot state has no verify handler."""
    from mtp_jax.models.qwen4_exp.slot_states import check_slot_states

    states = tuple(SlotState(s.name, s.description, s.handler) for s in check_slot_states())
    return ModelSpec("qwen4_exp", _build, (), states)
