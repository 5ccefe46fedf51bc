"""A loaded model: config, dtype, the split nnx model and its research API.

:class:`LoadedModel` is what a family's loader returns (:func:`mtp_jax.models.loader.
load_model`) and what the engine serves. Its ``forward`` / ``mtp_forward`` are jit-able functions
of token ids and hidden states (no cache to manage), run by the family's programs that the
loader hands in (``forward_program``, ``mtp_forward_program``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mtp_jax.config import ConfigError

__all__ = ["DTYPES", "NP_DTYPES", "resolve_dtype", "LoadedModel"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def resolve_dtype(dtype: str | None) -> str:
    """``None``/``"auto"``: bfloat16 on an accelerator, float32 on CPU; else the name of a
    supported dtype. Raises :class:`ConfigError` for another."""
    if dtype in (None, "auto"):
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    name = getattr(jnp.dtype(dtype), "name", str(dtype)) if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ConfigError(f"dtype (--dtype) {dtype!r} is not supported; use auto (bfloat16 on a "
                          "GPU, float32 on CPU), bfloat16, float16 or float32.")
    return name


@dataclasses.dataclass(eq=False)  # identity: engines key their compiled programs by the model
class LoadedModel:
    """A model with its parameters.

    Attributes:
      cfg: the family's config (e.g. :class:`~mtp_jax.config.ModelConfig`).
      dtype: ``"float32" | "bfloat16" | "float16"``.
      graphdef, params: the split nnx model; programs take ``params`` and merge inside jit.
      has_mtp: whether the ``mtp.*`` draft was loaded.
      pack_small_params: the engine's programs take the small parameters packed into one
        buffer per dtype (:mod:`mtp_jax.engine.param_packing`; fewer argument buffers per
        call) instead of one buffer each.
      forward_program, mtp_forward_program: the family's jitted ``(graphdef, params, ...)``
        functions behind :meth:`forward` and :meth:`mtp_forward`.
      weight_bytes_saved: device bytes the projections kept quantized save against the model
        dtype (:func:`mtp_jax.models.quantized.saved_bytes`; 0 when none are), taken off the
        engine's planned weight bytes.
      derived: models made from this one (:func:`mtp_jax.models.draft_head.with_draft_head`),
        by their key.
    """

    cfg: object
    dtype: str
    graphdef: object
    params: object
    has_mtp: bool
    pack_small_params: bool = False
    weight_bytes_saved: int = 0
    forward_program: Callable | None = dataclasses.field(default=None, repr=False)
    mtp_forward_program: Callable | None = dataclasses.field(default=None, repr=False)
    derived: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def extra_weight_bytes(self) -> int:
        """Device bytes the model holds besides its checkpoint's tensors (qwen4_exp's n-gram
        tables with ``ple_backend="device"``), added to the engine's planned weight bytes."""
        return 0

    @property
    def host_callbacks(self) -> bool:
        """Whether the model's programs call back into the host (qwen4_exp's PLE rows): such
        programs cannot be serialized, so the executable cache does not save them."""
        return False

    def module(self, params=None):
        """The nnx module, merged from the graphdef and ``params`` (default: the model's)."""
        return nnx.merge(self.graphdef, self.params if params is None else params)

    def forward(self, input_ids, params=None):
        """Full forward without a cache.

        Args: ``input_ids [B, T]`` int; ``params``: a pytree shaped like :attr:`params` to run
        with instead (e.g. the argument of your own ``jax.jit`` or ``jax.grad`` function:
        ``jax.jit(lambda p, ids: m.forward(ids, params=p))``; a function that closes over
        ``m.params`` instead bakes them into its program as constants).
        Returns: ``(logits [B, T, V] float32, hidden_states [B, T, H])``, hidden after the final
        norm (what the LM head reads), in the model dtype.
        Raises: ``ValueError`` for input ids that are not ``[B, T]``.
        """
        ids = jnp.asarray(input_ids, jnp.int32)
        if ids.ndim != 2:
            raise ValueError(f"forward takes input_ids [B, T]; got shape {ids.shape}. Add a batch "
                             "axis (e.g. ids[None]).")
        return self.forward_program(self.graphdef, self.params if params is None else params,
                                    ids)

    def mtp_forward(self, hidden_states, next_token_ids, params=None):
        """Teacher-forced MTP draft rows at positions ``0..T-1``.

        Args: ``hidden_states [B, T, H]`` (target hidden after the final norm, or a previous
        ``mtp_hidden`` row for a chained step), ``next_token_ids [B, T]`` (token t+1 per row),
        ``params`` as for :meth:`forward`.
        Returns: ``(logits [B, T, V] float32, mtp_hidden [B, T, H])`` (``mtp_hidden`` after
        ``mtp.norm``). Raises ``ValueError`` when the model was loaded without its draft or the
        shapes disagree.
        """
        if not self.has_mtp:
            raise ValueError("this model was loaded without its mtp.* draft; use "
                             "load_model(path, with_mtp=True).")
        hidden = jnp.asarray(hidden_states)
        nxt = jnp.asarray(next_token_ids, jnp.int32)
        if hidden.ndim != 3 or nxt.shape != hidden.shape[:2]:
            raise ValueError(f"mtp_forward takes hidden_states [B, T, H] and next_token_ids "
                             f"[B, T]; got {hidden.shape} and {nxt.shape}.")
        return self.mtp_forward_program(self.graphdef,
                                        self.params if params is None else params, hidden, nxt)
