"""The live server's refusals, aborts, engine failures, cache rebuild and metrics."""

from __future__ import annotations

import threading

import pytest

from mtp_jax import SamplingParams
from tests.serve.test_completions import IDS

GREEDY = {"prompt": IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def status(live) -> dict:
    return live.client.get("/v1/cache/status").json()


def wait_idle(live) -> dict:
    """The cache status once no request runs (the engine thread applies aborts between
    steps; bounded by a count, not a clock)."""
    for _ in range(2000):
        s = status(live)
        if s["running_requests"] == 0 and s["waiting_requests"] == 0:
            return s
    raise AssertionError(f"requests still running: {s}")


def errors_counted(live, code: int) -> float:
    """``mtp_jax_request_errors_total`` of HTTP status ``code`` in ``/metrics`` (0 if none)."""
    prefix = f'mtp_jax_request_errors_total{{status="{code}"}} '
    lines = live.client.get("/metrics").text.splitlines()
    return next((float(x[len(prefix):]) for x in lines if x.startswith(prefix)), 0.0)


def check_error(resp, code: int, param=None) -> dict:
    assert resp.status_code == code, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param and param in err["message"]
    return err


def test_api_key(live):
    anon = live.client.post("/v1/completions", json=GREEDY, headers={"Authorization": ""})
    assert check_error(anon, 401)["type"] == "authentication_error"
    wrong = live.client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    check_error(wrong, 401)
    assert live.client.get("/health", headers={"Authorization": ""}).status_code == 200
    assert [m["id"] for m in live.client.get("/v1/models").json()["data"]] == ["tiny"]


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function"}]),
                                         ("repetition_penalty", 1.2), ("logit_bias", {"5": 1}),
                                         ("best_of", 3)])
def test_unsupported_fields_are_named(live, field, value):
    err = check_error(live.client.post("/v1/completions", json={**GREEDY, field: value}), 400,
                      field)
    assert "not supported" in err["message"]


def test_background_warmup_serves_requests_while_it_builds(live, monkeypatch):
    """``--warmup background`` (the server's default): :func:`mtp_jax.serve.cli.warm_up`
    returns with programs still building, a request served meanwhile gets the tokens
    ``LLM.generate`` gives, and a cancel leaves nothing building; ``--warmup none`` builds
    nothing."""
    from mtp_jax.serve.cli import warm_up

    monkeypatch.setenv("MTP_JAX_COMPILE_THREADS", "1")  # the cancel waits for one compile
    engine = live.llm.engine
    before = engine.device.programs.compiled_count()
    live.state.worker.call(lambda: warm_up(live.llm, "none"), idle=True).result(timeout=60)
    assert engine.device.building() == 0 and engine.device.programs.compiled_count() == before
    live.state.worker.call(lambda: warm_up(live.llm, "background"), idle=True).result(timeout=60)
    try:
        assert engine.device.building() > 0  # it returned before its programs were built
        resp = live.client.post("/v1/completions", json=GREEDY)
        assert resp.status_code == 200, resp.text
        want = live.reference(IDS, SamplingParams(temperature=0, max_tokens=6,
                                                  ignore_eos=True))
        assert resp.json()["choices"][0]["token_ids"] == want.token_ids
    finally:
        assert engine.wait_for_programs(cancel=True, timeout=300)
    assert engine.device.building() == 0


def test_bad_requests_are_4xx_and_good_ones_still_served(live):
    post = lambda body, **kw: live.client.post("/v1/completions", json=body, **kw)  # noqa
    check_error(live.client.post("/v1/completions", content=b"{not json"), 400)
    check_error(post([1, 2]), 400)
    check_error(post({**GREEDY, "temperature": "hot"}), 400, "temperature")
    check_error(post({**GREEDY, "max_tokens": 2.5}), 400, "max_tokens")
    check_error(post({**GREEDY, "top_p": 0}), 400, "top_p")
    check_error(post({**GREEDY, "n": 0}), 400, "n")
    check_error(post({**GREEDY, "logprobs": 21}), 400, "logprobs")
    check_error(live.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400,
        "top_logprobs")
    check_error(post({**GREEDY, "frobnicate": 1}), 400, "frobnicate")
    check_error(post({**GREEDY, "model": "gpt-4"}), 404, "model")
    long = check_error(post({**GREEDY, "prompt": [3] * 200}), 400, "prompt")
    assert long["code"] == "context_length_exceeded" and "max_model_len" in long["message"]
    # a max_tokens that runs past the context is refused, not cut short (the conftest's
    # max_model_len is 128; GREEDY's prompt is len(IDS) tokens)
    room = 128 - len(IDS)
    err = check_error(post({**GREEDY, "max_tokens": room + 1}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded" and f"max_tokens <= {room}" in err["message"]
    assert post({**GREEDY, "max_tokens": room}).status_code == 200  # exactly fits
    err = check_error(live.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500}), 400,
        "max_completion_tokens")
    assert "leave it out" in err["message"]
    # chat_template_kwargs reach the template (the conftest's reads ``lead``: 2 more bytes,
    # 2 more prompt tokens); one it does not read is refused naming those it does
    chat = lambda **kw: live.client.post("/v1/chat/completions", json={  # noqa
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **kw})
    plain = chat().json()["usage"]["prompt_tokens"]
    assert chat(chat_template_kwargs={"lead": "xy"}).json()["usage"]["prompt_tokens"] == plain + 2
    err = check_error(chat(chat_template_kwargs={"enable_thinking": False}), 400,
                      "chat_template_kwargs")
    assert "does not read it; it reads ['lead']" in err["message"]
    for msg, why in [({"role": "wizard", "content": "x"}, "'wizard' is not a role"),
                     ({"role": "user"}, "has no content")]:
        err = check_error(live.client.post("/v1/chat/completions", json={"messages": [msg]}),
                          400, "messages")
        assert why in err["message"]
    check_error(post({**GREEDY, "prompt": [5, 300]}), 400)
    check_error(live.client.post("/v1/chat/completions", json={"messages": []}), 400,
                "messages")
    # a value of none of a field's types is named by the field, its forms and where it failed
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    err = check_error(live.client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, image]}]}), 400,
        "messages.0.content")
    assert "text only" in err["message"] and "at 1.type" in err["message"]
    assert ".str" not in err["message"] and ".str" not in err["param"]
    err = check_error(post({**GREEDY, "prompt": ["Hello", [1, 2]]}), 400, "prompt")
    assert "a list of strings" in err["message"] and "a list of token ids" in err["message"]
    # two fields wrong are not one union: the first is named as it is
    err = check_error(post({**GREEDY, "temperature": "hot", "top_p": "x"}), 400)
    assert err["param"] in ("temperature", "top_p") and " must be " not in err["message"]
    ok = post({**GREEDY, "n": 1, "presence_penalty": 0, "logprobs": None})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 6


def test_closed_stream_aborts_and_frees_its_slot(live):
    live.client.post("/v1/cache/flush")
    before = wait_idle(live)
    body = {**GREEDY, "max_tokens": 100, "stream": True}
    with live.client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the first tokens came
    after = wait_idle(live)  # the abort reached the engine
    live.client.post("/v1/cache/flush")
    after = status(live)
    assert after["free_slots"] == before["free_slots"] == after["max_running_requests"]
    assert after["kv_pages_free"] == before["kv_pages_free"] == after["kv_pages_total"]
    assert 'mtp_jax_requests_total{finish_reason="abort"}' in live.client.get("/metrics").text


def test_engine_failure_fails_its_requests_and_the_server_keeps_serving(live):
    sched = live.llm.engine.scheduler
    real = sched.step

    def broken():
        sched.step = real  # once
        raise RuntimeError("injected device failure")

    sched.step = broken
    before = errors_counted(live, 500)
    err = check_error(live.client.post("/v1/completions", json=GREEDY), 500)
    assert "injected device failure" in err["message"]
    assert errors_counted(live, 500) == before + 1  # counted once
    ok = live.client.post("/v1/completions", json=GREEDY).json()
    assert ok["choices"][0]["token_ids"] == live.reference(
        IDS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)).token_ids
    assert wait_idle(live)["free_slots"] == status(live)["max_running_requests"]


def test_metrics_in_prometheus_text(live):
    live.client.post("/v1/completions", json=GREEDY)
    before = errors_counted(live, 400), errors_counted(live, 404)
    check_error(live.client.post("/v1/completions", json={**GREEDY, "max_tokens": 0}), 400)
    check_error(live.client.post("/v1/completions", json={**GREEDY, "model": "nope"}), 404)
    assert (errors_counted(live, 400), errors_counted(live, 404)) == (before[0] + 1,
                                                                      before[1] + 1)
    text = live.client.get("/metrics", headers={"Authorization": ""}).text
    for name in ("mtp_jax_requests_total", "mtp_jax_generation_tokens_total",
                 "mtp_jax_time_to_first_token_seconds_bucket",
                 "mtp_jax_inter_token_latency_seconds_count", "mtp_jax_spec_accept_length_sum",
                 "mtp_jax_spec_acceptance_rate_count", "mtp_jax_queue_depth",
                 "mtp_jax_kv_pages_in_use", "mtp_jax_prefix_cache_hit_rate"):
        assert f"\n{name}" in text, name


def test_cache_rebuild_while_serving(live):
    ref = live.client.post("/v1/completions", json=GREEDY).json()["choices"][0]["token_ids"]

    def generate():
        got = live.client.post("/v1/completions", json=GREEDY)
        assert got.status_code == 200 and got.json()["choices"][0]["token_ids"] == ref

    s0 = status(live)
    # grow the KV pool (the draft KV with it) while a stream runs: the resize waits for it
    stream_out, started = {}, threading.Event()

    def stream():
        with live.client.stream("POST", "/v1/completions",
                                json={**GREEDY, "max_tokens": 60, "stream": True}) as r:
            lines = r.iter_lines()
            stream_out["text"] = next(lines) + "\n"
            started.set()  # running in the engine when the resize comes
            stream_out["text"] += "\n".join(lines)
        started.set()

    t = threading.Thread(target=stream)
    t.start()
    started.wait()
    grown = live.client.post("/v1/cache/resize", json={"num_pages": s0["num_pages"] + 8})
    t.join()
    assert grown.status_code == 200, grown.text
    assert grown.json()["num_pages"] == s0["num_pages"] + 8
    assert stream_out["text"].rstrip().endswith("data: [DONE]")
    assert '"finish_reason": "length"' in stream_out["text"]
    generate()
    # grow the slot pool (KV, draft KV and prefix cache kept)
    more = live.client.post("/v1/cache/resize", json={"max_running_requests": 4}).json()
    assert more["max_running_requests"] == 4 and more["num_pages"] == s0["num_pages"] + 8
    generate()
    flushed = live.client.post("/v1/cache/flush").json()
    assert flushed["kv_pages_free"] == flushed["kv_pages_total"]
    generate()
    # refused: too large for the memory budget, and too small for one request
    kept = status(live)
    err = check_error(live.client.post("/v1/cache/resize", json={"num_pages": 10**12}), 400)
    assert "budget" in err["message"] and "max_running_requests" not in err["message"]
    for few in (1, 2):  # named with the least that holds one request
        err = check_error(live.client.post("/v1/cache/resize", json={"num_pages": few}), 400)
        assert "cannot hold one request" in err["message"] and "pass at least" in err["message"]
    check_error(live.client.post("/v1/cache/resize", json={"num_pages": "big"}), 400,
                "num_pages")
    assert status(live) == kept
    generate()
    back = live.client.post("/v1/cache/resize", json={"num_pages": s0["num_pages"],
                                                      "max_running_requests": 2}).json()
    assert back["num_pages"] == s0["num_pages"] and back["max_running_requests"] == 2
    generate()
