"""The server as a user starts it, ``python -m mtp_jax.serve`` in a process of its own, driven by
the official ``openai`` client: completions and chat, streamed and not, equal ``LLM.generate``
(the reference of the in-process live server, same checkpoint and settings); then a bounded
load test: 200 requests from 16 concurrent clients, a quarter of them bad, none lost, none
wrong (each good one gets its solo output), with several requests running at once in the
engine and a 4xx naming the problem for each bad one."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from mtp_jax import SamplingParams
from tests.helpers.server_process import serve_process
from tests.serve.conftest import API_KEY, free_port

openai = pytest.importorskip("openai")

PROMPTS = ["Hello, server", "The rain in Spain", "abc abc abc", "1, 2, 3,", "tiny model:",
           "Once upon", "JAX and", "zzz"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(model_dir):
    """A server process on a free localhost port (the live fixture's checkpoint and engine
    settings, 4 requests at once); its base URL. Stopped at the end of the module."""
    args = ["--model", model_dir, "--dtype", "float32", "--speculative-num-steps", "2",
            "--max-running-requests", "4", "--max-model-len", "128", "--port", str(free_port()),
            "--served-model-name", "tiny", "--api-key", API_KEY, "--log-level", "warning"]
    with serve_process(args) as url:
        yield url


def _client(url: str, key: str = API_KEY):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)


def test_openai_client_gets_what_llm_generate_gives(served, live):
    client = _client(served)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        ref = live.reference(prompt, params)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == ref.text
        assert got.usage.completion_tokens == len(ref.token_ids)
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages,
                                          max_tokens=MAX_TOKENS, temperature=0)
    ref = live.reference(live.llm.tokenizer.apply_chat_template(messages),
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert chat.choices[0].message.content == ref.text
    assert chat.choices[0].finish_reason == ref.finish_reason
    with pytest.raises(openai.AuthenticationError):
        _client(served, "wrong-key").models.list()


def _good(client, prompt: str, stream: bool) -> str:
    """A greedy completion of ``prompt``, streamed or not; its text."""
    kw = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
    return client.completions.create(**kw).choices[0].text


BAD = [  # (keywords, the error the client raises, what its message names)
    (dict(model="gpt-4"), "NotFoundError", "model"),
    (dict(max_tokens=-1), "BadRequestError", "max_tokens"),
    (dict(prompt=[3] * 200), "BadRequestError", "max_model_len"),
    (dict(extra_body={"frobnicate": 1}), "BadRequestError", "frobnicate"),
]


def _bad(client, i: int) -> str:
    """A bad request (one of :data:`BAD`); the name of the error it raised and whether its
    message names the problem."""
    kw = dict(model="tiny", prompt="x", max_tokens=MAX_TOKENS, temperature=0)
    change, want, names = BAD[i % len(BAD)]
    kw.update(change)
    try:
        client.completions.create(**kw)
    except openai.APIStatusError as e:
        ok = type(e).__name__ == want and 400 <= e.status_code < 500 and names in str(e)
        return "refused" if ok else f"wrong refusal {type(e).__name__}: {e}"
    return "accepted"


def test_load_200_requests_16_clients_none_lost_none_wrong(served):
    client = _client(served)
    solo = {p: _good(client, p, False) for p in PROMPTS}  # one at a time
    running, stop = [0], threading.Event()

    def watch():  # the most requests the engine held at once, from /metrics
        while not stop.is_set():
            text = httpx.get(served + "/metrics", timeout=10).text
            for line in text.splitlines():
                if line.startswith("mtp_jax_running_requests"):
                    running[0] = max(running[0], int(float(line.split()[-1])))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    n, bad_every = 200, 4

    def one(i):
        if i % bad_every == bad_every - 1:
            return _bad(client, i // bad_every)
        return _good(client, PROMPTS[i % len(PROMPTS)], stream=bool(i % 2))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(n)))
    stop.set()
    watcher.join(timeout=30)
    assert len(results) == n  # none lost: every call returned or raised
    wrong = [(i, r) for i, r in enumerate(results) if i % bad_every != bad_every - 1
             and r != solo[PROMPTS[i % len(PROMPTS)]]]
    assert not wrong, wrong[:5]
    refusals = [r for i, r in enumerate(results) if i % bad_every == bad_every - 1]
    assert refusals == ["refused"] * (n // bad_every), [r for r in refusals if r != "refused"]
    assert running[0] >= 2
    status = httpx.get(served + "/v1/cache/status",
                       headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert status["running_requests"] == 0 and status["waiting_requests"] == 0
