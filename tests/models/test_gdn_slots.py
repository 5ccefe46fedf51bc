"""The model's GDN layers addressing the state pools by slot (what a speculative round does)
against the same steps on a gathered batch view, for both GDN backends (``pallas``: the fused
kernels in interpret mode on CPU).

Checks: a decode step and a verify window + partial commit on the pools at shuffled slots give
the hidden states of the batch-view path and write exactly the view path's new states at those
slots, leaving every other slot unchanged bitwise.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.cache.pools import make_pools
from mtp_jax.models.layers.gdn import GDNConvRows, GDNRows
from tests.helpers.model_backends import with_backend
from tests.models.test_gdn_decode import tiny  # noqa: F401 (fixture)

B, SLOTS, PROMPT = 3, 6, 5


def _prefilled(model, rng):
    """Pools with random GDN states in every slot (fresh values, not zeros) and a prefilled KV
    for ``B`` requests; returns ``(pools, table, slots)``."""
    cfg = model.cfg
    pools = make_pools(cfg, num_pages=1 + B * 2, page_size=8, slots=SLOTS, k=0, mtp=False,
                       dtype=jnp.float32)
    rand = lambda a, scale: jnp.asarray(scale * rng.standard_normal(a.shape), a.dtype)
    gdn = pools.gdn
    gdn = type(gdn)(tuple(rand(a, 0.3) for a in gdn.recurrent),
                    tuple(rand(a, 1.0) for a in gdn.conv))
    table = jnp.asarray(1 + np.arange(B * 2).reshape(B, 2), jnp.int32)
    ids = jnp.asarray(rng.integers(2, cfg.vocab_size, (B, PROMPT)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (B, PROMPT))
    slots = jnp.asarray(rng.permutation(np.arange(1, SLOTS))[:B], jnp.int32)
    _, kv, view = model(ids, AttentionBatch(pos, jnp.ones((B, PROMPT), bool), table),
                        pools.kv, gdn.gather(slots), "prefill")
    return gdn.scatter(slots, view), kv, table, slots


def _check_pool(new_pool, old_pool, slots, view):
    others = np.setdiff1d(np.arange(SLOTS), np.asarray(slots))
    for new, old, v in zip(new_pool.recurrent + new_pool.conv, old_pool.recurrent + old_pool.conv,
                           view.recurrent + view.conv):
        np.testing.assert_array_equal(np.asarray(new)[others], np.asarray(old)[others])
        np.testing.assert_allclose(np.asarray(new)[np.asarray(slots)], np.asarray(v),
                                   rtol=1e-5, atol=1e-6)
        assert not np.allclose(np.asarray(new)[np.asarray(slots)],
                               np.asarray(old)[np.asarray(slots)])


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_slot_addressed_steps_equal_batch_view_steps(tiny, backend):  # noqa: F811
    model = with_backend(tiny, "gdn", backend)
    rng = np.random.default_rng(11)
    gdn, kv, table, slots = _prefilled(model, rng)
    cfg = model.cfg

    # Decode: one row per request, the second request's row not valid (keeps its state).
    tok = jnp.asarray(rng.integers(2, cfg.vocab_size, (B, 1)), jnp.int32)
    valid = jnp.asarray([[True], [False], [True]])
    step = AttentionBatch(jnp.full((B, 1), PROMPT, jnp.int32), valid, table)
    h_pool, _, pool = model(tok, step, kv, gdn, "decode", slots=slots)
    h_view, _, view = model(tok, step, kv, gdn.gather(slots), "decode")
    np.testing.assert_allclose(np.asarray(h_pool), np.asarray(h_view), rtol=1e-5, atol=1e-6)
    for new, old in zip(pool.recurrent + pool.conv, gdn.recurrent + gdn.conv):
        np.testing.assert_array_equal(np.asarray(new)[np.asarray(slots[1])],
                                      np.asarray(old)[np.asarray(slots[1])])
    view = type(gdn)(*(tuple(a.at[1].set(o[slots[1]]) for a, o in zip(vs, os_))
                       for vs, os_ in ((view.recurrent, gdn.recurrent), (view.conv, gdn.conv))))
    _check_pool(pool, gdn, slots, view)

    # Verify a 3-row window and commit 3, 0 and 2 rows.
    t = 3
    ids = jnp.asarray(rng.integers(2, cfg.vocab_size, (B, t)), jnp.int32)
    win = AttentionBatch(PROMPT + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t)),
                         jnp.ones((B, t), bool), table)
    length = jnp.asarray([3, 0, 2], jnp.int32)
    h_pool, _, rows = model(ids, win, kv, gdn, "verify", slots=slots)
    kind = GDNConvRows if backend == "pallas" else GDNRows
    assert all(isinstance(r, kind) for r in rows)
    h_view, _, rows_v = model(ids, win, kv, gdn.gather(slots), "verify")
    np.testing.assert_allclose(np.asarray(h_pool), np.asarray(h_view), rtol=1e-5, atol=1e-6)
    pool = model.commit(gdn, rows, length, slots=slots)
    view = model.commit(gdn.gather(slots), rows_v, length)
    untouched = np.asarray(slots[1])
    for new, old in zip(pool.recurrent + pool.conv, gdn.recurrent + gdn.conv):
        np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(old)[untouched])
    keep = np.asarray([0, 2])
    for new, v in zip(pool.recurrent + pool.conv, view.recurrent + view.conv):
        np.testing.assert_allclose(np.asarray(new)[np.asarray(slots)[keep]], np.asarray(v)[keep],
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="slots: prefill"):
        model(ids, win, kv, gdn, "prefill", slots=slots)


def test_fused_pallas_steps_match_the_xla_reference(tiny):  # noqa: F811
    """The same decode step and verify + commit on the pools, through the fused Pallas kernels
    (interpret mode) and through the XLA reference: hidden states and new pools agree."""
    out = {}
    for backend in ("xla", "pallas"):
        model = with_backend(tiny, "gdn", backend)
        rng = np.random.default_rng(13)  # the same pools, tokens and slots for both
        gdn, kv, table, slots = _prefilled(model, rng)
        tok = jnp.asarray(rng.integers(2, model.cfg.vocab_size, (B, 1)), jnp.int32)
        step = AttentionBatch(jnp.full((B, 1), PROMPT, jnp.int32), jnp.ones((B, 1), bool), table)
        h_d, _, pool_d = model(tok, step, kv, gdn, "decode", slots=slots)
        ids = jnp.asarray(rng.integers(2, model.cfg.vocab_size, (B, 4)), jnp.int32)
        win = AttentionBatch(PROMPT + jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (B, 4)),
                             jnp.ones((B, 4), bool), table)
        h_v, _, rows = model(ids, win, kv, gdn, "verify", slots=slots)
        pool_c = model.commit(gdn, rows, jnp.asarray([4, 1, 2], jnp.int32), slots=slots)
        out[backend] = [h_d, h_v] + list(pool_d.recurrent + pool_d.conv + pool_c.recurrent
                                          + pool_c.conv)
    for a, b in zip(out["pallas"], out["xla"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
