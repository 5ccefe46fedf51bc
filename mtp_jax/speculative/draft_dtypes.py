"""What ``speculative_draft_head_dtype`` / ``speculative_draft_layer_dtype = "auto"`` (the
default) choose: the int8 draft head and layer (:mod:`mtp_jax.models.draft_head`) where they
save bytes a round waits on, the model dtype elsewhere.

``auto`` is int8 for the MTP draft on an accelerator with a 16-bit compute dtype (bfloat16,
float16): there every draft step reads the draft's LM head and projections from memory, and
int8 halves those reads. The 27B k = 3 round took 1.287x the decode step with the model-dtype
draft and 1.214x with the int8 head and layer on an H100 (1.302x and 1.232x on the H200;
docs/benchmarks.md, sessions 39, 18 and 22). On the CPU and in float32 ``auto`` keeps the model dtype (float32 is a reference dtype:
its drafts are the exact ones).

The output stays exact either way (the target verifies every draft with its own head). The
drafts can change: the int8 head re-scores the 8 blocks of 32 rows holding its best logits
in the model dtype, so a greedy draft is the model-dtype head's argmax unless the int8 error
reaches the gap between the best and the 8th logit; the int8 layer carries each weight's
rounding (at most 1/254 of its row's largest) into the draft's hidden state. On the trained
fixture (tests/fixtures/tiny_trained, k = 3, 16 motif prompts of 64 greedy tokens) the accept
rate moved from 0.4901 to 0.4942 with both, the tokens unchanged; a test holds the accept
length no more than 1% below the model dtype's (tests/speculative/test_draft_dtypes_auto.py). The cost is memory: the int8 copies are held
beside the model-dtype weights (N x (H + 4) bytes for the head, out x (in + 4) per draft
projection; on the 27B about 1.7 GB), and the memory plan counts them.
"""

from __future__ import annotations

import dataclasses

import jax

from mtp_jax.config import DRAFT_DTYPE_AUTO, SpeculativeConfig

__all__ = ["auto_draft_dtype", "platform", "resolve_draft_dtypes"]

SIXTEEN_BIT = ("bfloat16", "float16")


def platform() -> str:
    """The platform ``auto`` decides for: ``jax.default_backend()`` (``"cpu"``, ``"gpu"``,
    ...)."""
    return jax.default_backend()


def auto_draft_dtype(algorithm: str, dtype: str, on: str | None = None) -> str | None:
    """The draft dtype ``auto`` stands for: ``"int8"`` for ``algorithm == "mtp"`` with a
    16-bit compute ``dtype`` (a name, e.g. ``"bfloat16"``) on a platform ``on`` other than
    ``"cpu"`` (default: :func:`platform`), else ``None`` (the model dtype)."""
    where = platform() if on is None else on
    fast = algorithm == "mtp" and dtype in SIXTEEN_BIT and where != "cpu"
    return "int8" if fast else None


def resolve_draft_dtypes(spec: SpeculativeConfig, dtype: str,
                         on: str | None = None) -> SpeculativeConfig:
    """``spec`` with each draft dtype given as ``"auto"`` replaced by
    :func:`auto_draft_dtype` (``dtype``: the compute dtype's name; ``on``: the platform, default
    :func:`platform`); other values unchanged
    (None: the model dtype). Idempotent."""
    def pick(value):
        return auto_draft_dtype(spec.algorithm, dtype, on) if value == DRAFT_DTYPE_AUTO \
            else value
    return dataclasses.replace(spec, draft_head_dtype=pick(spec.draft_head_dtype),
                               draft_layer_dtype=pick(spec.draft_layer_dtype))
