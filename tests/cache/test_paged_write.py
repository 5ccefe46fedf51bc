"""``write_kv`` (``mtp_jax.cache.paged``): the K/V rows land where a numpy loop over the page
table puts them, and invalid rows and rows whose page is the trash page write nothing (the
whole pool, trash page included, is compared); and a one-row write followed by the reference
attention's page gather, pools donated, compiles without a copy of the pool (XLA-CPU copied it
four times per call when the write went through a ``[P * page_size, ...]`` reshape)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.cache.paged import TRASH_PAGE, AttentionBatch, write_kv
from pallas_kernels.paged_attention.reference import paged_attention_reference


def _numpy_write(pages, new, positions, valid, table):
    out = pages.copy()
    page_size = pages.shape[1]
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            pos = positions[b, t]
            page = table[b, pos // page_size]
            if valid[b, t] and page != TRASH_PAGE:
                out[page, pos % page_size] = new[b, t]
    return out


@pytest.mark.parametrize("b,t", [(1, 1), (3, 1), (2, 4), (1, 13)])
def test_write_kv_matches_numpy(b, t):
    rng = np.random.default_rng(b * 100 + t)
    page_size, max_pages, hkv, d = 4, 5, 2, 3
    num_pages = 1 + b * max_pages
    pages = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    table = (1 + rng.permutation(b * max_pages)).reshape(b, max_pages).astype(np.int32)
    start = rng.integers(0, page_size * max_pages - t + 1, b)
    positions = (start[:, None] + np.arange(t)).astype(np.int32)
    valid = rng.random((b, t)) < 0.8
    valid[:, 0] = True
    if b * t > 1:
        valid[-1, -1] = False  # at least one invalid row
    if t > 1:  # a valid row past the request's pages (the table's tail is the trash page)
        table[0, positions[0, -1] // page_size] = TRASH_PAGE
    new = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    got = write_kv(jnp.asarray(pages), jnp.asarray(new),
                   AttentionBatch(jnp.asarray(positions), jnp.asarray(valid), jnp.asarray(table)))
    want = _numpy_write(pages, new, positions, valid, table)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_one_row_write_then_gather_does_not_copy_the_pool():
    num_pages, page_size, hkv, d, hq = 257, 16, 2, 8, 4
    shape = (num_pages, page_size, hkv, d)

    def step(pools, q, new, batch):
        k_pages = write_kv(pools[0], new, batch)
        v_pages = write_kv(pools[1], new, batch)
        out = paged_attention_reference(q, k_pages, v_pages, batch.page_table,
                                        batch.positions, scale=d ** -0.5)
        return out, (k_pages, v_pages)

    pools = (jnp.zeros(shape), jnp.zeros(shape))
    batch = AttentionBatch(jnp.array([[5]], jnp.int32), jnp.ones((1, 1), bool),
                           jnp.arange(1, 9, dtype=jnp.int32)[None])
    hlo = jax.jit(step, donate_argnums=0).lower(
        pools, jnp.zeros((1, 1, hq, d)), jnp.ones((1, 1, hkv, d)), batch).compile().as_text()
    pool = r"f32\[{}\]".format(",".join(map(str, shape)))
    copies = re.findall(rf"= {pool}[^ ]* copy\(", hlo)
    assert copies == [], f"{len(copies)} whole-pool copies per call"
