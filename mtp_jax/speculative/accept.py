"""Acceptance of one speculative verify round over a batch.

Shapes (B rows, k drafts per row, V vocab; k is static, taken from the array shapes):

* ``target_logits [B, k+1, V]``: target logits at verify positions ``c..c+k`` (scoring
  ``[pending, d_1..d_k]``), so ``target_logits[:, j]`` is the target's distribution for the token
  after ``d_j`` (``d_0`` = pending).
* ``draft_tokens [B, k] int32``: ``d_1..d_k``.
* ``draft_probs [B, k, V] float`` or ``None``: the proposer's distribution ``q_j`` that ``d_{j+1}``
  was drawn from (normally ``sampling.filtered_probs`` of the draft logits with the row's
  parameters). ``None`` means the proposer is deterministic (``q_j`` is one-hot at ``d_{j+1}``).
* ``num_draft [B] int32`` (optional, default k): per-row draft count after clamping (docs/design.md; the house plan:
  "k is clamped for that row"); drafts at positions ``>= num_draft[b]`` are ignored and row b
  behaves exactly like a round with ``num_draft[b]`` drafts (0 == a plain decode step).

Outputs: ``num_accepted [B] int32`` in ``[0, num_draft]`` and ``emitted [B, k+1] int32`` =
``d_1..d_n, t, -1, ...`` where ``n = num_accepted`` and ``t`` is the target's token at position n
(argmax for greedy rows; the residual sample after a rejection or the bonus sample after all drafts
were accepted for sampled rows). Every row emits ``n + 1`` tokens.

Sampled rows use exact speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023) on
the SAME filtered distributions as plain sampling (``sampling.filtered_probs``); their output
tokens are distributed exactly as sequential sampling from the filtered target. Greedy rows
(temperature 0) give exactly :func:`greedy_accept` and their result never depends on the rng.

Random streams (see ``sampling.row_keys``): the acceptance uniforms use
``row_keys(seed, step, SALT_ACCEPT)`` and the residual/bonus draw uses
``row_keys(seed, step, SALT_RESIDUAL)``; ``step`` is the row's generated-token count at the start
of the round. The proposer should draw ``d_{j+1}`` with ``row_keys(seed, step, SALT_DRAFT + j)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.sampling import (
    SALT_ACCEPT,
    SALT_RESIDUAL,
    SamplingTensors,
    categorical,
    filtered_probs,
    row_keys,
)

__all__ = ["greedy_accept", "rejection_accept", "accept"]

PAD_TOKEN = -1


def _check_shapes(target_logits, draft_tokens, draft_probs=None, num_draft=None):
    if target_logits.ndim != 3:
        raise ValueError(
            f"target_logits must be [B, k+1, V]; got shape {target_logits.shape}")
    B, k1, V = target_logits.shape
    if draft_tokens.shape != (B, k1 - 1):
        raise ValueError(
            f"draft_tokens must be [B, k] = {(B, k1 - 1)} to match target_logits "
            f"{target_logits.shape}; got {draft_tokens.shape}")
    if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
        raise ValueError(f"draft_tokens must be an integer array; got dtype {draft_tokens.dtype}")
    if draft_probs is not None and draft_probs.shape != (B, k1 - 1, V):
        raise ValueError(
            f"draft_probs must be [B, k, V] = {(B, k1 - 1, V)} or None (deterministic "
            f"proposer); got {draft_probs.shape}")
    if num_draft is not None and num_draft.shape != (B,):
        raise ValueError(f"num_draft must be [B] = {(B,)}; got {num_draft.shape}")
    return B, k1 - 1, V


def _prefix_len(ok: jax.Array) -> jax.Array:
    """``[B, k] bool`` -> ``[B] int32`` length of the leading all-True run."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _assemble(draft_tokens: jax.Array, n: jax.Array, final: jax.Array) -> jax.Array:
    """``emitted [B, k+1]`` = ``d_1..d_n, final, -1...``."""
    B, k = draft_tokens.shape
    d_ext = jnp.concatenate(
        [draft_tokens.astype(jnp.int32), jnp.full((B, 1), PAD_TOKEN, jnp.int32)], axis=1)
    pos = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    n = n[:, None]
    return jnp.where(pos < n, d_ext, jnp.where(pos == n, final[:, None], PAD_TOKEN))


def _draft_valid(draft_tokens, V, k, num_draft):
    """``[B, k] bool``: draft position j is inside the row's clamp and the token id is in range."""
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    valid = (draft_tokens >= 0) & (draft_tokens < V)
    if num_draft is not None:
        valid = valid & (j < num_draft.astype(jnp.int32)[:, None])
    return valid


def greedy_accept(target_logits: jax.Array, draft_tokens: jax.Array,
                  num_draft: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Greedy verify: accept the longest prefix with ``d_{j+1} == argmax(l_j)``.

    Args:
      target_logits: ``[B, k+1, V]`` float.
      draft_tokens: ``[B, k]`` int.
      num_draft: optional ``[B]`` int32 per-row draft count (default k).

    Returns:
      ``(num_accepted [B] int32, emitted [B, k+1] int32)`` with
      ``emitted = d_1..d_n, argmax(l_n), -1...`` (argmax = first index of the max, as
      ``jnp.argmax``).

    Raises:
      ValueError: inconsistent shapes or non-integer draft tokens.
    """
    target_logits = jnp.asarray(target_logits)
    draft_tokens = jnp.asarray(draft_tokens)
    num_draft = None if num_draft is None else jnp.asarray(num_draft)
    B, k, V = _check_shapes(target_logits, draft_tokens, None, num_draft)
    top = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    match = (draft_tokens.astype(jnp.int32) == top[:, :k]) & _draft_valid(
        draft_tokens, V, k, num_draft)
    n = _prefix_len(match)
    final = jnp.take_along_axis(top, n[:, None], axis=1)[:, 0]
    return n, _assemble(draft_tokens, n, final)


def rejection_accept(target_logits: jax.Array, draft_tokens: jax.Array,
                     draft_probs: jax.Array | None, params: SamplingTensors, step: jax.Array,
                     num_draft: jax.Array | None = None, *,
                     filtering: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Exact speculative rejection sampling for one verify round (per-row greedy/sampled).

    For a sampled row with ``p_j = filtered_probs(target_logits[:, j], row params)`` and ``q_j`` the
    draft distribution: draft ``d_{j+1}`` is accepted iff ``u_j * q_j(d_{j+1}) < p_j(d_{j+1})``
    with ``u_j ~ U[0, 1)``; at the first rejection j the emitted token is drawn from
    ``norm(max(p_j - q_j, 0))`` (``p_j`` if that is all zero); after all drafts are accepted the
    bonus is drawn from ``p_k`` (``p_{num_draft}`` for clamped rows). Out-of-range draft ids are
    rejected. Rows with temperature 0 return exactly :func:`greedy_accept` and ignore the rng.

    Args:
      target_logits: ``[B, k+1, V]`` float.
      draft_tokens: ``[B, k]`` int.
      draft_probs: ``[B, k, V]`` float, or ``None`` for a deterministic proposer.
      params: :class:`~mtp_jax.sampling.SamplingTensors` with ``[B]`` fields.
      step: ``[B]`` int32, the row's generated-token count at the start of the round.
      num_draft: optional ``[B]`` int32 per-row draft count (default k).
      filtering: static, as :func:`~mtp_jax.sampling.filtered_probs`'s (whether some row
        filters; ``None``: tested at run time).

    Returns:
      ``(num_accepted [B] int32, emitted [B, k+1] int32)``.

    Raises:
      ValueError: inconsistent shapes or non-integer draft tokens.
    """
    target_logits = jnp.asarray(target_logits)
    draft_tokens = jnp.asarray(draft_tokens)
    draft_probs = None if draft_probs is None else jnp.asarray(draft_probs)
    num_draft = None if num_draft is None else jnp.asarray(num_draft)
    B, k, V = _check_shapes(target_logits, draft_tokens, draft_probs, num_draft)
    step = jnp.asarray(step)
    if params.temperature.shape != (B,) or step.shape != (B,):
        raise ValueError(
            f"rejection_accept: B={B} rows but params.temperature has shape "
            f"{params.temperature.shape} and step has shape {step.shape}; all must be [B]")

    n_greedy, emitted_greedy = greedy_accept(target_logits, draft_tokens, num_draft)

    d = draft_tokens.astype(jnp.int32)
    valid = _draft_valid(d, V, k, num_draft)  # [B, k]
    d_safe = jnp.clip(d, 0, V - 1)
    # [B, k+1, V]; the [B] params broadcast over the k+1 positions of each row.
    p = filtered_probs(target_logits, params.temperature, params.top_k, params.top_p,
                       params.min_p, filtering=filtering)
    p_d = jnp.take_along_axis(p[:, :k], d_safe[..., None], axis=-1)[..., 0]  # [B, k]
    if draft_probs is None:
        q_d = jnp.ones((B, k), jnp.float32)
    else:
        q_d = jnp.take_along_axis(
            draft_probs.astype(jnp.float32), d_safe[..., None], axis=-1)[..., 0]

    keys_u = row_keys(params.seed, step, SALT_ACCEPT)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,), jnp.float32))(keys_u)  # [B, k]
    ok = valid & (u * q_d < p_d)
    n = _prefix_len(ok)  # [B]

    # Distribution of the token at position n: residual after a rejection, or p_n (bonus) when
    # position n has no draft (n == k or n == num_draft).
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    has_draft = n < (k if num_draft is None else jnp.minimum(num_draft.astype(jnp.int32), k))
    if k == 0:
        q_n = jnp.zeros_like(p_n)
    elif draft_probs is None:
        d_n = jnp.take_along_axis(d, jnp.minimum(n, k - 1)[:, None], axis=1)[:, 0]
        q_n = jax.nn.one_hot(d_n, V, dtype=jnp.float32)  # out-of-range ids give all zeros
    else:
        q_n = jnp.take_along_axis(
            draft_probs, jnp.minimum(n, k - 1)[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    q_n = jnp.where(has_draft[:, None], q_n, 0.0)
    resid = jnp.maximum(p_n - q_n, 0.0)
    resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p_n)
    final = categorical(row_keys(params.seed, step, SALT_RESIDUAL), resid)

    emitted = _assemble(d, n, final)
    greedy = params.is_greedy
    n = jnp.where(greedy, n_greedy, n)
    emitted = jnp.where(greedy[:, None], emitted_greedy, emitted)
    return n, emitted


def accept(target_logits: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array | None,
           params: SamplingTensors, step: jax.Array,
           num_draft: jax.Array | None = None, *,
           greedy_only: bool = False,
           filtering: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """Verify-round acceptance for a batch mixing greedy and sampled rows (one jit, no host branch).

    Same contract and results as :func:`rejection_accept` (greedy rows == :func:`greedy_accept`).
    Static knowledge of the batch, as :func:`mtp_jax.sampling.sample` takes it: with
    ``greedy_only`` the filtering/sampling work is not traced; with ``filtering`` ``True`` /
    ``False`` (some row samples; some row filters, or none) it is traced with no run-time
    test; with neither, it is skipped at run time (``lax.cond``) when every row is greedy.
    """
    target_logits = jnp.asarray(target_logits)
    draft_tokens = jnp.asarray(draft_tokens)
    _check_shapes(target_logits, draft_tokens,
                  None if draft_probs is None else jnp.asarray(draft_probs),
                  None if num_draft is None else jnp.asarray(num_draft))

    def all_greedy(_):
        return greedy_accept(target_logits, draft_tokens, num_draft)

    if greedy_only:
        return all_greedy(None)

    def mixed(_):
        return rejection_accept(target_logits, draft_tokens, draft_probs, params, step, num_draft,
                                filtering=filtering)

    if filtering is not None:
        return mixed(None)
    return jax.lax.cond(jnp.all(params.is_greedy), all_greedy, mixed, None)
