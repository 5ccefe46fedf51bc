"""Gated DeltaNet state pool: one recurrent state and one conv window per slot and GDN layer.

recurrent: ``[slots, Hv, Dk, Dv]`` float32 per layer.
conv:      ``[slots, conv_dim, K]`` per layer, a ring of raw (pre-conv) inputs keyed by position
           (position p in column p mod K), model dtype; with ``ring=False`` the shift register
           ``[slots, conv_dim, K-1]`` of the last K-1 inputs (qwen4_exp). See
           :mod:`mtp_jax.models.layers.conv_state`.
Slot 0 is the trash slot of padding rows (read by them only; XLA writes leave them out);
requests get slots 1..slots-1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.cache.rows import set_rows

TRASH_SLOT = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LinearState:
    recurrent: tuple[jax.Array, ...]
    conv: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, num_layers: int, slots: int, hv: int, dk: int, dv: int, conv_dim: int,
              kernel: int, dtype, ring: bool = True) -> "LinearState":
        cols = kernel if ring else kernel - 1
        return cls(
            recurrent=tuple(jnp.zeros((slots, hv, dk, dv), jnp.float32) for _ in range(num_layers)),
            conv=tuple(jnp.zeros((slots, conv_dim, cols), dtype) for _ in range(num_layers)))

    def gather(self, slots: jax.Array) -> "LinearState":
        """The states of ``slots [B]`` (a batch view, ``[B, ...]`` per layer)."""
        return LinearState(tuple(r[slots] for r in self.recurrent), tuple(c[slots] for c in self.conv))

    def scatter(self, slots: jax.Array, batch: "LinearState") -> "LinearState":
        """Write a batch view back at ``slots [B]`` (rows on :data:`TRASH_SLOT` write nothing:
        :func:`mtp_jax.cache.rows.set_rows`)."""
        put = lambda whole, part: tuple(set_rows(a, slots, b, TRASH_SLOT)
                                        for a, b in zip(whole, part))
        return LinearState(put(self.recurrent, batch.recurrent), put(self.conv, batch.conv))

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.recurrent + self.conv)
