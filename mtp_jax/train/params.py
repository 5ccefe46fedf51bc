"""The draft's parameters as the trainer holds them: a flat dict of canonical tensor names.

The model's nnx ``State`` is split into the frozen target and the ``mtp.*`` draft; the draft is
kept as ``{canonical name: float32 array}`` (``mtp.fc.weight``, ``mtp.layers.0.mlp...``), the
names the checkpoint's tensors have, so the optimizer state, the saved train state and the
exported tensors all speak one naming. :class:`DraftParams` turns the flat dict back into the
model's ``State`` inside the train step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["DraftParams", "split_draft", "to_numpy"]


def _name(path) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", ""))) for p in path
                    if not isinstance(p, jax.tree_util.GetAttrKey))


@dataclasses.dataclass(frozen=True, eq=False)
class DraftParams:
    """How the flat draft dict maps onto the model's draft ``State``.

    Attributes:
      names: canonical tensor names, in the ``State``'s leaf order.
      treedef: the draft ``State``'s tree structure.
      dtypes: each tensor's dtype in the model (the trainer keeps float32 masters).
    """

    names: tuple[str, ...]
    treedef: object
    dtypes: tuple

    def to_state(self, flat: dict) -> nnx.State:
        """``{name: array}`` -> the draft ``State``, each array cast to the model's dtype."""
        return jax.tree.unflatten(self.treedef, [flat[n].astype(d)
                                                 for n, d in zip(self.names, self.dtypes)])


def split_draft(model):
    """``model`` (a ``LoadedModel`` with its draft, loaded with ``merge_projections=False``) ->
    ``(frozen State, {name: float32 array} of the draft, DraftParams)``.

    Raises ``ValueError`` when the model has no draft or merged projections (whose parameters
    are not the checkpoint's tensors)."""
    if not model.has_mtp:
        raise ValueError("the model was loaded without its mtp.* draft; load it with "
                         "with_mtp=True (a checkpoint without one gets a fresh head first).")
    draft, frozen = model.params.split(nnx.PathContains("mtp"), ...)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(draft)
    names = tuple(_name(p) for p, _ in leaves)
    if any(".qkv_proj." in n or ".gate_up_proj." in n or ".in_proj." in n for n in names):
        raise ValueError("the draft has merged projections; load the model with "
                         "merge_projections=False so its parameters are the checkpoint's "
                         "tensors.")
    flat = {n: jnp.asarray(v, jnp.float32) for n, (_, v) in zip(names, leaves)}
    return frozen, flat, DraftParams(names, treedef, tuple(v.dtype for _, v in leaves))


def to_numpy(flat: dict) -> dict[str, np.ndarray]:
    """The flat draft as host float32 arrays (for export)."""
    return {n: np.asarray(v, np.float32) for n, v in flat.items()}
