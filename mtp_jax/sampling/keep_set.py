"""The set of tokens that top-k / top-p keep, per row, found without sorting the vocabulary.

:func:`mtp_jax.sampling.filtered_probs` keeps a prefix of each row's ranking (logit descending,
then token id ascending): its first ``n_keep`` ranks, where ``n_keep`` follows from top-k and
top-p (the module docstring of :mod:`mtp_jax.sampling.filtering`). A prefix is described by its last rank's
logit ``v_last`` and token id ``i_last``: token ``i`` is kept iff ``x_i > v_last``, or
``x_i == v_last`` and ``i <= i_last``.

Two ways to find ``(v_last, i_last)``:

* :func:`prefix_end_sorted`: sort the whole row (two keys). Exact for any row, but on an H200
  ``filtered_probs`` with top-p took 1.0 ms for 7 rows of 248,320 ids (the sampled rows of a
  batch-1 k = 3 round: 40% of the 2B round) and 20 ms for 224 rows (batch 32), against 0.09
  and 0.36 ms with no filter (``docs/benchmarks.md``, session 20). The candidates took
  0.41 and 3.6 ms where the sort took 0.86 and 14.2 ms on another H200 (peaked rows).
* :func:`prefix_end_candidates`: cut the row into ``num_chunks`` chunks and take each chunk's
  ``per_chunk`` largest logits (``lax.top_k``); sort only those candidates. With ``T`` the
  largest of the chunks' ``per_chunk``-th values, every logit ``> T`` is a candidate (its chunk
  holds fewer than ``per_chunk`` logits above it), so the candidates' ranking is the row's
  ranking down to the last logit ``> T``, and its values are the row's down to the ranks valued
  ``T`` (the row may hold more ``T``-valued ids, in another id order). The answer is therefore
  the row's when ``v_last > T`` and, with top-k on, ``top_k`` ranks of correct values exist among
  the candidates (the top-k mass needs them); the function reports that per row as ``valid``.
  :func:`keep_mask` takes the sorted answer for the rows where it is not (a flat row whose
  top-p set spans much of the vocabulary; a peaked row, as a trained model mostly gives, keeps
  far fewer ids than the 4,096 candidates), so the result is the sorted one for every row, up
  to float32 summation order in the masses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_CHUNKS = 256  # chunks of the vocabulary, each contributing PER_CHUNK candidates
PER_CHUNK = 16  # candidates per chunk
MIN_VOCAB = 32768  # smaller rows are sorted whole


def _ranked_prefix(x_sorted, i_sorted, m, t, k_eff, top_p, p_off, mass_k=None):
    """``(v_last, i_last, n_keep)`` from a ranking ``x_sorted``/``i_sorted [..., n]`` (ranks
    beyond ``n`` unknown); ``mass_k [...]``: the top-k mass, or ``None`` for the sum over the
    first ``k_eff`` of these ranks."""
    rank = jax.lax.broadcasted_iota(jnp.int32, x_sorted.shape, x_sorted.ndim - 1)
    e_sorted = jnp.exp((x_sorted - m) / t[..., None])
    in_k = rank < k_eff[..., None]
    e_k = jnp.where(in_k, e_sorted, 0.0)
    if mass_k is None:
        mass_k = jnp.sum(e_k, axis=-1)
    cum = jnp.cumsum(e_k, axis=-1)
    # cumulative mass strictly before each rank
    excl = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
    in_p = p_off[..., None] | (excl < (top_p * mass_k)[..., None]) | (rank == 0)
    n_keep = jnp.sum((in_k & in_p).astype(jnp.int32), axis=-1)  # a prefix of the ranking
    last = (n_keep - 1)[..., None]
    v_last = jnp.take_along_axis(x_sorted, last, axis=-1)[..., 0]
    i_last = jnp.take_along_axis(i_sorted, last, axis=-1)[..., 0]
    return v_last, i_last, n_keep


def prefix_end_sorted(x, m, t, k_eff, top_p, p_off):
    """``(v_last, i_last)`` of each row's kept prefix by a sort of the whole row.

    Args:
      x: ``[..., V]`` float32 logits (``-0.0`` canonicalised to ``0.0``).
      m: ``[..., 1]`` row max; t: ``[...]`` temperature (> 0); k_eff: ``[...]`` int32 in
        ``[1, V]``; top_p: ``[...]`` float32; p_off: ``[...]`` bool.
    Returns:
      ``v_last [...]`` float32 and ``i_last [...]`` int32.
    """
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    neg_sorted, i_sorted = jax.lax.sort((-x, iota), dimension=x.ndim - 1, num_keys=2)
    v_last, i_last, _ = _ranked_prefix(-neg_sorted, i_sorted, m, t, k_eff, top_p, p_off)
    return v_last, i_last


def prefix_end_candidates(x, m, t, k_eff, top_p, p_off, *, num_chunks: int = NUM_CHUNKS,
                          per_chunk: int = PER_CHUNK):
    """``(v_last, i_last, valid)``: the kept prefix's end from each chunk's ``per_chunk``
    largest logits; ``valid [...]`` bool marks the rows where it is provably the sorted
    answer (module docstring). Arguments as :func:`prefix_end_sorted`; ``num_chunks`` chunks
    of ``ceil(V / num_chunks) >= per_chunk`` ids each (the last padded with ``-inf``)."""
    v = x.shape[-1]
    length = -(-v // num_chunks)
    if length < per_chunk:
        raise ValueError(f"prefix_end_candidates: {num_chunks} chunks of a {v}-id row hold "
                         f"{length} ids each, fewer than per_chunk={per_chunk}.")
    pad = num_chunks * length - v
    xc = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    xc = xc.reshape(*x.shape[:-1], num_chunks, length)
    vals, local = jax.lax.top_k(xc, per_chunk)  # [..., C, per_chunk], descending
    # T: every logit above it is a candidate. (The chunk's smallest candidate is taken with a
    # min: a slice of top_k's output made XLA-CPU replace its TopK by a sort of every chunk,
    # 35 against 5 ms for two rows.)
    threshold = jnp.max(jnp.min(vals, axis=-1), axis=-1)
    ids = local + (jnp.arange(num_chunks, dtype=jnp.int32) * length)[:, None]
    flat = vals.shape[:-2] + (num_chunks * per_chunk,)
    neg_sorted, i_sorted = jax.lax.sort((-vals.reshape(flat), ids.reshape(flat)),
                                        dimension=len(flat) - 1, num_keys=2)
    x_sorted = -neg_sorted
    topk_on = k_eff < v
    # The top-k mass over the candidates' ranks (right where valid), else the whole row's.
    rank = jax.lax.broadcasted_iota(jnp.int32, flat, len(flat) - 1)
    e_cand = jnp.where(rank < k_eff[..., None], jnp.exp((x_sorted - m) / t[..., None]), 0.0)
    e_row = jnp.exp((x - m) / t[..., None])
    mass_k = jnp.where(topk_on, jnp.sum(e_cand, axis=-1), jnp.sum(e_row, axis=-1))
    v_last, i_last, _ = _ranked_prefix(x_sorted, i_sorted, m, t, k_eff, top_p, p_off,
                                       mass_k=mass_k)
    known = jnp.sum((x_sorted >= threshold[..., None]).astype(jnp.int32), axis=-1)
    valid = (v_last > threshold) & (~topk_on | (k_eff <= known))
    return v_last, i_last, valid


def keep_mask(x, m, t, k_eff, top_p, p_off, filtered, *, num_chunks: int = NUM_CHUNKS,
              per_chunk: int = PER_CHUNK, min_vocab: int | None = None,
              some_filtered: bool | None = None):
    """``[..., V]`` bool: the ids each row keeps, all of them in rows outside ``filtered``.

    Without a filtered row every id is kept. Otherwise the candidates' answer
    (:func:`prefix_end_candidates`) is taken where it is valid, and the whole-row sort's
    elsewhere; the sort runs only when some filtered row is not valid (a ``lax.cond``), and for
    every filtered row when rows are shorter than ``min_vocab`` (default :data:`MIN_VOCAB`,
    read at trace time).

    Args:
      filtered: ``[...]`` bool, the rows with top-k or top-p on (and not greedy).
      some_filtered: static, when the caller knows it: ``True`` (some row may filter: the
        filter is traced with no run-time test), ``False`` (no row filters: every id is kept,
        nothing traced; ``filtered`` must then be all false) or ``None`` (a ``lax.cond`` on
        ``any(filtered)``; on a GPU a conditional reads its predicate back to the host, which
        waits for the device there).
      Others as :func:`prefix_end_sorted`.
    Returns:
      ``[..., V]`` bool.
    """
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)

    def from_end(v_last, i_last):
        # Token i has rank <= last  <=>  x_i > v_last, or x_i == v_last and i <= i_last.
        v_last, i_last = v_last[..., None], i_last[..., None]
        return (x > v_last) | ((x == v_last) & (iota <= i_last)) | ~filtered[..., None]

    def all_kept(_):
        return jnp.ones(x.shape, dtype=bool)

    def by_sort(_):
        return from_end(*prefix_end_sorted(x, m, t, k_eff, top_p, p_off))

    def by_candidates(_):
        v_c, i_c, valid = prefix_end_candidates(x, m, t, k_eff, top_p, p_off,
                                                num_chunks=num_chunks, per_chunk=per_chunk)

        def with_sort(_):
            v_s, i_s = prefix_end_sorted(x, m, t, k_eff, top_p, p_off)
            return jnp.where(valid, v_c, v_s), jnp.where(valid, i_c, i_s)

        return from_end(*jax.lax.cond(jnp.all(valid | ~filtered), lambda _: (v_c, i_c),
                                      with_sort, None))

    short = x.shape[-1] < (MIN_VOCAB if min_vocab is None else min_vocab)
    by_filter = by_sort if short else by_candidates
    if some_filtered is not None:
        return by_filter(None) if some_filtered else all_kept(None)
    return jax.lax.cond(jnp.any(filtered), by_filter, all_kept, None)


__all__ = ["MIN_VOCAB", "NUM_CHUNKS", "PER_CHUNK", "keep_mask", "prefix_end_candidates",
           "prefix_end_sorted"]
