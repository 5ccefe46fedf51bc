"""The MTP draft's reduced LM head: the rows of the LM head for the hot token ids.

Gathered once after load (:func:`with_draft_head`) from ``lm_head.weight`` (or the embedding
when the head is tied) into ``weight [N, H]`` with ``ids [N] int32``, and stored on the model as
``draft_head``; ``model.draft_logits(z)`` then computes ``z @ weight.T -> [..., N]`` instead of
the full ``[..., V]`` (:mod:`mtp_jax.spec.draft_vocab` defines the hot set). The target's logits
are untouched.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.kernels import kernels_of
from mtp_jax.models.layers.basic import as_data
from pallas_kernels.gemv import gemv

__all__ = ["DraftHead", "with_draft_head", "draft_head_bytes"]


class DraftHead(nnx.Module):
    """``weight [N, H]`` (model dtype): LM-head rows of the hot ids ``ids [N] int32``;
    ``backend``: how a call runs (:func:`pallas_kernels.gemv.gemv`, as the LM head's)."""

    def __init__(self, weight: jax.Array, ids: jax.Array, backend: str = "xla"):
        self.weight = nnx.Param(weight)
        self.ids = nnx.Variable(ids)
        self.backend = backend

    def __call__(self, z: jax.Array) -> jax.Array:
        """``z [..., H]`` -> logits ``[..., N]`` float32 (the same product as the full head,
        restricted to the hot rows)."""
        return gemv(z, self.weight[...], backend=self.backend).astype(jnp.float32)


def with_draft_head(model, hot_ids: np.ndarray | None):
    """A :class:`~mtp_jax.models.loader.LoadedModel` whose draft scores only ``hot_ids``
    (``[N]`` ints in ``[0, V)``, unique; from :func:`mtp_jax.spec.draft_vocab.hot_token_ids`).

    ``None`` returns ``model`` itself. Otherwise the new model shares every parameter array
    with ``model`` and adds the gathered ``draft_head`` (``N * H`` elements), so it has its own
    compiled programs; it is made once per (model, hot ids) and reused.
    Raises ``ValueError`` when the model has no MTP draft, or ids are out of range.
    """
    if hot_ids is None:
        return model
    ids = np.asarray(hot_ids, np.int32)
    if not model.has_mtp:
        raise ValueError("a reduced draft vocabulary needs the mtp.* draft, which this model "
                         "was loaded without; load it with with_mtp=True.")
    if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= model.cfg.vocab_size:
        raise ValueError(f"hot ids must be a non-empty 1-D array in [0, {model.cfg.vocab_size});"
                         f" got shape {ids.shape}.")
    cache = model.__dict__.setdefault("_draft_head_models", {})
    key = ids.tobytes()
    if key not in cache:
        module = model.module()
        table = (module.lm_head if module.lm_head is not None else module.embed_tokens).weight
        dev_ids = jax.device_put(ids, next(iter(table[...].devices())))
        head = DraftHead(jnp.take(table[...], dev_ids, axis=0), dev_ids,
                         backend=kernels_of(model.cfg).gemv)
        # as_data: the attribute was static (None) when the model was built.
        module.draft_head = as_data(head)
        graphdef, params = nnx.split(module)
        derived = dataclasses.replace(model, graphdef=graphdef, params=params)
        # Hot sets of the same size give the same program structure (the ids are a parameter):
        # share the compiled programs instead of compiling them again.
        for other in cache.values():
            if other.graphdef == graphdef and jax.tree_util.tree_structure(
                    other.params) == jax.tree_util.tree_structure(params):
                derived.__dict__["programs"] = other.programs
                break
        cache[key] = derived
    return cache[key]


def draft_head_bytes(cfg, n: int, dtype: str) -> int:
    """Bytes the draft head adds: ``n`` rows of ``hidden_size`` in ``dtype`` plus the ids."""
    return n * cfg.hidden_size * np.dtype(jnp.dtype(dtype)).itemsize + 4 * n
