"""The native PLE lookup (``ple_lookup.cc`` through ``ple_native``): its rows equal the numpy
path's (``ple_rows`` over ``ngram_ids`` and ``NgramTable``) bit for bit, for the tiny fixture's
tables in every dtype, for the released Flash-Next constants over tables split in parts, and
for eos inside the context and the rows; inside the engine's programs (the CPU handler of the
FFI call) it gives the callback's tokens and accept counts with drafts that are accepted. Skipped
where no C++ compiler builds the library.

Teeth (checked by breaking ple_lookup.cc): with eos not ending a segment, every row test
fails; with C's remainder in place of Python's (negative hashes kept negative), the wrapping
multipliers' test fails; with bfloat16 ties rounded up (or the rounding truncating), the
float32-stored bfloat16 test fails; with float16 ties rounded up or its subnormals truncated,
the float16 one; with the part found by the first start below the row instead of the last,
the split-table tests fail.
"""

from __future__ import annotations

import gc
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from mtp_jax.models.loader import load_model
from mtp_jax.models.qwen4_exp import load_qwen4_exp, ple_native
from mtp_jax.models.qwen4_exp.config import (Qwen4ExpConfig, head_offsets, head_vocab_sizes,
                                             layer_multipliers, ngram_table_rows)
from mtp_jax.models.qwen4_exp.loaded import PLEHost, PLETables, ple_rows
from tests.helpers.paths import fixture_path
from tests.helpers.qwen4_ple import engine_prompts, histories, run_mtp, small_flash_next

FIX = fixture_path("tiny_qwen4_exp")
TRAINED = fixture_path("tiny_qwen4_trained")


@pytest.fixture
def native(monkeypatch):
    monkeypatch.setenv("MTP_JAX_PLE_LOOKUP", "native")
    if ple_native.library() is None:
        pytest.skip(f"the native PLE lookup does not build here: "
                    f"{ple_native.unavailable_reason()}")


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("dtype,backend", [("float32", "memory"), ("bfloat16", "disk"),
                                           ("float16", "disk")])
def test_native_rows_equal_numpy_rows(native, dtype, backend):
    model = load_qwen4_exp(FIX, dtype, with_mtp=False, ple_backend=backend)
    source = model.module().ple_source
    assert ple_native.registered(source)
    cfg = model.cfg
    hist = histories(np.random.default_rng(7), cfg.vocab_size, cfg.eos_token_id,
                      cfg.ngram_size - 1, t=29)
    ctx, ids = hist[:, :cfg.ngram_size - 1], hist[:, cfg.ngram_size - 1:]
    want = model.host_rows(ctx, ids)
    width = model.host_row_width
    assert np.array_equal(_bits(ple_native.host_rows(source, ctx, ids, width)), _bits(want))
    got = jax.jit(lambda c, i: ple_native.rows(source, c, i, width))(ctx, ids)
    assert np.array_equal(_bits(got), _bits(want))
    del model
    gc.collect()
    assert not ple_native.registered(source)  # the tables went with the model
    with pytest.raises(KeyError, match="not registered"):
        ple_native.host_rows(source, ctx, ids, width)


class _PartsTable:
    """An ``NgramTable`` stand-in over random stored rows split in uneven parts."""

    def __init__(self, rows, dim, stored, out, seed, cuts):
        a = np.random.default_rng(seed).standard_normal((rows, dim))
        kind, odd = np.arange(rows) % 5, 2 * (np.arange(rows) // 5 % 2)[:, None] + 1
        a[kind == 0] *= 1e-6  # float16 subnormals
        a[kind == 1] *= 7e4  # beyond float16's range
        # ties, to the even neighbour below and above: float16's (10 mantissa bits) and
        # bfloat16's (7)
        a[kind == 2] = (1 + odd * 2.0 ** -11 * np.ones(dim))[kind == 2]
        a[kind == 3] = (1 + odd * 2.0 ** -8 * np.ones(dim))[kind == 3]
        a = a.astype(stored)
        edges = [0, *cuts, rows]
        self._parts = [a[s:e] for s, e in zip(edges[:-1], edges[1:])]
        self._a, self.out_dtype, self.dim = a, np.dtype(out), dim

    @property
    def parts(self):
        return self._parts, np.asarray([0, *self._cuts()], np.int64)

    def _cuts(self):
        return np.cumsum([p.shape[0] for p in self._parts])[:-1].tolist()

    def lookup(self, ids):
        with np.errstate(over="ignore"):  # beyond float16: inf, as the native cast
            return self._a[np.asarray(ids)].astype(self.out_dtype)


@pytest.mark.parametrize("stored,out,wrap", [(np.float32, ml_dtypes.bfloat16, False),
                                             (ml_dtypes.bfloat16, np.float32, False),
                                             (np.float32, np.float16, False),
                                             (np.float32, np.float32, True)])
def test_native_rows_with_flash_next_constants(native, stored, out, wrap):
    """The released multipliers (vocab 248320) over small tables split in three parts, two
    PLE layers, stored in one dtype and served in another. ``wrap``: multipliers above 2^62,
    whose int64 products wrap and whose XORs go negative (numpy's remainder is Python's)."""
    cfg = small_flash_next()
    hosts = []
    for j, layer in enumerate(cfg.ple_layers):
        sizes, rows = head_vocab_sizes(cfg, j), ngram_table_rows(cfg, j)
        table = _PartsTable(rows, cfg.ngram_head_dim, stored, out, j, [rows // 3, rows // 2])
        mult = ([2 ** 62 + 2 ** 40 * i + 2 * j + 1 for i in range(cfg.ngram_size)] if wrap
                else layer_multipliers(cfg, j))
        hosts.append(PLEHost(layer, table, mult, sizes, head_offsets(sizes)))
    tables = PLETables(hosts)
    source = 10 ** 6 + 17
    assert ple_native.register(source, cfg, tables)
    hist = histories(np.random.default_rng(5), cfg.vocab_size, cfg.eos_token_id,
                      cfg.ngram_size - 1, t=17)
    ctx, ids = hist[:, :cfg.ngram_size - 1], hist[:, cfg.ngram_size - 1:]
    want = ple_rows(cfg, hosts, ctx, ids)
    got = ple_native.host_rows(source, ctx, ids, 2 * cfg.ple_embed_dim)
    assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("flaw", ["strided", "short", "none"])
def test_native_lookup_refuses_what_it_cannot_read(native, flaw):
    """A table part that is not one contiguous array, or a table shorter than its hash
    constants reach, is left to the callback (which raises IndexError for such rows)."""
    cfg = Qwen4ExpConfig.from_folder(FIX)
    sizes, rows = head_vocab_sizes(cfg, 0), ngram_table_rows(cfg, 0)
    table = _PartsTable(2 * rows, cfg.ngram_head_dim, np.float32, np.float32, 0, [])
    reach = max(o + v for o, v in zip(head_offsets(sizes), sizes))  # rows the hash reads
    table._parts = [table._parts[0][::2] if flaw == "strided"
                    else table._parts[0][:reach - (flaw == "short")].copy()]
    tables = PLETables([PLEHost(1, table, layer_multipliers(cfg, 0), sizes,
                                head_offsets(sizes))])
    assert ple_native.register(10 ** 6 + 18, cfg, tables) == (flaw == "none")


def test_native_choice(monkeypatch):
    monkeypatch.setenv("MTP_JAX_PLE_LOOKUP", "fast")
    with pytest.raises(ValueError, match="MTP_JAX_PLE_LOOKUP='fast'.*auto, native, callback"):
        ple_native.choice()
    monkeypatch.setenv("MTP_JAX_PLE_LOOKUP", "callback")
    model = load_qwen4_exp(FIX, "float32", with_mtp=False, ple_backend="disk")
    assert not ple_native.registered(model.module().ple_source)
    monkeypatch.setenv("MTP_JAX_PLE_LOOKUP", "auto")  # native on a GPU, the callback on the CPU
    model = load_qwen4_exp(FIX, "float32", with_mtp=False, ple_backend="disk")
    assert ple_native.registered(model.module().ple_source) == (
        jax.default_backend() != "cpu" and ple_native.library() is not None)


def test_engine_native_lookup_gives_callback_tokens_and_accepts(native, monkeypatch):
    """MTP k = 3 over the trained fixture, two rounds per call: the programs' rows by the
    FFI call (CPU handler) against the callback; drafts are accepted."""
    nat = load_model(TRAINED, "float32", with_mtp=True, ple_backend="disk")
    assert ple_native.registered(nat.module().ple_source)
    monkeypatch.setenv("MTP_JAX_PLE_LOOKUP", "callback")
    cb = load_model(TRAINED, "float32", with_mtp=True, ple_backend="disk")
    assert not ple_native.registered(cb.module().ple_source)
    prompts = engine_prompts(nat.cfg)
    a, b = run_mtp(nat, prompts), run_mtp(cb, prompts)
    assert a == b
    assert sum(r[3] for r in a) > 0  # drafts were accepted


def test_without_a_compiler_the_callback_serves_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(ple_native, "_STATE", {})  # as in a fresh process
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MTP_JAX_PLE_LOOKUP", "native")
    with pytest.warns(UserWarning, match="native PLE lookup is unavailable.*no-such-compiler"):
        model = load_qwen4_exp(FIX, "float32", with_mtp=False, ple_backend="disk")
    assert not ple_native.registered(model.module().ple_source)
    assert "no-such-compiler" in ple_native.unavailable_reason()
    assert os.listdir(tmp_path / "native") == []  # no half-built file left behind


def test_model_line_says_where_the_ple_rows_come_from(native, monkeypatch):
    from types import SimpleNamespace

    from mtp_jax.cli_report import ple_note

    def note(**kw):
        return ple_note(SimpleNamespace(model=load_qwen4_exp(FIX, "float32", with_mtp=False,
                                                             **kw)))

    assert note(ple_backend="disk") == "; PLE rows by the native host lookup"
    assert note(ple_backend="device") == "; PLE rows from the device tables"
    monkeypatch.setenv("MTP_JAX_PLE_LOOKUP", "callback")
    assert note(ple_backend="memory") == "; PLE rows by a host callback"
