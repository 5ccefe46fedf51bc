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

from mtp_jax.sampling.params import (check_seed, check_temperature, check_top_k, check_top_p,
                                     is_greedy)

__all__ = ["SamplingTensors"]


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
        """``[B] bool``: rows that use argmax and never touch the rng (:func:`is_greedy`)."""
        return is_greedy(self.temperature)

    def filters_any(self, vocab_size: int) -> bool:
        """Whether some sampled row filters (top-k in ``(0, vocab_size)`` or top-p below 1), on
        host values (``from_params(..., host=True)``): the static ``filtering`` flag of
        :func:`sample`, :func:`filtered_probs` and :func:`mtp_jax.speculative.accept.accept` for this
        batch. ``False`` also holds for any smaller vocabulary the rows are filtered over (a
        top-k at or above ``vocab_size`` is at or above it too)."""
        temp, k, p = (np.asarray(a) for a in (self.temperature, self.top_k, self.top_p))
        return bool(np.any(~is_greedy(temp) & (((k > 0) & (k < vocab_size)) | (p < 1))))

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
            try:
                check_temperature(t)
                check_top_k(k)
                check_top_p(p)
                check_seed(s)
            except ValueError as e:
                raise ValueError(f"row {i}: {e}") from None
            if not 0 < int(k) < 2**31:  # off (<= 0), or at least any vocabulary: off too
                k = -1
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
