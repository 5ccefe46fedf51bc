"""Paged attention entry point; picks an implementation (``xla`` for now)."""

from __future__ import annotations

from pallas_kernels.paged_attention.reference import paged_attention_reference

BACKENDS = ("xla",)


def paged_attention(q, k_pages, v_pages, page_table, q_positions, *, scale: float,
                    backend: str = "xla"):
    """See :func:`paged_attention_reference` for shapes; ``backend`` in :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not available; use one of {BACKENDS}.")
    return paged_attention_reference(q, k_pages, v_pages, page_table, q_positions, scale=scale)
