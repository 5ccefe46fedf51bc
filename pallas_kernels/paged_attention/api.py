"""Paged attention entry point; ``backend`` picks the implementation.

* ``"xla"``: :func:`~pallas_kernels.paged_attention.reference.paged_attention_reference` (gathers
  the whole page table each call), or, for a table of more than ``MAX_GATHER_KEYS`` keys,
  :func:`~pallas_kernels.paged_attention.blocked.paged_attention_blocked` (key blocks up to the
  largest query position, online softmax);
* ``"pallas"``: the flash-decoding Triton kernel of :mod:`pallas_kernels.paged_attention.pallas`
  for decode and verify calls (``T <= MAX_KERNEL_T`` rows per request and at most
  ``MAX_QUERY_ROWS`` padded query rows per kv head), which reads each request's pages only up
  to its largest query position. Longer calls (prefill chunks) take the ``"xla"`` path.

A gated-attention layer on the ``pallas`` backend calls the kernel through
:func:`~pallas_kernels.paged_attention.pallas.paged_attention_rows` on the query rows that
:func:`~pallas_kernels.paged_attention.prep.qk_norm_rope_write` writes (norms, RoPE and the
K/V pool writes in one kernel; ``mtp_jax.models.layers.attention``).

Both backends agree up to float rounding.
"""

from __future__ import annotations

from pallas_kernels.common import interpret_mode
from pallas_kernels.paged_attention.blocked import paged_attention_blocked, uses_blocks
from pallas_kernels.paged_attention.pallas import (MAX_QUERY_ROWS, paged_attention_pallas,
                                                   padded_query_rows)
from pallas_kernels.paged_attention.reference import paged_attention_reference

BACKENDS = ("xla", "pallas")
MAX_KERNEL_T = 16  # query rows per request above which "pallas" uses the reference (prefill)


def uses_kernel(t: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether backend ``"pallas"`` runs the kernel for ``T = t`` rows (else the reference)."""
    group = num_q_heads // num_kv_heads
    return t <= MAX_KERNEL_T and padded_query_rows(t, group) <= MAX_QUERY_ROWS


def paged_attention(q, k_pages, v_pages, page_table, q_positions, *, scale: float,
                    backend: str = "xla", interpret: bool | None = None):
    """Causal grouped-query attention over paged K/V (prefill, decode and verify rows).

    Args:
      q: ``[B, T, Hq, D]`` roped queries.
      k_pages, v_pages: ``[num_pages, page_size, Hkv, D]`` one layer's pool.
      page_table: ``[B, max_pages]`` int32; q_positions: ``[B, T]`` int32.
      scale: softmax scale (``D ** -0.5``).
      backend: one of :data:`BACKENDS`.
      interpret: Pallas interpret mode for ``"pallas"``; ``None`` means "when the default device
        is not a GPU".
    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype`` (see :func:`paged_attention_reference`).
    Raises:
      ValueError: an unknown backend, or shapes the kernel cannot take.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not available; use one of {BACKENDS}.")
    if backend == "pallas" and uses_kernel(q.shape[1], q.shape[2], k_pages.shape[2]):
        return paged_attention_pallas(q, k_pages, v_pages, page_table, q_positions, scale=scale,
                                      interpret=interpret_mode(interpret))
    if uses_blocks(k_pages.shape[1], page_table.shape[1]):
        return paged_attention_blocked(q, k_pages, v_pages, page_table, q_positions, scale=scale)
    return paged_attention_reference(q, k_pages, v_pages, page_table, q_positions, scale=scale)
