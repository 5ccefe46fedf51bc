"""Step-form gated delta rule over a verify window: :func:`gdn_verify` (outputs, state only
read) and :func:`gdn_commit` (new state, no outputs); for one row per request (a plain decode
step) :func:`gdn_decode` gives both from one read of the state. ``backend`` picks the
implementation:

* ``"xla"``: :func:`~pallas_kernels.gdn.reference.gdn_recurrent_reference` with the row loop
  unrolled;
* ``"pallas"``: the Triton kernels of :mod:`pallas_kernels.gdn.pallas` (``T`` padded to a power
  of two with ``g = beta = 0`` rows, which leave the state unchanged exactly).

Both backends agree up to float rounding. Within one backend, verify, commit and decode run the
same per-row arithmetic, so a verify's row ``t`` matches decoding that row after committing rows
``< t``, a decode matches a one-row verify plus commit, and a row with ``g = beta = 0`` leaves
the state unchanged exactly.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import interpret_mode, next_pow2
from pallas_kernels.gdn.pallas import (gdn_commit_pallas, gdn_decode_pallas, gdn_verify_pallas,
                                       pad_rows)
from pallas_kernels.gdn.reference import gdn_decode_reference, gdn_recurrent_reference

BACKENDS = ("xla", "pallas")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"gdn backend {backend!r} is not available; use one of {BACKENDS}.")


def _pad_rows(q, k, v, g, beta):
    """Pad the row axis (1) to a power of two with zero rows (``g = beta = 0``: no-op rows)."""
    tp = next_pow2(q.shape[1])
    return tuple(pad_rows(a, tp) for a in (q, k, v, g, beta))


def _f32(*arrays):
    return tuple(jnp.asarray(a, jnp.float32) for a in arrays)


def gdn_verify(q, k, v, g, beta, state, *, backend: str = "xla",
               interpret: bool | None = None):
    """Outputs of the step form over the ``T`` rows of a verify window; ``state`` is only read.

    Args:
      q, k: ``[B, T, H, Dk]`` (q scaled by ``Dk**-0.5``, both L2-normalised); v ``[B, T, H, Dv]``;
        g (log decay, <= 0), beta (write strength in [0, 1]) ``[B, T, H]``; state
        ``[B, H, Dk, Dv]``. Cast to float32.
      backend: one of :data:`BACKENDS`.
      interpret: Pallas interpret mode; ``None`` means "when the default device is not a GPU".
    Returns:
      ``o [B, T, H, Dv]`` float32.
    Raises:
      ValueError: unknown backend, or (pallas) shapes the kernel cannot take.
    """
    _check_backend(backend)
    q, k, v, g, beta, state = _f32(q, k, v, g, beta, state)
    if backend == "xla":
        return gdn_recurrent_reference(q, k, v, g, beta, state, unroll=True)[0]
    t = q.shape[1]
    o = gdn_verify_pallas(*_pad_rows(q, k, v, g, beta), state, interpret=interpret_mode(interpret))
    return o[:, :t]


def gdn_commit(q, k, v, g, beta, state, *, backend: str = "xla",
               interpret: bool | None = None):
    """State after applying the ``T`` rows of a window; arguments as :func:`gdn_verify`.

    Rows to leave out (rejected drafts, padding) must carry ``g = 0, beta = 0``.
    Returns the new state ``[B, H, Dk, Dv]`` float32 (the Pallas kernel writes it in place
    when the caller donates ``state``).
    """
    _check_backend(backend)
    q, k, v, g, beta, state = _f32(q, k, v, g, beta, state)
    if backend == "xla":
        return gdn_recurrent_reference(q, k, v, g, beta, state, unroll=True)[1]
    return gdn_commit_pallas(*_pad_rows(q, k, v, g, beta), state, interpret=interpret_mode(interpret))


def gdn_decode(q, k, v, g, beta, state, *, backend: str = "xla",
               interpret: bool | None = None):
    """One decode row per request: ``(o, new state)`` from one read of ``state``, equal to
    :func:`gdn_verify` plus :func:`gdn_commit` of that row (same backend, same arithmetic).

    Args: as :func:`gdn_verify` with ``T = 1``: q, k ``[B, 1, H, Dk]``, v ``[B, 1, H, Dv]``,
    g, beta ``[B, 1, H]``, state ``[B, H, Dk, Dv]`` (cast to float32). A request whose row is not
    live must carry ``g = 0, beta = 0``: its state comes back unchanged exactly.
    Returns ``(o [B, 1, H, Dv], new state [B, H, Dk, Dv])`` float32 (the Pallas kernel writes the
    state in place when the caller donates ``state``).
    Raises ValueError: unknown backend, ``T != 1``, or (pallas) shapes the kernel cannot take.
    """
    _check_backend(backend)
    q, k, v, g, beta, state = _f32(q, k, v, g, beta, state)
    if q.shape[1] != 1:
        raise ValueError(f"gdn_decode: T={q.shape[1]} rows; decode takes one row per request "
                         "(use gdn_verify + gdn_commit for a window).")
    if backend == "xla":
        return gdn_decode_reference(q, k, v, g, beta, state)
    return gdn_decode_pallas(q, k, v, g, beta, state, interpret=interpret_mode(interpret))
