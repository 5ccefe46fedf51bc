"""``MTPDraft.write_kv`` of each family (what a plain round of adaptive speculation writes,
:func:`mtp_jax.engine.programs._plain_round_drafts`) against the whole draft step
(``MTPDraft.__call__``, step 0) on the same random inputs: every draft page it writes (K, V, and
for qwen4_exp the raw index keys) equals the step's at the valid rows' positions, and every
other entry keeps its random value (the padding row's goes to the trash page). Float32, tiny
fixtures; one compile of each program per family.

Teeth (each seen to fail): qwen4_exp's ``write_kv`` leaving the index pages unwritten, or
projecting K/V from ``u``'s first stream instead of the hyper-connection's mix, or roping K at
position + 1; qwen3_5's skipping ``input_layernorm``; either writing the padding row too.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.cache.paged import TRASH_PAGE, AttentionBatch
from mtp_jax.models.loader import load_model
from mtp_jax.models.registry import entry_of
from tests.helpers.paths import fixture_path

PAGE = 4
# request 0 writes positions 5..7 (pages 1, 2); request 1 positions 2..3, its third row padding
POSITIONS = np.array([[5, 6, 7], [2, 3, 4]], np.int32)
VALID = np.array([[True, True, True], [True, True, False]])
TABLE = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
NUM_PAGES = 7  # page 0 is the trash page


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draft_pages(graphdef, whole: bool, params, hidden, next_ids, batch, draft):
    """The draft pages after the whole draft step (``whole``) or after ``write_kv``."""
    model = nnx.merge(graphdef, params)
    if whole:
        return model.mtp(model.embed_tokens, hidden, next_ids, batch, draft)[1]
    return model.mtp.write_kv(model.embed_tokens, hidden, next_ids, batch, draft)


def _written():
    """``[NUM_PAGES, PAGE]`` bool: the page entries of the valid rows."""
    mask = np.zeros((NUM_PAGES, PAGE), bool)
    for b, t in zip(*np.nonzero(VALID)):
        p = POSITIONS[b, t]
        mask[TABLE[b, p // PAGE], p % PAGE] = True
    return mask


@pytest.mark.parametrize("ckpt", ["tiny_moe_fused", "tiny_qwen4_exp"])
def test_write_kv_equals_the_draft_steps_pages(ckpt):
    m = load_model(fixture_path(ckpt), "float32", with_mtp=True)
    mtp = nnx.merge(m.graphdef, m.params).mtp
    assert hasattr(mtp, "write_kv"), ckpt  # else a plain round runs the whole draft step
    rng = np.random.default_rng(0)
    width = mtp.pre_fc_norm_hidden.weight.shape[0]  # H, or hc*H (qwen4_exp's streams)
    hidden = jnp.asarray(rng.normal(0, 1, (*POSITIONS.shape, width)), jnp.float32)
    next_ids = jnp.asarray(rng.integers(0, m.cfg.vocab_size, POSITIONS.shape), jnp.int32)
    batch = AttentionBatch(jnp.asarray(POSITIONS), jnp.asarray(VALID), jnp.asarray(TABLE))
    # the family's own draft pool (PagedKV; QSAPaged: K/V and raw index keys), random-filled
    pool = entry_of(m.cfg).make_pools(m.cfg, num_pages=NUM_PAGES, page_size=PAGE, slots=2, k=1,
                                      mtp=True, dtype=jnp.float32).draft_kv
    before = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 1, a.shape), a.dtype), pool)
    whole = _draft_pages(m.graphdef, True, m.params, hidden, next_ids, batch, before)
    got = _draft_pages(m.graphdef, False, m.params, hidden, next_ids, batch, before)
    written = _written()
    kept = ~written
    kept[TRASH_PAGE] = False  # padding rows land on the trash page
    leaves = list(zip(*(map(np.asarray, jax.tree.leaves(t)) for t in (before, whole, got))))
    per_layer = 3 if m.cfg.model_type == "qwen4_exp" else 2
    assert len(leaves) == per_layer * m.cfg.mtp_num_hidden_layers
    for old, want, new in leaves:
        np.testing.assert_allclose(new[written], want[written], rtol=1e-5, atol=1e-5)
        changed = (new[written] != old[written]).reshape(written.sum(), -1)
        assert changed.any(1).all()  # every valid row was written
        np.testing.assert_array_equal(new[kept], old[kept])
        np.testing.assert_array_equal(want[kept], old[kept])
