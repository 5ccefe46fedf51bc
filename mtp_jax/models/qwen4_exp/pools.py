"""The engine's state pools for qwen4_exp (:class:`~mtp_jax.cache.pools.Pools` with this family's
paged and per-slot states), and the checks their sizes need.

``Pools.kv`` (target) and ``Pools.draft_kv`` (MTP draft) are :class:`QSAPaged`: per QSA layer the
paged K/V ``[P, ps, Hkv, D]`` and the paged raw index keys ``[P, ps, 1, d_idx]``, all keyed by the
target's page ids, so the page table, the prefix cache and the rollback by position cover them.
``Pools.gdn`` (and ``Pools.snapshots``) is a :class:`Qwen4Slots`: per slot the GDN recurrent and
conv states, the QSA open index groups, the PLE conv windows and the n-gram context (the last
``ngram_size - 1`` committed token ids, from which a round's PLE rows are looked up on the host
by a callback inside the program), the slot states of
:mod:`~mtp_jax.models.qwen4_exp.slot_states`. A prefix-cache snapshot holds the whole
``Qwen4Slots`` of its position (the open index groups included), so snapshot boundaries and pages
need not fall on QSA block edges.

Index keys: the target pages hold the raw keys of complete blocks only (the open block's rows
live in the open group, a ring committed per accepted row); the draft pages hold the raw key of
every row by position, like its K/V (its rows are speculative by nature — chained steps, rows
past the accepted ones — and a row rewritten by position is overwritten before any query can
score its block, which completes only in the call that writes it), so the draft keeps no open
group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.cache.linear_state import TRASH_SLOT, LinearState
from mtp_jax.cache.paged import PagedKV
from mtp_jax.cache.pools import Pools, hidden_pools
from mtp_jax.cache.rows import set_rows

__all__ = ["QSAPaged", "Qwen4Slots", "make_qwen4_pools"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QSAPaged:
    """Paged states of QSA layers: ``kv`` (K/V) and ``idx`` (raw index keys
    ``[P, ps, 1, d_idx]`` per layer), same page ids."""

    kv: PagedKV
    idx: tuple[jax.Array, ...]

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @classmethod
    def zeros(cls, cfg, layers: int, num_pages: int, page_size: int, dtype) -> "QSAPaged":
        kv = PagedKV.zeros(layers, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim,
                           dtype)
        idx = tuple(jnp.zeros((num_pages, page_size, 1, cfg.indexer_head_dim), dtype)
                    for _ in range(layers))
        return cls(kv, idx)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Qwen4Slots:
    """Per-slot states ``[slots, ...]``: ``gdn`` (recurrent f32 ``[Hv, Dk, Dv]``, conv shift
    register ``[conv_dim, K-1]``) per GDN layer, ``open_idx`` ``[r, d_idx]`` per QSA layer,
    ``ple_conv`` ``[hc*H, (K-1)*ngram_size]`` per PLE layer, ``ngram_ctx`` ``[N-1]`` int32 (the
    token ids before the slot's next position; entries before the request's start are not
    read: :func:`~mtp_jax.models.qwen4_exp.slot_states.context_at`)."""

    gdn: LinearState
    open_idx: tuple[jax.Array, ...]
    ple_conv: tuple[jax.Array, ...]
    ngram_ctx: jax.Array

    def gather(self, slots: jax.Array) -> "Qwen4Slots":
        """The states of ``slots [B]`` (a batch view)."""
        return Qwen4Slots(self.gdn.gather(slots), tuple(a[slots] for a in self.open_idx),
                          tuple(a[slots] for a in self.ple_conv), self.ngram_ctx[slots])

    def scatter(self, slots: jax.Array, view: "Qwen4Slots") -> "Qwen4Slots":
        """Write a batch view back at ``slots [B]`` (rows on the trash slot write nothing:
        :func:`mtp_jax.cache.rows.set_rows`)."""
        put = lambda whole, part: tuple(set_rows(a, slots, b, TRASH_SLOT)
                                        for a, b in zip(whole, part))
        return Qwen4Slots(self.gdn.scatter(slots, view.gdn), put(self.open_idx, view.open_idx),
                          put(self.ple_conv, view.ple_conv),
                          set_rows(self.ngram_ctx, slots, view.ngram_ctx, TRASH_SLOT))

    @classmethod
    def zeros(cls, cfg, slots: int, dtype) -> "Qwen4Slots":
        gdn = LinearState.zeros(len(cfg.linear_layer_ids), slots, cfg.linear_num_value_heads,
                                cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, dtype, ring=False)
        groups = tuple(jnp.zeros((slots, cfg.indexer_compress_ratio, cfg.indexer_head_dim), dtype)
                       for _ in cfg.full_layer_ids)
        ple = tuple(jnp.zeros((slots, cfg.hc_hidden, cfg.ple_conv_state_len), dtype)
                    for _ in cfg.ple_layers)
        return cls(gdn, groups, ple, jnp.zeros((slots, cfg.ngram_size - 1), jnp.int32))


def make_qwen4_pools(cfg, *, num_pages: int, page_size: int, slots: int, k: int, mtp: bool,
                     dtype, num_snapshots: int = 0) -> Pools:
    """Zeroed pools of a qwen4_exp engine (``ModelEntry.make_pools``); ``k`` =
    speculative_num_steps (0: speculation off)."""
    n_draft = cfg.mtp_num_hidden_layers if mtp else 0
    probs_shape = (slots, k, cfg.vocab_size) if mtp else (slots, 0, 0)
    snapshots = (Qwen4Slots.zeros(cfg, num_snapshots + 1, dtype) if num_snapshots
                 else Qwen4Slots(LinearState((), ()), (), (), jnp.zeros((0, 0), jnp.int32)))
    return Pools(kv=QSAPaged.zeros(cfg, len(cfg.full_layer_ids), num_pages, page_size, dtype),
                 draft_kv=QSAPaged.zeros(cfg, n_draft, num_pages, page_size, dtype),
                 gdn=Qwen4Slots.zeros(cfg, slots, dtype),
                 next_tokens=jnp.zeros((slots, k + 1), jnp.int32),
                 draft_probs=jnp.zeros(probs_shape, jnp.float32), snapshots=snapshots,
                 position=jnp.zeros((slots,), jnp.int32), step=jnp.zeros((slots,), jnp.int32),
                 output_counts=jnp.zeros((slots, cfg.vocab_size), jnp.int32),
                 **hidden_pools(cfg.hc_hidden, slots=slots, mtp=mtp, num_snapshots=num_snapshots))
