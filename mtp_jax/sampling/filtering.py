"""The filtered sampling distribution: the one function shared by plain sampling and speculative
acceptance.

Everything here is jit-able with fixed shapes; per-row sampling parameters are arrays (never Python
values that change per step), so one compiled program serves any mix of greedy and sampled rows.

Definitions (per row):

* greedy: :func:`mtp_jax.sampling.params.is_greedy` (temperature 0; the checks refuse negative
  values, and any ``temperature <= 0`` inside jit is greedy). A greedy row's distribution is the
  one-hot of ``argmax(logits)`` (first index of the max on ties, exactly ``jnp.argmax``).
* otherwise ``probs = softmax(logits / temperature)`` restricted, in this order, to

  1. top-k: the ``top_k`` highest-ranked tokens (``top_k <= 0`` or ``top_k >= V`` means off);
  2. top-p: the smallest rank-prefix of the top-k set whose cumulative probability, measured on the
     top-k distribution renormalised, is ``>= top_p`` (the token that crosses ``top_p`` is kept;
     ``top_p >= 1`` means off; the top-ranked token is always kept);
  3. min-p: the tokens whose probability is at least ``min_p`` times the most likely token's,
     ``p_i >= min_p * p_max``, i.e. ``(x_i - max(x)) / temperature >= log(min_p)`` (``min_p
     <= 0`` means off; the most likely token is always kept). Renormalising after top-k and
     top-p scales every kept probability alike, so the ratio and this set do not depend on
     where min-p stands in the order; transformers' ``MinPLogitsWarper`` runs after top-p as
     here, while vLLM applies min-p before top-k / top-p, which gives another top-p set when
     both are on;

  then renormalised. Ranking is by logit descending, then token index ascending, so ties are
  resolved deterministically in favour of the lower token id (rank 0 == ``jnp.argmax``).

The random draws from it are in :mod:`mtp_jax.sampling.draw`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.sampling.keep_set import keep_mask
from mtp_jax.sampling.params import is_greedy

__all__ = ["filtered_logprobs", "filtered_probs"]


def _bcast_param(value, batch_shape: tuple[int, ...], name: str) -> jax.Array:
    """Broadcast a per-row parameter over ``batch_shape`` aligning on the LEFT.

    A ``[B]`` parameter applied to ``[B, S]`` batch dims becomes ``[B, S]`` (row b's value for every
    s). Scalars broadcast everywhere.
    """
    value = jnp.asarray(value)
    nb = len(batch_shape)
    if value.ndim > nb:
        raise ValueError(
            f"{name} has shape {value.shape} but logits have only {nb} leading (batch) dims "
            f"{batch_shape}; pass one value per leading row (shape {batch_shape[:1]}) or a scalar")
    for i, d in enumerate(value.shape):
        if d != 1 and d != batch_shape[i]:
            raise ValueError(
                f"{name} has shape {value.shape}, incompatible with the logits' leading dims "
                f"{batch_shape}; parameters align with the leading dims from the left "
                f"(e.g. shape {batch_shape[:1]} for per-row values)")
    value = value.reshape(value.shape + (1,) * (nb - value.ndim))
    return jnp.broadcast_to(value, batch_shape)


def filtered_probs(logits: jax.Array, temperature, top_k, top_p, min_p=None, *,
                   filtering: bool | None = None) -> jax.Array:
    """Filtered sampling distribution (see the module docstring for the exact definition).

    Args:
      logits: ``[..., V]`` float (any float dtype; computed in float32).
      temperature: float, broadcast over the leading dims of ``logits`` aligned from the LEFT:
        a scalar, or shape ``[B]`` for logits ``[B, ..., V]`` (row b's value for all of row b), or
        any prefix shape of ``logits.shape[:-1]``. ``<= 0`` means greedy (one-hot of argmax).
      top_k: int, same broadcasting; ``<= 0`` or ``>= V`` means off.
      top_p: float, same broadcasting; ``>= 1`` means off.
      min_p: float, same broadcasting, or None; ``<= 0`` (and None) means off.
      filtering: static, when the caller knows it (:meth:`SamplingTensors.filters_any`):
        ``True`` traces the top-k / top-p / min-p filters with no run-time test of whether any
        row filters, ``False`` traces none (every row's filters must be off), ``None`` tests
        top-k / top-p at run time (a ``lax.cond``: on a GPU a host round trip;
        :func:`mtp_jax.sampling.keep_set.keep_mask`; min-p, an elementwise test, is traced).

    Returns:
      ``[..., V] float32`` probabilities; each row sums to 1 (greedy rows exactly one-hot).
      Tokens outside the filtered set are exactly 0. A row whose logits are all ``-inf`` gives NaN.

    Raises:
      ValueError: ``logits`` has no vocab axis, or a parameter's shape does not align with the
        leading dims of ``logits``.
    """
    x, z, keep, greedy = _scaled_and_kept(logits, temperature, top_k, top_p, min_p, filtering)
    # Unnormalised softmax weights; the max token gets exactly 1.
    w = jnp.where(keep, jnp.exp(z), 0.0)
    probs = w / jnp.sum(w, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    onehot = (iota == jnp.argmax(x, axis=-1)[..., None]).astype(jnp.float32)
    return jnp.where(greedy[..., None], onehot, probs)


def filtered_logprobs(logits: jax.Array, temperature, top_k, top_p, min_p=None, *,
                      filtering: bool | None = None) -> jax.Array:
    """Log-probabilities of the distribution a sampled row draws from: ``log`` of
    :func:`filtered_probs` (``log_softmax(logits / temperature)`` over the top-k / top-p /
    min-p kept set, renormalised; ``-inf`` outside it), computed in log space so that small
    probabilities do not underflow.

    Greedy rows (temperature 0), whose sampling distribution is the one-hot of the argmax,
    get the model's own distribution instead: ``log_softmax(logits)`` (temperature 1, no
    top-k / top-p / min-p), whose maximum is the greedy token.

    Args and ``filtering``: as :func:`filtered_probs`.

    Returns:
      ``[..., V] float32``; ``-inf`` for the ids a sampled row's filter drops.
    """
    _, z, keep, _ = _scaled_and_kept(logits, temperature, top_k, top_p, min_p, filtering)
    zk = jnp.where(keep, z, -jnp.inf)
    lse = jnp.log(jnp.sum(jnp.exp(zk), axis=-1, keepdims=True))  # >= log 1: the max is kept
    return zk - lse


def _scaled_and_kept(logits, temperature, top_k, top_p, min_p, filtering):
    """``(x, z, keep, greedy)`` of :func:`filtered_probs`: the float32 logits ``x [..., V]``,
    ``z = (x - max) / t`` (``t`` = 1 for greedy rows), the kept set ``keep [..., V]`` bool
    (every id for greedy and unfiltered rows) and ``greedy [...]`` bool."""
    logits = jnp.asarray(logits)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"logits must have shape [..., V] with V >= 1; got shape {logits.shape}")
    batch_shape = logits.shape[:-1]
    V = logits.shape[-1]
    temperature = _bcast_param(temperature, batch_shape, "temperature").astype(jnp.float32)
    top_k = _bcast_param(top_k, batch_shape, "top_k").astype(jnp.int32)
    top_p = _bcast_param(top_p, batch_shape, "top_p").astype(jnp.float32)

    x = logits.astype(jnp.float32)
    x = jnp.where(x == 0, jnp.float32(0), x)  # canonicalise -0.0 so sort and == agree on ties
    greedy = is_greedy(temperature)
    t = jnp.where(greedy, jnp.float32(1), temperature)
    k_eff = jnp.where((top_k <= 0) | (top_k >= V), V, top_k)
    p_off = top_p >= 1
    row_filters = (~greedy) & ((k_eff < V) | ~p_off)

    m = jnp.max(x, axis=-1, keepdims=True)
    z = (x - m) / t[..., None]
    keep = keep_mask(x, m, t, k_eff, top_p, p_off, row_filters, some_filtered=filtering)
    if min_p is not None and filtering is not False:
        min_p = _bcast_param(min_p, batch_shape, "min_p").astype(jnp.float32)
        on = (~greedy) & (min_p > 0)
        floor = jnp.log(jnp.where(on, min_p, 1.0))[..., None]  # z of the max is 0 >= floor
        keep = keep & (~on[..., None] | (z >= floor))
    return x, z, keep, greedy
