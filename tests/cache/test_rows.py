"""``set_rows`` (``mtp_jax.cache.rows``): rows addressed to the trash id write nothing and the
others land as a numpy loop puts them, for the pools' dtypes (the pool is compared whole,
trash row included, so a write of a padding row shows up)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.cache.rows import dropped, set_rows


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_set_rows_leaves_the_trash_row_alone(dtype):
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((6, 3, 2)).astype(dtype)
    index = np.array([0, 4, 0, 2, 5, 0], np.int32)  # three padding rows on trash id 0
    rows = rng.standard_normal((6, 3, 2)).astype(np.float32)
    want = pool.copy()
    for i, r in zip(index, rows):
        if i != 0:
            want[i] = r.astype(dtype)
    got = np.asarray(set_rows(jnp.asarray(pool), jnp.asarray(index), jnp.asarray(rows)))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == pool.dtype


def test_set_rows_other_trash_id_and_dropped():
    pool = jnp.zeros((4, 2), jnp.float32)
    got = set_rows(pool, jnp.array([3, 1], jnp.int32), jnp.ones((2, 2)), trash=3)
    np.testing.assert_array_equal(np.asarray(got), [[0, 0], [1, 1], [0, 0], [0, 0]])
    np.testing.assert_array_equal(np.asarray(dropped(jnp.array([2, 5]), jnp.array([True, False]),
                                                     9)), [2, 9])
