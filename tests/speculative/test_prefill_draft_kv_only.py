"""A prefill's draft extend (:func:`mtp_jax.speculative.mtp.mtp_drafts` with ``kv_only``: the
draft KV of every chunk row from ``MTPDraft.write_kv``, the whole draft step on the pick row
alone) against the whole draft step over every row, for each family on the same random
inputs: the same drafts ``d_1..d_k``, and every draft page (K, V, and for qwen4_exp the raw
index keys) equal within float32 rounding, untouched entries unchanged. Float32, tiny fixtures.

Teeth (each seen to fail, both families): the pick row's step run at the chunk's first
position instead of the pick's, or fed the first row's hidden; the other rows' KV not written.
And the prefill program without drafts against the one with them (the last test).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.prefill_batch import ChunkRow, prefill_batch
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from mtp_jax.models.registry import entry_of
from mtp_jax.speculative.mtp import mtp_drafts
from tests.helpers.paths import fixture_path

K = 3
PAGE = 4
# request 0 prefills positions 5..9 (pick: its last row, 9); request 1 positions 2..4, its
# last two rows padding (pick 3); request 2 is a padding request (length 0: pick row 0,
# invalid; its page table all trash, as the engine pads a batch)
POSITIONS = np.array([[5, 6, 7, 8, 9], [2, 3, 4, 5, 6], [0, 1, 2, 3, 4]], np.int32)
VALID = np.array([[True] * 5, [True, True, True, False, False], [False] * 5])
PICK = np.array([4, 2, 0], np.int32)  # the last valid row
TABLE = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0]], np.int32)
NUM_PAGES = 9  # page 0 is the trash page


@functools.partial(jax.jit, static_argnums=(0, 1))
def _extend(graphdef, kv_only: bool, params, pools, hidden, next_ids, batch):
    model = nnx.merge(graphdef, params)
    end = jnp.asarray(POSITIONS[:, 0] + VALID.sum(1), jnp.int32)
    limit = jnp.full_like(end, TABLE.shape[1] * PAGE)
    (drafts, _), pools = mtp_drafts(model, pools, hidden, next_ids, batch, jnp.asarray(PICK),
                                    jnp.ones_like(end), end, limit, None, K, True,
                                    kv_only=kv_only)
    return drafts, pools.draft_kv


@pytest.mark.parametrize("ckpt", ["tiny_moe_fused", "tiny_qwen4_exp"])
def test_kv_only_extend_drafts_and_writes_as_the_whole_step(ckpt):
    m = load_model(fixture_path(ckpt), "float32", with_mtp=True)
    mtp = nnx.merge(m.graphdef, m.params).mtp
    rng = np.random.default_rng(1)
    width = mtp.pre_fc_norm_hidden.weight.shape[0]  # H, or hc*H (qwen4_exp's streams)
    hidden = jnp.asarray(rng.normal(0, 1, (*POSITIONS.shape, width)), jnp.float32)
    next_ids = jnp.asarray(rng.integers(0, m.cfg.vocab_size, POSITIONS.shape), jnp.int32)
    batch = AttentionBatch(jnp.asarray(POSITIONS), jnp.asarray(VALID), jnp.asarray(TABLE))
    pools = entry_of(m.cfg).make_pools(m.cfg, num_pages=NUM_PAGES, page_size=PAGE, slots=3,
                                       k=K, mtp=True, dtype=jnp.float32)
    before = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 1, a.shape), a.dtype),
                          pools.draft_kv)
    pools = dataclasses.replace(pools, draft_kv=before)
    want_drafts, want = _extend(m.graphdef, False, m.params, pools, hidden, next_ids, batch)
    got_drafts, got = _extend(m.graphdef, True, m.params, pools, hidden, next_ids, batch)
    np.testing.assert_array_equal(np.asarray(got_drafts)[:2], np.asarray(want_drafts)[:2])
    for old, w, g in zip(*(map(np.asarray, jax.tree.leaves(t)) for t in (before, want, got))):
        live = np.ones(w.shape[0], bool)
        live[0] = False  # the trash page takes padding rows in either order
        np.testing.assert_allclose(g[live], w[live], rtol=1e-5, atol=1e-5)
        assert (w[live] != old[live]).any()  # the extend wrote something there


@pytest.mark.parametrize("ckpt", ["tiny_trained", "tiny_qwen4_exp"])
def test_prefill_without_drafts_writes_the_drafting_prefills_draft_kv(ckpt):
    """The prefill variant without drafts (``PrefillVariant.drafts`` False, for calls whose
    drafts no round would verify) against the drafting one on the same batch: the same first
    tokens, the drafts left stale (-1), and the draft KV (for qwen4_exp the index keys too) at
    every prompt position equal within float32 rounding, the last row paired with the first
    token. Teeth: that row paired with the chunk's next ids (0 past the prompt) fails."""
    m = load_model(fixture_path(ckpt), "float32", with_mtp=True)
    eng = Engine(m, EngineConfig(max_running_requests=2, dtype="float32", page_size=PAGE,
                                 max_model_len=64, enable_prefix_cache=False,
                                 chunked_prefill_size=32),
                 SpeculativeConfig(algorithm="mtp", num_steps=K, adaptive=False))
    sched, dev = eng.scheduler, eng.scheduler.device
    rng = np.random.default_rng(3)
    reqs = [Request(request_id=str(i), index=i, prompt=None, seed=i,
                    prompt_ids=rng.integers(1, m.cfg.vocab_size, n).tolist(),
                    params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            for i, n in enumerate((13, 7))]
    for r in reqs:
        sched.add(r)
        sched.admit(r)
    rows = [ChunkRow(r, 0, len(r.prompt_ids)) for r in reqs]
    batch = prefill_batch(rows, sched.prefill_shape(2, 13), sched.book, None, K)
    drafting = sched.prefill_variant(reqs)
    assert drafting.drafts
    start = jax.tree.map(jnp.copy, dev.pools)
    outs, kvs = [], []
    for variant in (drafting, dataclasses.replace(drafting, drafts=False)):
        dev.pools = jax.tree.map(jnp.copy, start)
        outs.append(np.asarray(dev.prefill(batch, variant)))
        kvs.append([np.asarray(a) for a in jax.tree.leaves(dev.pools.draft_kv)])
    np.testing.assert_array_equal(outs[1][:2, 0], outs[0][:2, 0])
    assert (outs[0][:2, 1:] >= 0).all() and (outs[1][:2, 1:] == -1).all()
    for i, r in enumerate(reqs):
        pos = np.arange(len(r.prompt_ids))
        pages, offsets = batch.page_table[i, pos // PAGE], pos % PAGE
        for want, got in zip(*kvs):
            np.testing.assert_allclose(got[pages, offsets], want[pages, offsets],
                                       rtol=1e-5, atol=1e-5)
