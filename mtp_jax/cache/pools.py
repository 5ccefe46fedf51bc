"""The engine's device state as one pytree, donated to every program.

Fields (``slots`` = max_running_requests + 1; slot 0 and page 0 are the trash slot / page that
padding rows write to):

* ``kv``: target paged KV, per attention layer ``[num_pages, page_size, Hkv, D]``.
* ``draft_kv``: MTP draft paged KV, per MTP layer, same page ids as the target (the target's page
  table addresses it); empty when MTP is off.
* ``gdn``: GDN recurrent ``[slots, Hv, Dk, Dv]`` f32 and conv ``[slots, conv_dim, K]`` (a ring
  keyed by position) per layer.
* ``next_tokens``: ``[slots, k+1]`` int32, the pending token and the k drafts of each slot's
  next round (written by prefill and by each round).
* ``draft_probs``: ``[slots, k, V]`` f32, the draft distributions q of those drafts (MTP only;
  rejection sampling needs them); ``[slots, 0, 0]`` otherwise.
* ``snapshots``: GDN states saved at prefix-cache boundaries, ``[num_snapshots + 1, ...]`` per
  layer like ``gdn`` (id 0 is the trash snapshot); no arrays at all without the prefix cache
  (every pool array is an argument buffer of every program call, which costs host time).
* ``snapshot_hidden``: ``[num_snapshots + 1, H]`` float32, the target's hidden at the position
  before each snapshot's boundary, and ``slot_hidden``: ``[slots, H]`` float32, the one loaded
  with a slot's snapshot: with MTP draft KV and the prefix cache only (``None`` otherwise), so
  that a hit may rewrite the draft row its next token changes (:mod:`mtp_jax.engine.snapshots`).
* ``output_counts``: ``[slots, V]`` int32, how many times each id is in the slot's output so
  far (set by the final prefill chunk, added to by each round) for the presence and frequency
  penalties (:mod:`mtp_jax.sampling.penalties`); only programs of a batch with a penalty read
  or write it.
* ``position``: ``[slots]`` int32, the position of each slot's pending token (= tokens in its
  target KV); ``step``: ``[slots]`` int32, tokens the slot's request has generated (the
  random-stream step of its next sampled token). Both are set by the final prefill chunk and
  advanced by each round by the tokens it commits, on the device, so that a round can be
  dispatched before the host has read the previous one's result (overlap scheduling).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.cache.linear_state import LinearState
from mtp_jax.cache.paged import PagedKV
from mtp_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pools:
    kv: PagedKV
    draft_kv: PagedKV
    gdn: LinearState
    next_tokens: jax.Array
    draft_probs: jax.Array
    snapshots: LinearState
    position: jax.Array
    step: jax.Array
    snapshot_hidden: jax.Array | None = None
    slot_hidden: jax.Array | None = None
    output_counts: jax.Array | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(self))


def hidden_pools(width: int, *, slots: int, mtp: bool, num_snapshots: int) -> dict:
    """``snapshot_hidden`` and ``slot_hidden`` (:class:`Pools` keywords): zeroed float32
    ``[num_snapshots + 1, width]`` and ``[slots, width]`` (``width``: the last axis of the
    hidden the target hands its MTP draft) with MTP draft KV and snapshots; no keyword (the
    fields stay ``None``, no buffer at all) otherwise."""
    if not (mtp and num_snapshots):
        return {}
    return dict(snapshot_hidden=jnp.zeros((num_snapshots + 1, width), jnp.float32),
                slot_hidden=jnp.zeros((slots, width), jnp.float32))


def make_pools(cfg: ModelConfig, *, num_pages: int, page_size: int, slots: int, k: int,
               mtp: bool, dtype, num_snapshots: int = 0) -> Pools:
    """Allocate zeroed pools. ``k`` = speculative_num_steps (0 when speculation is off)."""
    kv = PagedKV.zeros(len(cfg.full_layer_ids), num_pages, page_size, cfg.num_key_value_heads,
                       cfg.head_dim, dtype)
    draft = PagedKV.zeros(cfg.mtp_num_hidden_layers if mtp else 0, num_pages, page_size,
                          cfg.num_key_value_heads, cfg.head_dim, dtype)
    gdn_of = lambda n: LinearState.zeros(len(cfg.linear_layer_ids), n, cfg.linear_num_value_heads,
                                         cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                         cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, dtype)
    gdn = gdn_of(slots)
    probs_shape = (slots, k, cfg.vocab_size) if mtp else (slots, 0, 0)
    return Pools(kv=kv, draft_kv=draft, gdn=gdn,
                 next_tokens=jnp.zeros((slots, k + 1), jnp.int32),
                 draft_probs=jnp.zeros(probs_shape, jnp.float32),
                 snapshots=gdn_of(num_snapshots + 1) if num_snapshots else LinearState((), ()),
                 position=jnp.zeros((slots,), jnp.int32), step=jnp.zeros((slots,), jnp.int32),
                 output_counts=jnp.zeros((slots, cfg.vocab_size), jnp.int32),
                 **hidden_pools(cfg.hidden_size, slots=slots, mtp=mtp, num_snapshots=num_snapshots))
