"""Per-token log-probabilities as int32 columns of a program's one readback, and back.

A program that reports log-probabilities (a logprobs variant: ``top >= 0``) appends, for each
of ``R`` emitted positions of a row, ``1 + 2 * top`` int32 columns to its readback: the chosen
token's log-probability, the ids of the ``top`` most likely tokens (most likely first) and
their log-probabilities, each float32 carried as its int32 bits (``lax.bitcast_convert_type``),
so that the host still reads one int32 array with one copy. The distribution is
:func:`~mtp_jax.sampling.filtering.filtered_logprobs` of the row's own sampling parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.sampling.filtering import filtered_logprobs
from mtp_jax.sampling.params import MAX_LOGPROBS
from mtp_jax.sampling.tensors import SamplingTensors

__all__ = ["logprob_columns", "split_logprob_columns", "top_bucket", "columns_per_token"]


def columns_per_token(top: int) -> int:
    """int32 columns one position takes in a readback with ``top`` alternatives (0 for
    ``top < 0``: no log-probabilities)."""
    return 0 if top < 0 else 1 + 2 * top


def top_bucket(asked) -> int:
    """The ``top`` of a program call from the requests' ``SamplingParams.logprobs`` (None:
    not asked): -1 when none asks, else the largest asked rounded up to a power of two (at
    most :data:`~mtp_jax.sampling.params.MAX_LOGPROBS`; 0 stays 0), so that few programs
    serve every mix."""
    asked = [a for a in asked if a is not None]
    if not asked:
        return -1
    top = max(asked)
    return 0 if top == 0 else min(1 << (top - 1).bit_length(), MAX_LOGPROBS)


def logprob_columns(logits: jax.Array, tokens: jax.Array, sampling: SamplingTensors, top: int,
                    filtering: bool | None = None) -> jax.Array:
    """The readback columns of ``R`` positions per row.

    Args:
      logits: ``[B, R, V]`` float, the target's logits that position r's token was drawn
        from.
      tokens: ``[B, R]`` int, the chosen tokens (negative ids, padding, read as id 0).
      sampling: ``[B]`` rows; top: alternatives per position (static, >= 0).
      filtering: as :func:`~mtp_jax.sampling.filtering.filtered_probs`.

    Returns:
      ``[B, R * (1 + 2 * top)]`` int32.
    """
    b, r, _ = logits.shape
    lp = filtered_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                           sampling.min_p, filtering=filtering)  # [B, R, V]
    chosen = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[..., None], axis=-1)  # [B, R, 1]
    bits = lambda a: jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)  # noqa: E731
    parts = [bits(chosen)]
    if top:
        vals, ids = jax.lax.top_k(lp, top)  # [B, R, top], most likely first
        parts += [ids.astype(jnp.int32), bits(vals)]
    return jnp.concatenate(parts, axis=-1).reshape(b, r * columns_per_token(top))


def split_logprob_columns(cols: np.ndarray, top: int):
    """Host side of :func:`logprob_columns`: ``cols [..., R * (1 + 2 * top)]`` int32 ->
    ``(chosen [..., R] float32, top_ids [..., R, top] int32, top_logprobs [..., R, top]
    float32)``."""
    cols = np.asarray(cols, np.int32)
    per = cols.reshape(*cols.shape[:-1], -1, columns_per_token(top))
    chosen = per[..., 0].view(np.float32)
    return chosen, per[..., 1:1 + top], np.ascontiguousarray(per[..., 1 + top:]).view(np.float32)
