"""A loaded model rebuilt as an nnx module whose layers of one kind run another kernel
backend (for comparing a kernel path with the XLA path on the same weights), and a one-request
prefill for driving such a model step by step."""

from __future__ import annotations

import dataclasses

# op -> (whether a decoder layer has that op, the layer's module that holds the backend)
_LAYERS = {
    "gdn": (lambda layer: layer.layer_type != "full_attention", lambda layer: layer.linear_attn),
    "attention": (lambda layer: layer.layer_type == "full_attention",
                  lambda layer: layer.self_attn),
}


def with_backend(m, op: str, backend: str):
    """``m`` (a ``load_model`` result) as an nnx module whose ``op`` layers (``"gdn"``, with
    the commit, or ``"attention"``) and config use ``backend``."""
    from flax import nnx

    from mtp_jax.kernels import KernelBackends

    has, module = _LAYERS[op]
    model = nnx.merge(m.graphdef, m.params)
    model.cfg = dataclasses.replace(m.cfg, kernels=KernelBackends(**{op: backend}))
    for layer in model.layers:
        if has(layer):
            module(layer).backend = backend
    return model


def prefill_one_row(model, cfg, ids):
    """Prefill one request ``ids [1, T]`` into fresh float32 pools (one slot, pages 1..4 of 8
    tokens). Returns ``(kv, gdn, page_table [1, 4])`` for the decode steps after it."""
    import jax.numpy as jnp

    from mtp_jax.cache.paged import AttentionBatch
    from mtp_jax.cache.pools import make_pools

    t = ids.shape[1]
    pools = make_pools(cfg, num_pages=5, page_size=8, slots=1, k=0, mtp=False,
                       dtype=jnp.float32)
    table = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    _, kv, gdn = model(jnp.asarray(ids), AttentionBatch(pos, jnp.ones((1, t), bool), table),
                       pools.kv, pools.gdn, "prefill")
    return kv, gdn, table
