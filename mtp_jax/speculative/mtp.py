"""The MTP proposer: the checkpoint's own ``mtp.*`` layer drafts the next round's k tokens.

Inside a compiled program (prefill or round), after the target's forward::

    draft extend over T rows        row t pairs the target's hidden h_t with token x_{t+1}
                                    (at position t), writing the draft KV of every row (a
                                    prefill writes only the KV of the rows, then runs the
                                    whole draft step on the pick row: ``kv_only``)
    d_1 from row pick[b]            the last committed row of each request
    d_2..d_k: k-1 chained steps     the draft's own hidden z fed back with the token it drafted,
                                    step j at position pos + j - 1

Greedy rows draft the argmax; sampled rows draw from the filtered draft distribution q, which
is stored with the drafts (``Pools.draft_probs``) for the next round's rejection sampling.
With presence / frequency penalties (``counts``: the output's counts before the first draft)
each draft step's logits are penalised over the output and the drafts before it
(:mod:`mtp_jax.sampling.penalties`), as the verify penalises the target's. The
draft's LM head may be its own (a reduced vocabulary or int8 rows:
:mod:`mtp_jax.models.draft_head`, hot ids from :mod:`mtp_jax.speculative.draft_vocab`).

The model supplies the pieces (``model.mtp``, ``model.embed_tokens``, ``model.draft_logits``,
``model.draft_greedy``); nothing here knows the family.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.cache.pools import Pools
from mtp_jax.cache.rows import set_rows
from mtp_jax.sampling import SALT_DRAFT, categorical, filtered_probs, row_keys
from mtp_jax.sampling.penalties import draft_penalty

__all__ = ["draft_token", "chain_drafts", "mtp_drafts", "store_next_tokens", "row_at",
           "write_draft_kv"]


def row_at(x, index):
    """``x[b, index[b]]`` for ``x [B, T, ...]`` and ``index [B]`` int32: ``[B, ...]``."""
    return jnp.take_along_axis(x, index.reshape(-1, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]


def draft_token(model, z, sampling, step, j, greedy_only, filtering=None, penalty=None):
    """Draft token j (0-based) from MTP hidden ``z [B, H]``: argmax for greedy rows, else a draw
    from the filtered draft distribution q, which is returned for rejection sampling (greedy
    rows' q is never read). With ``greedy_only`` (static; the host picks it when every row is
    greedy) the filtering is not traced; otherwise some row samples, so no run-time test of an
    all-greedy batch is made (on a GPU it would be a host round trip per draft step).

    With a reduced draft vocabulary (``model.draft_head``: N hot ids) the draft scores only the
    hot ids: the argmax / draw over the N logits is mapped to its full id, and q (filtered over
    the N logits) is scattered into ``[B, V]``, zero outside the hot set, so the accept step
    sees the distribution the draft really sampled from. With an int8 draft head the logits
    are its mixed ones (int8 products, the best blocks re-scored in the model dtype;
    :mod:`mtp_jax.models.draft_head`), and q is filtered over them; greedy-only programs
    take ``model.draft_greedy`` (the best re-scored candidate, no pass over all V).
    ``filtering`` (static; the host's :meth:`~mtp_jax.sampling.SamplingTensors.filters_any`):
    whether the filter is traced, with no run-time test (``None``: tested at run time).
    ``penalty`` (``[B, V]`` float32 or None): lowered from the logits first (taken at the hot
    ids with a reduced vocabulary); then greedy-only programs score every logit.
    Random stream: ``row_keys(seed, step, SALT_DRAFT + j)``.
    Returns ``(tokens [B] int32, q [B, V] float32)``."""
    zeros = lambda: jnp.zeros((z.shape[0], model.cfg.vocab_size), jnp.float32)  # noqa: E731
    if greedy_only and penalty is None:
        return model.draft_greedy(z), zeros()
    logits, hot = model.draft_logits(z)  # [B, N]; hot [N] int32, None: N = V, column = id
    if penalty is not None:
        logits = logits.astype(jnp.float32) - (penalty if hot is None
                                               else jnp.take(penalty, hot, axis=1))
    to_id = (lambda i: i) if hot is None else (lambda i: jnp.take(hot, i))
    greedy_tok = jnp.argmax(logits, -1).astype(jnp.int32)
    if greedy_only:
        return to_id(greedy_tok), zeros()
    q = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                       sampling.min_p, filtering=filtering)
    drawn = categorical(row_keys(sampling.seed, step, SALT_DRAFT + j), q)
    if hot is not None:
        q = jnp.zeros((q.shape[0], model.cfg.vocab_size), jnp.float32).at[:, hot].set(
            q, unique_indices=True)
    return to_id(jnp.where(sampling.is_greedy, greedy_tok, drawn)), q


def chain_drafts(model, draft_kv, z, tok, q, pos, page_table, limit, sampling, step, k,
                 greedy_only, filtering=None, counts=None):
    """k-1 chained draft steps from ``z [B, H]`` and draft token ``tok [B]`` (with its ``q [B,
    V]``); step j runs at position ``pos + j - 1`` and writes its draft KV only below ``limit
    [B]``; ``counts`` (``[B, V]`` int32 or None): the output's counts before ``tok``, for the
    penalties. Returns ``(drafts [B, k] int32, q [B, k, V] float32, draft_kv)``."""
    toks, qs = [tok], [q]
    for j in range(1, k):
        p = pos + j - 1
        batch = AttentionBatch(p[:, None], (p < limit)[:, None], page_table)
        zj, draft_kv = model.mtp(model.embed_tokens, z[:, None], toks[-1][:, None], batch,
                                 draft_kv, step=j)
        z = zj[:, 0]
        pen = None if counts is None else draft_penalty(counts, toks, sampling)
        t, qj = draft_token(model, z, sampling, step, j, greedy_only, filtering, pen)
        toks.append(t)
        qs.append(qj)
    return jnp.stack(toks, 1), jnp.stack(qs, 1), draft_kv


def mtp_drafts(model, pools: Pools, hidden, next_ids, abatch, pick, step, pos, limit,
               sampling, k: int, greedy_only: bool, filtering: bool | None = None,
               kv_only: bool = False, counts=None):
    """Draft extend over the rows of ``hidden [B, T, H]`` (row t pairs the hidden at t with
    ``next_ids[:, t]``, at ``abatch``'s positions), then draft ``d_1`` from row ``pick [B]``
    and ``d_2..d_k`` by chained steps at ``pos [B]`` onwards (writes below ``limit [B]``
    only); the random streams use ``step [B]``. ``kv_only`` (static; for a prefill's chunk,
    whose rows but ``pick`` feed no draft): the extend writes the draft KV of every row
    (``model.mtp.write_kv``, where the family has it: the KV projections only) and runs the
    whole draft step on row ``pick`` alone, saving the draft's attention, MLP and norm over
    the other rows. ``counts`` (``[B, V]`` int32 or None): the output's counts before
    ``d_1``, when the batch has penalties. Returns ``((drafts [B, k] int32, q [B, k, V]
    float32), pools with the new draft KV)``."""
    if not (kv_only and hasattr(model.mtp, "write_kv")):
        z, draft_kv = model.mtp(model.embed_tokens, hidden, next_ids, abatch, pools.draft_kv)
        z_pick = row_at(z, pick)
    else:
        draft_kv = write_draft_kv(model, pools.draft_kv, hidden, next_ids, abatch)
        one = AttentionBatch(row_at(abatch.positions, pick)[:, None],
                             row_at(abatch.valid, pick)[:, None], abatch.page_table)
        z, draft_kv = model.mtp(model.embed_tokens, row_at(hidden, pick)[:, None],
                                row_at(next_ids, pick)[:, None], one, draft_kv)
        z_pick = z[:, 0]
    pen = None if counts is None else draft_penalty(counts, [], sampling)
    tok, q = draft_token(model, z_pick, sampling, step, 0, greedy_only, filtering, pen)
    drafts, qs, draft_kv = chain_drafts(model, draft_kv, z_pick, tok, q, pos,
                                        abatch.page_table, limit, sampling, step, k,
                                        greedy_only, filtering, counts)
    return (drafts, qs), dataclasses.replace(pools, draft_kv=draft_kv)


def write_draft_kv(model, draft_kv, hidden, ids, abatch: AttentionBatch):
    """The draft KV with the rows of ``hidden [B, T, H]`` paired with ``ids [B, T]`` written at
    ``abatch``'s positions, as a draft step writes them: ``model.mtp.write_kv`` where the
    family has it (the KV projections only), else the whole draft step, its output unused
    (XLA drops what the KV does not need)."""
    write = getattr(model.mtp, "write_kv", None)
    if write is not None:
        return write(model.embed_tokens, hidden, ids, abatch, draft_kv)
    return model.mtp(model.embed_tokens, hidden, ids, abatch, draft_kv)[1]


def store_next_tokens(pools: Pools, slot, pending, drafts, k: int, fill: int = 0) -> Pools:
    """``next_tokens[slot] = [pending, d_1..d_k]`` (``fill`` in place of drafts when ``drafts``
    is None: 0 with no proposer, or host drafts that come with the next round's batch; -1 for
    stale MTP drafts, which the next round verifies none of) and, with MTP
    drafts ``(tokens [B, k], q [B, k, V])``, ``draft_probs[slot] = q``; rows on the trash slot
    write nothing (:func:`mtp_jax.cache.rows.set_rows`)."""
    row = pending[:, None]
    if drafts is not None:
        toks, qs = drafts
        row = jnp.concatenate([row, toks], 1)
        pools = dataclasses.replace(pools, draft_probs=set_rows(pools.draft_probs, slot, qs))
    elif k:
        row = jnp.concatenate([row, jnp.full((row.shape[0], k), fill, jnp.int32)], 1)
    return dataclasses.replace(pools, next_tokens=set_rows(pools.next_tokens, slot, row))
