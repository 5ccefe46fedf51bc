"""One host-to-device transfer per program call: a pytree of small numpy arrays packed into a
single int32 buffer, unpacked inside the jitted program.

Each array leaf of a batch (``RoundBatch``, ``PrefillBatch``) would otherwise be its own
host-to-device copy — eleven per round — and at batch 1 on a small model those copies are a
visible share of a round. 4-byte dtypes travel bit-for-bit (float32 and uint32 are viewed as
int32); bool travels as int32 0/1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_WORD = {np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint32)}


def pack(tree) -> tuple[np.ndarray, tuple]:
    """``tree`` of numpy arrays -> ``(buffer [N] int32, layout)``; ``layout`` is hashable (a
    static jit argument) and holds the tree structure, shapes and dtypes.

    Raises ValueError for a leaf dtype other than int32, float32, uint32 or bool.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts, shapes = [], []
    for i, leaf in enumerate(leaves):
        a = np.asarray(leaf)
        if a.dtype == np.bool_:
            parts.append(a.astype(np.int32).ravel())
        elif a.dtype in _WORD:
            parts.append(np.ascontiguousarray(a).view(np.int32).ravel())
        else:
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][i][0])
            raise ValueError(f"pack: leaf {path} dtype {a.dtype} is not one of int32, float32, "
                             "uint32, bool; convert it on the host first.")
        shapes.append((a.shape, a.dtype.str))
    buf = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    return buf, (treedef, tuple(shapes))


def unpack(buf: jax.Array, layout: tuple):
    """Inverse of :func:`pack`, traced inside a program: slices of ``buf`` back into the tree
    that ``layout`` describes."""
    treedef, shapes = layout
    leaves, at = [], 0
    for shape, dtype_str in shapes:
        n = int(np.prod(shape, dtype=np.int64))
        part = buf[at:at + n].reshape(shape)
        dtype = np.dtype(dtype_str)
        if dtype == np.bool_:
            part = part != 0
        elif dtype != np.int32:
            part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        leaves.append(part)
        at += n
    return jax.tree_util.tree_unflatten(treedef, leaves)
