"""``ple_backend="device"``: the n-gram hash in jnp (uint32 pairs) equals numpy's int64
``ngram_ids`` exactly (the released Flash-Next constants, the tiny fixture's, and the bounds'
extremes); the device rows equal the memory backend's ``ple_rows`` bit for bit; the engine with
device tables (no host callback) gives the same tokens and accept counts as with disk tables.

Teeth (checked by breaking ple_device.py): with the carry into ``mul64``'s third 16-bit column
dropped, the Flash-Next and extreme-bound hash tests and both Flash-Next-constant row tests
fail (the tiny fixture's ids, below 256, make no such carry); with the Horner step shifting one
bit short, or the eos segment starting at an eos instead of after it, every hash and row test
fails."""

from __future__ import annotations

import functools
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from mtp_jax.models.loader import load_model
from mtp_jax.models.qwen4_exp import load_qwen4_exp
from mtp_jax.models.qwen4_exp.config import (Qwen4ExpConfig, head_offsets, head_vocab_sizes,
                                             layer_multipliers, ngram_table_rows)
from mtp_jax.models.qwen4_exp.dummy import SyntheticTable
from mtp_jax.models.qwen4_exp.loaded import PLEHost, ple_rows
from mtp_jax.models.qwen4_exp.ple import ngram_ids
from mtp_jax.models.qwen4_exp.ple_device import (PLEDevice, PLETable, check_constants,
                                                 device_ngram_ids)
from mtp_jax.train.target import split_trainable
from tests.helpers.paths import fixture_path
from tests.helpers.qwen4_ple import engine_prompts, histories, run_mtp, small_flash_next

FIX = fixture_path("tiny_qwen4_exp")
TRAINED = fixture_path("tiny_qwen4_trained")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def _flash_next():
    raw = json.load(open(os.path.join(ROOT, "configs", "Qwen3.8-Flash-Next.json")))
    return Qwen4ExpConfig.from_dict(raw)


def _constants(name):
    """``(vocab, eos, N, heads, multipliers, head sizes, offsets)`` of one PLE layer."""
    if name == "extremes":  # the largest multiplier and head sizes the bounds allow
        vocab, n, heads = 2 ** 31 - 1, 3, 2
        top = (2 ** 63 - 1) // vocab  # even here: top - 1 is the largest odd multiplier
        mult = [top - 1, 2 ** 31 + 11, top - 3]
        sizes = [2 ** 31 - 1, 2 ** 30 - 35, 65521, 3]  # primes below 2^31, 2^30, 2^16; 3
        return vocab, 0, n, heads, mult, sizes, [0] * len(sizes)
    cfg = _flash_next() if name == "flash_next" else Qwen4ExpConfig.from_folder(FIX)
    sizes = head_vocab_sizes(cfg, 0)
    return (cfg.vocab_size, cfg.eos_token_id, cfg.ngram_size, cfg.heads_per_ngram,
            layer_multipliers(cfg, 0), sizes, head_offsets(sizes))


@pytest.mark.parametrize("name", ["flash_next", "tiny", "extremes"])
def test_device_hash_equals_numpy(name):
    vocab, eos, n, heads, mult, sizes, offs = _constants(name)
    check_constants(vocab, mult, sizes, offs, sum(sizes) + offs[-1])
    hist = histories(np.random.default_rng(len(name)), vocab, eos, n - 1)
    for t in (hist.shape[1] - (n - 1), 1):  # every row; a decode step's one row
        h = hist[:, -(t + n - 1):]
        want = ngram_ids(h, t, mult, sizes, offs, n, heads, eos)
        fn = jax.jit(functools.partial(device_ngram_ids, n_new=t, multipliers=mult,
                                       vocab_sizes=sizes, offsets=offs, ngram_size=n,
                                       heads_per_ngram=heads, eos=eos))
        got = np.asarray(fn(np.asarray(h, np.int32)))
        assert got.dtype == np.int32 and 0 <= want.min() and want.max() < 2 ** 31
        np.testing.assert_array_equal(got, want)


def test_device_hash_bounds_are_checked():
    vocab = 248320
    with pytest.raises(ValueError, match="2\\^63"):
        check_constants(vocab, [2 ** 63 // vocab + 1], [7], [0], 7)
    with pytest.raises(ValueError, match="2\\^31"):
        check_constants(vocab, [3], [2 ** 31 + 11], [0], 2 ** 32)
    with pytest.raises(ValueError, match="rows"):
        check_constants(vocab, [3], [7, 11], [0, 7], 17)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_rows_equal_memory_rows_bitwise(dtype):
    dev = load_qwen4_exp(FIX, dtype, with_mtp=False, ple_backend="device")
    mem = load_qwen4_exp(FIX, dtype, with_mtp=False, ple_backend="memory")
    assert not dev.host_callbacks and mem.host_callbacks
    cfg = dev.cfg
    hist = histories(np.random.default_rng(3), cfg.vocab_size, cfg.eos_token_id,
                      cfg.ngram_size - 1, t=23)
    ctx, ids = hist[:, :cfg.ngram_size - 1], hist[:, cfg.ngram_size - 1:]
    want = mem.host_rows(ctx, ids)
    module = dev.module()
    got = np.asarray(jax.jit(lambda m, c, i: m.ple_device(c, i))(module, ctx, ids))
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(dev.host_rows(ctx, ids).view(np.uint32), want.view(np.uint32))
    assert np.array_equal(np.asarray(dev.traced_rows(ids)).view(np.uint32),
                          mem.host_rows(np.full_like(ctx, cfg.eos_token_id), ids).view(np.uint32))
    # the table: a program input in the model dtype, counted, never trainable
    tables = [v for p, v in nnx.to_flat_state(dev.params) if isinstance(v, PLETable)]
    assert len(tables) == len(cfg.ple_layers) and tables[0][...].dtype == np.dtype(
        mem.ple[0].table.out_dtype)
    assert dev.extra_weight_bytes == sum(t[...].nbytes for t in tables) > 0
    assert mem.extra_weight_bytes == 0
    if dtype == "float32":
        train, _ = split_trainable(dev.params, lambda name: True)
        assert not any(isinstance(v, PLETable) for _, v in nnx.to_flat_state(train))
        g = np.load(os.path.join(FIX, "golden.npz"))
        la, sa = dev.forward(g["input_ids"])
        lb, sb = mem.forward(g["input_ids"])
        assert np.array_equal(np.asarray(la), np.asarray(lb))
        assert np.array_equal(np.asarray(sa), np.asarray(sb))


class _ArrayTable:
    """A host table over one random array (what ``ple_rows`` and ``PLEDevice`` read)."""

    def __init__(self, rows, dim, seed):
        self.rows = rows
        self.out_dtype = np.dtype(np.float32)
        self._a = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)

    def lookup(self, ids):
        return self._a[np.asarray(ids)]

    def device_rows(self):
        return self._a


@pytest.mark.parametrize("kind", ["array", "synthetic"])
def test_device_rows_with_flash_next_constants(kind):
    """The released shape's multipliers (vocab 248320) over a smaller table (head sizes from
    a base of 5000, 2 values a head): ``ple_rows`` and :class:`PLEDevice` bitwise, for a plain
    table and for the synthetic one of random weights (rows read ``id mod 4096``)."""
    cfg = small_flash_next()
    hosts = []
    for j, layer in enumerate(cfg.ple_layers):
        sizes, rows = head_vocab_sizes(cfg, j), ngram_table_rows(cfg, j)
        table = (_ArrayTable(rows, cfg.ngram_head_dim, j) if kind == "array"
                 else SyntheticTable(rows, cfg.ngram_head_dim, np.float32, j))
        hosts.append(PLEHost(layer, table, layer_multipliers(cfg, j), sizes,
                             head_offsets(sizes)))
    dev = PLEDevice(cfg, hosts)
    assert dev.wrap == ((0, 0) if kind == "array" else (4096, 4096))
    hist = histories(np.random.default_rng(5), cfg.vocab_size, cfg.eos_token_id,
                      cfg.ngram_size - 1, t=17)
    ctx, ids = hist[:, :cfg.ngram_size - 1], hist[:, cfg.ngram_size - 1:]
    want = ple_rows(cfg, hosts, ctx, ids)
    got = np.asarray(jax.jit(lambda m, c, i: m(c, i))(dev, ctx, ids))
    assert got.shape == want.shape == (*ids.shape, 2 * cfg.ple_embed_dim)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_gguf_target_with_device_tables(tmp_path):
    """A GGUF target (tests/gguf/writer.py) loads with device tables: no host callback, its
    rows equal the memory backend's."""
    from tests.gguf.writer import write_target

    path = write_target(TRAINED, str(tmp_path / "t.gguf"))
    dev = load_model(path, "float32", with_mtp=False, ple_backend="device")
    mem = load_model(path, "float32", with_mtp=False, ple_backend="memory")
    assert not dev.host_callbacks and dev.extra_weight_bytes > 0
    ids = np.random.default_rng(1).integers(0, dev.cfg.vocab_size, (2, 9))
    want = mem.host_rows(np.stack([mem.ngram_context([])] * 2), ids)
    assert np.array_equal(np.asarray(dev.traced_rows(ids)).view(np.uint32), want.view(np.uint32))


def test_engine_device_tables_give_disk_tokens_and_accepts():
    disk = load_model(TRAINED, "float32", with_mtp=True, ple_backend="disk")
    dev = load_model(TRAINED, "float32", with_mtp=True, ple_backend="device")
    assert disk.host_callbacks and not dev.host_callbacks
    prompts = engine_prompts(disk.cfg)
    a, b = run_mtp(disk, prompts), run_mtp(dev, prompts)
    assert a == b
    assert sum(r[3] for r in b) > 0  # drafts were accepted


class _FakeDevice:
    def __init__(self, platform: str, limit: int | None):
        self.platform, self._limit = platform, limit

    def memory_stats(self):
        return None if self._limit is None else {"bytes_limit": self._limit}


def test_auto_backend_choice():
    """``ple_backend="auto"`` (the default): device on an accelerator whose memory holds the
    tables four times over, disk on the CPU, for tables too large, or with no known limit; an
    explicit choice is kept. On this CPU a default load keeps the host callback."""
    from mtp_jax.models.qwen4_exp.ple_device import choose_backend

    gpu = _FakeDevice("gpu", 100 << 30)
    assert choose_backend(None, 25 << 30, gpu) == "device"
    assert choose_backend("auto", (25 << 30) + 1, gpu) == "disk"
    assert choose_backend("auto", 1, _FakeDevice("gpu", None)) == "disk"
    assert choose_backend(None, 1, _FakeDevice("cpu", 100 << 30)) == "disk"
    assert choose_backend("memory", 1, gpu) == "memory"
    assert choose_backend("device", 1 << 50, _FakeDevice("cpu", None)) == "device"
    model = load_model(FIX, "float32", with_mtp=False)
    assert model.host_callbacks and model.extra_weight_bytes == 0
