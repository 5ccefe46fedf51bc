"""Plain generation on a qwen4_exp checkpoint through LLM and the CLI: the greedy tokens equal
transformers' (golden fixture), and the disk and memory PLE backends give identical tokens."""

import json

import numpy as np

from mtp_jax import LLM, SamplingParams
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


def test_llm_defaults_run_mtp_and_match_hf():
    """``LLM(folder)`` with its defaults (MTP, k = 3, the prefix cache on) gives transformers'
    greedy tokens."""
    g = np.load(CKPT + "/golden.npz")
    llm = LLM(CKPT, dtype="float32")
    assert llm.speculative.algorithm == "mtp" and llm.speculative.k == 3
    res = llm.generate([row.tolist() for row in g["input_ids"]],
                       SamplingParams(temperature=0, max_tokens=g["greedy_tokens"].shape[1],
                                      ignore_eos=True))
    assert [r.token_ids for r in res] == g["greedy_tokens"].tolist()
    assert all(r.num_draft_tokens > 0 for r in res)


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
