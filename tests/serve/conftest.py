"""One live server for the directory's tests (package-scoped: its threads and engine stop when
the directory's tests end, so no later test shares the process with them; one engine build;
the cache-rebuild test, which changes the pool shapes, runs last and puts them back): the tiny
MoE fixture (float32, MTP k = 2) with a byte-level tokenizer and a chat template of its own
(ids 0..258 of the fixture's 300), served by uvicorn on a free localhost port from a thread."""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest

from tests.helpers.paths import fixture_path

API_KEY = "test-key"
# short, so that a chat prompt fits the smallest prefill bucket (16 tokens; one program less);
# ``lead`` (empty unless a request's chat_template_kwargs give it) opens the assistant's turn
CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role[0] }}:{{ m.content }}<|im_end|>"
                 "{% endfor %}{% if add_generation_prompt %}a:{{ lead | default('') }}{% endif %}")


def write_byte_tokenizer(folder: str) -> None:
    """A byte-level tokenizer (256 byte ids, no merges, 3 special tokens) and a chat
    template."""
    import json

    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}, f)


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory) -> str:
    """tiny_moe_fused's weights and config with the byte tokenizer."""
    out = tmp_path_factory.mktemp("tiny_served")
    src = fixture_path("tiny_moe_fused")
    for name in os.listdir(src):
        if name != "golden.npz":
            os.symlink(os.path.join(src, name), out / name)
    write_byte_tokenizer(str(out))
    return str(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A running server: ``url``, ``llm``, ``state`` (the app's ServerState), ``client``
    (httpx, with the API key)."""

    def __init__(self, llm, app, server, url):
        self.llm, self.app, self.server, self.url = llm, app, server, url
        self.state = app.state.server
        self.client = httpx.Client(base_url=url, timeout=120,
                                   headers={"Authorization": f"Bearer {API_KEY}"})

    def reference(self, prompt, params):
        """``LLM.generate`` of one prompt, run on the engine thread once it is idle."""
        return self.state.worker.call(lambda: self.llm.generate([prompt], params)[0],
                                      idle=True).result(timeout=120)


@pytest.fixture(scope="package")
def live(model_dir):
    import uvicorn

    from mtp_jax import LLM
    from mtp_jax.serve import create_app

    llm = LLM(model_dir, dtype="float32", speculative_num_steps=2, max_running_requests=2,
              max_model_len=128)
    app = create_app(llm, served_model_name="tiny", api_key=API_KEY)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    srv = Live(llm, app, server, f"http://127.0.0.1:{port}")
    yield srv
    srv.client.close()
    server.should_exit = True
    thread.join(timeout=30)
