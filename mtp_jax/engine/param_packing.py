"""Small parameters packed into one buffer per dtype for the compiled programs (opt-in).

A program call hands every parameter to the runtime as its own buffer: about 230 for the
Qwen3.5-2B shape and 450 for Qwen3.6-35B-A3B after merging projections, of which more than
half are small vectors (norm weights). If the host pays per argument buffer on each call (an
inference from the session-7 profiles; 1.17 us per parameter buffer measured on the H200,
``docs/benchmarks.md``; the A/B is ``python -m mtp_jax.bench --pack-small-params``), packing
those vectors cuts that cost. Inside the program each packed leaf is a static slice of its
buffer, which XLA fuses into the elementwise kernel that reads it (norms), so no kernel is
added. Leaves read directly by a Pallas kernel (the GDN ``A_log``, ``dt_bias`` and conv
weights) stay separate: a slice passed to a custom call would be copied first.

``ParamPacking.plan(params)`` fixes the layout; ``pack(leaves)`` builds the call arguments once
(``(buffers..., kept leaves...)``); ``unpack(args)`` rebuilds the leaves in order inside a
traced program. Values are unchanged (the same elements, the same dtype).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

MAX_ELEMENTS = 1 << 16  # leaves up to this many elements are packed
NOT_PACKED = ("A_log", "dt_bias", "conv1d")  # read directly by the fused GDN kernels


@dataclasses.dataclass(frozen=True)
class ParamPacking:
    """Static layout of the packed call arguments.

    Attributes:
      n_leaves: leaves of the parameter pytree (``jax.tree_util.tree_leaves`` order).
      dtypes: one packed buffer per dtype name, in this order.
      packed: ``(leaf index, buffer index, offset, shape)`` per packed leaf (offsets in
        elements).
      kept: indices of the leaves passed as they are, after the buffers.
    """

    n_leaves: int
    dtypes: tuple[str, ...]
    packed: tuple[tuple[int, int, int, tuple[int, ...]], ...]
    kept: tuple[int, ...]

    @classmethod
    def plan(cls, params, max_elements: int = MAX_ELEMENTS,
             not_packed: tuple[str, ...] = NOT_PACKED) -> "ParamPacking":
        """Pack every leaf of at most ``max_elements`` elements whose path names none of
        ``not_packed``; group by dtype."""
        with_paths = jax.tree_util.tree_flatten_with_path(params)[0]
        dtypes: list[str] = []
        sizes: list[int] = []
        packed, kept = [], []
        for i, (path, leaf) in enumerate(with_paths):
            name = jax.tree_util.keystr(path)
            n = math.prod(leaf.shape)
            if n > max_elements or any(w in name for w in not_packed):
                kept.append(i)
                continue
            dt = jnp.dtype(leaf.dtype).name
            if dt not in dtypes:
                dtypes.append(dt)
                sizes.append(0)
            b = dtypes.index(dt)
            packed.append((i, b, sizes[b], tuple(leaf.shape)))
            sizes[b] += n
        return cls(len(with_paths), tuple(dtypes), tuple(packed), tuple(kept))

    @property
    def buffers(self) -> int:
        return len(self.dtypes)

    def pack(self, leaves) -> tuple:
        """``(buffers..., kept leaves...)`` from the leaves (a new device buffer per dtype)."""
        if len(leaves) != self.n_leaves:
            raise ValueError(f"ParamPacking.pack: {len(leaves)} leaves, the plan has "
                             f"{self.n_leaves}.")
        parts: list[list] = [[] for _ in self.dtypes]
        for i, b, _, _ in self.packed:
            parts[b].append(jnp.ravel(leaves[i]))
        buffers = tuple(jnp.concatenate(p) for p in parts)
        return buffers + tuple(leaves[i] for i in self.kept)

    def unpack(self, args) -> list:
        """The leaves, in order, from :meth:`pack`'s arguments (static slices of the
        buffers; traceable)."""
        buffers, kept = args[:self.buffers], args[self.buffers:]
        leaves: list = [None] * self.n_leaves
        for i, b, off, shape in self.packed:
            n = math.prod(shape)
            leaves[i] = jax.lax.slice(buffers[b], (off,), (off + n,)).reshape(shape)
        for i, leaf in zip(self.kept, kept):
            leaves[i] = leaf
        return leaves
