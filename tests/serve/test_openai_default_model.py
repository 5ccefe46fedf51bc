"""The server on the built-in default model, started as the README starts it (no ``--model``,
no key), under the official ``openai`` client: the served name is ``default``; a completion,
the same streamed, and a chat reply (the real Qwen tokenizer's chat template) equal what
``LLM`` gives in-process on the same model. The server builds the default model in an empty
cache folder (but for the session's converted tokenizer), as on a newcomer's first start."""

from __future__ import annotations

import shutil

import pytest

from mtp_jax import LLM, SamplingParams
from tests.helpers.server_process import serve_process
from tests.serve.conftest import free_port

openai = pytest.importorskip("openai")

SETTINGS = dict(max_running_requests=2, max_model_len=256)
MAX_TOKENS = 8


def test_openai_client_on_the_default_model(vocab_cache, tmp_path, monkeypatch):
    from mtp_jax.tools import qwen_vocab

    shutil.copy(qwen_vocab.converted_tokenizer_json(vocab_cache), tmp_path)
    args = ["--port", str(free_port()), "--log-level", "warning",
            "--max-running-requests", str(SETTINGS["max_running_requests"]),
            "--max-model-len", str(SETTINGS["max_model_len"])]
    prompt, messages = "The capital of France is", [{"role": "user", "content": "Say hello."}]
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0)
    with serve_process(args, env={"MTP_JAX_CACHE": str(tmp_path)}) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        assert [m.id for m in client.models.list().data] == ["default"]
        kw = dict(model="default", prompt=prompt, extra_body={"ignore_eos": True}, **greedy)
        done = client.completions.create(**kw)
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                           if c.choices)
        chat = client.chat.completions.create(model="default", messages=messages, **greedy)
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path))  # the model the server built
    llm = LLM(**SETTINGS)
    ref = llm.generate([prompt], SamplingParams(ignore_eos=True, **greedy))[0]
    assert done.choices[0].text == streamed == ref.text
    assert done.usage.completion_tokens == MAX_TOKENS == len(ref.token_ids)
    assert done.usage.prompt_tokens == len(ref.prompt_token_ids)
    reply = llm.chat(messages, SamplingParams(**greedy))
    assert chat.choices[0].message.content == reply.text
    assert chat.choices[0].finish_reason == reply.finish_reason
