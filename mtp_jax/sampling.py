"""Token sampling: the one filtering function shared by plain sampling and speculative acceptance.

Everything here is jit-able with fixed shapes; per-row sampling parameters are arrays (never Python
values that change per step), so one compiled program serves any mix of greedy and sampled rows.

Definitions (per row):

* greedy: ``temperature == 0`` (any ``temperature <= 0`` inside jit is treated as greedy;
  :meth:`SamplingTensors.from_params` rejects negative values). A greedy row's distribution is the
  one-hot of ``argmax(logits)`` (first index of the max on ties, exactly ``jnp.argmax``).
* otherwise ``probs = softmax(logits / temperature)`` restricted, in this order, to

  1. top-k: the ``top_k`` highest-ranked tokens (``top_k <= 0`` or ``top_k >= V`` means off);
  2. top-p: the smallest rank-prefix of the top-k set whose cumulative probability, measured on the
     top-k distribution renormalised, is ``>= top_p`` (the token that crosses ``top_p`` is kept;
     ``top_p >= 1`` means off; the top-ranked token is always kept);

  then renormalised. Ranking is by logit descending, then token index ascending, so ties are
  resolved deterministically in favour of the lower token id (rank 0 == ``jnp.argmax``).

Random streams: every random draw uses a per-row key from :func:`row_keys` ``(seed[b], step[b],
salt)``. ``salt`` separates the uses inside one step (see the ``SALT_*`` constants); ``step`` should
be the row's count of generated tokens at the start of the step/round, so it strictly increases and
no key is ever reused for the same use. Seeded runs are therefore reproducible and independent of
batch composition.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.keep_set import keep_mask

__all__ = [
    "SALT_SAMPLE",
    "SALT_ACCEPT",
    "SALT_RESIDUAL",
    "SALT_DRAFT",
    "SamplingTensors",
    "filtered_probs",
    "row_keys",
    "categorical",
    "sample",
]

MAX_TEMPERATURE = float(np.finfo(np.float32).max)  # larger temperatures overflow float32

# Salts that separate the random streams of one row at one step. Keep them distinct.
SALT_SAMPLE = 0  # plain (non-speculative) sampling of the next token
SALT_ACCEPT = 1  # the k acceptance uniforms of a verify round
SALT_RESIDUAL = 2  # the residual / bonus token of a verify round
SALT_DRAFT = 16  # draft token j of a round uses salt SALT_DRAFT + j (j = 0..k-1)


@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters, a JAX pytree (all fields are data leaves).

    Fields (B = batch rows):
      temperature: ``[B] float32``; 0 means greedy.
      top_k: ``[B] int32``; ``<= 0`` (conventionally -1) means off.
      top_p: ``[B] float32`` in (0, 1]; 1.0 means off.
      seed: ``[B] uint32``; the row's random seed (ignored by greedy rows).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def is_greedy(self) -> jax.Array:
        """``[B] bool``: rows that use argmax and never touch the rng."""
        return self.temperature <= 0

    def filters_any(self, vocab_size: int) -> bool:
        """Whether some sampled row filters (top-k in ``(0, vocab_size)`` or top-p below 1), on
        host values (``from_params(..., host=True)``): the static ``filtering`` flag of
        :func:`sample`, :func:`filtered_probs` and :func:`mtp_jax.spec.accept.accept` for this
        batch. ``False`` also holds for any smaller vocabulary the rows are filtered over (a
        top-k at or above ``vocab_size`` is at or above it too)."""
        temp, k, p = (np.asarray(a) for a in (self.temperature, self.top_k, self.top_p))
        return bool(np.any((temp > 0) & (((k > 0) & (k < vocab_size)) | (p < 1))))

    @classmethod
    def greedy(cls, batch_size: int) -> "SamplingTensors":
        """All-greedy parameters for ``batch_size`` rows (also what padding rows get)."""
        return cls.from_params([], pad_to=batch_size)

    @classmethod
    def from_params(
        cls,
        params: Iterable[Sequence[float | int]],
        pad_to: int | None = None,
        host: bool = False,
    ) -> "SamplingTensors":
        """Build from host values, validating each row.

        Args:
          params: one ``(temperature, top_k, top_p, seed)`` tuple per row. ``temperature`` is a
            float in ``[0, MAX_TEMPERATURE]`` (0 = greedy); ``top_k`` an int (``<= 0`` or -1 =
            off; values from 2**31 up, beyond int32 and any vocabulary, are off too);
            ``top_p`` a float in (0, 1] (1.0 = off); ``seed`` an int in ``[0, 2**32)``.
          host: keep the fields as numpy arrays (a jitted program takes them as inputs without
            a separate transfer per field).
          pad_to: if given, append greedy rows (temperature 0, top_k -1, top_p 1, seed 0) up to this
            many rows (a batch bucket size).

        Returns:
          ``SamplingTensors`` with ``[B]`` arrays (``B = pad_to`` or ``len(params)``).

        Raises:
          ValueError: a row is not a 4-tuple, a value is out of range or of the wrong type, or
            there are more rows than ``pad_to``.
        """
        rows = list(params)
        temps, ks, ps, seeds = [], [], [], []
        for i, row in enumerate(rows):
            try:
                t, k, p, s = row
            except (TypeError, ValueError):
                raise ValueError(
                    f"sampling params row {i} is {row!r}; expected a 4-tuple "
                    "(temperature, top_k, top_p, seed)") from None
            if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)) \
                    or not 0 <= float(t) <= MAX_TEMPERATURE:
                raise ValueError(
                    f"row {i}: temperature={t!r} is not supported; use a number in [0, "
                    f"{MAX_TEMPERATURE:.3g}] (0 means greedy; the bound is float32's largest)")
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
                raise ValueError(
                    f"row {i}: top_k={k!r} must be an int; use -1 (or 0) to disable top-k")
            if not 0 < int(k) < 2**31:  # off (<= 0), or at least any vocabulary: off too
                k = -1
            if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)) \
                    or not (0.0 < float(p) <= 1.0):
                raise ValueError(
                    f"row {i}: top_p={p!r} is not supported; use a number in (0, 1] "
                    "(1.0 disables top-p)")
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)) \
                    or not 0 <= int(s) < 2**32:
                raise ValueError(
                    f"row {i}: seed={s!r} is not supported; use an int in [0, 2**32) "
                    "(e.g. seed % 2**32)")
            temps.append(float(t))
            ks.append(int(k))
            ps.append(float(p))
            seeds.append(int(s))
        if pad_to is not None:
            if pad_to < len(rows):
                raise ValueError(
                    f"pad_to={pad_to} is smaller than the number of rows ({len(rows)}); "
                    "pick a batch bucket at least as large as the batch")
            n_pad = pad_to - len(rows)
            temps += [0.0] * n_pad
            ks += [-1] * n_pad
            ps += [1.0] * n_pad
            seeds += [0] * n_pad
        put = (lambda a: a) if host else jnp.asarray
        return cls(
            temperature=put(np.asarray(temps, np.float32)),
            top_k=put(np.asarray(ks, np.int32)),
            top_p=put(np.asarray(ps, np.float32)),
            seed=put(np.asarray(seeds, np.uint32)),
        )


jax.tree_util.register_dataclass(
    SamplingTensors,
    data_fields=["temperature", "top_k", "top_p", "seed"],
    meta_fields=[],
)


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


def filtered_probs(logits: jax.Array, temperature, top_k, top_p, *,
                   filtering: bool | None = None) -> jax.Array:
    """Filtered sampling distribution (see the module docstring for the exact definition).

    Args:
      logits: ``[..., V]`` float (any float dtype; computed in float32).
      temperature: float, broadcast over the leading dims of ``logits`` aligned from the LEFT:
        a scalar, or shape ``[B]`` for logits ``[B, ..., V]`` (row b's value for all of row b), or
        any prefix shape of ``logits.shape[:-1]``. ``<= 0`` means greedy (one-hot of argmax).
      top_k: int, same broadcasting; ``<= 0`` or ``>= V`` means off.
      top_p: float, same broadcasting; ``>= 1`` means off.
      filtering: static, when the caller knows it (:meth:`SamplingTensors.filters_any`):
        ``True`` traces the top-k / top-p filter with no run-time test of whether any row
        filters, ``False`` traces none (every row's filters must be off), ``None`` tests at run
        time (a ``lax.cond``: on a GPU a host round trip; :func:`mtp_jax.keep_set.keep_mask`).

    Returns:
      ``[..., V] float32`` probabilities; each row sums to 1 (greedy rows exactly one-hot).
      Tokens outside the filtered set are exactly 0. A row whose logits are all ``-inf`` gives NaN.

    Raises:
      ValueError: ``logits`` has no vocab axis, or a parameter's shape does not align with the
        leading dims of ``logits``.
    """
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
    greedy = temperature <= 0
    t = jnp.where(greedy, jnp.float32(1), temperature)
    k_eff = jnp.where((top_k <= 0) | (top_k >= V), V, top_k)
    p_off = top_p >= 1
    row_filters = (~greedy) & ((k_eff < V) | ~p_off)

    m = jnp.max(x, axis=-1, keepdims=True)
    # Unnormalised softmax weights; the max token gets exactly 1.
    e = jnp.exp((x - m) / t[..., None])
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)

    keep = keep_mask(x, m, t, k_eff, top_p, p_off, row_filters, some_filtered=filtering)
    w = jnp.where(keep, e, 0.0)
    probs = w / jnp.sum(w, axis=-1, keepdims=True)
    onehot = (iota == jnp.argmax(x, axis=-1)[..., None]).astype(jnp.float32)
    return jnp.where(greedy[..., None], onehot, probs)


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
                               filtering=filtering)
        drawn = categorical(row_keys(params.seed, step, salt), probs)
        return jnp.where(greedy, greedy_tok, drawn)

    if filtering is not None:
        return random_path(None)
    return jax.lax.cond(jnp.all(greedy), lambda _: greedy_tok, random_path, None)
