"""The blocked XLA paged attention (``pallas_kernels.paged_attention.blocked``) against a float64
numpy re-derivation: prefill chunks, decode and verify rows at every offset, pages in random
order, NaN / inf wherever no row may look, several key blocks and tables wider than the
context; and ``paged_attention`` taking it only for tables wider than ``MAX_GATHER_KEYS``."""

from __future__ import annotations

import numpy as np
import pytest

from pallas_kernels.paged_attention import api
from pallas_kernels.paged_attention.blocked import (MAX_GATHER_KEYS, paged_attention_blocked,
                                                    uses_blocks)
from tests.kernels.test_pallas_paged_attention import make_inputs, window


def attention_np(q, k_pages, v_pages, table, positions, scale):
    """Each query row against the keys at positions <= its own, in float64."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    table, positions = np.asarray(table), np.asarray(positions)
    b, t, hq, d = q.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    out = np.zeros_like(q)
    for i in range(b):
        for r in range(t):
            n = positions[i, r] + 1
            slots = [(table[i, s // page_size], s % page_size) for s in range(n)]
            k = np.stack([k_pages[p, o] for p, o in slots])  # [n, Hkv, D]
            v = np.stack([v_pages[p, o] for p, o in slots])
            for h in range(hq):
                s = k[:, h // (hq // hkv)] @ q[i, r, h] * scale
                w = np.exp(s - s.max())
                out[i, r, h] = (w / w.sum()) @ v[:, h // (hq // hkv)]
    return out


def check(inputs, block_keys, atol=2e-5):
    q, k, v, table, pos = inputs
    scale = q.shape[-1] ** -0.5
    got = np.asarray(paged_attention_blocked(q, k, v, table, pos, scale=scale,
                                             block_keys=block_keys))
    want = attention_np(q, k, v, table, pos, scale)
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=atol, rtol=atol)


@pytest.mark.parametrize("block_keys", [8, 24, 64, 4096])
def test_prefill_chunks_across_blocks(block_keys):
    """Two requests' prompt chunks (rows at consecutive positions, the second request's chunk
    starting mid-context), blocks of 1, 3 (24 keys over 8-key pages), 8 pages and all."""
    rng = np.random.default_rng(block_keys)
    lengths = [37, 61]
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, 12), hq=4, hkv=2,
                         d=16, page_size=8, max_pages=10)
    check(inputs, block_keys)


@pytest.mark.parametrize("t", [1, 4])
def test_decode_and_verify_every_offset(t):
    """Decode (t = 1) and verify (t = 4) windows ending at every offset of a 16-key page, on a
    table four times wider than the longest context."""
    rng = np.random.default_rng(t)
    lengths = [16 * 2 + e + t for e in range(16)]
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, t), hq=6, hkv=2,
                         d=8, page_size=16, max_pages=12)
    check(inputs, block_keys=32)


def test_api_takes_blocks_only_for_wide_tables(monkeypatch):
    calls = []
    monkeypatch.setattr(api, "paged_attention_blocked",
                        lambda *a, **k: calls.append(1) or paged_attention_blocked(*a, **k))
    rng = np.random.default_rng(5)
    page_size = 16
    wide = MAX_GATHER_KEYS // page_size + 1
    assert uses_blocks(page_size, wide) and not uses_blocks(page_size, wide - 1)
    lengths = [70, 300]
    inputs = make_inputs(rng, written=lengths, positions=window(lengths, 3), hq=4, hkv=1, d=8,
                         page_size=page_size, max_pages=wide)
    q, k, v, table, pos = inputs
    scale = q.shape[-1] ** -0.5
    got = np.asarray(api.paged_attention(q, k, v, table, pos, scale=scale, backend="xla"))
    np.testing.assert_allclose(got, attention_np(q, k, v, table, pos, scale), atol=2e-5,
                               rtol=2e-5)
    assert calls == [1]
    api.paged_attention(q, k, v, table[:, :wide - 1], pos, scale=scale, backend="xla")
    assert calls == [1]  # one page narrower: the one-shot reference
