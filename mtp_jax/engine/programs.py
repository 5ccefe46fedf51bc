"""The compiled programs: prefill and the speculative round.

Both are pure functions ``program(graphdef, params, pools, batch) -> (outputs, pools)``, jitted
once per shape bucket with the pools donated. The round is one program:

    verify [pending, d_1..d_k] at positions c..c+k   (target; GDN step form, state untouched)
    accept                                            (greedy or exact rejection sampling)
    commit the GDN rows 0..n                          (replay of the accepted rows)
    draft extend over the k+1 verify rows             (MTP: row i pairs h_{c+i} with x_{c+i+1})
    k-1 chained draft steps                           (MTP: z fed back with the drafted token)

so its only host transfer is the emitted tokens and accepted counts. With k = 0 it is a plain
decode step, whose GDN layers use the decode form (output and new state in one pass, no
commit) unless a prefix-cache snapshot is saved in the round. Each slot's position and
generated-token count live in the pools and advance on the device, so the host can dispatch
the next round before reading this one's result, and one call can run several rounds in a row
(:func:`spec_rounds`, the engine's ``num_scheduler_steps``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.engine.batch import PrefillBatch, RoundBatch
from mtp_jax.engine.packing import pack, unpack
from mtp_jax.engine.pools import Pools
from mtp_jax.sampling import SALT_DRAFT, SALT_SAMPLE, filtered_probs, row_keys, categorical, sample
from mtp_jax.spec.accept import accept


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundOutput:
    """A call's result as one ``readback [R, B, k+3]`` int32 array (``R`` rounds of the call,
    in order), so that the host reads it with one device-to-host copy
    (``RoundOutput(np.asarray(out.readback))`` is its host copy). Per round and row:
    ``emitted [.., k+1]`` (``d_1..d_n, bonus, -1...``) | ``num_accepted`` | ``num_draft``
    (drafts the row verified, k clamped by :func:`clamp_drafts`). :func:`spec_round` returns
    one round without the leading axis (``[B, k+3]``); the properties index the last axis."""

    readback: jax.Array

    @property
    def emitted(self):
        return self.readback[..., :-2]

    @property
    def num_accepted(self):
        return self.readback[..., -2]

    @property
    def num_draft(self):
        return self.readback[..., -1]


def clamp_drafts(k: int, position, step, limit, max_step):
    """Drafts each row can verify: at most k, with the verify positions ``position ..
    position + n`` below ``limit`` (allocated pages) and the round's tokens (n drafts and the
    bonus) within ``max_step - step`` (tokens the request may still generate). All ``[B]``
    int32; returns ``[B]`` int32 in ``[0, k]`` (0 = a plain decode step)."""
    room = jnp.minimum(limit - position, max_step - step) - 1
    return jnp.clip(room, 0, k).astype(jnp.int32)


def _draft_token(model, z, sampling, step, j, greedy_only, filtering=None):
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
    Returns ``(tokens [B] int32, q [B, V] float32)``."""
    if greedy_only:
        return (model.draft_greedy(z),
                jnp.zeros((z.shape[0], model.cfg.vocab_size), jnp.float32))
    logits, hot = model.draft_logits(z)  # [B, N]; hot [N] int32, None: N = V, column = id
    to_id = (lambda i: i) if hot is None else (lambda i: jnp.take(hot, i))
    greedy_tok = jnp.argmax(logits, -1).astype(jnp.int32)
    q = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                       filtering=filtering)
    drawn = categorical(row_keys(sampling.seed, step, SALT_DRAFT + j), q)
    if hot is not None:
        q = jnp.zeros((q.shape[0], model.cfg.vocab_size), jnp.float32).at[:, hot].set(
            q, unique_indices=True)
    return to_id(jnp.where(sampling.is_greedy, greedy_tok, drawn)), q


def _chain(model, draft_kv, z, tok, q, pos, page_table, limit, sampling, step, k, greedy_only,
           filtering=None):
    """k-1 chained draft steps from ``z [B, H]`` and draft token ``tok [B]``; step j runs at
    position ``pos + j - 1`` and writes its draft KV only below ``limit [B]``.
    Returns ``(drafts [B, k], q [B, k, V], draft_kv)``."""
    toks, qs = [tok], [q]
    for j in range(1, k):
        p = pos + j - 1
        batch = AttentionBatch(p[:, None], (p < limit)[:, None], page_table)
        zj, draft_kv = model.mtp(model.embed_tokens, z[:, None], toks[-1][:, None], batch,
                                 draft_kv, step=j)
        z = zj[:, 0]
        t, qj = _draft_token(model, z, sampling, step, j, greedy_only, filtering)
        toks.append(t)
        qs.append(qj)
    return jnp.stack(toks, 1), jnp.stack(qs, 1), draft_kv


def _row(x, index):
    """``x[b, index[b]]`` for ``x [B, T, ...]``."""
    return jnp.take_along_axis(x, index.reshape(-1, 1, *([1] * (x.ndim - 2))), axis=1)[:, 0]


def _mtp_drafts(model, pools: Pools, hidden, next_ids, abatch, pick, step, pos, limit,
                sampling, k: int, greedy_only: bool, filtering: bool | None = None):
    """Draft extend over the rows of ``hidden [B, T, H]`` (row t pairs the hidden at t with
    ``next_ids[:, t]``), then draft ``d_1`` from row ``pick [B]`` and ``d_2..d_k`` by chained
    steps at ``pos [B]`` onwards (writes below ``limit [B]`` only); the random streams use
    ``step [B]``. Returns ``((drafts [B, k], q [B, k, V]), pools with the new draft KV)``."""
    z, draft_kv = model.mtp(model.embed_tokens, hidden, next_ids, abatch, pools.draft_kv)
    z_pick = _row(z, pick)
    tok, q = _draft_token(model, z_pick, sampling, step, 0, greedy_only, filtering)
    drafts, qs, draft_kv = _chain(model, draft_kv, z_pick, tok, q, pos, abatch.page_table,
                                  limit, sampling, step, k, greedy_only, filtering)
    return (drafts, qs), dataclasses.replace(pools, draft_kv=draft_kv)


def _store_next(pools: Pools, slot, pending, drafts, k: int) -> Pools:
    """``next_tokens[slot] = [pending, d_1..d_k]`` (zeros without drafts) and, with MTP drafts,
    ``draft_probs[slot] = q``."""
    row = pending[:, None]
    if drafts is not None:
        toks, qs = drafts
        row = jnp.concatenate([row, toks], 1)
        pools = dataclasses.replace(pools, draft_probs=pools.draft_probs.at[slot].set(qs))
    elif k:
        row = jnp.concatenate([row, jnp.zeros((row.shape[0], k), jnp.int32)], 1)
    return dataclasses.replace(pools, next_tokens=pools.next_tokens.at[slot].set(row))


def _save_round_snapshots(model, pools: Pools, rows, batch: RoundBatch) -> Pools:
    """Save the GDN state after verify row ``snap_row[b]`` into ``snap_id[b]`` (rows with
    ``snap_row < 0`` write the trash snapshot 0). A second replay: the host traces this only
    into the round variant it calls when some row crosses a prefix-cache boundary, so other
    rounds carry neither its cost nor a conditional."""
    if not pools.snapshots.recurrent or pools.snapshots.recurrent[0].shape[0] == 0:
        return pools
    view = pools.gdn.gather(batch.slot)
    state = model.commit(view, rows, jnp.maximum(batch.snap_row + 1, 0))
    snapshots = pools.snapshots.scatter(jnp.where(batch.snap_row >= 0, batch.snap_id, 0), state)
    return dataclasses.replace(pools, snapshots=snapshots)


def prefill(graphdef, params, pools: Pools, batch: PrefillBatch, *, k: int, mtp: bool,
            greedy_only: bool = False):
    """Prefill one chunk per row (the GDN state starts at zero when ``start == 0``, else from
    the slot); sample the first token; with MTP, write the draft KV over the chunk's rows and
    draft ``d_1..d_k``. Writes ``next_tokens[slot] = [x_T, d_1..d_k]`` (final chunk only matters).
    ``greedy_only`` (static): every row is greedy, so no sampling path is traced.

    Returns ``(first_token [B] int32, pools)``.
    """
    model = nnx.merge(graphdef, params)
    b, t = batch.input_ids.shape
    local = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = batch.start[:, None] + local
    valid = local < batch.length[:, None]
    abatch = AttentionBatch(pos, valid, batch.page_table)
    view = pools.gdn.gather(batch.slot)
    fresh = batch.start == 0
    view = jax.tree.map(lambda a: jnp.where(fresh.reshape(-1, *([1] * (a.ndim - 1))), 0, a), view)
    hidden, kv, view = model(batch.input_ids, abatch, pools.kv, view, "prefill")
    last = jnp.maximum(batch.length - 1, 0)
    h_last = _row(hidden, last)
    first = sample(model.logits(h_last), batch.sampling, batch.step, salt=SALT_SAMPLE,
                   greedy_only=greedy_only)
    pools = dataclasses.replace(pools, kv=kv, gdn=pools.gdn.scatter(batch.slot, view))
    drafts = None
    if mtp:
        is_final = pos == (batch.prompt_len - 1)[:, None]
        next_ids = jnp.where(is_final, first[:, None], batch.next_ids)
        end = batch.start + batch.length
        limit = batch.page_table.shape[1] * pools.kv.page_size * jnp.ones_like(end)
        drafts, pools = _mtp_drafts(model, pools, hidden, next_ids, abatch, last,
                                    batch.step + 1, end, limit, batch.sampling, k, greedy_only)
    pools = _store_next(pools, batch.slot, first, drafts, k)
    pools = dataclasses.replace(
        pools, position=pools.position.at[batch.slot].set(batch.start + batch.length),
        step=pools.step.at[batch.slot].set(jnp.ones_like(batch.slot)))
    return first, pools


def spec_round(graphdef, params, pools: Pools, batch: RoundBatch, *, k: int, proposer: str,
               greedy_only: bool = False, filtering: bool | None = None,
               snapshot: bool = False):
    """One verify/accept/commit(/draft) round; ``proposer`` in ``none | mtp | external``.

    Static variants: ``greedy_only`` (every row greedy: no sampling path traced), ``filtering``
    (some row samples: ``True`` when some row filters by top-k / top-p, ``False`` when none
    does; traced without run-time tests; ``None``: tested at run time) and
    ``snapshot`` (some row crosses a prefix-cache boundary: the snapshot replay is traced).
    Choosing them on the host keeps data-dependent conditionals, which synchronise the GPU with
    the host and split its command buffers, out of the round.

    Row b starts at the slot's ``Pools.position`` and verifies ``num_draft[b] <= k`` drafts
    (:func:`clamp_drafts`): verify rows past it, and every write at or past ``limit[b]``, go to
    the trash page, and the acceptance ignores those drafts. The slot's position and step
    advance by the tokens committed (live rows only). With ``k = 0`` and no snapshot, a model
    whose ``gdn_modes`` has ``"decode"`` runs its GDN layers in the decode form (new states
    returned directly, equal to verify + commit of the row), so no commit is traced; other
    models take the verify + commit path.
    Returns ``(RoundOutput, pools)``.
    """
    model = nnx.merge(graphdef, params)
    b = batch.slot.shape[0]
    if proposer == "external":
        tokens = batch.tokens
    else:
        tokens = pools.next_tokens[batch.slot]
    position, step = pools.position[batch.slot], pools.step[batch.slot]
    num_draft = clamp_drafts(k, position, step, batch.limit, batch.max_step)
    rows_idx = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    pos = position[:, None] + rows_idx
    valid = batch.live[:, None] & (rows_idx <= num_draft[:, None]) & (
        pos < batch.limit[:, None])
    abatch = AttentionBatch(pos, valid, batch.page_table)
    # k = 0 (no snapshot replay): the GDN layers' decode form returns the new states directly,
    # equal to verify + commit of the one row (not-valid rows keep theirs), so no commit runs.
    # The layers address the state pools by slot (the fused Pallas kernels in place; the XLA
    # path gathers and scatters per layer).
    decode = k == 0 and not snapshot and "decode" in getattr(model, "gdn_modes", ())
    hidden, kv, rows = model(tokens, abatch, pools.kv, pools.gdn,
                             "decode" if decode else "verify", slots=batch.slot)
    logits = model.logits(hidden)  # [B, k+1, V]
    if k:
        q = pools.draft_probs[batch.slot] if proposer == "mtp" else None
        n, emitted = accept(logits, tokens[:, 1:], q, batch.sampling, step,
                            num_draft=num_draft, greedy_only=greedy_only, filtering=filtering)
    else:
        n = jnp.zeros((b,), jnp.int32)
        emitted = sample(logits[:, 0], batch.sampling, step, salt=SALT_SAMPLE,
                         greedy_only=greedy_only, filtering=filtering)[:, None]
    commit_len = jnp.where(batch.live, n + 1, 0)
    if snapshot:
        pools = _save_round_snapshots(model, pools, rows, batch)
    gdn = rows if decode else model.commit(pools.gdn, rows, commit_len, slots=batch.slot)
    pools = dataclasses.replace(pools, kv=kv, gdn=gdn)
    bonus = _row(emitted, n)
    drafts = None
    if proposer == "mtp":
        next_ids = jnp.maximum(emitted, 0)  # x_{c+i+1} for rows i <= n; later rows are rewritten
        live_limit = jnp.where(batch.live, batch.limit, 0)
        drafts, pools = _mtp_drafts(model, pools, hidden, next_ids, abatch, n,
                                    step + n + 1, position + n + 1, live_limit,
                                    batch.sampling, k, greedy_only, filtering)
    pools = _store_next(pools, batch.slot, bonus, drafts, k)
    advance = jnp.where(batch.live, n + 1, 0)
    pools = dataclasses.replace(pools, position=pools.position.at[batch.slot].add(advance),
                                step=pools.step.at[batch.slot].add(advance))
    return RoundOutput(jnp.concatenate([emitted, n[:, None], num_draft[:, None]], 1)), pools


def spec_rounds(graphdef, params, pools: Pools, batch: RoundBatch, *, rounds: int, **static):
    """``rounds`` consecutive :func:`spec_round` calls over the same batch in one program
    (multi-step scheduling: the host's per-call cost is paid once for ``rounds`` rounds). Each
    round reads the positions, generated-token counts and pending tokens the previous one left
    in the pools, so the tokens equal those of ``rounds`` separate calls. The host must have
    allocated pages for every round (``limit``); rounds past a request's stop compute tokens
    the host discards. ``static``: :func:`spec_round`'s keywords (``snapshot`` needs
    ``rounds == 1``: the host saves snapshots in single rounds).

    Returns ``(RoundOutput with readback [rounds, B, k+3], pools)``.
    Raises ValueError for ``rounds < 1`` or a multi-round snapshot call."""
    if rounds < 1 or (rounds > 1 and static.get("snapshot")):
        raise ValueError(f"spec_rounds: rounds={rounds} must be >= 1, and 1 with snapshot.")
    if rounds == 1:
        out, pools = spec_round(graphdef, params, pools, batch, **static)
        return RoundOutput(out.readback[None]), pools

    def body(pools, _):
        out, pools = spec_round(graphdef, params, pools, batch, **static)
        return pools, out.readback

    # One compiled round body; unrolling ran no faster on the H200 (docs/benchmarks.md).
    pools, readback = jax.lax.scan(body, pools, None, length=rounds)
    return RoundOutput(readback), pools


def save_snapshot(pools: Pools, slot: jax.Array, snapshot: jax.Array) -> Pools:
    """Copy the GDN state of ``slot [n]`` into snapshot ids ``snapshot [n]``."""
    return dataclasses.replace(pools, snapshots=pools.snapshots.scatter(
        snapshot, pools.gdn.gather(slot)))


def load_snapshot(pools: Pools, snapshot: jax.Array, slot: jax.Array) -> Pools:
    """Copy snapshot ids ``snapshot [n]`` into the GDN state of ``slot [n]``."""
    return dataclasses.replace(pools, gdn=pools.gdn.scatter(
        slot, pools.snapshots.gather(snapshot)))


SAVE_SNAPSHOT = jax.jit(save_snapshot, donate_argnums=(0,))
LOAD_SNAPSHOT = jax.jit(load_snapshot, donate_argnums=(0,))

@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted programs of one loaded model.

    The graphdef is closed over (hashing it per call as a static argument costs milliseconds)
    and the parameters travel as a flat tuple of arrays; the batch (numpy arrays) travels as one
    packed int32 buffer (:mod:`mtp_jax.engine.packing`), so a call costs one host-to-device
    copy. Pools are donated. Shapes and the static keywords (``k``, ``mtp``, ``proposer``,
    ``greedy_only``, ``filtering``, ``snapshot``) key the compile caches: one program per bucket
    and variant.

    With ``executables`` (what :func:`make_programs` gives), calls run the compiled program of
    their shapes from an :class:`~mtp_jax.engine.executable_cache.ExecutableTable`: loaded from
    the executable cache on disk without tracing when it is there, else traced, compiled and
    saved (nothing on disk when the compilation cache is ``none``). The jitted functions stay
    the reference (``.lower`` for inspection) and serve calls when ``executables`` is None.
    """

    prefill_jit: object
    round_jit: object
    treedef: object
    executables: object = None  # ExecutableTable | None

    def leaves(self, params) -> tuple:
        return tuple(jax.tree_util.tree_leaves(params))

    def prefill(self, leaves, pools, batch: PrefillBatch, **static):
        """:func:`prefill` on a batch of numpy arrays; returns ``(first_token, pools)``."""
        buf, spec = pack(batch)
        if self.executables is not None:
            return self.executables.call("prefill", self.prefill_jit, leaves, pools, buf, spec,
                                         static)
        return self.prefill_jit(leaves, pools, buf, spec=spec, **static)

    def round(self, leaves, pools, batch: RoundBatch, **static):
        """:func:`spec_rounds` on a batch of numpy arrays; returns ``(RoundOutput, pools)``
        (``readback [rounds, B, k+3]``; ``rounds`` defaults to 1)."""
        buf, spec = pack(batch)
        if self.executables is not None:
            return self.executables.call("round", self.round_jit, leaves, pools, buf, spec,
                                         static)
        return self.round_jit(leaves, pools, buf, spec=spec, **static)

    def compiled_count(self) -> int:
        """Programs compiled or loaded so far: the jit caches plus the executable table."""
        n = self.prefill_jit._cache_size() + self.round_jit._cache_size()
        return n + (len(self.executables) if self.executables is not None else 0)


def make_programs(graphdef, params, packing=None) -> Programs:
    """The programs of a model. ``packing``: a
    :class:`~mtp_jax.engine.param_packing.ParamPacking` when the calls pass its packed
    arguments (``packing.pack(leaves)``) instead of one buffer per parameter."""
    from mtp_jax.engine.executable_cache import ExecutableTable

    treedef = jax.tree_util.tree_structure(params)
    unpack_params = (lambda leaves: leaves) if packing is None else packing.unpack
    params_of = lambda leaves: jax.tree_util.tree_unflatten(treedef, unpack_params(leaves))

    def prefill_(leaves, pools, buf, *, spec, k, mtp, greedy_only=False):
        return prefill(graphdef, params_of(leaves), pools, unpack(buf, spec), k=k, mtp=mtp,
                       greedy_only=greedy_only)

    def round_(leaves, pools, buf, *, spec, k, proposer, greedy_only=False, filtering=None,
               snapshot=False, rounds=1):
        return spec_rounds(graphdef, params_of(leaves), pools, unpack(buf, spec), k=k,
                           proposer=proposer, greedy_only=greedy_only, filtering=filtering,
                           snapshot=snapshot, rounds=rounds)

    return Programs(
        prefill_jit=jax.jit(prefill_, static_argnames=("spec", "k", "mtp", "greedy_only"),
                            donate_argnums=(1,)),
        round_jit=jax.jit(round_, static_argnames=("spec", "k", "proposer", "greedy_only",
                                                   "filtering", "snapshot", "rounds"),
                          donate_argnums=(1,)),
        treedef=treedef, executables=ExecutableTable(graphdef))
