"""Completions and chat through the live server against LLM.generate (the reference, run on
the same engine while the server is idle), concurrent clients, streams."""

from __future__ import annotations

import json
import threading

import pytest

from mtp_jax import SamplingParams

IDS = [5, 9, 30, 7, 200, 41, 3]


def sse_events(resp) -> list:
    """The data of each server-sent event (``[DONE]`` as the string)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_greedy_completions_equal_llm_generate(live):
    for prompt in ("Hello, server", IDS):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 9, "temperature": 0}
        got = live.client.post("/v1/completions", json=body).json()
        ref = live.reference(prompt, SamplingParams(temperature=0, max_tokens=9))
        choice = got["choices"][0]
        assert choice["token_ids"] == ref.token_ids and choice["text"] == ref.text
        assert choice["finish_reason"] == ref.finish_reason
        assert got["usage"]["completion_tokens"] == len(ref.token_ids)
        assert got["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
        spec = got["speculative"]
        assert spec["num_rounds"] >= 1 and spec["accept_length"] >= 1.0
        # drafts verified: the engine's greedy estimate (random head) may skip them all
        assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]


def test_concurrent_clients_each_get_their_solo_output(live):
    prompts = [[int(7 + 13 * i + j) % 250 + 2 for j in range(3 + i)] for i in range(6)]
    got = [None] * len(prompts)

    def client(i):
        body = {"prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        got[i] = live.client.post("/v1/completions", json=body).json()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for p, g in zip(prompts, got):
        assert g["choices"][0]["token_ids"] == live.reference(p, params).token_ids


def test_batch_prompt_gives_one_choice_per_prompt(live):
    body = {"prompt": [IDS, IDS[:4]], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    got = live.client.post("/v1/completions", json=body).json()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert got["choices"][1]["token_ids"] == live.reference(IDS[:4], params).token_ids
    assert got["usage"]["completion_tokens"] == 10


def test_stream_deltas_concatenate_to_the_full_text(live):
    body = {"prompt": "Stream me", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = live.client.post("/v1/completions", json=body).json()["choices"][0]
    with live.client.stream("POST", "/v1/completions",
                            json={**body, "stream": True,
                                  "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == full["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "speculative" in chunks[-1]
    assert events[-2]["usage"]["completion_tokens"] == 12


def test_stop_string_is_cut_from_streamed_and_full_text(live):
    body = {"prompt": "Stops", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = live.client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[3:5]  # a stop string the greedy output reaches
    assert len(stop) == 2
    cut = live.client.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[:text.index(stop)]
    with live.client.stream("POST", "/v1/completions",
                            json={**body, "stop": stop, "stream": True}) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut["text"]


def test_chat_uses_the_chat_template(live):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    got = live.client.post("/v1/chat/completions", json=body).json()
    prompt = live.llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}])
    ref = live.reference(prompt, SamplingParams(temperature=0, max_tokens=6))
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert got["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    with live.client.stream("POST", "/v1/chat/completions",
                            json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events[1:-1]]
    assert "".join(deltas) == ref.text
    assert events[-2]["choices"][0]["finish_reason"] == ref.finish_reason


def test_cli_flags_defaults_and_docs():
    """The server takes the CLI's engine flags (no prompt flags) plus its own; no --model is
    the built-in default model; docs/cli.md documents every flag."""
    import os

    from mtp_jax.generate import llm_kwargs
    from mtp_jax.serve.cli import build_parser
    from tests.helpers.paths import DOCS

    args = build_parser().parse_args([])
    assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", 8000, None)
    assert llm_kwargs(args)["model"] is None and llm_kwargs(args)["speculative_num_steps"] == 3
    flags = [s for a in build_parser()._actions for s in a.option_strings]
    assert "--prompt" not in flags and "--speculative-num-steps" in flags
    doc = open(os.path.join(DOCS, "cli.md")).read()
    assert [f for f in flags if f"`{f}" not in doc and f not in ("-h", "--help")] == []


def test_an_address_it_cannot_listen_on_is_refused_before_the_load(monkeypatch, capsys):
    """A port another socket listens on, or a host that is not this machine's, is an
    ``error:`` line naming the flag and exit status 2, before any weight loads (uvicorn's own
    error came after the load and the warm-up)."""
    import socket

    import mtp_jax.serve.cli as serve_cli

    monkeypatch.setattr(serve_cli, "make_llm", lambda args: pytest.fail("the model loaded"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert serve_cli.main(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"error: --port {port} on 127.0.0.1: cannot listen there" in err
    assert "pass a free --port" in err
    assert serve_cli.main(["--host", "no-such-host.invalid", "--port", str(port)]) == 2
    assert "error: --host no-such-host.invalid: not an address of this machine" in \
        capsys.readouterr().err
