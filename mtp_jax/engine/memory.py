"""Memory planning: how many KV pages and state slots fit the budget, before anything is
allocated.

Budget (bytes) = ``mem_fraction`` x device memory (or an explicit ``max_total_tokens``). From it,
in this order: the weights, the per-slot state of ``max_running_requests + 1`` slots (GDN recurrent
and conv state, pending/draft tokens, draft distributions), then KV pages, each holding
``page_size`` positions of every target attention layer plus every MTP draft layer. The planned
pool bytes equal the bytes :func:`mtp_jax.cache.pools.make_pools` allocates.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mtp_jax.cache.allocator import pages_needed
from mtp_jax.config import ConfigError, ModelConfig, SpeculativeConfig
from mtp_jax.models.draft_head import draft_head_bytes, draft_layer_bytes
from mtp_jax.models.loaded import DTYPES
from mtp_jax.models.registry import entry_of
from mtp_jax.speculative.draft_dtypes import resolve_draft_dtypes
from mtp_jax.speculative.draft_vocab import hot_token_ids

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# Page and slot bytes are measured on the shapes of the family's own pools
# (ModelEntry.make_pools), so the plan counts every state a family keeps.


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Sizes in bytes (``*_bytes``), pages and slots."""

    num_pages: int
    slots: int
    page_bytes: int  # target + draft KV of one page
    slot_bytes: int  # GDN state + pending/draft tokens + draft distributions of one slot
    weights_bytes: int
    budget_bytes: int | None
    snapshots: int = 0  # prefix-cache GDN snapshots (plus one trash snapshot when > 0)
    snapshot_bytes: int = 0  # one snapshot (GDN states; with MTP, the hidden)

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def slot_state_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def snapshots_total_bytes(self) -> int:
        return (self.snapshots + 1) * self.snapshot_bytes if self.snapshots else 0

    @property
    def pool_bytes(self) -> int:
        return self.kv_bytes + self.slot_state_bytes + self.snapshots_total_bytes

    def describe(self) -> str:
        gib = lambda b: f"{b / 2**30:.2f} GiB"
        return (f"weights {gib(self.weights_bytes)}, KV {self.num_pages} pages x "
                f"{self.page_bytes} B = {gib(self.kv_bytes)}, slot state {self.slots} x "
                f"{self.slot_bytes} B = {gib(self.slot_state_bytes)}"
                + (f", budget {gib(self.budget_bytes)}" if self.budget_bytes else ""))


def _pool_bytes(cfg, page_size: int, dtype: str, k: int, mtp: bool, *, num_pages: int,
                slots: int, num_snapshots: int) -> int:
    """Bytes of the pools the family's ``make_pools`` would allocate (shapes only, nothing is
    allocated)."""
    make = entry_of(cfg).make_pools
    tree = jax.eval_shape(lambda: make(cfg, num_pages=num_pages, page_size=page_size,
                                       slots=slots, k=k, mtp=mtp, dtype=DTYPES[dtype],
                                       num_snapshots=num_snapshots))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def _unit_bytes(cfg, page_size: int, dtype: str, k: int, mtp: bool, what: str,
                snapshots: bool = True) -> int:
    """Bytes one more ``what`` (``num_pages``, ``slots`` or ``num_snapshots``) adds to the
    pools; ``snapshots``: whether the pools hold prefix-cache snapshots (what a slot holds
    depends on it: the hidden a hit loads)."""
    sizes = {"num_pages": 1, "slots": 1, "num_snapshots": 1 if snapshots else 0}
    base = _pool_bytes(cfg, page_size, dtype, k, mtp, **sizes)
    sizes[what] = 2
    return _pool_bytes(cfg, page_size, dtype, k, mtp, **sizes) - base


def page_bytes(cfg: ModelConfig, page_size: int, dtype: str, mtp: bool) -> int:
    """One KV page of every paged state (target and draft attention layers; the family's
    other paged states, e.g. qwen4_exp's raw index keys)."""
    return _unit_bytes(cfg, page_size, dtype, 0, mtp, "num_pages")


def snapshot_bytes(cfg: ModelConfig, dtype: str, mtp: bool) -> int:
    """One prefix-cache snapshot: a request's slot states (GDN recurrent f32 and conv window;
    the family's other per-slot states) and, with MTP draft KV, the target hidden before its
    boundary (float32)."""
    return _unit_bytes(cfg, 16, dtype, 0, mtp, "num_snapshots")


def slot_bytes(cfg: ModelConfig, k: int, dtype: str, mtp: bool, snapshots: bool) -> int:
    """One slot: its states, next_tokens (k + 1 int32), position and step, with MTP its
    draft distributions ``[k, V]`` f32 and, with prefix-cache ``snapshots`` too, the hidden a
    hit loads (float32)."""
    return _unit_bytes(cfg, 16, dtype, k, mtp, "slots", snapshots)


def prefix_snapshots(engine_cfg) -> int:
    """Prefix-cache GDN snapshot slots of an engine (an :class:`~mtp_jax.config.EngineConfig`):
    0 with the prefix cache off, else ``max_prefix_snapshots``, or 4 per running request. The
    engine's plan and the check before load both count them."""
    if not engine_cfg.enable_prefix_cache:
        return 0
    if engine_cfg.max_prefix_snapshots is not None:
        return engine_cfg.max_prefix_snapshots
    return 4 * engine_cfg.max_running_requests


def plan_memory(cfg: ModelConfig, *, dtype: str, page_size: int, max_running_requests: int,
                max_model_len: int, k: int, mtp: bool, weights_bytes: int,
                device_bytes: int | None = None, mem_fraction: float = 0.9,
                max_total_tokens: int | None = None, snapshots: int = 0) -> MemoryPlan:
    """Plan the pools. ``max_total_tokens`` (KV positions, all requests together) wins over the
    memory fraction; without either (no device statistics, e.g. on CPU) the pool holds
    ``max_running_requests`` full-length requests.

    Raises :class:`ConfigError` naming the numbers and the flag to change when one request of
    ``max_model_len`` tokens plus its verify window and draft chain does not fit.
    """
    if not 0 < mem_fraction <= 1:
        raise ConfigError(f"mem_fraction (--mem-fraction) {mem_fraction} must be in (0, 1]; use "
                          "0.9 (the default) or the share of device memory to use.")
    slots = max_running_requests + 1
    pb = page_bytes(cfg, page_size, dtype, mtp)
    sb = slot_bytes(cfg, k, dtype, mtp, snapshots > 0)
    snap_b = snapshot_bytes(cfg, dtype, mtp)
    snap_total = (snapshots + 1) * snap_b if snapshots else 0
    per_request = pages_needed(max_model_len + 2 * k + 1, page_size)
    budget = None
    if max_total_tokens is not None:
        num_pages = 1 + pages_needed(max_total_tokens, page_size)
    elif device_bytes:
        budget = int(device_bytes * mem_fraction)
        free = budget - weights_bytes - slots * sb - snap_total
        num_pages = max(0, free // pb) if pb else 1 + max_running_requests * per_request
        num_pages = int(min(num_pages, 1 + max_running_requests * per_request))
    else:
        num_pages = 1 + max_running_requests * per_request
    if num_pages - 1 < per_request:
        have = (num_pages - 1) * page_size
        extra = f" (+{2 * k + 1} for the verify window and draft chain)" if k else " (+1)"
        if max_total_tokens is not None:
            fix = (f"max_total_tokens={max_total_tokens}. Raise --max-total-tokens to at least "
                   f"{per_request * page_size} or lower --max-model-len.")
        else:
            fix = (f"weights {weights_bytes / 2**30:.2f} GiB, {slots} slots x "
                   f"{sb / 2**20:.1f} MiB of state"
                   + (f", budget {budget / 2**30:.2f} GiB (mem_fraction={mem_fraction})"
                      if budget else "")
                   + ". Lower --max-model-len or --max-running-requests, or raise "
                     "--mem-fraction or --max-total-tokens.")
        raise ConfigError(
            f"one request of max_model_len={max_model_len} tokens{extra} needs {per_request} KV "
            f"pages of {page_size} tokens, but the budget leaves {max(0, num_pages - 1)} pages "
            f"({have} tokens): {fix}")
    return MemoryPlan(num_pages=int(num_pages), slots=slots, page_bytes=pb, slot_bytes=sb,
                      weights_bytes=int(weights_bytes), budget_bytes=budget,
                      snapshots=snapshots, snapshot_bytes=snap_b)


def planned_weights_bytes(cfg: ModelConfig, dtype: str, mtp: bool,
                          speculative: SpeculativeConfig | None) -> int:
    """:func:`weights_bytes` plus the MTP draft's own LM head when ``speculative`` gives it one
    (a reduced vocabulary, read from the token map if there is one, and/or int8 rows;
    :func:`mtp_jax.models.draft_head.draft_head_bytes`) and the int8 copy of the draft's
    projections when it asks for one (:func:`~mtp_jax.models.draft_head.draft_layer_bytes`).
    The engine's plan and the check before load both count this; draft dtypes left at
    ``"auto"`` count as what they resolve to for ``dtype`` on this platform
    (:mod:`mtp_jax.speculative.draft_dtypes`). Raises ConfigError for an unreadable token map."""
    total = weights_bytes(cfg, dtype, mtp)
    if not mtp or speculative is None:
        return total
    speculative = resolve_draft_dtypes(speculative, dtype)
    hot = hot_token_ids(speculative.algorithm, speculative.draft_vocab_size,
                        speculative.token_map_path, cfg.vocab_size)
    return (total + draft_head_bytes(cfg, None if hot is None else hot.size, dtype,
                                     speculative.draft_head_dtype)
            + draft_layer_bytes(cfg, speculative.draft_layer_dtype,
                                entry_of(cfg).tensor_shapes(cfg, True)))


def weights_bytes(cfg: ModelConfig, dtype: str, mtp: bool) -> int:
    """Parameter bytes of the checkpoint's tensors (the family's
    :attr:`~mtp_jax.models.entry.ModelEntry.tensor_shapes`; GDN A_log/dt_bias are float32)."""
    tensors = entry_of(cfg).tensor_shapes(cfg, mtp)
    total = 0
    for name, shape in tensors.items():
        size = 4 if name.endswith(("A_log", "dt_bias")) else _ITEMSIZE[dtype]
        total += int(np.prod(shape)) * size
    return total
