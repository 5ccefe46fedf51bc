"""The LLM face: several requests at once, stops, seeds, token-id prompts, and the CLI."""

import json

import numpy as np
import pytest

from mtp_jax import LLM, SamplingParams
from mtp_jax.engine import scheduler as scheduler_mod
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_moe_fused")


@pytest.fixture(scope="module")
def llm_mtp():
    return LLM(CKPT, dtype="float32", speculative_algorithm="mtp", speculative_num_steps=2,
               max_running_requests=2)


def _prompts(n, vocab=300):
    rng = np.random.default_rng(3)
    return [rng.integers(2, vocab, int(rng.integers(2, 20))).tolist() for _ in range(n)]


def test_more_requests_than_slots_equal_solo_runs(llm_mtp):
    prompts = _prompts(5)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    together = llm_mtp.generate(prompts, params)
    for p, out in zip(prompts, together):
        solo = llm_mtp.generate([p], params)[0]
        assert out.token_ids == solo.token_ids
        assert len(out.token_ids) == 7 and out.finish_reason == "length"
        assert out.text == ""  # no tokenizer in this folder
    llm_mtp.engine.flush_cache()  # the prefix cache keeps prompt pages until flushed
    assert llm_mtp.engine.book.slots.num_free == 2 and llm_mtp.engine.book.pages.num_free == \
        llm_mtp.engine.book.pages.size - 1  # everything released


def test_seeded_sampling_is_reproducible_and_greedy_ignores_seed(llm_mtp):
    p = _prompts(1)[0]
    a = llm_mtp.generate([p], SamplingParams(temperature=1.0, max_tokens=12, seed=5,
                                             ignore_eos=True))[0]
    b = llm_mtp.generate([p], SamplingParams(temperature=1.0, max_tokens=12, seed=5,
                                             ignore_eos=True))[0]
    c = llm_mtp.generate([p], SamplingParams(temperature=1.0, max_tokens=12, seed=6,
                                             ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    g1 = llm_mtp.generate([p], SamplingParams(temperature=0, max_tokens=8, seed=1))[0]
    g2 = llm_mtp.generate([p], SamplingParams(temperature=0, max_tokens=8, seed=2))[0]
    assert g1.token_ids == g2.token_ids


def test_stop_token_truncates_exactly(llm_mtp):
    p = _prompts(1)[0]
    full = llm_mtp.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_at = full.token_ids[4]
    first = full.token_ids.index(stop_at)
    out = llm_mtp.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                               stop_token_ids=[stop_at]))[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop"


def test_bad_requests_raise_before_work(llm_mtp):
    with pytest.raises(ValueError, match="empty prompt"):
        llm_mtp.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm_mtp.generate([[5, 300]])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm_mtp.generate("hello")


def test_external_proposer_all_right_accepts_everything(llm_mtp):
    p = _prompts(1)[0]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    ref = llm_mtp.generate([p], params)[0].token_ids  # greedy: the model's own tokens

    def proposer(rid, ids, k):
        done = len(ids) - len(p)
        return (ref + [0] * 8)[done:done + k]

    llm = LLM(CKPT, dtype="float32", speculative_algorithm="external", speculative_num_steps=3,
              proposer=proposer)
    out = llm.generate([p], params)[0]
    assert out.token_ids == ref
    # 1 prefill token, then rounds of k+1 = 4: 1 + 4 + 4 = 9.
    assert out.num_rounds == 2 and out.accept_length == 4.0 and out.acceptance_rate == 1.0


def test_stats_line_reports_accept_length_with_speculation_off():
    """Speculation off: one token per decode step (accept length 1.00), no drafts (n/a); on:
    (tokens - 1) / rounds and accepted / proposed."""
    from mtp_jax.engine.requests import RequestOutput
    from mtp_jax.generate import _stats_line

    off = RequestOutput("a", None, [1, 2], [5, 6, 7, 8], "", "length", num_rounds=3)
    assert "accept_length=1.00 acceptance_rate=n/a" in _stats_line(off, 1.0)
    on = RequestOutput("b", None, [1, 2], [5, 6, 7, 8, 9, 10, 11], "", "length", num_rounds=2,
                       num_draft_tokens=6, num_accepted_tokens=4)
    assert "accept_length=3.00 acceptance_rate=66.7%" in _stats_line(on, 1.0)


def test_cli_on_default_model(vocab_cache, tmp_path, monkeypatch, capsys):
    import shutil

    from mtp_jax import generate
    from mtp_jax.tools import qwen_vocab

    # An empty cache but for the converted tokenizer.json (the session's, as test_tokenizer's
    # test_default_model does): the CLI builds the default model there, without converting the
    # vocabulary a second time in the session.
    shutil.copy(qwen_vocab.converted_tokenizer_json(vocab_cache), tmp_path)
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path))
    rc = generate.main(["--prompt", "Hello there", "--max-tokens", "5", "--json",
                        "--speculative-num-steps", "2", "--chat"])
    assert rc == 0
    cap = capsys.readouterr()
    rec = json.loads(cap.out.strip().splitlines()[-1])
    assert rec["output_tokens"] == 5 and isinstance(rec["text"], str)
    # the [model] line names the round cost adaptive speculation holds drafting to; the
    # default model's LM head makes it more than a round of k = 2 can commit
    assert "adaptive (a round costs " in cap.err and "a request drafts while" in cap.err
    assert "so no request drafts" in cap.err
    assert rec["accept_length"] is not None and rec["prompt_tokens"] > 3


def test_cli_rejects_bad_spec_steps(capsys):
    from mtp_jax import generate

    assert generate.main(["--model", CKPT, "--speculative-num-steps", "9"]) == 2
    assert "speculative_num_steps" in capsys.readouterr().err


def test_generate_stream_yields_tokens_as_rounds_complete(llm_mtp):
    prompts = _prompts(3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = llm_mtp.generate(prompts, params)
    got = {i: [] for i in range(3)}
    finals = {}
    for chunk in llm_mtp.generate_stream(prompts + [[]], params):
        if chunk.finished:
            finals[chunk.index] = chunk.output
        got.setdefault(chunk.index, []).extend(chunk.new_token_ids)
    assert finals[3].finish_reason == "error" and got[3] == []
    for i in range(3):
        assert got[i] == ref[i].token_ids == finals[i].token_ids


def test_cli_prompts_file(llm_mtp, tmp_path, capsys):
    """``--prompts-file`` with ``--json``: each record's tokens are a solo run's (its draft
    counts may differ: adaptive speculation decides greedy requests together), and every
    record carries the run's prefix-cache counters, the ``[prefix-cache]`` line's figures (the
    same run without ``--json``)."""
    from mtp_jax import generate

    f = tmp_path / "reqs.jsonl"
    prompts = _prompts(3)
    f.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": 3 + i})
                           for i, p in enumerate(prompts)))
    rc = generate.main(["--model", CKPT, "--prompts-file", str(f), "--json", "--ignore-eos",
                        "--speculative-num-steps", "2", "--max-running-requests", "2"])
    assert rc == 0
    cap = capsys.readouterr()
    assert "Requests:" not in cap.err  # no progress bar when stderr is not a terminal
    lines = [json.loads(x) for x in cap.out.strip().splitlines()]
    assert [rec["output_tokens"] for rec in lines] == [3, 4, 5]
    for p, rec in zip(prompts, lines):
        solo = llm_mtp.generate([p], SamplingParams(
            temperature=0, max_tokens=rec["output_tokens"], ignore_eos=True))[0]
        assert rec["token_ids"] == solo.token_ids
        assert 0 <= rec["num_accepted_tokens"] <= rec["num_draft_tokens"]
    assert sum(rec["num_draft_tokens"] for rec in lines) > 0
    cache = lines[0]["prefix_cache"]
    assert all(rec["prefix_cache"] == cache for rec in lines)
    assert cache["lookups"] == 3 and cache["prompt_tokens"] == sum(map(len, prompts))
    # Without --json and without a tokenizer the text output shows the token ids.
    assert generate.main(["--model", CKPT, "--prompts-file", str(f), "--ignore-eos",
                          "--speculative-num-steps", "2", "--max-running-requests", "2"]) == 0
    text_out = capsys.readouterr().out
    for rec in lines:
        assert f"(no tokenizer) token ids: {rec['token_ids']}" in text_out
    assert (f"[prefix-cache] lookups={cache['lookups']} hits={cache['hits']} "
            f"reused_tokens={cache['reused_tokens']} of prompt_tokens={cache['prompt_tokens']}"
            ) in text_out
    f.write_text('{"prompt": [1, 2], "bogus": 1}\n')
    assert generate.main(["--model", CKPT, "--prompts-file", str(f)]) == 2
    assert "unknown keys" in capsys.readouterr().err


def test_cli_prompts_file_bad_sampling_line_fails_alone(tmp_path, capsys):
    from mtp_jax import generate

    f = tmp_path / "reqs.jsonl"
    p = _prompts(2)
    f.write_text(json.dumps({"prompt": p[0], "max_tokens": 2}) + "\n"
                 + json.dumps({"prompt": p[1], "temperature": -1}) + "\n")
    # llm_mtp's settings (MTP, k = 2, two slots): the CLI loads the programs it saved.
    rc = generate.main(["--model", CKPT, "--prompts-file", str(f), "--json",
                        "--speculative-num-steps", "2", "--max-running-requests", "2"])
    assert rc == 1
    recs = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert recs[0]["output_tokens"] == 2 and recs[0]["finish_reason"] in ("length", "stop")
    assert recs[1]["finish_reason"] == "error" and "request 2" in recs[1]["error"]
    assert recs[0]["prompt_tokens"] == len(p[0]) and recs[1]["prompt_tokens"] is None


def test_warmup_compiles_everything_the_run_calls(llm_mtp, monkeypatch):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 300, n).tolist() for n in (5, 70, 9)]  # 70 > one snapshot interval
    # The top-p request ends first: rounds with and without a filtering row (two variants).
    params = [SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, ignore_eos=True)]
    next_id = llm_mtp._next_id
    assert llm_mtp.warmup(prompts, params) > 0
    assert llm_mtp._next_id == next_id  # default seeds are not shifted by the warm-up
    before = llm_mtp.engine.compiled_program_count()
    seen = []
    real = scheduler_mod.sampling_choice
    monkeypatch.setattr(scheduler_mod, "sampling_choice",
                        lambda *a: seen.append(real(*a)) or seen[-1])
    outs = llm_mtp.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [30, 40, 6]
    assert {v.get("filtering") for v in seen if not v["greedy_only"]} == {True, False}
    assert llm_mtp.engine.compiled_program_count() == before
