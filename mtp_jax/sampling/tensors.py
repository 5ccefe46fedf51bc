"""``SamplingTensors``: a batch's per-row sampling parameters as device arrays (a pytree).

Built from host values by :meth:`SamplingTensors.from_params`, which checks each value with the
same functions as :class:`~mtp_jax.sampling.params.SamplingParams` (one validation, one message).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.sampling.params import (check_min_p, check_penalty, check_seed, check_temperature,
                                     check_top_k, check_top_p, is_greedy)

FIELDS = ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty",
          "frequency_penalty")  # a row's values, in from_params' order
OFF = (0.0, -1, 1.0, 0, 0.0, 0.0, 0.0)  # a padding row's (greedy, every filter off)

__all__ = ["SamplingTensors"]


@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters, a JAX pytree (all fields are data leaves).

    Fields (B = batch rows):
      temperature: ``[B] float32``; 0 means greedy.
      top_k: ``[B] int32``; ``<= 0`` (conventionally -1) means off.
      top_p: ``[B] float32`` in (0, 1]; 1.0 means off.
      seed: ``[B] uint32``; the row's random seed (ignored by greedy rows).
      min_p: ``[B] float32`` in [0, 1]; 0.0 means off.
      presence_penalty, frequency_penalty: ``[B] float32`` in [-2, 2]; 0.0 means off
        (:mod:`mtp_jax.sampling.penalties`).

    The last three may be None (their default, for code that builds the first four): off
    for every row.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    min_p: jax.Array | None = None
    presence_penalty: jax.Array | None = None
    frequency_penalty: jax.Array | None = None

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def is_greedy(self) -> jax.Array:
        """``[B] bool``: rows that use argmax and never touch the rng (:func:`is_greedy`)."""
        return is_greedy(self.temperature)

    def filters_any(self, vocab_size: int) -> bool:
        """Whether some sampled row filters (top-k in ``(0, vocab_size)``, top-p below 1 or
        min-p above 0), on host values (``from_params(..., host=True)``): the static
        ``filtering`` flag of :func:`sample`, :func:`filtered_probs` and
        :func:`mtp_jax.speculative.accept.accept` for this batch. ``False`` also holds for
        any smaller vocabulary the rows are filtered over (a top-k at or above
        ``vocab_size`` is at or above it too)."""
        temp, k, p = (np.asarray(a) for a in (self.temperature, self.top_k, self.top_p))
        mp = np.zeros(()) if self.min_p is None else np.asarray(self.min_p)
        return bool(np.any(~is_greedy(temp) & (((k > 0) & (k < vocab_size)) | (p < 1)
                                               | (mp > 0))))

    def penalizes_any(self) -> bool:
        """Whether some row has a presence or frequency penalty, on host values (greedy rows
        too: they take the argmax of the penalised logits): the static ``penalties`` flag of
        the engine's program variants (:mod:`mtp_jax.engine.variants`)."""
        pens = [np.asarray(a) for a in (self.presence_penalty, self.frequency_penalty)
                if a is not None]
        return bool(any(np.any(a != 0) for a in pens))

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
          params: one tuple per row of 4 to 7 of :data:`FIELDS`, in order: ``(temperature,
            top_k, top_p, seed[, min_p[, presence_penalty[, frequency_penalty]]])``, the ones
            left out off. ``temperature`` is a float in ``[0, MAX_TEMPERATURE]`` (0 =
            greedy); ``top_k`` an int (``<= 0`` or -1 = off; values from 2**31 up, beyond
            int32 and any vocabulary, are off too); ``top_p`` a float in (0, 1] (1.0 = off);
            ``seed`` an int in ``[0, 2**32)``; ``min_p`` a float in [0, 1] (0.0 = off); the
            penalties floats in [-2, 2] (0.0 = off).
          host: keep the fields as numpy arrays (a jitted program takes them as inputs without
            a separate transfer per field).
          pad_to: if given, append greedy rows with every filter and penalty off
            (:data:`OFF`) up to this many rows (a batch bucket size).

        Returns:
          ``SamplingTensors`` with ``[B]`` arrays (``B = pad_to`` or ``len(params)``).

        Raises:
          ValueError: a row is not a tuple of 4 to 7 values, a value is out of range or of
            the wrong type, or there are more rows than ``pad_to``.
        """
        rows = list(params)
        cols = [[] for _ in FIELDS]
        for i, row in enumerate(rows):
            try:
                values = tuple(row)
            except TypeError:
                values = ()
            if not 4 <= len(values) <= len(FIELDS):
                raise ValueError(
                    f"sampling params row {i} is {row!r}; expected a tuple of 4 to "
                    f"{len(FIELDS)} values ({', '.join(FIELDS)}), the ones left out off")
            t, k, p, s, mp, pres, freq = values + OFF[len(values):]
            try:
                check_temperature(t)
                check_top_k(k)
                check_top_p(p)
                check_seed(s)
                check_min_p(mp)
                check_penalty("presence_penalty", pres)
                check_penalty("frequency_penalty", freq)
            except ValueError as e:
                raise ValueError(f"row {i}: {e}") from None
            if not 0 < int(k) < 2**31:  # off (<= 0), or at least any vocabulary: off too
                k = -1
            for col, v in zip(cols, (float(t), int(k), float(p), int(s), float(mp),
                                     float(pres), float(freq))):
                col.append(v)
        if pad_to is not None:
            if pad_to < len(rows):
                raise ValueError(
                    f"pad_to={pad_to} is smaller than the number of rows ({len(rows)}); "
                    "pick a batch bucket at least as large as the batch")
            for col, v in zip(cols, OFF):
                col += [v] * (pad_to - len(rows))
        put = (lambda a: a) if host else jnp.asarray
        dtypes = (np.float32, np.int32, np.float32, np.uint32, np.float32, np.float32,
                  np.float32)
        return cls(*(put(np.asarray(col, dt)) for col, dt in zip(cols, dtypes)))


jax.tree_util.register_dataclass(
    SamplingTensors,
    data_fields=list(FIELDS),
    meta_fields=[],
)
