"""``python -m mtp_jax.bench``: prefill, decode-step and speculative-round timings on a
random-weight model of a real shape, against the HBM floor.

For each configuration (``configs/*.json``), batch size and k (0 = speculation off) it reports:
prefill tokens/s, the median round time (a decode step when k = 0), the bytes the round must move
(weights, KV, GDN state, draft) and the floor at ``--hbm-tbps``, the fraction of the floor
reached, tokens/s (k = 0) or tokens/s at accept lengths 2.5 / 3.0 / 3.5 (k > 0; a round's time
does not depend on acceptance in a fixed-shape program, so tokens/s = accept length x batch /
round time), the time of the first prefill and round calls (compilation), the compiled-program count, and peak device memory.

Weights are random and drawn on the device (no checkpoint on disk). Output: a table on stdout and
a JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

from mtp_jax.config import EngineConfig, ModelConfig, SpecConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from mtp_jax.weights import names

ACCEPT_LENGTHS = (2.5, 3.0, 3.5)


def load_config(path: str) -> ModelConfig:
    with open(path) as f:
        raw = json.load(f)
    strip = lambda d: {k: strip(v) if isinstance(v, dict) else v for k, v in d.items()
                       if not k.startswith("_")}
    return ModelConfig.from_dict(strip(raw))


def _numel(shape) -> int:
    return int(np.prod(shape))


def expected_experts(cfg: ModelConfig, tokens: int) -> float:
    """Expected distinct experts hit by ``tokens`` tokens under uniform routing."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def forward_weight_bytes(cfg: ModelConfig, tensors: dict, tokens: int, itemsize: int) -> float:
    """Weight bytes one forward over ``tokens`` rows reads: every tensor except the embedding
    table (only ``tokens`` rows) and the routed experts (only the experts hit)."""
    total = 0.0
    for name, shape in tensors.items():
        if name == "embed_tokens.weight":
            total += tokens * shape[1] * itemsize
        elif ".mlp.experts." in name:
            total += _numel(shape) / shape[0] * expected_experts(cfg, tokens) * itemsize
        else:
            total += _numel(shape) * itemsize
    return total


def round_bytes(cfg: ModelConfig, batch: int, k: int, context: int, itemsize: int) -> dict:
    """Bytes a round (k > 0) or decode step (k = 0) moves, by kind."""
    target = names.target_tensors(cfg)
    lm_head = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}
    if cfg.tie_word_embeddings:
        target = {**target, **lm_head}  # the tied head reads the whole table
    rows = batch * (k + 1)
    out = {"weights": forward_weight_bytes(cfg, target, rows, itemsize)}
    kv_per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    out["kv_read"] = batch * context * kv_per_token * len(cfg.full_layer_ids)
    state = (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
             * len(cfg.linear_layer_ids))
    # verify reads the state; the commit reads it and writes it back (k > 0), decode the same.
    out["gdn_state"] = batch * state * 3
    if k:
        draft = {**names.mtp_tensors(cfg), **lm_head}
        out["draft_weights"] = (forward_weight_bytes(cfg, draft, batch * (k + 1), itemsize)
                                + (k - 1) * forward_weight_bytes(cfg, draft, batch, itemsize))
        out["draft_kv_read"] = k * batch * context * kv_per_token * cfg.mtp_num_hidden_layers
    out["total"] = sum(out.values())
    return out


def _requests(batch: int, prompt_len: int, max_tokens: int, vocab: int, start: int):
    rng = np.random.default_rng(start)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(request_id=str(start + i), index=start + i, prompt=None,
                    prompt_ids=rng.integers(10, vocab - 10, prompt_len).tolist(), params=params,
                    seed=0) for i in range(batch)]


def bench_one(model, batch: int, k: int, prompt_len: int, steps: int, page_size: int,
              hbm_tbps: float) -> dict:
    cfg = model.cfg
    spec = SpecConfig(algorithm="mtp" if k else "none", num_steps=k or 3)
    eng = Engine(model, EngineConfig(max_running_requests=batch + 1, page_size=page_size,
                                     max_model_len=prompt_len + (steps + 8) * (k + 1) + 64,
                                     chunked_prefill_size=prompt_len,
                                     enable_prefix_cache=False, dtype=model.dtype), spec)
    reqs = _requests(batch, prompt_len, 10**9, cfg.vocab_size, 0)
    t0 = time.perf_counter()
    for r in reqs:
        eng.add_request(r)
    while eng.waiting or eng.prefilling:
        eng.step()  # prefill (and rounds for those already decoding)
    jax.block_until_ready(eng.pools)
    first_calls_s = time.perf_counter() - t0  # compiles the prefill and round programs used
    # Prefill throughput: one more prompt through the compiled program, timed alone.
    extra = _requests(1, prompt_len, 2, cfg.vocab_size, 10**6)[0]
    eng.add_request(extra)
    eng.waiting.remove(extra)
    extra.slot = eng.slots.take()[0]
    extra.reserve = 0
    t0 = time.perf_counter()
    eng._prefill_chunk(extra, prompt_len)
    jax.block_until_ready(eng.pools)
    prefill_s = time.perf_counter() - t0
    eng._release(extra)
    for _ in range(3):
        eng._run_round(reqs)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng._run_round(reqs)  # ends with the one host read of the round's outputs
        times.append(time.perf_counter() - t0)
    rt = statistics.median(times)
    context = prompt_len + sum(len(r.output_ids) for r in reqs) // batch
    itemsize = 2 if model.dtype != "float32" else 4
    by = round_bytes(cfg, batch, k, context, itemsize)
    floor = by["total"] / (hbm_tbps * 1e12)
    res = {"batch": batch, "k": k, "prompt_len": prompt_len, "context": context,
           "prefill_tokens_per_s": prompt_len / prefill_s, "round_ms": rt * 1e3,
           "round_ms_p10": float(np.percentile(times, 10)) * 1e3,
           "floor_ms": floor * 1e3, "fraction_of_floor": floor / rt,
           "bytes": {k_: float(v) for k_, v in by.items()},
           "first_calls_s": first_calls_s,
           "compiled_programs": eng.compiled_program_count()}
    if k:
        res["tokens_per_s_at_accept_length"] = {str(a): a * batch / rt for a in ACCEPT_LENGTHS}
        res["measured_accept_length"] = (sum(len(r.output_ids) - 1 for r in reqs)
                                         / max(1, sum(r.num_rounds for r in reqs)))
    else:
        res["tokens_per_s"] = batch / rt
    stats = jax.devices()[0].memory_stats() or {}
    res["peak_device_bytes"] = stats.get("peak_bytes_in_use")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtp_jax.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", required=True, help="configs/<name>.json")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--k", type=int, nargs="+", default=[0, 3])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=50, help="timed rounds (median reported)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hbm-tbps", type=float, default=4.2)
    p.add_argument("--out", default="bench.json")
    args = p.parse_args(argv)
    results = []
    for path in args.config:
        cfg = load_config(path)
        t0 = time.perf_counter()
        model = load_model(cfg=cfg, dtype=args.dtype, dummy_weight=True, with_mtp=True)
        jax.block_until_ready(model.params)
        print(f"# {path}: random weights in {time.perf_counter() - t0:.1f}s", flush=True)
        for b in args.batch:
            for k in args.k:
                r = bench_one(model, b, k, args.prompt_len, args.steps, args.page_size,
                              args.hbm_tbps)
                r["config"] = path
                results.append(r)
                tps = (f"{r['tokens_per_s']:.1f}" if not k else " / ".join(
                    f"{v:.1f}" for v in r["tokens_per_s_at_accept_length"].values()))
                print(f"{path.split('/')[-1]:28s} B={b:<3d} k={k} round={r['round_ms']:.2f}ms "
                      f"floor={r['floor_ms']:.2f}ms ({r['fraction_of_floor']:.0%}) "
                      f"tok/s={tps} prefill={r['prefill_tokens_per_s']:.0f} tok/s "
                      f"first_calls={r['first_calls_s']:.1f}s "
                      f"peak={(r['peak_device_bytes'] or 0) / 2**30:.1f}GiB", flush=True)
        del model
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
