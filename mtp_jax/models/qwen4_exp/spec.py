"""The qwen4_exp entry of :mod:`mtp_jax.models.registry`: builder and per-request slot states.

Slot states and how a speculative verify would commit them (the verify itself comes with the
qwen4_exp speculative issue; plain decoding needs none of it):

* GDN recurrent / conv window: ``replay`` (as Qwen3.5);
* PLE conv window ``[slots, hc*H, (K-1)*ngram_size]``: ``replay`` (a shift register of the
  accepted rows' normed gated values);
* n-gram context ``[slots, ngram_size-1]`` token ids (host side): ``replay`` (shift register of the
  accepted tokens).

QSA raw index keys are paged like KV (same page ids), so they roll back by position and need no
slot state; block keys are recomputed from them, so there is no separate open-group ring.
Drafts: none registered yet for the engine (``mtp_forward`` exists for research use; the
speculative engine path for this family is a later issue), so speculation is refused at config
time rather than failing later.
"""

from __future__ import annotations


def _build(cfg, dtype, with_mtp: bool):
    from mtp_jax.models.qwen4_exp.model import Qwen4ExpModel

    return Qwen4ExpModel(cfg, dtype, with_mtp=with_mtp)


def registry_entry(ModelSpec, SlotState):
    """``ModelSpec`` for qwen4_exp, built with the registry's own classes (no import cycle)."""
    states = (
        SlotState("gdn_recurrent", "Gated DeltaNet recurrent state [slots, Hv, Dk, Dv] float32 "
                  "per linear-attention layer", "replay"),
        SlotState("gdn_conv", "Gated DeltaNet causal-conv window [slots, conv_dim, K-1] per "
                  "linear-attention layer", "replay"),
        SlotState("ple_conv", "PLE dilated conv window [slots, hc*H, (K-1)*ngram_size] per PLE "
                  "layer", "replay"),
        SlotState("ngram_context", "last ngram_size-1 token ids per request (eos at start), "
                  "host side", "replay"),
    )
    return ModelSpec("qwen4_exp", _build, (), states)
