"""Presence and frequency penalties over the output so far, speculative rows included.

For a row whose output so far holds id ``v`` ``c_v`` times (the generated tokens only, not
the prompt), the logits the sampler and the acceptance read are::

    x'_v = x_v - frequency_penalty * c_v - presence_penalty * (c_v > 0)

before temperature, top-k, top-p and min-p (OpenAI's definition of both penalties; vLLM
applies them to the logits in this way before temperature). The counts live on the device, one
``[V] int32`` row per slot (``Pools.output_counts``): a prefill's final chunk sets its slot's
row to the first token, and each round adds the tokens it commits.

In a verify, row ``j`` decides the token after ``d_1..d_j``, so its counts are the slot's
plus those drafts (:func:`verify_penalties`): where the drafts are accepted that is exactly
the output before the token, and where one is rejected the rows after it are never read. The
MTP draft penalises its own drafts the same way (:func:`draft_penalty`), so that its drafts
follow the penalised target; the output stays exact either way, since the acceptance reads
the distribution each draft was drawn from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.sampling.tensors import SamplingTensors

__all__ = ["penalty", "verify_penalties", "draft_penalty", "add_tokens", "first_counts"]


def _coefficients(sampling: SamplingTensors, ndim: int):
    """The rows' ``(frequency, presence)`` float32, shaped ``[B, 1, ...]`` to broadcast over
    ``ndim``-dimensional ``[B, ..., V]`` arrays (zeros where a field is None)."""
    def col(a):
        a = jnp.zeros_like(sampling.temperature) if a is None else a
        return a.astype(jnp.float32).reshape((-1,) + (1,) * (ndim - 1))
    return col(sampling.frequency_penalty), col(sampling.presence_penalty)


def penalty(counts: jax.Array, sampling: SamplingTensors) -> jax.Array:
    """``frequency * c + presence * (c > 0)``: ``counts [B, ..., V]`` int -> float32 of the
    same shape, the amount each logit is lowered by."""
    freq, pres = _coefficients(sampling, counts.ndim)
    c = counts.astype(jnp.float32)
    return freq * c + pres * (counts > 0).astype(jnp.float32)


def _with_drafts(counts: jax.Array, drafts: jax.Array, rows: int) -> jax.Array:
    """``[B, rows, V]`` int32: row ``j`` is ``counts [B, V]`` plus one for each of
    ``drafts[:, :j]`` (``drafts [B, >= rows - 1]``, negative ids add nothing); elementwise, so
    that XLA fuses it into its reader."""
    iota = jax.lax.broadcasted_iota(jnp.int32, (1, 1, counts.shape[-1]), 2)
    j = jnp.arange(rows, dtype=jnp.int32)[None, :, None]
    out = jnp.broadcast_to(counts[:, None, :], (counts.shape[0], rows, counts.shape[-1]))
    for i in range(rows - 1):  # draft i counts from row i + 1 on
        out = out + ((drafts[:, i, None, None] == iota) & (j > i)).astype(jnp.int32)
    return out


def verify_penalties(logits: jax.Array, counts: jax.Array, drafts: jax.Array,
                     sampling: SamplingTensors) -> jax.Array:
    """The penalised logits of a verify: ``logits [B, k+1, V]``, ``counts [B, V]`` int32 (the
    slots' counts: the output up to and with the round's pending token), ``drafts [B, k]``
    int32 (``d_1..d_k``). Row ``j``'s counts add ``d_1..d_j``. Returns ``[B, k+1, V]``
    float32."""
    c = _with_drafts(counts, drafts, logits.shape[1])
    return logits.astype(jnp.float32) - penalty(c, sampling)


def draft_penalty(counts: jax.Array, drafted: list, sampling: SamplingTensors) -> jax.Array:
    """The penalty of an MTP draft step: ``counts [B, V]`` int32 (the output before the
    round's first draft) plus the tokens ``drafted`` so far (a list of ``[B]`` int32).
    Returns ``[B, V]`` float32."""
    iota = jax.lax.broadcasted_iota(jnp.int32, (1, counts.shape[-1]), 1)
    for tok in drafted:
        counts = counts + (tok[:, None] == iota).astype(jnp.int32)
    return penalty(counts, sampling)


def add_tokens(counts: jax.Array, slot: jax.Array, tokens: jax.Array,
               taken: jax.Array) -> jax.Array:
    """``counts [S, V]`` with ``tokens [B, T]`` added to the rows of ``slot [B]`` where
    ``taken [B, T]`` (a scatter-add; the other entries, negative ids included, are sent out of
    range and dropped, so that they do not all update one address: colliding scatter
    writes serialise on a GPU, docs/design.md)."""
    s, v = counts.shape
    ids = jnp.clip(tokens, 0, v - 1)
    rows = jnp.where(taken, slot[:, None], s)
    return counts.at[rows, ids].add(jnp.ones_like(counts, shape=tokens.shape), mode="drop")


def first_counts(counts: jax.Array, slot: jax.Array, first: jax.Array,
                 final: jax.Array) -> jax.Array:
    """``counts [S, V]`` with the rows of ``slot [B]`` where ``final [B]`` set to the one-hot
    of ``first [B]`` (a prompt's first output token); the other rows are not written (sent
    out of range and dropped, as in :func:`add_tokens`)."""
    s, v = counts.shape
    onehot = (jnp.arange(v, dtype=jnp.int32)[None, :] == first[:, None]).astype(counts.dtype)
    return counts.at[jnp.where(final, slot, s)].set(onehot, mode="drop")
