"""Prefix-cache snapshots on the device: what the programs save at a boundary and what a hit
restores.

A snapshot at boundary ``p`` (a committed length, a multiple of the snapshot interval) holds
the GDN state after positions ``0 .. p-1`` (``Pools.snapshots``) and, for an engine whose pages
hold MTP draft KV, the target's hidden at position ``p - 1`` (``Pools.snapshot_hidden``). The
hidden is what lets a request reuse a cached page whose last draft-KV row was written for
another next token: the draft row at ``p - 1`` pairs ``h_{p-1}`` with token ``p``, so a request
whose token ``p`` differs copies the page (:data:`COPY_PAGE`, the cached one stays as it was),
loads the snapshot (:data:`LOAD_SNAPSHOT`: the GDN state and the hidden into the slot) and its
first prefill chunk rewrites that one row (:func:`redraft_row`) before the chunk's own rows.
Every other row of the page depends on tokens the two prompts share.

The programs (:mod:`mtp_jax.engine.programs`) call the save functions inside their traces; the
host side is :mod:`mtp_jax.engine.prefix` and the radix tree (:mod:`mtp_jax.cache.radix`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.cache.pools import Pools
from mtp_jax.cache.rows import set_rows
from mtp_jax.engine.batch import PrefillBatch, RoundBatch
from mtp_jax.speculative.mtp import row_at, write_draft_kv

__all__ = ["COPY_PAGE", "LOAD_SNAPSHOT", "has_snapshots", "prefill_targets", "redraft_row",
           "save_prefill_snapshots", "save_round_snapshots"]


def has_snapshots(pools: Pools) -> bool:
    """Whether the pools hold prefix-cache snapshots (static: their leaves' shapes)."""
    leaves = jax.tree_util.tree_leaves(pools.snapshots)
    return bool(leaves) and leaves[0].shape[0] > 0


def _save_hidden(pools: Pools, ids: jax.Array, hidden: jax.Array) -> Pools:
    """``snapshot_hidden[ids] = hidden`` (``ids [N]`` int32, 0: the trash snapshot, not
    written; ``hidden [N, H]``) where the pools keep the hidden (MTP draft KV in the pages)."""
    if pools.snapshot_hidden is None:
        return pools
    return dataclasses.replace(pools, snapshot_hidden=set_rows(pools.snapshot_hidden, ids, hidden))


def save_round_snapshots(model, pools: Pools, rows, batch: RoundBatch, position: jax.Array,
                         num_draft: jax.Array, decode: bool, hidden: jax.Array) -> Pools:
    """Save the GDN state after verify row ``batch.snap_at - 1 - position`` into ``snap_id``
    for rows whose boundary this round's verify rows reach (``0 <= row <= num_draft``, live);
    the others go to the trash snapshot 0 (not written). ``position [B]`` is the round's
    start; ``hidden [B, k+1, H]`` the target's hidden of the verify rows (that row's is saved
    beside the state). Decode form (``decode``): ``rows`` are the new states of the one row,
    saved as they are; else a second replay. The host traces this only into the variant it
    calls when some row may reach a prefix-cache boundary within the call, so other calls
    carry neither its cost nor a conditional."""
    if not has_snapshots(pools):
        return pools
    row = batch.snap_at - 1 - position
    save = (batch.snap_at >= 0) & batch.live & (row >= 0) & (row <= num_draft)
    if decode:
        state = rows.gather(batch.slot)
    else:
        view = pools.gdn.gather(batch.slot)
        state = model.commit(view, rows, jnp.where(save, row + 1, 0))
    ids = jnp.where(save, batch.snap_id, 0)
    pools = dataclasses.replace(pools, snapshots=pools.snapshots.scatter(ids, state))
    return _save_hidden(pools, ids, row_at(hidden, jnp.clip(row, 0, hidden.shape[1] - 1)))


def prefill_targets(batch: PrefillBatch):
    """``(rows, save)`` ``[B, S]``: the chunk rows before each boundary ``snap_at`` (int32)
    and whether it is saved (a boundary in ``start+1 .. start+length``)."""
    rows = batch.snap_at - batch.start[:, None]
    save = (batch.snap_at >= 0) & (rows > 0) & (rows <= batch.length[:, None])
    return rows, save


def save_prefill_snapshots(pools: Pools, batch: PrefillBatch, view, states,
                           hidden: jax.Array) -> Pools:
    """Write the prefix-cache snapshots of a prefill chunk: ``states`` (the slot states after
    each target's rows, ``[B, S, ...]`` leaves) into ``snap_id``, or, for a family without
    them (``states`` None), the chunk's final states ``view`` into the id of a boundary at the
    chunk's end; beside each, the hidden of the row before the boundary (``hidden [B, T, H]``,
    the chunk's). Targets not saved go to the trash snapshot 0 (not written)."""
    rows, save = prefill_targets(batch)
    last = hidden.shape[1] - 1
    if states is None:
        end = save & (rows == batch.length[:, None])
        ids = jnp.max(jnp.where(end, batch.snap_id, 0), axis=1)
        pools = dataclasses.replace(pools, snapshots=pools.snapshots.scatter(ids, view))
        return _save_hidden(pools, ids, row_at(hidden, jnp.clip(batch.length - 1, 0, last)))
    ids = jnp.where(save, batch.snap_id, 0).reshape(-1)
    flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), states)
    pools = dataclasses.replace(pools, snapshots=pools.snapshots.scatter(ids, flat))
    before = jnp.clip(rows - 1, 0, last)  # [B, S]
    h = jnp.take_along_axis(hidden, before[:, :, None], axis=1)  # [B, S, H]
    return _save_hidden(pools, ids, h.reshape(-1, h.shape[-1]))


def redraft_row(model, pools: Pools, batch: PrefillBatch, dtype) -> Pools:
    """Rewrite the draft KV at position ``start - 1`` of the rows with ``batch.redraft``: the
    slot's hidden (loaded with the snapshot it resumes from) paired with the chunk's first
    token, as the draft step writes it (``model.mtp.write_kv`` where the family has it, else
    the whole draft step, its output unused). ``dtype``: the target hidden's (the slot keeps
    it in float32). A no-op without the slot hidden (no MTP draft KV, or no prefix cache)."""
    if pools.slot_hidden is None:
        return pools
    h = pools.slot_hidden[batch.slot][:, None, :].astype(dtype)  # [B, 1, H]
    valid = (batch.redraft & (batch.start > 0))[:, None]
    abatch = AttentionBatch(jnp.maximum(batch.start - 1, 0)[:, None], valid, batch.page_table)
    return dataclasses.replace(pools, draft_kv=write_draft_kv(
        model, pools.draft_kv, h, batch.input_ids[:, :1], abatch))


def load_snapshot(pools: Pools, snapshot: jax.Array, slot: jax.Array) -> Pools:
    """Copy snapshot ids ``snapshot [n]`` into the GDN state (and, where kept, the hidden) of
    ``slot [n]``."""
    pools = dataclasses.replace(pools, gdn=pools.gdn.scatter(
        slot, pools.snapshots.gather(snapshot)))
    if pools.slot_hidden is None:
        return pools
    return dataclasses.replace(pools, slot_hidden=pools.slot_hidden.at[slot].set(
        pools.snapshot_hidden[snapshot]))


def copy_page(pools: Pools, src: jax.Array, dst: jax.Array) -> Pools:
    """Copy KV pages ``src [n]`` to ``dst [n]`` (int32), target and draft, every layer (a
    copy-on-write of a cached page before a request writes into it)."""
    move = lambda a: a.at[dst].set(a[src])
    return dataclasses.replace(pools, kv=jax.tree.map(move, pools.kv),
                               draft_kv=jax.tree.map(move, pools.draft_kv))


LOAD_SNAPSHOT = jax.jit(load_snapshot, donate_argnums=(0,))
COPY_PAGE = jax.jit(copy_page, donate_argnums=(0,))
