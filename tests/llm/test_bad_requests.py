"""Bad requests (issue 4, part 4): invalid sampling parameters raise ValueError before any work;
a bad prompt among several gets finish_reason="error" with the message while the others finish
with the same output as their solo runs; a lone bad prompt raises."""

import json
import math

import numpy as np
import pytest

from mtp_jax import LLM, SamplingParams
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_moe_fused")
MAX_LEN = 4096  # the default max_model_len, and the tiny checkpoint's max_position_embeddings
VOCAB = 300


@pytest.fixture(scope="module")
def llm():
    return LLM(CKPT, dtype="float32", speculative_algorithm="mtp", speculative_num_steps=2,
               max_running_requests=1)


@pytest.fixture
def run_spy(llm, monkeypatch):
    calls = []
    real = llm.engine.run

    def spy(requests, *a, **k):
        calls.append([list(r.prompt_ids) for r in requests])
        return real(requests, *a, **k)

    monkeypatch.setattr(llm.engine, "run", spy)
    return calls


BAD_PROMPTS = [
    ("empty", [], r"empty prompt: a prompt needs at least one token"),
    ("too_long", [2 + i % 250 for i in range(MAX_LEN)],
     rf"prompt of {MAX_LEN} tokens does not fit max_model_len {MAX_LEN}.*the model's "
     rf"max_position_embeddings \({MAX_LEN}\) caps max_model_len"),
    ("id_too_large", [5, VOCAB, 7], rf"prompt token ids \[{VOCAB}\] are outside the vocabulary "
                                    rf"\[0, {VOCAB}\)"),
    ("negative_id", [5, -1], r"prompt token ids \[-1\] are outside the vocabulary"),
    ("float_ids", [5, 2.5], r"prompt token ids must be ints; got \[2\.5\]"),
    ("text_without_tokenizer", "hello", r"has no tokenizer files; pass prompts as lists of "
                                        r"token ids"),
    ("not_a_prompt", 3.5, r"prompt 3\.5 is neither a string, a list of token ids nor a prompt "
                          r"dict"),
    ("dict_unknown_key", {"ids": [1]}, r"prompt dict keys \['ids'\] are not supported"),
    ("dict_both_keys", {"prompt": "a", "prompt_token_ids": [1]},
     r"holds exactly one of 'prompt' \(text\) or 'prompt_token_ids'"),
    ("dict_ids_as_prompt", {"prompt": [5, 6]}, r"'prompt' is list, not text"),
]


def _good(n):
    rng = np.random.default_rng(11)
    return [rng.integers(2, VOCAB, int(rng.integers(3, 12))).tolist() for _ in range(n)]


@pytest.mark.parametrize("bad", BAD_PROMPTS, ids=[b[0] for b in BAD_PROMPTS])
def test_lone_bad_prompt_raises_before_work(llm, run_spy, bad):
    name, prompt, pattern = bad
    with pytest.raises(ValueError, match=pattern):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
    assert run_spy == []


def test_bad_prompts_in_a_batch_fail_alone(llm):
    good = _good(3)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=6, seed=7,
                            ignore_eos=True)
    prompts = [good[0]] + [b[1] for b in BAD_PROMPTS[:4]] + [good[1]] \
        + [b[1] for b in BAD_PROMPTS[4:]] + [good[2]]
    params = [greedy] * len(prompts)
    params[-1] = seeded
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts)
    bad_outs = [o for o in outs if o.finish_reason == "error"]
    assert len(bad_outs) == len(BAD_PROMPTS)
    for (name, prompt, pattern), o in zip(BAD_PROMPTS, bad_outs):
        import re

        assert re.search(pattern, o.error), (name, o.error)
        assert o.token_ids == [] and o.text == ""
    good_outs = [o for o in outs if o.finish_reason != "error"]
    assert [o.prompt_token_ids for o in good_outs] == good
    solo = [llm.generate([good[0]], greedy)[0], llm.generate([good[1]], greedy)[0],
            llm.generate([good[2]], seeded)[0]]
    for o, s in zip(good_outs, solo):
        assert o.error is None and o.finish_reason == "length"
        assert o.token_ids == s.token_ids and len(o.token_ids) == 6
    assert len({o.request_id for o in outs}) == len(outs)
    # Every slot was given back: the refused prompts left nothing behind.
    assert llm.engine.book.slots.num_free == 1


def test_all_prompts_bad_in_a_batch(llm, run_spy):
    outs = llm.generate([[], [VOCAB]], SamplingParams(temperature=0, max_tokens=3))
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert "empty prompt" in outs[0].error and "outside the vocabulary" in outs[1].error


BAD_PARAMS = [
    (dict(temperature=-0.1), r"temperature -0\.1 must be a number in \[0, 3\.4e\+38\]"),
    (dict(temperature=math.nan), r"temperature nan must be a number in \[0, "),
    (dict(temperature=math.inf), r"temperature inf must be a number in \[0, "),
    (dict(temperature=1e39), r"temperature 1e\+39 must be a number in \[0, .*float32"),
    (dict(temperature="0.5"), r"temperature '0\.5' must be a number in \[0, "),
    (dict(top_p=0), r"top_p 0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p 1\.5 must be in \(0, 1\]"),
    (dict(top_p=-0.2), r"top_p -0\.2 must be in \(0, 1\]"),
    (dict(top_p=math.nan), r"top_p nan must be in \(0, 1\]"),
    (dict(top_k=-2), r"top_k -2 must be an int: -1 or 0 \(off\) or >= 1"),
    (dict(top_k=2.5), r"top_k 2\.5 must be an int"),
    (dict(max_tokens=0), r"max_tokens 0 must be an int >= 1"),
    (dict(max_tokens=-3), r"max_tokens -3 must be an int >= 1"),
    (dict(max_tokens=True), r"max_tokens True must be an int >= 1"),
    (dict(seed=-1), r"seed -1 must be an int in \[0, 2\*\*32\)"),
    (dict(stop=[""]), r"stop \[''\] must hold non-empty strings"),
    (dict(stop_token_ids=[-4]), r"stop_token_ids \[-4\] must hold ints >= 0"),
]


@pytest.mark.parametrize("kwargs,pattern", BAD_PARAMS, ids=[str(b[0]) for b in BAD_PARAMS])
def test_invalid_sampling_params_raise_at_construction(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_valid_edge_sampling_params():
    SamplingParams(temperature=0, top_p=1, top_k=-1, max_tokens=1)
    SamplingParams(top_k=0, top_p=1e-6, seed=2**32 - 1, stop="x", stop_token_ids=[0])
    SamplingParams(top_k=np.int64(5), max_tokens=np.int32(3), temperature=np.float32(0.5))


@pytest.mark.parametrize("kwargs,pattern", BAD_PARAMS[:6], ids=[str(b[0]) for b in BAD_PARAMS[:6]])
def test_params_changed_after_construction_refused_before_work(llm, run_spy, kwargs, pattern):
    good = _good(2)
    sp = SamplingParams(temperature=0, max_tokens=3)
    for k, v in kwargs.items():
        setattr(sp, k, v)
    with pytest.raises(ValueError, match=pattern):
        llm.generate(good, [SamplingParams(temperature=0, max_tokens=3), sp])
    assert run_spy == []


def test_stop_strings_without_a_tokenizer_are_refused(llm, run_spy):
    """This checkpoint has no tokenizer, so a stop string could never match: refused, not
    ignored."""
    with pytest.raises(ValueError, match=r"stop strings \['a'\] need a tokenizer.*"
                                         r"use stop_token_ids"):
        llm.generate([[5, 6]], SamplingParams(stop=["a"], max_tokens=4))
    assert run_spy == []


def test_sampling_params_count_and_type(llm, run_spy):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(_good(3), [SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"sampling_params\[0\] is dict, not SamplingParams"):
        llm.generate(_good(1), [{"temperature": 0}])
    with pytest.raises(ValueError, match=r"sampling_params is a dict; pass a SamplingParams"):
        llm.generate(_good(1), {"temperature": 0})
    for bad in (5, None):
        with pytest.raises(ValueError, match=rf"prompts {bad} \(\w+\) must be a string, a list "
                                             "of token ids, a prompt dict, or a list of "
                                             "these"):
            llm.generate(bad, SamplingParams())
    assert run_spy == []


def test_stop_token_ids_outside_the_vocabulary(llm, run_spy):
    """A stop id the model can never emit is refused like a prompt id outside the vocabulary:
    alone it raises before any work; among several, that request fails alone."""
    bad = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[3, VOCAB])
    with pytest.raises(ValueError, match=rf"stop_token_ids \[{VOCAB}\] are outside the "
                                         rf"vocabulary \[0, {VOCAB}\)"):
        llm.generate(_good(1), bad)
    assert run_spy == []
    ok = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[VOCAB - 1])
    outs = llm.generate(_good(2), [bad, ok])
    assert outs[0].finish_reason == "error" and "stop_token_ids" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) >= 1


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "0"], "max_tokens (--max-tokens) 0 must be an int >= 1"),
    (["--temperature", "-1"], "temperature (--temperature) -1.0 must be a number in [0, 3.4e+38]"),
    (["--seed", "-1"], "seed (--seed) -1 must be an int in [0, 2**32); pass a non-negative one "
                       "such as 4294967295 (the same 32 bits)."),
    (["--top-p", "1.5"], "top_p (--top-p) 1.5 must be in (0, 1]"),
    (["--top-k", "-3"], "top_k (--top-k) -3 must be an int"),
    (["--prompts-file", "/nonexistent/p.jsonl"],
     "--prompts-file /nonexistent/p.jsonl: No such file or directory; pass an existing JSONL"),
    (["--prompt", "hi"], "has no tokenizer files"),
])
def test_cli_bad_requests(args, message, capsys):
    from mtp_jax import generate

    assert generate.main(["--model", CKPT, "--spec-algo", "none"] + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_cli_prompt_and_prompts_file_refused_together(tmp_path, capsys):
    """Two sources of prompts: argparse refuses the pair rather than ignore one."""
    from mtp_jax import generate

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": [5, 6]}\n')
    with pytest.raises(SystemExit) as e:
        generate.main(["--model", CKPT, "--prompt", "hi", "--prompts-file", str(f)])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_warnings_print_as_one_line(monkeypatch, capsys):
    """A warning raised while the CLI runs prints as ``warning: <message>``, without the
    Python source line that raised it."""
    import warnings

    import mtp_jax
    from mtp_jax import generate
    from mtp_jax.config import ConfigError
    from mtp_jax.engine.engine import MultiStepWarning

    def fake_llm(*args, **kwargs):
        warnings.warn("calls near snapshot boundaries run one round", MultiStepWarning)
        raise ConfigError("stop here")

    monkeypatch.setattr(mtp_jax, "LLM", fake_llm)
    assert generate.main(["--model", CKPT]) == 2
    err = capsys.readouterr().err
    assert "warning: calls near snapshot boundaries run one round\n" in err
    assert "MultiStepWarning" not in err and "fake_llm" not in err and "warnings.warn" not in err
    assert "error: stop here" in err


def test_cli_several_prompts_report_each_error(capsys):
    """Several prompts: each bad one is reported on its own and the exit status is 1."""
    from mtp_jax import generate

    rc = generate.main(["--model", CKPT, "--spec-algo", "none", "--prompt", "a", "--prompt", "b",
                        "--json"])
    assert rc == 1
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["finish_reason"] for r in recs] == ["error", "error"]
    assert all("no tokenizer files" in r["error"] for r in recs)


def test_top_k_beyond_int32_is_off_not_an_error(llm):
    """top_k at or above the vocabulary is off, also from 2**31 up (beyond int32): the request
    runs and samples as with top_k off, and the LLM keeps working."""
    prompt = _good(1)[0]
    sampled = dict(temperature=1.0, max_tokens=6, seed=9)
    off = llm.generate(prompt, SamplingParams(top_k=-1, **sampled))[0]
    huge = llm.generate(prompt, SamplingParams(top_k=2**31, **sampled))[0]
    assert huge.error is None and huge.token_ids == off.token_ids


def test_cli_seed_is_a_base_seed_per_prompt(tmp_path, capsys):
    """--seed S gives prompt i a seed made from S and i: a repeated prompt gets another sample,
    the same flags give the same texts, and a line's own seed is used as it is."""
    from mtp_jax import generate

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": [5, 6, 7]}\n{"prompt": [5, 6, 7]}\n'
                 '{"prompt": [5, 6, 7], "seed": 123}\n')
    flags = ["--model", CKPT, "--spec-algo", "none", "--prompts-file", str(f), "--json",
             "--temperature", "2.0", "--max-tokens", "12", "--seed", "5"]

    def run(extra=()):
        assert generate.main(flags + list(extra)) == 0
        return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]

    first, again = run(), run()
    assert first == again
    assert first[0] != first[1]
    other_base = run(["--seed", "6"])
    assert other_base[0] != first[0] and other_base[2] == first[2]


def test_cli_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    from mtp_jax import generate

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "_main", interrupted)
    assert generate.main(["--prompt", "hi"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C)" in err and "Traceback" not in err


def test_vllm_prompt_dicts_run_as_their_contents(llm):
    """vLLM's ``{"prompt_token_ids": ids}`` (and ``{"prompt": text}``) prompts: the same
    outputs as the bare ids, one dict alone is one prompt, and the text form reaches the
    tokenizer (``prompt_ids`` with a stand-in tokenizer)."""
    from mtp_jax.prompts import prompt_ids

    good = _good(2)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    plain = llm.generate(good, greedy)
    dicts = llm.generate([{"prompt_token_ids": good[0]}, good[1]], greedy)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert dicts[0].prompt_token_ids == good[0] and dicts[0].prompt is None
    one = llm.generate({"prompt_token_ids": good[1]}, greedy)
    assert len(one) == 1 and one[0].token_ids == plain[1].token_ids
    assert llm.get_tokenizer() is None  # this folder has no tokenizer files

    class Chars:  # a stand-in tokenizer: one id per character
        def encode(self, text):
            return [ord(c) for c in text]

    assert prompt_ids({"prompt": "hi"}, Chars(), VOCAB, MAX_LEN) == ("hi", [104, 105])
