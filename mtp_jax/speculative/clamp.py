"""How many drafts a row may verify in a round: k, clamped where pages or the request's token
budget run out (the house plan: "k is clamped for that row; k = 0 is a plain decode step inside the
same program"). :func:`clamp_drafts` runs inside the round program; :func:`clamp_num_draft` is
its host reference, which the scheduler uses to foresee a round's reach."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["clamp_drafts", "clamp_num_draft"]


def clamp_drafts(k: int, position, step, limit, max_step):
    """Drafts each row can verify: at most k, with the verify positions ``position ..
    position + n`` below ``limit`` (allocated pages) and the round's tokens (n drafts and the
    bonus) within ``max_step - step`` (tokens the request may still generate). All ``[B]``
    int32; returns ``[B]`` int32 in ``[0, k]`` (0 = a plain decode step)."""
    room = jnp.minimum(limit - position, max_step - step) - 1
    return jnp.clip(room, 0, k).astype(jnp.int32)


def clamp_num_draft(k: int, position: int, allocated_tokens: int, emitted: int,
                    max_tokens: int, prompt_len: int, max_model_len: int) -> int:
    """:func:`clamp_drafts` of one row on the host: at most k, with the verify positions
    ``position .. position + n`` inside the allocated pages (``allocated_tokens``), and no more
    than the tokens the request may still emit (``max_tokens`` and ``max_model_len``, ``emitted``
    so far) minus the bonus token."""
    room_pages = allocated_tokens - position - 1
    room_tokens = min(max_tokens - emitted, max_model_len - prompt_len - emitted) - 1
    return max(0, min(k, room_pages, room_tokens))
