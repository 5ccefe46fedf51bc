"""Plain generation on a qwen4_exp checkpoint through LLM and the CLI: the greedy tokens equal
transformers' (golden fixture), and the disk and memory PLE backends give identical tokens."""

import json

import numpy as np
import pytest

from mtp_jax import LLM, ConfigError, SamplingParams
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_qwen4_exp")


def test_llm_greedy_matches_hf_with_both_ple_backends():
    g = np.load(CKPT + "/golden.npz")
    ids = g["input_ids"]
    n = g["greedy_tokens"].shape[1]
    outs = {}
    for backend in ("disk", "memory"):
        llm = LLM(CKPT, dtype="float32", speculative_algorithm="none", ple_backend=backend)
        res = llm.generate([row.tolist() for row in ids],
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        outs[backend] = [r.token_ids for r in res]
    assert outs["disk"] == outs["memory"] == g["greedy_tokens"].tolist()


def test_qwen4_exp_refuses_speculation_before_loading():
    with pytest.raises(ConfigError, match="not supported for qwen4_exp yet"):
        LLM(CKPT, dtype="float32")
    # external drafts: the same refusal (the engine that serves it runs plain decoding), not a
    # list of drafts it cannot run either
    with pytest.raises(ConfigError, match="'external' is not supported for qwen4_exp yet"):
        LLM(CKPT, dtype="float32", speculative_algorithm="external",
            proposer=lambda rid, ids, k: [0] * k)


def test_cli_on_qwen4_exp(capsys, tmp_path):
    from mtp_jax import generate

    g = np.load(CKPT + "/golden.npz")
    # Text prompts need a tokenizer; this folder has none, so feed ids through a prompts file.
    assert generate.main(["--model", CKPT, "--speculative-algorithm", "none", "--json",
                          "--max-tokens", "3", "--ignore-eos", "--dtype", "float32",
                          "--prompts-file", _ids_file(tmp_path, g["input_ids"][0].tolist())]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["token_ids"] == g["greedy_tokens"][0, :3].tolist()


def _ids_file(folder, ids):
    path = folder / "ids.jsonl"
    path.write_text(json.dumps({"prompt": ids}) + "\n")
    return str(path)


def test_random_checkpoint_tool_writes_qwen4_exp(tmp_path):
    """The CLI tool writes a qwen4_exp checkpoint; cached greedy decoding on it equals the
    argmax of the cache-free full forward over the growing sequence."""
    from mtp_jax.models.loader import load_model
    from mtp_jax.tools.random_checkpoint import main

    cfg = json.load(open(CKPT + "/config.json"))
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    out = tmp_path / "ck"
    assert main(["--config", str(tmp_path / "cfg.json"), "--out", str(out), "--dtype",
                 "float32", "--seed", "3"]) == 0
    llm = LLM(str(out), dtype="float32", speculative_algorithm="none")
    prompt = [3, 4, 5, 6, 7]
    toks = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4,
                                                 ignore_eos=True))[0].token_ids
    m = load_model(str(out), "float32", with_mtp=False)
    logits, _ = m.forward(np.asarray([prompt + toks]))  # causal: one forward checks every step
    assert toks == np.asarray(logits)[0, len(prompt) - 1:-1].argmax(-1).tolist()


def test_decode_overlaps_ple_lookup_with_stop_checks_and_next_head(monkeypatch):
    """Order of a decode step in the sequential engine: the head program of step t+1 is
    dispatched, then the PLE lookup of token t runs on a worker thread WHILE the main thread does
    token t's stop checks (a two-way handshake: a lookup done inline, or joined before the stop
    checks, times out here). Tokens stay equal to transformers' greedy ones."""
    import threading

    from mtp_jax.engine import sequential as stops_mod  # the name the engine calls
    from mtp_jax.models.qwen4_exp.loader import LoadedQwen4Exp

    g = np.load(CKPT + "/golden.npz")
    prompt, n = g["input_ids"][0].tolist(), g["greedy_tokens"].shape[1]
    events, started, appended = [], threading.Semaphore(0), threading.Semaphore(0)
    main = threading.main_thread

    real_start, real_lookup = LoadedQwen4Exp.start_step, LoadedQwen4Exp.lookup
    real_append = stops_mod.append_tokens

    def start_step(self, cache, ids):
        events.append(("head", cache.length))
        return real_start(self, cache, ids)

    def lookup(self, context, ids):
        rows = np.asarray(ids).shape[1]
        events.append(("lookup", rows, threading.current_thread() is main()))
        if rows == 1:
            started.release()
            assert appended.acquire(timeout=30), "the lookup did not overlap the stop checks"
        return real_lookup(self, context, ids)

    def append_tokens(req, toks, *args):
        if len(req.output_ids) + 1 < req.params.max_tokens:  # a lookup is in flight
            assert started.acquire(timeout=30), "no lookup in flight during the stop checks"
        events.append(("append", len(req.output_ids)))
        appended.release()
        return real_append(req, toks, *args)

    monkeypatch.setattr(LoadedQwen4Exp, "start_step", start_step)
    monkeypatch.setattr(LoadedQwen4Exp, "lookup", lookup)
    monkeypatch.setattr(stops_mod, "append_tokens", append_tokens)
    llm = LLM(CKPT, dtype="float32", speculative_algorithm="none")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert out[0].token_ids == g["greedy_tokens"][0].tolist()
    want = [("head", 0), ("lookup", len(prompt), True)]
    for i in range(n):
        if i + 1 < n:
            want += [("head", len(prompt) + i), ("lookup", 1, False)]
        want.append(("append", i))
    assert events == want
