"""Profile a few rounds of the engine on a random-weight real shape (GPU machine helper).

Usage: python scripts/profile_round.py CONFIG K BATCH OUTDIR
Writes a perfetto trace under OUTDIR and prints the top device ops by total time.
"""

import glob
import gzip
import json
import os
import sys
from collections import defaultdict

import jax

from mtp_jax.bench import _requests, load_config
from mtp_jax.config import EngineConfig, SpecConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.models.loader import load_model


def main(cfg_path, k, batch, out):
    k, batch = int(k), int(batch)
    cfg = load_config(cfg_path)
    model = load_model(cfg=cfg, dtype="bfloat16", dummy_weight=True, with_mtp=True)
    eng = Engine(model, EngineConfig(max_running_requests=batch, max_model_len=1024,
                                     dtype="bfloat16", enable_prefix_cache=False),
                 SpecConfig(algorithm="mtp" if k else "none", num_steps=k or 3))
    reqs = _requests(batch, 512, 10**6, cfg.vocab_size, 0)
    for r in reqs:
        eng.add_request(r)
    while eng.waiting or eng.prefilling:
        eng.step()
    for _ in range(5):
        eng._run_round(eng.decoding)
    jax.block_until_ready(eng.pools)
    with jax.profiler.trace(out, create_perfetto_trace=True):
        for _ in range(5):
            eng._run_round(eng.decoding)
        jax.block_until_ready(eng.pools)
    path = glob.glob(os.path.join(out, "**", "*.trace.json.gz"), recursive=True)[0]
    events = json.load(gzip.open(path))["traceEvents"]
    tot = defaultdict(float)
    cnt = defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") is not None and "dur" in e:
            tot[(e["pid"], e["name"])] += e["dur"]
            cnt[(e["pid"], e["name"])] += 1
    pids = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    rows = sorted(tot.items(), key=lambda kv: -kv[1])[:45]
    for (pid, name), us in rows:
        print(f"{us / 5 / 1000:8.3f} ms/round  x{cnt[(pid, name)] // 5:<5d} "
              f"{pids.get(pid, pid)[:18]:18s} {name[:90]}")


if __name__ == "__main__":
    main(*sys.argv[1:])
