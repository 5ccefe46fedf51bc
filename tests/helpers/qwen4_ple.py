"""Shared by the qwen4_exp PLE tests (device tables, native lookup): test histories, the
Flash-Next config with small n-gram tables, and a greedy MTP engine run over the trained
fixture."""

from __future__ import annotations

import json
import os

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from tests.fixtures.make_qwen4_trained_fixture import fixture_prompts
from tests.helpers.paths import REPO


def histories(rng, vocab, eos, ctx_len, b=6, t=40):
    """``[B, ctx_len + t]`` int ids: random, the largest ids, eos in the context and rows (also
    back to back, and at the first and last place)."""
    h = rng.integers(0, vocab, (b, ctx_len + t))
    h[0, :] = vocab - 1 - rng.integers(0, 3, ctx_len + t)  # the top ids
    h[1, rng.integers(0, ctx_len + t, 12)] = eos
    h[2, :ctx_len] = eos
    h[3, ctx_len - 1] = eos
    h[3, ctx_len + 5:ctx_len + 7] = eos
    h[4, -1] = eos
    h[5, ::3] = vocab - 1
    return h


def small_flash_next() -> Qwen4ExpConfig:
    """The released Flash-Next config with small n-gram tables (head sizes from a base of
    5000, 2 values a head) on two PLE layers."""
    raw = json.load(open(os.path.join(REPO, "configs", "Qwen3.8-Flash-Next.json")))
    raw["text_config"].update(ngram_vocab_size_base=5000, ple_embed_dim=32,
                              ple_layer_ids=[1, 2])
    return Qwen4ExpConfig.from_dict(raw)


def run_mtp(model, prompts, max_new=12):
    """Greedy MTP k = 3, one request at a time (one slot: fewer programs to compile), overlap
    on, two rounds per call: each round's rows come from inside the program (device tables)
    or by the host callback (disk)."""
    eng = Engine(model, EngineConfig(max_running_requests=1, dtype="float32", page_size=4,
                                     max_model_len=64, enable_prefix_cache=False,
                                     chunked_prefill_size=16, num_scheduler_steps=2),
                 SpeculativeConfig(algorithm="mtp", num_steps=3, adaptive=False))
    sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    reqs = [Request(request_id=f"p{i}", index=i, prompt=None, prompt_ids=list(p), params=sp,
                    seed=0) for i, p in enumerate(prompts)]
    eng.run(reqs)
    return [(r.output_ids, r.num_rounds, r.num_draft_tokens, r.num_accepted_tokens)
            for r in reqs]


def engine_prompts(cfg) -> list[list[int]]:
    """Three of the trained fixture's prompts and one with an eos (a segment boundary)
    inside."""
    prompts = fixture_prompts(cfg.vocab_size)[:3]
    return prompts + [prompts[0][:4] + [cfg.eos_token_id] + prompts[1][:6]]
