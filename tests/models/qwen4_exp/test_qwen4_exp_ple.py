"""PLE n-gram hashing against a pure-Python re-derivation and the ids HF looked up; memory and
disk table backends bitwise equal."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mtp_jax.models.qwen4_exp import load_qwen4_exp
from mtp_jax.models.qwen4_exp.config import (Qwen4ExpConfig, head_offsets, head_vocab_sizes,
                                             layer_multipliers)
from mtp_jax.models.qwen4_exp.ple import ngram_ids
from tests.helpers.paths import fixture_path

FIX = fixture_path("tiny_qwen4_exp")


def _py_ids(tokens, eos, mult, sizes, offs, n_max, heads):
    """Plain-Python hash: for each token, walk back inside its eos segment."""
    out = []
    for t in range(len(tokens)):
        seg = 0  # first index of t's segment: one past the last eos strictly before t
        for u in range(t):
            if tokens[u] == eos:
                seg = u + 1
        shifted = [tokens[t - s] if t - s >= seg else eos for s in range(n_max)]
        row = []
        for n in range(2, n_max + 1):
            mixed = 0
            for s in range(n):
                mixed ^= shifted[s] * mult[s]
            for h in range(heads):
                k = (n - 2) * heads + h
                row.append(mixed % sizes[k] + offs[k])
        out.append(row)
    return out


def _primes(n, lo):
    out, p = [], lo
    while len(out) < n:
        p += 1
        if p > 1 and all(p % d for d in range(2, int(p ** 0.5) + 1)):
            out.append(p)
    return out


def test_hash_constants_pure_python():
    cfg = Qwen4ExpConfig.from_folder(FIX)
    assert head_vocab_sizes(cfg, 0) == tuple(_primes(4, 39))
    assert head_vocab_sizes(cfg, 1) == tuple(_primes(8, 39)[4:])
    assert head_offsets((3, 5, 7)) == (0, 3, 8)
    m = layer_multipliers(cfg, 0)
    assert all(x % 2 == 1 and 0 < x * (cfg.vocab_size - 1) < 2 ** 63 for x in m)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ngram_ids_match_pure_python(seed):
    rng = np.random.default_rng(seed)
    eos, n_max, heads = 7, 4, 3
    mult = [2 * int(rng.integers(1, 2 ** 40)) + 1 for _ in range(n_max)]
    sizes = _primes(heads * (n_max - 1), 1000)
    offs = list(np.cumsum([0] + sizes[:-1]))
    toks = rng.integers(0, 12, (2, 25))  # eos (7) appears often, also back to back
    toks[0, :2] = eos
    ctx = np.full((2, n_max - 1), eos)
    hist = np.concatenate([ctx, toks], 1)
    got = ngram_ids(hist, toks.shape[1], mult, sizes, offs, n_max, heads, eos)
    for b in range(2):
        want = _py_ids(list(map(int, hist[b])), eos, mult, sizes, offs, n_max, heads)
        np.testing.assert_array_equal(got[b], np.array(want[n_max - 1:], np.int64))
    # incremental: the last n-1 tokens as context give the same ids as the whole history
    inc = ngram_ids(hist[:, 10 - (n_max - 1):], hist.shape[1] - 10, mult, sizes, offs, n_max,
                    heads, eos)
    np.testing.assert_array_equal(inc, got[:, 10 - (n_max - 1):])


def test_ngram_ids_equal_hf_lookup():
    g = np.load(os.path.join(FIX, "golden.npz"))
    m = load_qwen4_exp(FIX, "float32", with_mtp=False)
    p, cfg = m.ple[0], m.cfg
    ids = g["input_ids"].astype(np.int64)
    hist = np.concatenate([np.stack([m.ngram_context([])] * 2), ids], 1)
    got = ngram_ids(hist, ids.shape[1], p.multipliers, p.vocab_sizes, p.offsets, cfg.ngram_size,
                    cfg.heads_per_ngram, cfg.eos_token_id)
    np.testing.assert_array_equal(got, g["ngram_ids"])
    for b in range(2):
        want = _py_ids(list(map(int, hist[b])), cfg.eos_token_id, p.multipliers, p.vocab_sizes,
                       p.offsets, cfg.ngram_size, cfg.heads_per_ngram)
        np.testing.assert_array_equal(got[b], np.array(want[cfg.ngram_size - 1:]))


def test_disk_and_memory_backends_bitwise_equal():
    disk = load_qwen4_exp(FIX, "float32", with_mtp=False, ple_backend="disk")
    mem = load_qwen4_exp(FIX, "float32", with_mtp=False, ple_backend="memory")
    rows = disk.ple[0].table.rows
    ids = np.random.default_rng(0).integers(0, rows, (3, 17, 4))
    a, b = disk.ple[0].table.lookup(ids), mem.ple[0].table.lookup(ids)
    assert a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert len(disk.ple[0].table._parts) == 4  # the 4 stored shards, memory-mapped
    g = np.load(os.path.join(FIX, "golden.npz"))
    la, _ = disk.forward(g["input_ids"])
    lb, _ = mem.forward(g["input_ids"])
    assert np.array_equal(np.asarray(la), np.asarray(lb))
    with pytest.raises(ValueError, match="ple_backend"):
        load_qwen4_exp(FIX, "float32", with_mtp=False, ple_backend="gpu")
