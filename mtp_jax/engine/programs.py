"""The compiled programs: prefill and the speculative round.

Both are pure functions ``program(graphdef, params, pools, batch, variant) -> (outputs, pools)``,
jitted once per shape bucket and variant (:mod:`mtp_jax.engine.variants`) with the pools
donated. The round is one program:

    verify [pending, d_1..d_k] at positions c..c+k   (target; GDN step form, state untouched)
    accept                                            (greedy or exact rejection sampling)
    commit the GDN rows 0..n                          (replay of the accepted rows)
    draft extend over the k+1 verify rows             (MTP: row i pairs h_{c+i} with x_{c+i+1})
    k-1 chained draft steps                           (MTP: z fed back with the drafted token)

so its only host transfer is the emitted tokens and accepted counts. The speculative pieces
(clamp, accept, the MTP proposer) live in :mod:`mtp_jax.speculative`; this module strings them
around the target's forward. With k = 0 it is a plain decode step, whose GDN layers use the
decode form (output and new state in one pass, no commit) unless a prefix-cache snapshot is
saved in the round. Each slot's position and generated-token count live in the pools and
advance on the device, so the host can dispatch the next round before reading this one's
result, and one call can run several rounds in a row (:func:`rounds`, the engine's
``num_scheduler_steps``).
"""

from __future__ import annotations

import dataclasses
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.cache.pools import Pools
from mtp_jax.cache.rows import set_rows
from mtp_jax.engine.batch import PrefillBatch, RoundBatch
from mtp_jax.engine.executable_cache import ExecutableTable
from mtp_jax.engine.executable_key import CHANGED_CONSTANTS
from mtp_jax.engine.packing import pack, unpack
from mtp_jax.engine.param_packing import ParamPacking
from mtp_jax.engine.snapshots import (has_snapshots, prefill_targets, redraft_row,
                                     save_prefill_snapshots, save_round_snapshots)
from mtp_jax.engine.variants import PrefillVariant, RoundVariant
from mtp_jax.models.registry import entry_of
from mtp_jax.sampling import SALT_RESIDUAL, SALT_SAMPLE, sample
from mtp_jax.sampling.logprobs import columns_per_token, logprob_columns
from mtp_jax.sampling.penalties import add_tokens, first_counts, verify_penalties
from mtp_jax.speculative.accept import accept
from mtp_jax.speculative.clamp import clamp_drafts
from mtp_jax.speculative.mtp import mtp_drafts, row_at, store_next_tokens, write_draft_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundOutput:
    """A call's result as one ``readback [R, B, k+3]`` int32 array (``R`` rounds of the call,
    in order), so that the host reads it with one device-to-host copy
    (``RoundOutput(np.asarray(out.readback))`` is its host copy). Per round and row:
    ``emitted [.., k+1]`` (``d_1..d_n, bonus, -1...``) | ``num_accepted`` | ``num_draft``
    (drafts the row verified, k clamped by
    :func:`~mtp_jax.speculative.clamp.clamp_drafts`). :func:`one_round` returns one round
    without the leading axis (``[B, k+3]``); the properties index the last axis.

    A logprobs variant (``top >= 0``, static: the call's ``RoundVariant.logprobs``) appends
    ``(k+1) * (1 + 2 top)`` columns (:func:`~mtp_jax.sampling.logprobs.logprob_columns` of the
    emitted positions; ``logprob_columns`` here, split on the host by
    :func:`~mtp_jax.sampling.logprobs.split_logprob_columns`); the host copy keeps ``top``
    (``RoundOutput(np.asarray(out.readback), out.top)``)."""

    readback: jax.Array
    top: int = dataclasses.field(default=-1, metadata=dict(static=True))

    @property
    def _k1(self) -> int:
        return (self.readback.shape[-1] - 2) // (1 + columns_per_token(self.top))

    @property
    def emitted(self):
        return self.readback[..., :self._k1]

    @property
    def num_accepted(self):
        return self.readback[..., self._k1]

    @property
    def num_draft(self):
        return self.readback[..., self._k1 + 1]

    @property
    def logprob_columns(self):
        return self.readback[..., self._k1 + 2:]


def _plain_round_drafts(model, pools: Pools, hidden, emitted, abatch: AttentionBatch, slot,
                        bonus, proposer: str, pool_k: int) -> Pools:
    """After a plain round (k = 0) of an engine whose rounds draft ``pool_k`` tokens: with
    MTP, write the draft's KV of the committed row (its hidden paired with the token just
    emitted; :func:`~mtp_jax.speculative.mtp.write_draft_kv`) so that the
    draft attends to every position when drafting resumes; then ``next_tokens[slot] =
    [bonus, -1 x pool_k]``: the drafts are stale, and the next drafting round verifies none
    of them (:func:`one_round`)."""
    if proposer == "mtp":
        pools = dataclasses.replace(pools, draft_kv=write_draft_kv(
            model, pools.draft_kv, hidden, emitted[:, :1], abatch))
    stale = jnp.full((bonus.shape[0], pool_k), -1, jnp.int32)
    row = jnp.concatenate([bonus[:, None], stale], 1)
    return dataclasses.replace(pools, next_tokens=set_rows(pools.next_tokens, slot, row))


def prefill(graphdef, params, pools: Pools, batch: PrefillBatch, variant: PrefillVariant):
    """Prefill one chunk per row (the GDN state starts at zero when ``start == 0``, else from
    the slot); sample the first token; with MTP (``variant.mtp``), write the draft KV over the
    chunk's rows and draft ``d_1..d_k`` (``variant.drafts``; else the drafts are left stale,
    -1). Writes ``next_tokens[slot] = [x_T, d_1..d_k]`` (final chunk only matters).
    ``variant.greedy_only``: every row is greedy, so no sampling path is traced. With
    prefix-cache snapshots (``batch.snap_at`` has ``S > 0`` columns and the pools hold
    snapshots), saves the slot states at the boundaries inside the chunk: from the
    model's prefill forward at those rows (``ModelEntry.prefill_snapshots``), else the
    chunk's final states at a boundary at its end
    (:func:`~mtp_jax.engine.snapshots.save_prefill_snapshots`). With MTP, a row with
    ``batch.redraft`` first rewrites the draft KV at ``start - 1``
    (:func:`~mtp_jax.engine.snapshots.redraft_row`). ``variant.penalties``: a row that ends
    its prompt sets its slot's output counts to its first token (which no penalty touches:
    the output is empty before it), and the MTP draft penalises its drafts over them.

    Returns ``(next_tokens [B, k+1] int32: the first token and the drafts, pools)``; a
    logprobs variant appends the first token's ``1 + 2 * variant.logprobs`` columns
    (:func:`~mtp_jax.sampling.logprobs.logprob_columns`).
    """
    k, greedy_only = variant.k, variant.greedy_only
    model = nnx.merge(graphdef, params)
    b, t = batch.input_ids.shape
    local = jnp.arange(t, dtype=jnp.int32)[None, :]
    pos = batch.start[:, None] + local
    valid = local < batch.length[:, None]
    abatch = AttentionBatch(pos, valid, batch.page_table)
    view = pools.gdn.gather(batch.slot)
    fresh = batch.start == 0
    view = jax.tree.map(lambda a: jnp.where(fresh.reshape(-1, *([1] * (a.ndim - 1))), 0, a), view)
    snapshot = batch.snap_at.shape[1] > 0 and has_snapshots(pools)
    states = None
    if snapshot and entry_of(model.cfg).prefill_snapshots:
        rows = jnp.clip(prefill_targets(batch)[0], 0, t)
        hidden, kv, view, states = model(batch.input_ids, abatch, pools.kv, view, "prefill",
                                         state_rows=rows)
    else:
        hidden, kv, view = model(batch.input_ids, abatch, pools.kv, view, "prefill")
    last = jnp.maximum(batch.length - 1, 0)
    h_last = row_at(hidden, last)
    logits_last = model.logits(h_last)
    first = sample(logits_last, batch.sampling, batch.step, salt=SALT_SAMPLE,
                   greedy_only=greedy_only)
    pools = dataclasses.replace(pools, kv=kv, gdn=pools.gdn.scatter(batch.slot, view))
    if snapshot:
        pools = save_prefill_snapshots(pools, batch, view, states, hidden)
    counts = None
    if variant.penalties:
        ends = (batch.length > 0) & (batch.start + batch.length == batch.prompt_len)
        pools = dataclasses.replace(pools, output_counts=first_counts(
            pools.output_counts, batch.slot, first, ends))
        counts = pools.output_counts[batch.slot]
    drafts = None
    if variant.mtp:
        pools = redraft_row(model, pools, batch, hidden.dtype)
        is_final = pos == (batch.prompt_len - 1)[:, None]
        next_ids = jnp.where(is_final, first[:, None], batch.next_ids)
        end = batch.start + batch.length
        limit = batch.page_table.shape[1] * pools.kv.page_size * jnp.ones_like(end)
        if variant.drafts:
            drafts, pools = mtp_drafts(model, pools, hidden, next_ids, abatch, last,
                                       batch.step + 1, end, limit, batch.sampling, k,
                                       greedy_only, kv_only=True, counts=counts)
        else:  # the draft KV over the rows only; the drafts stay stale
            pools = dataclasses.replace(pools, draft_kv=write_draft_kv(
                model, pools.draft_kv, hidden, next_ids, abatch))
    pools = store_next_tokens(pools, batch.slot, first, drafts, k,
                              fill=-1 if variant.mtp else 0)
    pools = dataclasses.replace(
        pools, position=pools.position.at[batch.slot].set(batch.start + batch.length),
        step=pools.step.at[batch.slot].set(jnp.ones_like(batch.slot)))
    out = pools.next_tokens[batch.slot]
    if variant.logprobs >= 0:  # the first token's log-probabilities after its drafts
        out = jnp.concatenate([out, logprob_columns(
            logits_last[:, None], first[:, None], batch.sampling, variant.logprobs,
            filtering=False if greedy_only else None)], 1)
    return out, pools


def one_round(graphdef, params, pools: Pools, batch: RoundBatch, variant: RoundVariant,
              first=True):
    """One verify/accept/commit(/draft) round (``variant.rounds`` is not read here);
    ``first``: whether it is the call's first round (``batch.first_cap`` caps its drafts,
    ``batch.draft_cap`` those of the others).

    The variant's static choices (:class:`~mtp_jax.engine.variants.RoundVariant`):
    ``proposer`` (``none | mtp | external``), ``greedy_only`` (every row greedy: no sampling
    path traced), ``filtering`` (some row samples: ``True`` when some row filters by top-k /
    top-p, ``False`` when none does; traced without run-time tests; ``None``: tested at run
    time) and ``snapshot`` (some row crosses a prefix-cache boundary: the snapshot replay is
    traced). Choosing them on the host keeps data-dependent conditionals, which synchronise the
    GPU with the host and split its command buffers, out of the round.

    Row b starts at the slot's ``Pools.position`` and verifies ``num_draft[b] <= k`` drafts
    (:func:`~mtp_jax.speculative.clamp.clamp_drafts`): verify rows past it, and every write at
    or past ``limit[b]``, go to the trash page, and the acceptance ignores those drafts. The
    slot's position and step advance by the tokens committed (live rows only). ``variant.k``
    may be below the engine's k (the width of ``Pools.next_tokens`` less one): a plain call
    of adaptive speculation (:func:`_plain_round_drafts`); a drafting round after one verifies
    no stale draft. With ``k = 0``
    and no snapshot, a model whose ``gdn_modes`` has ``"decode"`` runs its GDN layers in the
    decode form (new states returned directly, equal to verify + commit of the row), so no
    commit is traced; other models take the verify + commit path. ``variant.penalties``:
    the logits the acceptance, the sampling and the log-probabilities read are penalised over
    the slot's output counts and the drafts before each row
    (:func:`~mtp_jax.sampling.penalties.verify_penalties`), the committed tokens are added to
    the counts, and the MTP draft penalises its drafts.
    Returns ``(RoundOutput, pools)``.
    """
    k, proposer, snapshot = variant.k, variant.proposer, variant.snapshot
    greedy_only, filtering = variant.greedy_only, variant.filtering
    model = nnx.merge(graphdef, params)
    b = batch.slot.shape[0]
    pool_k = pools.next_tokens.shape[1] - 1  # the engine's k; a plain call has k = 0
    if proposer == "external":
        tokens = batch.tokens
    else:
        tokens = pools.next_tokens[batch.slot][:, :k + 1]
    position, step = pools.position[batch.slot], pools.step[batch.slot]
    num_draft = clamp_drafts(k, position, step, batch.limit, batch.max_step)
    num_draft = jnp.minimum(num_draft, jnp.where(first, batch.first_cap, batch.draft_cap))
    if k and proposer == "mtp":  # drafts a plain round left stale (-1): verify none of them
        num_draft = jnp.where(tokens[:, 1] < 0, 0, num_draft)
        tokens = jnp.maximum(tokens, 0)
    rows_idx = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    pos = position[:, None] + rows_idx
    valid = batch.live[:, None] & (rows_idx <= num_draft[:, None]) & (
        pos < batch.limit[:, None])
    abatch = AttentionBatch(pos, valid, batch.page_table)
    # k = 0: the GDN layers' decode form returns the new states directly, equal to verify +
    # commit of the one row (not-valid rows keep theirs), so no commit runs (a snapshot saves
    # those states). The layers address the state pools by slot (the fused Pallas kernels in
    # place; the XLA path gathers and scatters per layer).
    decode = k == 0 and "decode" in getattr(model, "gdn_modes", ())
    hidden, kv, rows = model(tokens, abatch, pools.kv, pools.gdn,
                             "decode" if decode else "verify", slots=batch.slot)
    logits = model.logits(hidden)  # [B, k+1, V]
    if variant.penalties:
        logits = verify_penalties(logits, pools.output_counts[batch.slot], tokens[:, 1:],
                                  batch.sampling)
    if k:
        q = pools.draft_probs[batch.slot] if proposer == "mtp" else None
        n, emitted = accept(logits, tokens[:, 1:], q, batch.sampling, step,
                            num_draft=num_draft, greedy_only=greedy_only, filtering=filtering)
    else:
        n = jnp.zeros((b,), jnp.int32)
        # a plain call of a speculative engine draws as a round that verified no draft
        # (accept's residual stream), so that a request's tokens do not depend on whether
        # another request drafted in the call
        salt = SALT_RESIDUAL if pool_k else SALT_SAMPLE
        emitted = sample(logits[:, 0], batch.sampling, step, salt=salt,
                         greedy_only=greedy_only, filtering=filtering)[:, None]
    commit_len = jnp.where(batch.live, n + 1, 0)
    if snapshot:
        pools = save_round_snapshots(model, pools, rows, batch, position, num_draft, decode,
                                     hidden)
    gdn = rows if decode else model.commit(pools.gdn, rows, commit_len, slots=batch.slot)
    pools = dataclasses.replace(pools, kv=kv, gdn=gdn)
    bonus = row_at(emitted, n)
    counts = None
    if variant.penalties:
        pools = dataclasses.replace(pools, output_counts=add_tokens(
            pools.output_counts, batch.slot, emitted, batch.live[:, None] & (emitted >= 0)))
        counts = pools.output_counts[batch.slot]
    drafts = None
    if proposer == "mtp" and k:
        next_ids = jnp.maximum(emitted, 0)  # x_{c+i+1} for rows i <= n; later rows are rewritten
        live_limit = jnp.where(batch.live, batch.limit, 0)
        drafts, pools = mtp_drafts(model, pools, hidden, next_ids, abatch, n,
                                   step + n + 1, position + n + 1, live_limit,
                                   batch.sampling, k, greedy_only, filtering, counts=counts)
    if k < pool_k:  # a plain call of a speculative engine (adaptive speculation)
        pools = _plain_round_drafts(model, pools, hidden, emitted, abatch, batch.slot, bonus,
                                    proposer, pool_k)
    else:
        pools = store_next_tokens(pools, batch.slot, bonus, drafts, k)
    advance = jnp.where(batch.live, n + 1, 0)
    pools = dataclasses.replace(pools, position=pools.position.at[batch.slot].add(advance),
                                step=pools.step.at[batch.slot].add(advance))
    cols = [emitted, n[:, None], num_draft[:, None]]
    if variant.logprobs >= 0:  # emitted[:, j] was drawn from the target's row j
        cols.append(logprob_columns(logits, emitted, batch.sampling, variant.logprobs,
                                    filtering=False if greedy_only else filtering))
    return RoundOutput(jnp.concatenate(cols, 1), variant.logprobs), pools


def rounds(graphdef, params, pools: Pools, batch: RoundBatch, variant: RoundVariant):
    """``variant.rounds`` consecutive :func:`one_round` calls over the same batch in one
    program (multi-step scheduling: the host's per-call cost is paid once for that many
    rounds). Each round reads the positions, generated-token counts and pending tokens the
    previous one left in the pools, so the tokens equal those of separate calls. The host must
    have allocated pages for every round (``limit``); rounds past a request's stop compute
    tokens the host discards.

    Returns ``(RoundOutput with readback [rounds, B, k+3], pools)``."""
    if variant.rounds == 1:
        out, pools = one_round(graphdef, params, pools, batch, variant)
        return RoundOutput(out.readback[None], out.top), pools

    def body(pools, index):
        out, pools = one_round(graphdef, params, pools, batch, variant, first=index == 0)
        return pools, out.readback

    # One compiled round body; unrolling ran no faster on the H200 (docs/benchmarks.md).
    pools, readback = jax.lax.scan(body, pools, jnp.arange(variant.rounds))
    return RoundOutput(readback, variant.logprobs), pools


@dataclasses.dataclass(frozen=True, eq=False)
class Programs:
    """The jitted programs of one model structure.

    The graphdef is closed over (hashing it per call as a static argument costs milliseconds)
    and the parameters travel as a flat tuple of arrays; the batch (numpy arrays) travels as one
    packed int32 buffer (:mod:`mtp_jax.engine.packing`, its layout a static argument), so a
    call costs one host-to-device copy. Pools are donated. Shapes and the variant
    (:mod:`mtp_jax.engine.variants`) key the compile caches: one program per bucket and
    variant.

    With ``executables`` (what :func:`programs_for` gives), calls run the compiled program of
    their shapes from an :class:`~mtp_jax.engine.executable_cache.ExecutableTable`: loaded from
    the executable cache on disk without tracing when it is there, else traced, compiled and
    saved (nothing on disk when the compilation cache is ``none``). The jitted functions stay
    the reference (``.lower`` for inspection) and serve calls when ``executables`` is None.
    """

    prefill_jit: object
    round_jit: object
    treedef: object
    executables: object = None  # ExecutableTable | None

    def prefill(self, leaves, pools, batch: PrefillBatch, variant: PrefillVariant):
        """:func:`prefill` on a batch of numpy arrays; returns ``(first_token, pools)``."""
        buf, layout = pack(batch)
        if self.executables is not None:
            return self.executables.call("prefill", self.prefill_jit, leaves, pools, buf, layout,
                                         variant)
        return self.prefill_jit(leaves, pools, buf, layout=layout, variant=variant)

    def round(self, leaves, pools, batch: RoundBatch, variant: RoundVariant):
        """:func:`rounds` on a batch of numpy arrays; returns ``(RoundOutput, pools)``
        (``readback [variant.rounds, B, k+3]``)."""
        buf, layout = pack(batch)
        if self.executables is not None:
            return self.executables.call("round", self.round_jit, leaves, pools, buf, layout,
                                         variant)
        return self.round_jit(leaves, pools, buf, layout=layout, variant=variant)

    def compiled_count(self) -> int:
        """Programs compiled or loaded so far: the jit caches plus the executable table."""
        n = self.prefill_jit._cache_size() + self.round_jit._cache_size()
        return n + (len(self.executables) if self.executables is not None else 0)


def make_programs(graphdef, params, packing: ParamPacking | None = None,
                  persist: bool = True) -> Programs:
    """The programs of a model. ``packing``: a
    :class:`~mtp_jax.engine.param_packing.ParamPacking` when the calls pass its packed
    arguments (``packing.pack(leaves)``) instead of one buffer per parameter; ``persist``:
    whether the executable cache may save and load them (not for programs with host
    callbacks, which cannot be serialized)."""
    treedef = jax.tree_util.tree_structure(params)
    unpack_params = (lambda leaves: leaves) if packing is None else packing.unpack
    params_of = lambda leaves: jax.tree_util.tree_unflatten(treedef, unpack_params(leaves))

    def prefill_(leaves, pools, buf, *, layout, variant):
        return prefill(graphdef, params_of(leaves), pools, unpack(buf, layout), variant)

    def round_(leaves, pools, buf, *, layout, variant):
        return rounds(graphdef, params_of(leaves), pools, unpack(buf, layout), variant)

    return Programs(
        prefill_jit=jax.jit(prefill_, static_argnames=("layout", "variant"), donate_argnums=(1,)),
        round_jit=jax.jit(round_, static_argnames=("layout", "variant"), donate_argnums=(1,)),
        treedef=treedef, executables=ExecutableTable(graphdef, persist))


@dataclasses.dataclass(frozen=True, eq=False)
class ModelPrograms:
    """What an engine calls its programs with: the :class:`Programs` and the parameter
    arguments (``leaves``: the model's parameter leaves, or their packed form when the model
    was loaded with ``pack_small_params``)."""

    programs: Programs
    leaves: tuple
    constants: tuple = ()  # the changed traced constants they were made under (sorted items)


# Programs live as long as the model they were made for: every engine on one model shares them
# (and their compile caches). Models of one structure (the derived models of
# mtp_jax.models.draft_head.with_draft_head: a hot head's ids are a parameter) share them too.
_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def programs_for(model) -> ModelPrograms:
    """The programs of ``model`` (a loaded model: ``graphdef``, ``params``,
    ``pack_small_params``), made on the first call and shared by every engine on it and on
    any live model of the same structure (graphdef, parameter tree, packing, parameter shapes
    and dtypes: e.g. draft heads of two sizes get programs of their own) made under the same
    changed traced constants (:data:`mtp_jax.engine.executable_key.CHANGED_CONSTANTS`: two
    ``python -m mtp_jax.bench ab`` variants of one model do not share programs)."""
    got = _BY_MODEL.get(model)
    if got is not None:
        return got
    packing = ParamPacking.plan(model.params) if model.pack_small_params else None
    leaves = tuple(jax.tree_util.tree_leaves(model.params))
    leaves = leaves if packing is None else packing.pack(leaves)
    treedef = jax.tree_util.tree_structure(model.params)
    shapes = [(a.shape, a.dtype) for a in leaves]  # the executables are keyed without them
    constants = tuple(sorted(CHANGED_CONSTANTS.items()))
    programs = None
    for other, mp in list(_BY_MODEL.items()):
        if (other.pack_small_params == model.pack_small_params and mp.constants == constants
                and mp.programs.treedef == treedef
                and other.graphdef == model.graphdef
                and [(a.shape, a.dtype) for a in mp.leaves] == shapes):
            programs = mp.programs
            break
    if programs is None:
        programs = make_programs(model.graphdef, model.params, packing,
                                 persist=not model.host_callbacks)
    got = ModelPrograms(programs, leaves, constants)
    _BY_MODEL[model] = got
    return got
