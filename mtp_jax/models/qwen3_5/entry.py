"""The registry entries of the Qwen3.5 family: ``qwen3_5`` (dense) and ``qwen3_5_moe``.

Both are served by the batched engine with MTP and external drafts; a verify commits their two
GDN slot states by replay (the verify keeps the per-row inputs; the commit replays the accepted
rows).
"""

from __future__ import annotations

from mtp_jax.cache.pools import make_pools
from mtp_jax.config import ModelConfig
from mtp_jax.models.entry import ModelEntry, SlotState
from mtp_jax.models.qwen3_5.loader import build, load
from mtp_jax.models.qwen3_5.mtp_chain import draft_chain
from mtp_jax.models.qwen3_5.random_checkpoint import write_random
from mtp_jax.weights import names

__all__ = ["ENTRIES"]

SLOT_STATES = (
    SlotState("gdn_recurrent", "Gated DeltaNet recurrent state [slots, Hv, Dk, Dv] float32 per "
              "linear-attention layer", "replay"),
    SlotState("gdn_conv", "Gated DeltaNet causal-conv window [slots, conv_dim, K] per "
              "linear-attention layer, a ring keyed by position (position p in column p mod K)",
              "replay"),
)


def tensor_shapes(cfg: ModelConfig, with_mtp: bool) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of the checkpoint's tensors (``mtp.*`` with ``with_mtp``)."""
    out = dict(names.target_tensors(cfg))
    if with_mtp:
        out.update(names.mtp_tensors(cfg))
    return out


def _entry(model_type: str) -> ModelEntry:
    return ModelEntry(model_type=model_type, hf_model_types=(model_type, f"{model_type}_text"),
                      config_class=ModelConfig, build=build, load=load,
                      tensor_shapes=tensor_shapes, drafts=("mtp", "external"),
                      slot_states=SLOT_STATES, serving="rounds", make_pools=make_pools,
                      write_random=write_random, draft_chain=draft_chain,
                      prefill_snapshots=True)


ENTRIES = (_entry("qwen3_5"), _entry("qwen3_5_moe"))
