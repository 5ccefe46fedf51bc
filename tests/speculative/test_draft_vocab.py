"""Reduced draft vocabulary (``--speculative-draft-vocab-size`` / ``--speculative-token-map``):
greedy speculative decoding still equals plain decoding token for token, the draft's sampled
distribution q is zero outside the hot set and equals a float64 re-derivation over the hot
logits, bad settings fail before load naming the flag, and the benchmark counts N head rows.

The engine tests use a "chain" model: tiny_dense with every residual branch's output projection
zeroed and the MTP ``fc`` passing the embedding half through, so the target's next token after
x is g(x) = argmax(lm_head . rmsnorm(E[x])) and the full-vocabulary draft predicts it exactly
(every draft accepted). With a hot set, a draft is right exactly when the true token is hot.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.config import ConfigError, EngineConfig, ModelConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.speculative.mtp import draft_token
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.draft_head import with_draft_head
from mtp_jax.models.loader import load_model
from mtp_jax.models.params import fill_state, param_name
from mtp_jax.sampling import SamplingTensors
from mtp_jax.checks import check_settings
from mtp_jax.speculative.draft_vocab import hot_token_ids
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_dense")
N = 64
MAX_TOKENS = 20
SIZE_FLAG = "--speculative-draft-vocab-size"
MAP_FLAG = "--speculative-token-map"


def _arrays(model) -> dict:
    return {param_name(p): v[...] for p, v in nnx.to_flat_state(model.params)}


@pytest.fixture(scope="module")
def base():
    return load_model(CKPT, "float32", with_mtp=True)


@pytest.fixture(scope="module")
def chain(base):
    a = _arrays(base)
    h = base.cfg.hidden_size
    for name in list(a):
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) or name in (
                "norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight"):
            a[name] = jnp.zeros_like(a[name])
    a["mtp.fc.weight"] = jnp.concatenate([jnp.eye(h), jnp.zeros((h, h))], 1)
    return dataclasses.replace(base, params=fill_state(base.params, a))


def _requests(prompts, params):
    return [Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=list(p), params=sp,
                    seed=10 + i) for i, (p, sp) in enumerate(zip(prompts, params))]


def _greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine_cfg():
    return EngineConfig(max_running_requests=4, dtype="float32", max_model_len=64,
                        enable_prefix_cache=False)


def _run(model, prompts, params, **spec):
    """Serve on an engine whose every round drafts (the counts are of drafted rounds)."""
    eng = Engine(model, _engine_cfg(), SpeculativeConfig(**spec, adaptive=False))
    return eng.run(_requests(prompts, params)), eng


@pytest.fixture(scope="module")
def plain(chain):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 300, n).tolist() for n in (3, 11, 15)]
    reqs, _ = _run(chain, prompts, [_greedy()] * 3, algorithm="none")
    return prompts, [r.output_ids for r in reqs]


def test_hot_set_holding_the_continuation_accepts_every_draft(chain, plain):
    """A shuffled map (N < V) that holds every token of the plain continuation: each draft is
    the full-vocabulary draft, mapped through the hot ids, so every one is accepted."""
    prompts, want = plain
    rng = np.random.default_rng(1)
    need = sorted({t for out in want for t in out})
    others = rng.permutation(np.setdiff1d(np.arange(300), need))[:N - len(need)]
    hot = rng.permutation(np.concatenate([need, others]))
    assert hot.size == N and hot.max() >= N  # not the lowest ids, not in order
    reqs, eng = _run(chain, prompts, [_greedy()] * 3, algorithm="mtp", num_steps=3,
                     token_map_path=_write(hot, "hot.npy"))
    assert eng.draft_vocab_size == N
    low = Engine(chain, _engine_cfg(), SpeculativeConfig(algorithm="mtp", num_steps=3,
                                                         draft_vocab_size=N, adaptive=False))
    # same N: the compiled programs are shared
    assert low.device.programs is eng.device.programs
    for r, out in zip(reqs, want):
        assert r.output_ids == out
        assert r.num_draft_tokens > 0 and r.num_accepted_tokens == r.num_draft_tokens


def test_lowest_ids_reject_drafts_of_cold_tokens_and_equal_plain(chain, plain):
    """The N lowest ids: the continuation has tokens >= N, so some drafts are rejected and
    some accepted; greedy output still equals plain decoding token for token.

    The chain model's continuation depends only on the last prompt token, so the prompts here
    (request 0's last token after each prompt's others) all continue as request 0 did: the rows
    finish in the same round, and the engine reuses the programs compiled above."""
    prompts, want = plain
    assert any(t >= N for t in want[0]) and any(t < N for t in want[0])
    same_end = [p[:-1] + prompts[0][-1:] for p in prompts]
    reqs, eng = _run(chain, same_end, [_greedy()] * 3, algorithm="mtp", num_steps=3,
                     draft_vocab_size=N)
    assert eng.draft_vocab_size == N
    for r in reqs:
        assert r.output_ids == want[0], r.request_id
        assert 0 < r.num_accepted_tokens < r.num_draft_tokens, r.request_id


def test_int8_head_drafts_like_the_full_head(chain, plain):
    """``draft_head_dtype="int8"`` (all V rows, re-scored) through the engine: the chain
    model's full-head drafts are all right, and so are the int8 head's; output equals plain
    decoding token for token. (The chain model's logits are far apart, so int8 alone would
    draft the same tokens: the re-scoring is checked where it matters in
    ``test_draft_head_int8.py``.)"""
    prompts, want = plain
    reqs, eng = _run(chain, prompts, [_greedy()] * 3, algorithm="mtp", num_steps=3,
                     draft_head_dtype="int8")
    assert eng.draft_head_dtype == "int8" and eng.draft_vocab_size is None
    assert eng.model.module().draft_head.weight[...].dtype == jnp.int8
    for r, out in zip(reqs, want):
        assert r.output_ids == out
        assert r.num_draft_tokens > 0 and r.num_accepted_tokens == r.num_draft_tokens


def test_int8_layer_drafts_like_the_model_dtype(chain, plain):
    """``draft_layer_dtype="int8"`` with the int8 head: the chain model's draft projections
    (``fc`` = [I, 0], the zeroed output projections) are exact in int8, so every draft is
    still right and accepted; output equals plain decoding token for token."""
    prompts, want = plain
    reqs, eng = _run(chain, prompts, [_greedy()] * 3, algorithm="mtp", num_steps=3,
                     draft_head_dtype="int8", draft_layer_dtype="int8")
    assert eng.draft_layer_dtype == "int8"
    assert eng.model.module().mtp.fc.weight[...].dtype == jnp.int8
    for r, out in zip(reqs, want):
        assert r.output_ids == out
        assert r.num_draft_tokens > 0 and r.num_accepted_tokens == r.num_draft_tokens


@pytest.mark.gpu  # the sampled round variant takes about a minute to compile on a 2-core CPU
def test_near_greedy_sampled_rows_with_lowest_ids_equal_plain(chain, plain):
    """Sampled rows at temperature 1e-3 (one-hot filtered distributions, so the exact
    rejection sampling must reproduce the greedy tokens) mixed with a greedy row: the
    scattered q of the hot ids goes through the real accept step."""
    prompts, want = plain
    params = [_greedy(),
              SamplingParams(temperature=1e-3, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=1e-3, top_k=3, top_p=0.9, max_tokens=MAX_TOKENS,
                             ignore_eos=True)]
    same_end = [p[:-1] + prompts[0][-1:] for p in prompts]
    reqs, _ = _run(chain, same_end, params, algorithm="mtp", num_steps=3, draft_vocab_size=N)
    for r in reqs:
        assert r.output_ids == want[0], r.request_id
        assert 0 < r.num_accepted_tokens < r.num_draft_tokens, r.request_id


def _np_filtered(logits, t, top_k, top_p):
    """float64 softmax(logits / t) over the top_k best, then the smallest prefix whose mass
    reaches top_p (ranking by logit descending, position ascending), renormalised."""
    order = np.lexsort((np.arange(logits.size), -logits))
    e = np.exp((logits - logits.max()) / t)
    keep = np.zeros(logits.size, bool)
    kk = logits.size if top_k <= 0 else min(top_k, logits.size)
    ranked = e[order[:kk]]
    before = np.concatenate([[0.0], np.cumsum(ranked)[:-1]]) / ranked.sum()
    n = int(np.sum((before < top_p) | (top_p >= 1)))
    keep[order[:max(n, 1)]] = True
    w = np.where(keep, e, 0.0)
    return w / w.sum()


@pytest.mark.parametrize("tied", [False, True])
def test_draft_token_q_is_the_filtered_softmax_over_the_hot_logits(base, tied):
    """``draft_token`` with a hot head: q [B, V] is 0 outside the hot set, sums to 1 and
    equals the float64 filtered softmax of ``z @ W[hot].T``; drawn tokens are hot with q > 0;
    the greedy row's token is ``hot[argmax]``. Tied: the rows come from the embedding."""
    model = (load_model(fixture_path("tiny_moe_mtp_per_expert"), "float32", with_mtp=True)
             if tied else base)
    v, h = model.cfg.vocab_size, model.cfg.hidden_size
    hot = np.random.default_rng(3).permutation(v)[:N].astype(np.int32)
    module = with_draft_head(model, hot).module()
    table = _arrays(model)["embed_tokens.weight" if tied else "lm_head.weight"]
    w_hot = np.asarray(table, np.float64)[hot]
    np.testing.assert_array_equal(np.asarray(module.draft_head.weight[...]), np.asarray(table)[hot])
    z = np.random.default_rng(4).normal(0, 1, (5, h)).astype(np.float32)
    rows = [(0.0, -1, 1.0), (0.8, -1, 1.0), (1.0, 5, 1.0), (0.7, -1, 0.6), (1.3, 10, 0.8)]
    sampling = SamplingTensors.from_params([(t, k, p, 100 + i) for i, (t, k, p) in enumerate(rows)])
    step = jnp.arange(5, dtype=jnp.int32)
    tok, q = draft_token(module, jnp.asarray(z), sampling, step, 1, False)
    tok, q = np.asarray(tok), np.asarray(q)
    assert q.shape == (5, v) and q.dtype == np.float32
    cold = np.setdiff1d(np.arange(v), hot)
    logits = z.astype(np.float64) @ w_hot.T
    assert tok[0] == hot[np.argmax(logits[0])]
    for b, (t, k, p) in enumerate(rows[1:], 1):
        assert np.all(q[b, cold] == 0)
        np.testing.assert_allclose(q[b].sum(), 1.0, atol=1e-6)
        np.testing.assert_allclose(q[b, hot], _np_filtered(logits[b], t, k, p), atol=2e-6,
                                   err_msg=f"row {b}")
        assert tok[b] in hot and q[b, tok[b]] > 0
    g_tok, g_q = draft_token(module, jnp.asarray(z), sampling, step, 1, True)  # greedy-only
    np.testing.assert_array_equal(np.asarray(g_tok), hot[np.argmax(logits, -1)])
    assert g_q.shape == (5, v) and not np.asarray(g_q).any()


def _write(ids, name, fmt=None):
    import tempfile

    path = f"{tempfile.mkdtemp(prefix='tokmap_')}/{name}"
    if name.endswith(".npy"):
        np.save(path, np.asarray(ids))
    elif name.endswith(".json"):
        with open(path, "w") as f:
            json.dump([int(i) for i in ids] if fmt is None else fmt, f)
    else:
        with open(path, "w") as f:
            f.write(fmt if fmt is not None else "\n".join(str(int(i)) for i in ids) + "\n")
    return path


def test_token_map_formats_and_sizes():
    ids = [7, 3, 250, 0, 42]
    for name in ("m.npy", "m.json", "m.txt"):
        got = hot_token_ids("mtp", None, _write(ids, name), 300)
        assert got.dtype == np.int32 and got.tolist() == ids, name
        assert hot_token_ids("mtp", 3, _write(ids, name), 300).tolist() == [7, 3, 250]
    assert hot_token_ids("mtp", 4, None, 300).tolist() == [0, 1, 2, 3]
    assert hot_token_ids("mtp", None, None, 300) is None
    assert hot_token_ids("none", None, None, 300) is None


@pytest.mark.parametrize("kw, flag, words", [
    (dict(algorithm="none", draft_vocab_size=8), SIZE_FLAG, "mtp"),
    (dict(algorithm="external", token_map_path="x.txt"), MAP_FLAG, "mtp"),
    (dict(draft_vocab_size=0), SIZE_FLAG, "1..300"),
    (dict(draft_vocab_size=301), SIZE_FLAG, "1..300"),
    (dict(draft_vocab_size="8"), "speculative_draft_vocab_size '8' is of type str, not an int "
     "or None", "pass speculative_draft_vocab_size=8"),
    (dict(token_map=[5, 300]), MAP_FLAG, "300"),
    (dict(token_map=[-1, 2]), MAP_FLAG, "-1"),
    (dict(token_map=[5, 9, 5]), MAP_FLAG, "repeats token id 5"),
    (dict(token_map=[5, 9], draft_vocab_size=3), MAP_FLAG, "holds 2 ids"),
    (dict(token_map_path="/nonexistent/map.npy"), MAP_FLAG, "not a file"),
    (dict(token_map_text="4\nabc\n"), MAP_FLAG, ":2"),
    (dict(token_map_json={"ids": [1]}), MAP_FLAG, "list"),
    (dict(token_map_pt=True), MAP_FLAG, "numpy.save"),
])
def test_bad_settings_name_the_flag(kw, flag, words):
    kw = dict(kw)
    if "token_map" in kw:
        kw["token_map_path"] = _write(kw.pop("token_map"), "m.npy")
    if "token_map_text" in kw:
        kw["token_map_path"] = _write(None, "m.txt", kw.pop("token_map_text"))
    if "token_map_json" in kw:
        kw["token_map_path"] = _write(None, "m.json", kw.pop("token_map_json"))
    if kw.pop("token_map_pt", False):
        kw["token_map_path"] = _write(None, "map.pt", "")
    spec = SpeculativeConfig(**{"algorithm": "mtp", **kw})
    with pytest.raises(ConfigError) as e:  # the config-time checks with the vocabulary size
        check_settings(spec, vocab_size=ModelConfig.from_folder(CKPT).vocab_size)
    assert flag in str(e.value) and words in str(e.value), str(e.value)


def test_cli_and_llm_refuse_before_load(capsys):
    from mtp_jax import LLM, generate

    assert generate.main(["--model", CKPT, SIZE_FLAG, "0"]) == 2
    assert SIZE_FLAG in capsys.readouterr().err
    assert generate.main(["--model", CKPT, "--speculative-algorithm", "none",
                          MAP_FLAG, "/nonexistent.npy"]) == 2
    assert MAP_FLAG in capsys.readouterr().err
    with pytest.raises(ConfigError, match=SIZE_FLAG):  # qwen4_exp runs no draft
        LLM(fixture_path("tiny_qwen4_exp"), speculative_algorithm="none",
            speculative_draft_vocab_size=8)
    args = generate.build_parser().parse_args([SIZE_FLAG, "32768", MAP_FLAG, "m.npy"])
    assert args.speculative_draft_vocab_size == 32768 and args.speculative_token_map == "m.npy"


def test_bench_counts_hot_rows_and_passes_n(base, tmp_path, capsys):
    from mtp_jax.bench import main
    from mtp_jax.bench.floor import round_bytes
    from mtp_jax.bench.run import Settings, make_engine

    cfg = base.cfg
    k, v, h = 3, cfg.vocab_size, cfg.hidden_size
    full = round_bytes(cfg, 2, k, 100, 2)
    cut = round_bytes(cfg, 2, k, 100, 2, draft_vocab_size=N)
    assert cut["weights"] == full["weights"]  # the target's head stays full
    assert full["draft_weights"] - cut["draft_weights"] == k * (v - N) * h * 2
    s = Settings(prompt_len=16, decode_tokens=4, max_k=k, draft_vocab_size=N)
    assert make_engine(base, 1, k, s).draft_vocab_size == N
    assert make_engine(base, 1, 0, s).draft_vocab_size is None
    (tmp_path / "c.json").write_text(open(f"{CKPT}/config.json").read())
    for n in ("0", "301"):
        assert main(["--config", str(tmp_path / "c.json"), "--draft-vocab-size", n,
                     "--out", str(tmp_path / "o.json")]) == 2
        assert "--draft-vocab-size" in capsys.readouterr().err
