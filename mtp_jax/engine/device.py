"""The engine's device side: the state pools and the programs that take them.

:class:`DeviceState` holds the :class:`~mtp_jax.cache.pools.Pools` pytree and the model's
compiled programs with their parameter arguments (:func:`~mtp_jax.engine.programs.programs_for`),
and passes the pools through every call (each program donates them and returns new ones). It
also makes the pools anew after an error consumed them, and replaces the KV or the slot pools
on a resize.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.cache.pools import Pools
from mtp_jax.engine.batch import PrefillBatch, RoundBatch
from mtp_jax.engine.programs import RoundOutput, programs_for
from mtp_jax.engine.snapshots import COPY_PAGE, LOAD_SNAPSHOT
from mtp_jax.engine.variants import PrefillVariant, RoundVariant
from mtp_jax.models.registry import entry_of

__all__ = ["PoolShape", "DeviceState", "pools_usable"]


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """What every pool of an engine is made with beside its sizes: the model config, tokens
    per page, drafts per round ``k``, whether the MTP draft's KV and distributions are kept,
    and the KV dtype (a jnp dtype)."""

    cfg: object
    page_size: int
    k: int
    mtp: bool
    dtype: object

    def make(self, num_pages: int, slots: int, num_snapshots: int = 0) -> Pools:
        """Zeroed pools of these sizes (the family's ``ModelEntry.make_pools``)."""
        return entry_of(self.cfg).make_pools(self.cfg, num_pages=num_pages,
                                             page_size=self.page_size, slots=slots, k=self.k,
                                             mtp=self.mtp, dtype=self.dtype,
                                             num_snapshots=num_snapshots)


def pools_usable(pools) -> bool:
    """Whether every pool array can still be read: a program that failed may have consumed its
    donated input pools, or left its output pools holding the error (waits for the device)."""
    if pools is None:
        return False
    try:
        jax.block_until_ready(pools)
    except Exception:
        return False
    return True


class DeviceState:
    """The pools (``pools``) and programs (``programs``, called with ``leaves``) of one engine
    on ``model``; ``shape`` makes the pools, first with ``num_pages`` pages, ``slots`` slots and
    ``num_snapshots`` prefix-cache snapshots."""

    def __init__(self, model, shape: PoolShape, num_pages: int, slots: int, num_snapshots: int):
        mp = programs_for(model)
        self.programs, self.leaves, self.shape = mp.programs, mp.leaves, shape
        self.pools: Pools | None = shape.make(num_pages, slots, num_snapshots)

    @property
    def prefill_snapshots(self) -> bool:
        """Whether a prefill call saves prefix-cache snapshots at boundaries inside its chunk
        (the family's ``ModelEntry.prefill_snapshots``); else only at the chunk's end."""
        return entry_of(self.shape.cfg).prefill_snapshots

    # ---- programs -----------------------------------------------------------------------------
    def building(self) -> int:
        """Programs a background build still has in hand (0 without an executable table)."""
        table = self.programs.executables
        return table.building() if table is not None else 0

    def prefill(self, batch: PrefillBatch, variant: PrefillVariant) -> jax.Array:
        """Run a prefill call; returns its first tokens and drafts ``[B, k+1]`` int32 (on the
        device)."""
        first, self.pools = self.programs.prefill(self.leaves, self.pools, batch, variant)
        return first

    def round(self, batch: RoundBatch, variant: RoundVariant) -> RoundOutput:
        """Dispatch a round call; returns its :class:`RoundOutput` (on the device)."""
        out, self.pools = self.programs.round(self.leaves, self.pools, batch, variant)
        return out

    def load_snapshot(self, snapshot: int, slot: int) -> None:
        """Copy prefix-cache snapshot ``snapshot`` into the GDN state (and the hidden, where
        kept) of ``slot``."""
        self.pools = LOAD_SNAPSHOT(self.pools, jnp.asarray([snapshot], jnp.int32),
                                   jnp.asarray([slot], jnp.int32))

    def copy_page(self, src: int, dst: int) -> None:
        """Copy KV page ``src`` (target and draft) to page ``dst``."""
        self.pools = COPY_PAGE(self.pools, jnp.asarray([src], jnp.int32),
                               jnp.asarray([dst], jnp.int32))

    # ---- sizes --------------------------------------------------------------------------------
    def renew(self, num_pages: int, slots: int, num_snapshots: int) -> None:
        """Zeroed pools of these sizes (the old ones are given up first)."""
        self.pools = None
        self.pools = self.shape.make(num_pages, slots, num_snapshots)

    def replace_kv(self, num_pages: int) -> None:
        """A new target and draft KV pool of ``num_pages`` pages; the rest is kept."""
        self.pools = dataclasses.replace(self.pools, kv=None, draft_kv=None)
        fresh = self.shape.make(num_pages, 1)
        self.pools = dataclasses.replace(self.pools, kv=fresh.kv, draft_kv=fresh.draft_kv)

    def replace_slots(self, slots: int) -> None:
        """New slot pools (GDN state, pending tokens, draft distributions, positions, output
        counts) of ``slots`` slots; the KV and the snapshots are kept."""
        fresh = self.shape.make(1, slots, 1 if self.pools.slot_hidden is not None else 0)
        self.pools = dataclasses.replace(self.pools, gdn=fresh.gdn, slot_hidden=fresh.slot_hidden,
                                         next_tokens=fresh.next_tokens,
                                         draft_probs=fresh.draft_probs,
                                         position=fresh.position, step=fresh.step,
                                         output_counts=fresh.output_counts)
