"""The int8 draft head (``speculative_draft_head_dtype="int8"``): the row quantization and the
int8 product against float64 numpy, the re-scoring of the best rows (its greedy token is the
float64 argmax where the int8 logits alone miss it), the draft's sampled q over the mixed
logits, the bytes counted for memory and the benchmark's floor, and the refusals.

Engine runs (every draft accepted, output equal to plain decoding) are in
``test_draft_vocab.py``, which has the "chain" model whose full-head drafts are all right.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import ConfigError, ModelConfig, SpeculativeConfig, normalize_draft_dtype
from mtp_jax.speculative.mtp import draft_token
from mtp_jax.models.draft_head import (BLOCK, RESCORE, DraftHead, candidates, draft_head_bytes,
                                      with_draft_head)
from mtp_jax.models.layers.int8_rows import int8_matmul, quantize_rows, quantize_rows_in_blocks
from mtp_jax.models.loader import load_model
from mtp_jax.sampling import SamplingTensors
from pallas_kernels.gemv import gemv
from tests.helpers.paths import fixture_path

FLAG = "speculative_draft_head_dtype (--speculative-draft-head-dtype)"


def _table(v=4096, h=64, seed=0):
    w = np.random.default_rng(seed).standard_normal((v, h)) * 0.05
    w[3] = 0.0  # an all-zero row
    w[5, 7] = 0.9  # a row with an outlier
    return w.astype(np.float32)


def test_quantize_rows_bounds_and_scale():
    w = _table()
    q, s = quantize_rows(jnp.asarray(w))
    q, s = np.asarray(q), np.asarray(s)
    assert q.dtype == np.int8 and s.dtype == np.float32 and q.shape == w.shape
    amax = np.abs(w.astype(np.float64)).max(1)
    np.testing.assert_allclose(s[amax > 0], amax[amax > 0] / 127, rtol=1e-6)
    assert s[3] == 1.0 and not q[3].any()
    err = np.abs(w - q.astype(np.float64) * s[:, None].astype(np.float64))
    assert np.all(err <= s[:, None] * (0.5 + 1e-5))
    assert np.abs(q).max() == 127 and q.min() >= -127
    with pytest.raises(ValueError, match="expected"):
        quantize_rows(jnp.ones((2, 3, 4)))


@pytest.mark.parametrize("block", [7, 512, 5000])
def test_quantize_rows_in_blocks_equals_one_piece(block):
    """The blocked form (what the draft head uses at load) stores the same int8 rows and
    scales for blocks that divide the rows, do not (a remainder) and exceed them."""
    w = _table()
    q, s = jax.jit(quantize_rows)(jnp.asarray(w))  # as compiled, not op by op (jax 0.12.1's
    # CPU op-by-op division and its compiled one differ in the last bit)
    qb, sb = jax.jit(quantize_rows_in_blocks, static_argnums=1)(jnp.asarray(w), block)
    assert qb.dtype == jnp.int8 and qb.shape == q.shape and sb.shape == s.shape
    np.testing.assert_array_equal(np.asarray(qb), np.asarray(q))
    np.testing.assert_array_equal(np.asarray(sb), np.asarray(s))
    with pytest.raises(ValueError, match="expected"):
        quantize_rows_in_blocks(jnp.ones((2, 3, 4)))


@pytest.mark.parametrize("rows", [(1,), (5,), (2, 3), (9,)])
def test_int8_matmul_matches_float64(rows):
    w = _table()
    q, s = quantize_rows(jnp.asarray(w))
    x = np.random.default_rng(1).standard_normal((*rows, w.shape[1])).astype(np.float32)
    got = np.asarray(int8_matmul(jnp.asarray(x), q, s))
    want = (x.astype(np.float64) @ np.asarray(q, np.float64).T) * np.asarray(s, np.float64)
    assert got.dtype == np.float32 and got.shape == (*rows, w.shape[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="int8"):
        int8_matmul(jnp.asarray(x), jnp.asarray(w), s)


def _np_candidates(approx, r=RESCORE, size=BLOCK):
    """float64 numpy: the columns of the r blocks of ``size`` columns with the largest maxima
    (ties to the lower block), a last partial block's missing columns clamped to N-1."""
    n = approx.shape[-1]
    nb = -(-n // size)
    padded = np.full((approx.shape[0], nb * size), -np.inf)
    padded[:, :n] = approx
    bmax = padded.reshape(-1, nb, size).max(-1)
    top = np.argsort(-bmax, axis=1, kind="stable")[:, :r]
    cols = (top[..., None] * size + np.arange(size)).reshape(approx.shape[0], -1)
    return np.minimum(cols, n - 1)


@pytest.mark.parametrize("n", [1000, 4096, 40])
def test_candidates_hold_the_best_columns(n):
    x = np.random.default_rng(n).standard_normal((6, n)).astype(np.float32)
    got = np.asarray(candidates(jnp.asarray(x)))
    want = _np_candidates(x.astype(np.float64))
    np.testing.assert_array_equal(got, want)
    best = np.argsort(-x, axis=1)[:, :RESCORE]
    for row, b in zip(got, best):
        assert set(b) <= set(row)


@pytest.mark.parametrize("reduced", [False, True])
def test_rescored_argmax_is_the_float64_argmax(reduced):
    """500 hidden states: the int8 logits alone pick another token than the float64 product
    for some of them (the test has power), the re-scored logits never do; the candidate
    columns hold the model-dtype products, the others the int8 ones."""
    w = _table()
    v, h = w.shape
    ids = (np.random.default_rng(2).permutation(v)[:1000].astype(np.int32) if reduced
           else None)
    rows = w if ids is None else w[ids]
    q, s = quantize_rows(jnp.asarray(rows))
    head = DraftHead(q, None if ids is None else jnp.asarray(ids), s)
    z = np.random.default_rng(3).standard_normal((500, h)).astype(np.float32)
    exact = z.astype(np.float64) @ rows.astype(np.float64).T
    approx = np.asarray(head(jnp.asarray(z)))
    mixed = np.asarray(head(jnp.asarray(z), jnp.asarray(w)))
    assert np.sum(approx.argmax(1) != exact.argmax(1)) > 0
    np.testing.assert_array_equal(mixed.argmax(1), exact.argmax(1))
    tok = np.asarray(head.greedy(jnp.asarray(z), jnp.asarray(w)))  # token ids
    np.testing.assert_array_equal(tok, exact.argmax(1) if ids is None else ids[exact.argmax(1)])
    cand = _np_candidates(approx.astype(np.float64))
    np.testing.assert_allclose(np.take_along_axis(mixed, cand, 1),
                               np.take_along_axis(exact, cand, 1), rtol=1e-5, atol=1e-6)
    rest = np.ones(mixed.shape, bool)
    np.put_along_axis(rest, cand, False, 1)
    np.testing.assert_array_equal(mixed[rest], approx[rest])


def test_greedy_ties_go_to_the_lower_column():
    """Two equal rows (70 and 700, in different blocks) that hold the best logit for every z:
    ``greedy`` returns the lower one, as the argmax over the mixed logits does."""
    w = _table(1000, 64)
    z = np.random.default_rng(6).standard_normal((20, 64)).astype(np.float32)
    w[70] = w[700] = 3.0 * z.mean(0) / np.linalg.norm(z.mean(0))
    z = z + 4.0 * z.mean(0)  # every row of z leans towards the two rows
    q, s = quantize_rows(jnp.asarray(w))
    head = DraftHead(q, None, s)
    mixed = np.asarray(head(jnp.asarray(z), jnp.asarray(w)))
    assert np.all(mixed[:, 70] == mixed[:, 700]) and np.all(mixed.argmax(1) == 70)
    np.testing.assert_array_equal(np.asarray(head.greedy(jnp.asarray(z), jnp.asarray(w))), 70)


def test_rescore_rounds_to_the_table_dtype():
    """bf16: the re-scored columns hold bf16 values (as the bf16 head's logits are), within
    one bf16 step of the bf16 head's own logits (``gemv``); the others stay float32."""
    w = jnp.asarray(_table(1000, 64), jnp.bfloat16)
    q, s = quantize_rows(w)
    z = jnp.asarray(np.random.default_rng(5).standard_normal((50, 64)), jnp.bfloat16)
    mixed = np.asarray(DraftHead(q, None, s)(z, w))
    cand = np.asarray(candidates(jnp.asarray(np.asarray(int8_matmul(z, q, s)))))
    got = np.take_along_axis(mixed, cand, 1)
    np.testing.assert_array_equal(got, got.astype(jnp.bfloat16).astype(np.float32))
    want = np.take_along_axis(np.asarray(gemv(z, w).astype(jnp.float32)), cand, 1)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=0)
    rest = np.ones(mixed.shape, bool)
    np.put_along_axis(rest, cand, False, 1)
    assert np.any(mixed[rest] != mixed[rest].astype(jnp.bfloat16).astype(np.float32))


@pytest.mark.parametrize("tied", [False, True])
def test_draft_token_with_int8_head(tied):
    """``draft_token`` on a model with an int8 head of all V rows: greedy tokens are the
    float64 argmax of the full head; a sampled row's q is the float64 filtered softmax of the
    mixed logits (the distribution it was drawn from). Tied: the rows and the re-scoring
    come from the embedding."""
    from tests.speculative.test_draft_vocab import _np_filtered

    name = "tiny_moe_mtp_per_expert" if tied else "tiny_dense"
    model = load_model(fixture_path(name), "float32", with_mtp=True)
    module = with_draft_head(model, None, "int8").module()
    head = module.draft_head
    assert head.weight[...].dtype == jnp.int8 and head.ids is None
    assert (module.lm_head is None) == tied
    table = (module.embed_tokens if tied else module.lm_head).weight[...]
    w = np.asarray(table, np.float64)
    v, h = w.shape
    z = np.random.default_rng(4).normal(0, 1, (4, h)).astype(np.float32)
    rows = [(0.0, -1, 1.0), (0.8, -1, 1.0), (1.0, 5, 1.0), (0.7, -1, 0.6)]
    sampling = SamplingTensors.from_params([(t, k, p, 50 + i) for i, (t, k, p) in enumerate(rows)])
    step = jnp.arange(4, dtype=jnp.int32)
    tok, q = draft_token(module, jnp.asarray(z), sampling, step, 1, False)
    tok, q = np.asarray(tok), np.asarray(q)
    assert tok[0] == np.argmax(z[0].astype(np.float64) @ w.T)
    mixed = np.asarray(head(jnp.asarray(z), table), np.float64)
    for b, (t, k, p) in enumerate(rows[1:], 1):
        np.testing.assert_allclose(q[b], _np_filtered(mixed[b], t, k, p), atol=2e-6)
        assert q[b, tok[b]] > 0
    g_tok, _ = draft_token(module, jnp.asarray(z), sampling, step, 1, True)
    np.testing.assert_array_equal(np.asarray(g_tok), np.argmax(z.astype(np.float64) @ w.T, -1))


def test_bytes_for_memory_and_floor():
    from mtp_jax.bench.floor import round_bytes

    cfg = ModelConfig.from_folder(fixture_path("tiny_dense"))
    v, h, k = cfg.vocab_size, cfg.hidden_size, 3
    assert draft_head_bytes(cfg, None, "bfloat16") == 0
    assert draft_head_bytes(cfg, None, "bfloat16", "int8") == v * (h + 4)
    assert draft_head_bytes(cfg, 64, "bfloat16") == 64 * h * 2 + 4 * 64
    assert draft_head_bytes(cfg, 64, "bfloat16", "int8") == 64 * (h + 4) + 4 * 64
    full = round_bytes(cfg, 2, k, 100, 2)
    int8 = round_bytes(cfg, 2, k, 100, 2, draft_head_dtype="int8")
    assert int8["weights"] == full["weights"]  # the target's head stays in the model dtype
    assert full["draft_weights"] - int8["draft_weights"] == k * v * (2 * h - (h + 4))


@pytest.mark.parametrize("part", ["head", "layer"])
@pytest.mark.parametrize("algorithm, value, words", [
    ("mtp", "fp8", "unknown"),
    ("none", "int8", "--speculative-algorithm mtp"),
    ("external", "int8", "--speculative-algorithm mtp"),
])
def test_bad_settings_name_the_flag(part, algorithm, value, words):
    """Both draft dtypes (``speculative_draft_head_dtype``, ``..._layer_dtype``)."""
    spec = SpeculativeConfig(algorithm=algorithm, **{f"draft_{part}_dtype": value})
    with pytest.raises(ConfigError) as e:
        spec.validate()
    flag = f"speculative_draft_{part}_dtype (--speculative-draft-{part}-dtype)"
    assert flag in str(e.value) and words in str(e.value), str(e.value)


def test_cli_llm_and_bench_refuse_before_load(capsys, tmp_path):
    from mtp_jax import LLM, generate
    from mtp_jax.bench import main as bench_main

    ckpt = fixture_path("tiny_dense")
    assert generate.main(["--model", ckpt, "--speculative-algorithm", "none",
                          "--speculative-draft-head-dtype", "int8"]) == 2
    assert FLAG in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.build_parser().parse_args(["--speculative-draft-head-dtype", "int4"])
    parse = generate.build_parser().parse_args
    assert parse(["--speculative-draft-head-dtype", "INT8"]).speculative_draft_head_dtype == "int8"
    assert parse([]).speculative_draft_head_dtype == "auto"
    for given, want in ((None, None), ("model", None), (" Auto", "auto"), ("INT8", "int8"),
                        ("fp8", "fp8"), (8, 8)):
        assert normalize_draft_dtype(given) == want
    with pytest.raises(ConfigError, match="speculative_draft_head_dtype"):  # no draft there
        LLM(fixture_path("tiny_qwen4_exp"), speculative_algorithm="none",
            speculative_draft_head_dtype="int8")
    model = load_model(ckpt, "float32", with_mtp=False)
    with pytest.raises(ValueError, match="with_mtp=True"):
        with_draft_head(model, None, "int8")
    with pytest.raises(SystemExit):
        bench_main(["--config", f"{ckpt}/config.json", "--draft-head-dtype", "int4",
                    "--out", str(tmp_path / "o.json")])
