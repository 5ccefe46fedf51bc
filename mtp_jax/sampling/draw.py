"""Random draws of the engine's programs: per-row keys, categorical draws and :func:`sample`.

Random streams: every random draw uses a per-row key from :func:`row_keys` ``(seed[b], step[b],
salt)``. ``salt`` separates the uses inside one step (the ``SALT_*`` constants); ``step`` is the
row's count of generated tokens at the start of the step/round, so it strictly increases and no
key is ever reused for the same use. Seeded runs are therefore reproducible and independent of
batch composition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.sampling.filtering import filtered_probs
from mtp_jax.sampling.tensors import SamplingTensors

__all__ = ["SALT_SAMPLE", "SALT_ACCEPT", "SALT_RESIDUAL", "SALT_DRAFT", "row_keys", "categorical",
           "sample"]

# Salts that separate the random streams of one row at one step. Keep them distinct.
SALT_SAMPLE = 0  # plain (non-speculative) sampling of the next token
SALT_ACCEPT = 1  # the k acceptance uniforms of a verify round
SALT_RESIDUAL = 2  # the residual / bonus token of a verify round
SALT_DRAFT = 16  # draft token j of a round uses salt SALT_DRAFT + j (j = 0..k-1)


def row_keys(seed: jax.Array, step: jax.Array, salt) -> jax.Array:
    """Per-row PRNG keys ``fold_in(fold_in(fold_in(key(0), salt), seed[b]), step[b])``.

    Args:
      seed: ``[B]`` uint32 or int32 (int32 values are reinterpreted as uint32 bits).
      step: ``[B]`` int32/uint32, the row's generated-token count at the start of this step/round.
      salt: int (Python or traced scalar); one of the ``SALT_*`` constants (``SALT_DRAFT + j`` for
        draft position j).

    Returns:
      ``[B]`` typed key array (``jax.random.key`` style).

    Raises:
      ValueError: ``seed`` and ``step`` are not 1-D of the same length.
    """
    seed = jnp.asarray(seed)
    step = jnp.asarray(step)
    if seed.ndim != 1 or step.ndim != 1 or seed.shape != step.shape:
        raise ValueError(
            f"row_keys needs seed and step of shape [B]; got seed {seed.shape}, step {step.shape}")
    seed = jax.lax.bitcast_convert_type(seed.astype(jnp.int32), jnp.uint32) \
        if seed.dtype != jnp.uint32 else seed
    step = step.astype(jnp.uint32)
    base = jax.random.fold_in(jax.random.key(0), jnp.asarray(salt, jnp.uint32))

    def one(s, n):
        return jax.random.fold_in(jax.random.fold_in(base, s), n)

    return jax.vmap(one)(seed, step)


def categorical(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one token per row from ``probs`` (Gumbel-max on ``log probs``).

    Args:
      keys: ``[N]`` typed keys (from :func:`row_keys`).
      probs: ``[N, V]`` nonnegative weights (need not be normalised); zero-weight tokens are never
        drawn.

    Returns:
      ``[N] int32`` token ids.
    """
    logp = jnp.log(probs.astype(jnp.float32))  # log(0) = -inf: never drawn
    return jax.vmap(lambda k, lp: jax.random.categorical(k, lp, axis=-1))(keys, logp).astype(
        jnp.int32)


def sample(logits: jax.Array, params: SamplingTensors, step: jax.Array, *,
           salt=SALT_SAMPLE, greedy_only: bool = False,
           filtering: bool | None = None) -> jax.Array:
    """Sample the next token of each row.

    Greedy rows (temperature 0) return ``jnp.argmax(logits)`` and their result never depends on the
    rng; other rows draw from :func:`filtered_probs` with the key ``row_keys(seed, step, salt)``.
    What is traced follows what the caller knows (static), so that no host-synchronising
    conditional is in the program where the host has decided already:

    * ``greedy_only``: every row is greedy; the filtering and drawing are not traced;
    * ``filtering`` ``True`` / ``False`` (some row samples, and some row filters or none does:
      :meth:`SamplingTensors.filters_any`): the draw is traced with (or without) the filter,
      with no run-time test;
    * neither: when every row is greedy the filtering and drawing are skipped at run time
      (``lax.cond``), and the filter likewise when no row filters.

    Args:
      logits: ``[B, V]`` float.
      params: :class:`SamplingTensors` with ``[B]`` fields.
      step: ``[B]`` int32, the row's generated-token count (the key's step).
      salt: stream salt, default :data:`SALT_SAMPLE`.

    Returns:
      ``[B] int32`` tokens.

    Raises:
      ValueError: ``logits`` is not 2-D or the batch sizes disagree.
    """
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"sample expects logits [B, V]; got shape {logits.shape}")
    B = logits.shape[0]
    step = jnp.asarray(step)
    if params.temperature.shape != (B,) or step.shape != (B,):
        raise ValueError(
            f"sample: logits have B={B} rows but params.temperature has shape "
            f"{params.temperature.shape} and step has shape {step.shape}; all must be [B]")
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy_tok
    greedy = params.is_greedy

    def random_path(_):
        probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p,
                               params.min_p, filtering=filtering)
        drawn = categorical(row_keys(params.seed, step, salt), probs)
        return jnp.where(greedy, greedy_tok, drawn)

    if filtering is not None:
        return random_path(None)
    return jax.lax.cond(jnp.all(greedy), lambda _: greedy_tok, random_path, None)
