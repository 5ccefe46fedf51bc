"""Per-request slot states of qwen4_exp and their verify handlers (verify keeps, commit selects).

A speculative verify appends ``k+1`` rows to a request without knowing how many will be accepted.
Every per-request state therefore declares two hooks:

* ``verify(live, rows)``: what the verify keeps beside the live state (the live state is not
  changed);
* ``commit(live, kept, length, accepted)``: the live state after accepting the first
  ``accepted [B]`` rows (``length [B]``: tokens of the request before the rows).

Plain decoding uses the same hooks (a step is a verify whose rows are all accepted), so the
hooks run on every decode step. Handlers (``kind``):

* ``shift_register``: the state is the last ``L`` rows of a stream (PLE conv window, n-gram
  context, GDN conv window); verify keeps the rows, commit takes the ``L`` rows ending at the
  last accepted one.
* ``group_ring``: the QSA open index group, the raw index keys ``[B, r, d_idx]`` of the request's
  incomplete block of ``r = indexer_compress_ratio`` positions (slots ``0 .. length mod r - 1``
  filled, the rest zero). Verify keeps the ring ``[open group, rows]``: ``k+1`` rows may complete
  the open block and open the next one (or several). Rows of blocks that complete are written to
  the paged raw index keys (by position, so a rejected row is overwritten before any query treats
  its block as complete); commit takes the ring rows of the new open block.
* ``recurrence``: the GDN recurrent state; verify keeps the per-row inputs and commit replays the
  accepted rows (:func:`mtp_jax.models.layers.gdn.commit`; with the ``pallas`` GDN backend the
  verify keeps ``GDNConvRows``, which the model commits through its layer's fused kernels,
  ``GatedDeltaNet.commit``).

The registry name of each handler (``replay``: verify keeps rows, commit rebuilds the state from
the accepted ones) comes from :data:`mtp_jax.models.entry.VERIFY_HANDLERS`. A declaration
without a handler, or with a missing hook, is a :class:`~mtp_jax.config.ConfigError` raised by
:func:`check_slot_states` (at registry build and when a checkpoint is loaded, before any weight
is read).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from mtp_jax.config import ConfigError
from mtp_jax.models.entry import VERIFY_HANDLERS
from mtp_jax.models.layers.conv_state import conv_window
from mtp_jax.models.layers.gdn import commit as gdn_commit

# ---- group ring (QSA open index group) -------------------------------------------------------


def ring_verify(open_group: jax.Array, rows: jax.Array) -> jax.Array:
    """``open_group [B, r, d]``, raw index keys of the new rows ``rows [B, T, d]`` -> the ring
    ``[B, r + T, d]`` (model dtype). The live group is not changed."""
    return jnp.concatenate([open_group, rows.astype(open_group.dtype)], axis=1)


def ring_positions(length: jax.Array, r: int, t: int) -> jax.Array:
    """Positions ``[B, r + T]`` int32 of the ring rows: slot ``i`` of the open group sits at
    ``(length // r) * r + i``, new row ``j`` at ``length + j``."""
    length = jnp.asarray(length, jnp.int32)
    start = (length // r) * r
    return jnp.concatenate([start[:, None] + jnp.arange(r, dtype=jnp.int32),
                            length[:, None] + jnp.arange(t, dtype=jnp.int32)], axis=1)


def ring_flush(length: jax.Array, accepted: jax.Array, r: int, t: int) -> jax.Array:
    """``[B, r + T]`` bool: ring rows that hold a real raw key and whose block is complete after
    ``accepted`` rows, i.e. the rows to write to the paged raw index keys."""
    length, accepted = jnp.asarray(length, jnp.int32), jnp.asarray(accepted, jnp.int32)
    pos = ring_positions(length, r, t)
    filled = jnp.concatenate([jnp.arange(r)[None, :] < (length % r)[:, None],
                              jnp.arange(t)[None, :] < accepted[:, None]], axis=1)
    return filled & (pos < (((length + accepted) // r) * r)[:, None])


def ring_commit(ring: jax.Array, length: jax.Array, accepted: jax.Array, r: int) -> jax.Array:
    """The open group ``[B, r, d]`` after accepting the first ``accepted [B]`` rows of a ring
    ``[B, r + T, d]`` built at ``length [B]``: the raw keys of positions
    ``[(n // r) * r, n)``, ``n = length + accepted``, in slots ``0..``; zeros after them."""
    length, accepted = jnp.asarray(length, jnp.int32), jnp.asarray(accepted, jnp.int32)
    n_end = length + accepted
    start_old, start_new = (length // r) * r, (n_end // r) * r
    q = start_new[:, None] + jnp.arange(r, dtype=jnp.int32)  # [B, r] positions
    # A position before `length` is in the old open group only if no block completed.
    src = jnp.where(q < length[:, None], q - start_old[:, None], r + q - length[:, None])
    src = jnp.clip(src, 0, ring.shape[1] - 1)
    got = jnp.take_along_axis(ring, src[..., None], axis=1)
    return jnp.where((q < n_end[:, None])[..., None], got, jnp.zeros_like(got))


def group_ring_commit(live, kept, length, accepted):
    """``commit`` hook of the open group: ``kept`` is the ring from :func:`ring_verify`."""
    return ring_commit(kept, length, accepted, live.shape[1])


# ---- shift registers ---------------------------------------------------------------------------


def shift_register_commit(live: jax.Array, rows: jax.Array, length, accepted) -> jax.Array:
    """Window state ``live [B, C, L]`` (time last) after the first ``accepted [B]`` of
    ``rows [B, T, C]``: the ``L`` rows ending at the last accepted one (unchanged for 0)."""
    del length
    return conv_window(live, rows, jnp.asarray(accepted, jnp.int32))


def token_register_commit(live: jax.Array, rows: jax.Array, length, accepted) -> jax.Array:
    """N-gram context ``live [B, N-1]`` int32 after the first ``accepted [B]`` token ids of
    ``rows [B, T]``: the last ``N-1`` ids of ``[live, accepted rows]``."""
    del length
    n = live.shape[1]
    ext = jnp.concatenate([live, rows.astype(live.dtype)], axis=1)
    acc = jnp.broadcast_to(jnp.asarray(accepted, jnp.int32), (live.shape[0],))
    return jnp.take_along_axis(ext, acc[:, None] + jnp.arange(n, dtype=jnp.int32)[None], 1)


def context_at(live: jax.Array, start: jax.Array, eos: int) -> jax.Array:
    """The n-gram context ``[B, N-1]`` int32 of rows starting at position ``start [B]``:
    ``live``'s ids, with ``eos`` in place of those before the request's first token (a request
    starts after an eos; a slot's stale ids are never read)."""
    n = live.shape[1]
    before = start[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None]
    return jnp.where(before < 0, jnp.int32(eos), live)


def keep_rows(live, rows):
    """``verify`` hook of a shift register: keep the new rows, leave ``live`` alone."""
    del live
    return rows


def _gdn_commit(live, kept, length, accepted):
    del length
    return gdn_commit(live, kept, jnp.asarray(accepted, jnp.int32))


def _gdn_verify(live, rows):
    """Rows are the :class:`~mtp_jax.models.layers.gdn.GDNRows` of ``GatedDeltaNet.verify``."""
    del live
    return rows


# ---- declarations ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlotStateDecl:
    """One per-request state: registry ``handler`` name, handler ``kind`` and its two hooks."""

    name: str
    description: str
    handler: str | None
    kind: str | None
    verify: Callable | None
    commit: Callable | None


SLOT_STATES: tuple[SlotStateDecl, ...] = (
    SlotStateDecl("gdn_recurrent", "Gated DeltaNet recurrent state [slots, Hv, Dk, Dv] float32 "
                  "per linear-attention layer", "replay", "recurrence", _gdn_verify, _gdn_commit),
    SlotStateDecl("gdn_conv", "Gated DeltaNet causal-conv window [slots, conv_dim, K-1] per "
                  "linear-attention layer", "replay", "shift_register", keep_rows,
                  shift_register_commit),
    SlotStateDecl("ple_conv", "PLE dilated conv window [slots, hc*H, (K-1)*ngram_size] per PLE "
                  "layer", "replay", "shift_register", keep_rows, shift_register_commit),
    SlotStateDecl("ngram_context", "last ngram_size-1 token ids [slots, N-1] int32 per "
                  "request (eos before its start)", "replay", "shift_register", keep_rows, token_register_commit),
    SlotStateDecl("qsa_open_group", "QSA open index group [slots, compress_ratio, "
                  "indexer_head_dim] per QSA layer (raw index keys of the incomplete block)",
                  "replay", "group_ring", ring_verify, group_ring_commit),
)


def check_slot_states(states=None) -> tuple[SlotStateDecl, ...]:
    """Refuse a declaration without a usable verify handler.

    Raises:
      ConfigError: a state whose ``handler`` is not one of the registry's ``VERIFY_HANDLERS``,
        whose ``kind`` is unset, or whose ``verify`` / ``commit`` hook is not callable.
    """
    states = SLOT_STATES if states is None else states
    for s in states:
        missing = [k for k in ("verify", "commit") if not callable(getattr(s, k))]
        if s.handler not in VERIFY_HANDLERS or not s.kind or missing:
            raise ConfigError(
                f"qwen4_exp slot state {s.name!r} has no usable verify handler (handler "
                f"{s.handler!r}, kind {s.kind!r}, missing hooks {missing or 'none'}); every "
                f"per-request state needs a handler in {', '.join(VERIFY_HANDLERS)} with verify "
                "and commit hooks. Declare them in mtp_jax/models/qwen4_exp/slot_states.py.")
    return tuple(states)


def by_name(name: str) -> SlotStateDecl:
    return {s.name: s for s in SLOT_STATES}[name]
