"""A loaded model rebuilt as an nnx module whose layers of one kind run another kernel
backend (for comparing a kernel path with the XLA path on the same weights)."""

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
