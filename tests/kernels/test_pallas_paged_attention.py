"""Pallas paged attention (decode / verify rows) against the XLA reference.

CPU: the kernel in interpret mode (float32, 1e-5) and its Triton lowering at real shapes.
GPU (``-m gpu``): the compiled kernel at real shapes in bfloat16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import api
from pallas_kernels.paged_attention.pallas import choose_num_splits, paged_attention_pallas
from pallas_kernels.paged_attention.reference import paged_attention_reference
from tests.helpers.triton_lowering import lower_for_cuda


def make_inputs(rng, *, written, positions, hq, hkv, d, page_size, max_pages, spare_pages=3,
                dtype=np.float32, q_gain=3.0):
    """Random paged inputs in the engine's layout, with garbage wherever no row may look.

    written[b] positions 0..written[b]-1 hold real K/V in ``ceil(written/page_size)`` pages in
    random order; the table's other entries are the trash page 0. The trash page, spare pages
    and the slots past ``written`` in a request's last page hold NaN / inf. ``q_gain`` sharpens
    the softmax so that errors in single keys show.
    """
    written = np.asarray(written)
    positions = np.asarray(positions, np.int32)
    b, t = positions.shape
    counts = -(-written // page_size)
    num_pages = 1 + int(counts.sum()) + spare_pages
    k = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    v = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    ids = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((b, max_pages), np.int32)
    used = np.zeros(num_pages, bool)
    start = 0
    for i in range(b):
        table[i, :counts[i]] = ids[start:start + counts[i]]
        used[ids[start:start + counts[i]]] = True
        start += counts[i]
        last = table[i, counts[i] - 1]
        tail = written[i] - (counts[i] - 1) * page_size  # written slots in the last page
        k[last, tail:] = np.nan
        v[last, tail:] = rng.choice([np.nan, np.inf, -np.inf], size=v[last, tail:].shape)
    k[~used] = np.nan
    v[~used] = np.nan
    q = (q_gain * rng.standard_normal((b, t, hq, d))).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(table), jnp.asarray(positions)


def window(lengths, t):
    """Positions ``L-t .. L-1`` of each request (its last t tokens: decode or verify window)."""
    return np.stack([np.arange(n - t, n) for n in lengths]).astype(np.int32)


def check(inputs, *, rows=None, atol=1e-5, **kw):
    q, k, v, table, pos = inputs
    scale = q.shape[-1] ** -0.5
    want = np.asarray(paged_attention_reference(q, k, v, table, pos, scale=scale), np.float32)
    got = np.asarray(paged_attention_pallas(q, k, v, table, pos, scale=scale, interpret=True,
                                            **kw), np.float32)
    assert got.shape == want.shape and got.dtype == want.dtype
    if rows is not None:  # compare only these (request, row) pairs
        want, got = want[rows], got[rows]
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, atol=atol, rtol=atol)


@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_every_offset_in_a_page(page_size):
    """T = 1: the row's position takes every offset within a page across the batch (16) or a
    spread of them (64), with different lengths per request; group 4."""
    rng = np.random.default_rng(page_size)
    offsets = np.arange(16) if page_size == 16 else np.array([0, 1, 15, 16, 31, 32, 62, 63])
    lengths = offsets + 1 + page_size * rng.integers(0, 5, size=offsets.size)
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, 1), hq=8, hkv=2, d=64,
                         page_size=page_size, max_pages=6)
    check(inputs)


@pytest.mark.parametrize("t", [4, 8])
def test_verify_window_every_offset(t):
    """T = k+1 consecutive rows starting at every offset of a 16-slot page (so windows straddle
    a page boundary and a 64-key block boundary); group 6; contexts of different lengths."""
    rng = np.random.default_rng(t)
    starts = np.arange(16) + 16 * rng.integers(0, 9, size=16)
    lengths = starts + t
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, t), hq=12, hkv=2, d=32,
                         page_size=16, max_pages=10)
    check(inputs, num_splits=3)


def test_head_dim_256_group_6_page_64_verify():
    """Real head size and a 64-slot page; one request spans several blocks and splits."""
    rng = np.random.default_rng(7)
    lengths = np.array([5, 64, 65, 200, 130])
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, 4), hq=6, hkv=1, d=256,
                         page_size=64, max_pages=5)
    check(inputs)


def test_verify_rows_past_the_limit_see_garbage():
    """Rows past a request's page limit (engine: ``num_draft`` clamped) sit at positions whose
    slots hold garbage or map to the trash page; the rows before must stay exact and finite."""
    rng = np.random.default_rng(3)
    t = 8
    starts = np.array([13, 40, 63, 100])
    valid = np.array([1, 3, 8, 2])  # rows c .. c+valid-1 have K/V written
    positions = starts[:, None] + np.arange(t)[None, :]
    inputs = make_inputs(rng, written=starts + valid, positions=positions, hq=8, hkv=2, d=64,
                         page_size=16, max_pages=8)
    rows = np.arange(t)[None, :] < valid[:, None]
    check(inputs, rows=rows, num_splits=2)


@pytest.mark.parametrize("block_keys,num_splits", [(16, 1), (32, 5), (128, 2)])
def test_block_and_split_choices_agree(block_keys, num_splits):
    """Other key-block sizes and split counts (including more splits than blocks)."""
    rng = np.random.default_rng(block_keys)
    lengths = np.array([3, 77, 160])
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, 2), hq=4, hkv=1, d=64,
                         page_size=16, max_pages=12)
    check(inputs, block_keys=block_keys, num_splits=num_splits)


@pytest.mark.parametrize("heads_per_program,prefetch_pages,t", [
    (2, False, 1), (4, False, 4), (1, True, 1), (2, True, 4), (4, True, 1)])
def test_head_groups_and_page_prefetch_agree(heads_per_program, prefetch_pages, t):
    """Several kv heads per program and the next block's page ids read ahead: the same
    attention, with garbage past every request's keys (the clean and sanitized loops both run,
    a split may be empty, the prefetch past the last block reads the table's last block)."""
    rng = np.random.default_rng(10 * heads_per_program + t)
    lengths = np.array([5, 77, 160, 64])
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, t), hq=8, hkv=4, d=32,
                         page_size=16, max_pages=11)
    check(inputs, heads_per_program=heads_per_program, prefetch_pages=prefetch_pages,
          block_keys=32, num_splits=3)


def test_long_tables_take_the_long_launch(monkeypatch):
    """From ``LONG_TABLE_KEYS`` keys of table on, the kernel's default launch is the ``LONG_*``
    one (heads per program capped to a divisor of Hkv), and it gives the same attention."""
    from pallas_kernels.paged_attention import pallas as kernel

    short = kernel.Launch(kernel.SHORT_NUM_STAGES, 1, bool(kernel.SHORT_PREFETCH_PAGES), 4,
                          kernel.SHORT_FOUR_WARP_ROWS)
    monkeypatch.setattr(kernel, "LONG_TABLE_KEYS", 0)
    assert kernel.default_launch(4, 1 << 20) == short
    monkeypatch.setattr(kernel, "LONG_TABLE_KEYS", 160)
    monkeypatch.setattr(kernel, "LONG_HEADS_PER_PROGRAM", 4)
    assert kernel.default_launch(4, 159) == short
    assert kernel.default_launch(4, 160) == (
        kernel.LONG_NUM_STAGES, 4, bool(kernel.LONG_PREFETCH_PAGES),
        kernel.LONG_PROGRAMS_PER_SM, kernel.LONG_FOUR_WARP_ROWS)
    assert kernel.default_launch(2, 160)[1] == 2 and kernel.default_launch(1, 160)[1] == 1
    assert kernel.default_launch(6, 160)[1] == 2
    rng = np.random.default_rng(5)
    lengths = np.array([9, 150])
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, 2), hq=8, hkv=4, d=32,
                         page_size=16, max_pages=10)  # 160 keys: the long launch
    check(inputs, num_splits=2)


def test_head_groups_must_divide_the_kv_heads():
    q, pages = jnp.zeros((1, 1, 8, 64)), jnp.zeros((4, 16, 4, 64))
    table, pos = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    for g in (0, 3, 8):
        with pytest.raises(ValueError, match=f"heads_per_program {g} must be a power of two "
                                             "dividing Hkv = 4"):
            paged_attention_pallas(q, pages, pages, table, pos, scale=0.1,
                                   heads_per_program=g, interpret=True)


def test_api_backends():
    rng = np.random.default_rng(11)
    lengths = np.array([30, 50])
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, 2), hq=4, hkv=2, d=32,
                         page_size=16, max_pages=4)
    scale = 32 ** -0.5
    want = paged_attention_reference(*inputs, scale=scale)
    got = api.paged_attention(*inputs, scale=scale, backend="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"'triton'.*\('xla', 'pallas'\)"):
        api.paged_attention(*inputs, scale=scale, backend="triton")
    assert api.uses_kernel(1, 24, 4) and api.uses_kernel(8, 16, 2)
    assert not api.uses_kernel(17, 8, 2) and not api.uses_kernel(512, 8, 2)  # prefill chunks


def test_bad_shapes_raise():
    q = jnp.zeros((1, 1, 8, 64))
    pages = jnp.zeros((4, 24, 2, 64))  # page size 24: not a power of two
    table, pos = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="page_size 24"):
        paged_attention_pallas(q, pages, pages, table, pos, scale=0.1, interpret=True)
    pages = jnp.zeros((4, 16, 2, 64))
    with pytest.raises(ValueError, match="block_keys 8"):
        paged_attention_pallas(q, pages, pages, table, pos, scale=0.1, block_keys=8,
                               interpret=True)
    with pytest.raises(ValueError, match="head_dim must match"):
        paged_attention_pallas(q, jnp.zeros((4, 16, 2, 32)), jnp.zeros((4, 16, 2, 32)), table,
                               pos, scale=0.1, interpret=True)


def test_choose_num_splits():
    one = dict(programs_per_sm=1)
    for heads in (2, 4):
        assert 125 <= heads * choose_num_splits(1, heads, max_blocks=512, **one) <= 132
    assert choose_num_splits(8, 2, max_blocks=512, **one) == 8  # 128 programs, not 144
    assert choose_num_splits(32, 2, max_blocks=512, **one) == 2  # 128, not 192
    assert choose_num_splits(32, 4, max_blocks=512, **one) == 1
    # A short table at batch 1 (2 x 8 programs at 2 blocks each leave SMs idle): one block per
    # split; batch 8 fills 132 SMs at 2 blocks per split (16 x 18 programs), so it keeps 2.
    assert choose_num_splits(1, 2, max_blocks=16) == 16
    assert choose_num_splits(1, 2, max_blocks=16, min_blocks_per_split=2) == 8
    assert choose_num_splits(8, 2, max_blocks=36) == 18
    # 32 splits of 36 blocks would read 2 blocks each, as 18 do
    assert choose_num_splits(8, 2, max_blocks=36, min_blocks_per_split=1) == 18
    assert choose_num_splits(1, 2, max_blocks=32) == 32  # not 31: 2 blocks each (session 59)
    assert choose_num_splits(64, 4, max_blocks=1) == 1
    # Four programs per SM by default: batch 32 x 2 kv heads takes 8 splits (512 programs).
    assert choose_num_splits(32, 2, max_blocks=512) == 8
    assert 122 <= choose_num_splits(1, 2, max_blocks=128) <= 128  # 2 x 64 < 132: 1 block
    assert choose_num_splits(1, 2, max_blocks=512) == 256  # cost-bound: 2 blocks per split kept
    # a 128K-wide table at two programs per SM: 128 splits of 16 blocks (measured best, session
    # 59), not 132 (16 blocks too) or 121 (17)
    assert choose_num_splits(1, 2, max_blocks=2048, programs_per_sm=2) == 128
    assert 58 <= choose_num_splits(1, 2, max_blocks=128, min_blocks_per_split=2) <= 64


# (Hq, Hkv, T, page_size): Qwen3.5-2B, Qwen3.6-27B, Qwen3.6-35B-A3B head layouts, D = 256.
REAL = [(8, 2, 1, 16), (24, 4, 8, 16), (16, 2, 8, 64), (24, 4, 4, 64)]


@pytest.mark.parametrize("hq,hkv,t,page_size", REAL)
def test_triton_lowering_real_shapes(hq, hkv, t, page_size):
    b, d, max_pages = 8, 256, 32768 // page_size + 3  # odd sizes: only loaded blocks are 2^n
    spec = jax.ShapeDtypeStruct
    fn = functools.partial(paged_attention_pallas, scale=d ** -0.5)
    text = lower_for_cuda(fn, spec((b, t, hq, d), jnp.bfloat16),
                          spec((4099, page_size, hkv, d), jnp.bfloat16),
                          spec((4099, page_size, hkv, d), jnp.bfloat16),
                          spec((b, max_pages), jnp.int32), spec((b, t), jnp.int32))
    assert "triton" in text


@pytest.mark.parametrize("hq,hkv,t,page_size", REAL)
def test_triton_lowering_head_groups_with_page_prefetch(hq, hkv, t, page_size):
    b, d, max_pages = 1, 256, 131072 // page_size + 3
    spec = jax.ShapeDtypeStruct
    fn = functools.partial(paged_attention_pallas, scale=d ** -0.5, heads_per_program=hkv,
                           prefetch_pages=True, num_stages=1)
    text = lower_for_cuda(fn, spec((b, t, hq, d), jnp.bfloat16),
                          spec((8195, page_size, hkv, d), jnp.bfloat16),
                          spec((8195, page_size, hkv, d), jnp.bfloat16),
                          spec((b, max_pages), jnp.int32), spec((b, t), jnp.int32))
    assert "triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,t,page_size,batch,max_len", [
    (8, 2, 1, 16, 1, 32768), (24, 4, 4, 16, 8, 8192), (16, 2, 8, 64, 32, 4096),
    (24, 4, 8, 64, 1, 20000), (8, 2, 4, 16, 32, 2048)])
def test_gpu_real_shapes_bf16(hq, hkv, t, page_size, batch, max_len):
    rng = np.random.default_rng(batch * t)
    lengths = rng.integers(t, max_len + 1, size=batch)
    lengths[0] = max_len
    max_pages = -(-max_len // page_size) + 3
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, t), hq=hq, hkv=hkv,
                         d=256, page_size=page_size, max_pages=max_pages, dtype=jnp.bfloat16,
                         q_gain=2.0)
    scale = 256 ** -0.5
    got = jax.jit(functools.partial(paged_attention_pallas, scale=scale))(*inputs)
    assert got.dtype == jnp.bfloat16
    f32 = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in inputs]
    want = np.asarray(paged_attention_reference(*f32, scale=scale))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-2, rtol=1e-2)
