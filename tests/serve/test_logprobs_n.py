"""logprobs / top_logprobs and n > 1 through the live server against LLM.generate: OpenAI's
shapes, choice indices, seeds seed + i, streamed chunks per choice."""

from __future__ import annotations

import pytest

from mtp_jax import SamplingParams
from tests.serve.test_completions import IDS, sse_events

SAMPLED = {"prompt": IDS, "max_tokens": 7, "temperature": 0.9, "top_k": 5, "seed": 7,
           "ignore_eos": True}


def ref_params(seed, logprobs=2):
    return SamplingParams(temperature=0.9, top_k=5, max_tokens=7, seed=seed, ignore_eos=True,
                          logprobs=logprobs)


def test_completions_n_and_logprobs_equal_llm_generate(live):
    got = live.client.post("/v1/completions", json={**SAMPLED, "n": 2, "logprobs": 2}).json()
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert got["usage"]["prompt_tokens"] == len(IDS)  # counted once for both samples
    for j, choice in enumerate(got["choices"]):
        ref = live.reference(IDS, ref_params(7 + j))
        assert choice["token_ids"] == ref.token_ids
        lp = choice["logprobs"]
        # batched with its sibling, the reference alone: float32 rounding may differ
        assert lp["token_logprobs"] == pytest.approx([x.logprob for x in ref.logprobs],
                                                     abs=1e-5)
        assert len(lp["tokens"]) == len(lp["text_offset"]) == len(ref.token_ids)
        assert lp["text_offset"][0] == 0
        for tops, x in zip(lp["top_logprobs"], ref.logprobs):
            assert 1 <= len(tops) <= 2
            assert max(tops.values()) == pytest.approx(x.top[0][1], abs=1e-5)
    assert got["choices"][0]["token_ids"] != got["choices"][1]["token_ids"]


def test_chat_logprobs_shape(live):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "temperature": 0, "logprobs": True, "top_logprobs": 3}
    got = live.client.post("/v1/chat/completions", json=body).json()
    prompt = live.llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    ref = live.reference(prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=3))
    content = got["choices"][0]["logprobs"]["content"]
    # equal up to float32 rounding: whether a greedy request's round verified drafts (a
    # (k+1)-row program) or ran a plain step follows the engine's earlier requests
    assert [c["logprob"] for c in content] == pytest.approx(
        [x.logprob for x in ref.logprobs], abs=1e-5)
    for c, x in zip(content, ref.logprobs):
        assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx(
            [v for _, v in x.top], abs=1e-5)
        assert c["top_logprobs"][0]["token"] == c["token"]  # greedy: the best one
        assert c["bytes"] == list(c["token"].encode())
    plain = live.client.post("/v1/chat/completions", json={**body, "logprobs": False,
                                                           "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_stream_n_gives_chunks_per_choice(live):
    body = {**SAMPLED, "n": 2, "logprobs": 1}
    full = live.client.post("/v1/completions", json=body).json()["choices"]
    with live.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    for j in (0, 1):
        mine = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == j]
        assert sum((c["token_ids"] for c in mine), []) == full[j]["token_ids"]
        lps = [c["logprobs"] for c in mine if c["logprobs"] is not None]
        assert sum((x["token_logprobs"] for x in lps), []) == \
            full[j]["logprobs"]["token_logprobs"]
        assert sum((x["text_offset"] for x in lps), []) == full[j]["logprobs"]["text_offset"]
        assert mine[-1]["finish_reason"] == "length"
