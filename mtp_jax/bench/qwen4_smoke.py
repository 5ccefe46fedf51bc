"""``python -m mtp_jax.bench qwen4-smoke`` (or ``python -m mtp_jax.bench.qwen4_smoke``): qwen4_exp
through the batched engine on a cut-down Qwen3.8-Flash-Next shape (docs/benchmarks.md, session
25).

Writes a random bf16 checkpoint of ``configs/Qwen3.8-Flash-Next.json`` cut to ``--layers``
layers and ``--experts`` routed experts with a small n-gram table (``--ngram-base``), then runs
``LLM`` (``--ple-backend``, default auto; ``--gdn-backend`` / ``--moe-backend``, default auto
= the Pallas kernels on a GPU; prefix cache on) at ``--batches`` (default 1 and 8) and ``--k``
(default 0 and 3; with the random MTP head adaptive speculation lowers k: a k = 3 row is what a
user gets from a head that is never right). Prints one dict per row: the PLE backend, the
kernels, end-to-end tokens/s, ms per round (host + device) and the host PLE lookup's ms per
round (None with ``device``: its programs look the rows up themselves), by the form the
programs use (``ple_lookup``: ``native`` or ``callback``, ``--ple-lookup``). Writes
``$OUT/q4_smoke.json`` (or ``--out``).

``--gguf TYPE`` writes the cut shape as a Flash-Next GGUF target and a Strata MTP pack instead
(:mod:`mtp_jax.tools.random_gguf`: routed experts in TYPE, the other matrices in
``--gguf-dense-type``) and runs ``LLM(model.gguf, speculative_draft_model_path=mtp.gguf)``
with each ``--quantization`` given (``keep``: experts and plain projections in a kept block
type stay packed on the device; ``dequantize``: bf16 at load; ``auto`` = dequantize). Each row
carries ``weights_gb``, the device bytes of the weights as held (packed bytes where kept).
``--merge-projections on off`` runs each row with the loader's merged projections and without
(:func:`mtp_jax.models.qwen4_exp.entry.merged` skipped), an A/B in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time

import numpy as np

from mtp_jax.engine.memory import weights_bytes
from mtp_jax.llm import LLM
from mtp_jax.models.qwen4_exp import entry as qwen4_entry
from mtp_jax.models.qwen4_exp import ple_native
from mtp_jax.models.qwen4_exp.random_checkpoint import write_random_qwen4_exp
from mtp_jax.sampling import SamplingParams
from mtp_jax.tools.gguf_blocks import TYPES


SUMMARY = ("Flash-Next (qwen4_exp) cut to fit one card, through LLM at its defaults: tokens/s "
           "end to end and ms per round by PLE backend and lookup, batch and k")
DESCRIPTION = ("python -m mtp_jax.bench qwen4-smoke: writes a random bf16 checkpoint of the "
               "Qwen3.8-Flash-Next config cut to --layers layers and --experts routed experts "
               "(or, with --gguf, a GGUF target and a Strata MTP pack), then runs LLM at each "
               "combination of the list-valued flags and prints one row per batch: "
               "end-to-end tokens/s, ms per round and the host PLE lookup's ms per round. "
               "Rows go to q4_smoke.json in --out after each row. No HBM floor is computed "
               "(the engine benchmark, python -m mtp_jax.bench --config "
               "configs/Qwen3.8-Flash-Next.json, gives it).")

FLASH_NEXT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs", "Qwen3.8-Flash-Next.json")


def cut_config(path: str, layers: int, experts: int, ngram_base: int) -> dict:
    """The released config at ``path`` (keys starting with ``_`` dropped) cut down."""
    raw = {k: v for k, v in json.load(open(path)).items() if not k.startswith("_")}
    text = {k: v for k, v in raw["text_config"].items() if not k.startswith("_")}
    text.update(num_hidden_layers=layers, num_experts=experts, ngram_vocab_size_base=ngram_base,
                layer_types=text["layer_types"][:layers])
    raw["text_config"] = text
    return raw


def lookup_form(model) -> str | None:
    """How the programs look the PLE rows up on the host: ``native`` (the FFI call,
    :mod:`~mtp_jax.models.qwen4_exp.ple_native`), ``callback``, or None (device tables)."""
    if not model.host_callbacks:
        return None
    return "native" if ple_native.registered(model.module().ple_source) else "callback"


def lookup_ms(model, prompts, k: int, repeats: int = 50) -> float:
    """Mean ms of one round's host PLE lookup (``k + 1`` tokens per request), by the form
    the programs use (:func:`lookup_form`)."""
    ctx = np.stack([model.ngram_context(p[:-k - 1]) for p in prompts])
    ids = np.asarray([p[-k - 1:] for p in prompts])
    look = model.host_rows
    if lookup_form(model) == "native":
        look = functools.partial(ple_native.host_rows, model.module().ple_source,
                                 width=model.host_row_width)
    look(ctx, ids)
    t0 = time.perf_counter()
    for _ in range(repeats):
        look(ctx, ids)
    return 1e3 * (time.perf_counter() - t0) / repeats


@contextlib.contextmanager
def merging(on: bool):
    """Loads inside run with the qwen4_exp loader's merged projections (``on``, the default
    everywhere) or with one parameter per checkpoint tensor."""
    keep = qwen4_entry.merged
    if not on:
        qwen4_entry.merged = lambda model: model
    try:
        yield
    finally:
        qwen4_entry.merged = keep


def held_weights_gb(llm) -> float:
    """Device GB of the model's weights as held: the bf16 plan less what kept (packed) weights
    save."""
    model = llm.model
    planned = weights_bytes(model.cfg, "bfloat16", model.has_mtp)
    return round((planned - getattr(model, "weight_bytes_saved", 0)) / 1e9, 3)


def run_row(llm, prompts, k: int, max_tokens: int, rng, backend: str = "disk",
            kernels: str = "xla") -> dict:
    """Warm up on other prompts of the same lengths and ``max_tokens`` (the same buckets and
    prefix-cache snapshot crossings: nothing compiles in the timed run), then time."""
    other = [rng.integers(100, 200_000, len(p)).tolist() for p in prompts]
    llm.generate(other, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    eng = llm.engine
    r0, s0 = eng.stats.rounds, eng.stats.round_seconds
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))
    wall = time.perf_counter() - t0
    rounds = max(eng.stats.rounds - r0, 1)
    toks = sum(len(o.token_ids) for o in outs)
    return dict(ple_backend=backend, ple_lookup=lookup_form(llm.model), kernels=kernels, k=k,
                batch=len(prompts), tokens=toks,
                tok_s=round(toks / wall, 1),
                ms_per_round=round(1e3 * (eng.stats.round_seconds - s0) / rounds, 3),
                lookup_ms=(None if backend == "device"
                           else round(lookup_ms(llm.model, prompts, k), 3)),
                accept_length=outs[0].accept_length, weights_gb=held_weights_gb(llm))


def device_profile(model, k: int, prompt_len: int, out: str, tag: str = "") -> str:
    """The head of :func:`mtp_jax.bench.profile_round.text_of` for 10 traced calls of 4 rounds
    at batch 1 (figures per round)."""
    from mtp_jax.bench.profile_round import profile, text_of

    a = argparse.Namespace(prompt_len=prompt_len, rounds=10, num_scheduler_steps=4, batch=1,
                           sequence=600,
                           trace_dir=os.path.join(out, "traces"))
    wall, summary, _ = profile(a, model, model.cfg, k)
    text = text_of(f"k={k} batch 1: untraced wall {wall * 1e3:.2f} ms/round", summary)
    with open(os.path.join(out, f"q4_profile_k{k}{tag}.txt"), "w") as f:
        f.write(text + "\n")  # the whole report: every category, top kernel and the sequence
    head = "\n".join(text.splitlines()[:12])
    print(head, flush=True)
    return head


def write_checkpoint(a) -> tuple[str, str | None]:
    """Write the cut checkpoint (safetensors, or with ``--gguf`` a GGUF target and Strata
    pack); returns ``(model path, draft path or None)``."""
    raw = cut_config(a.config, a.layers, a.experts, a.ngram_base)
    if a.gguf is None:
        write_random_qwen4_exp(raw, a.checkpoint_dir, dtype="bfloat16", seed=0, with_mtp=True)
        return a.checkpoint_dir, None
    from mtp_jax.tools.random_gguf import describe, write_random_gguf
    folder = f"{a.checkpoint_dir}_gguf_{a.gguf}_{a.gguf_dense_type}"
    t0 = time.perf_counter()
    written = write_random_gguf(raw, folder, expert_type=a.gguf, dense_type=a.gguf_dense_type)
    print(f"wrote in {time.perf_counter() - t0:.1f} s:", *map(describe, written), sep="\n",
          flush=True)
    return written[0]["path"], written[1]["path"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtp_jax.bench qwen4-smoke",
                                description=DESCRIPTION, allow_abbrev=False)
    p.add_argument("--config", default=FLASH_NEXT_CONFIG,
                   help="the released config to cut (default: the repository's "
                        "configs/Qwen3.8-Flash-Next.json)")
    p.add_argument("--layers", type=int, default=8, help="layers kept (default %(default)s)")
    p.add_argument("--experts", type=int, default=64,
                   help="routed experts kept, at least the config's num_experts_per_tok "
                        "(10 for Flash-Next; default %(default)s)")
    p.add_argument("--ngram-base", type=int, default=200_000,
                   help="ngram_vocab_size_base of the n-gram tables (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=100,
                   help="prompt tokens per request (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="greedy tokens per request (default %(default)s)")
    p.add_argument("--checkpoint-dir", default="/tmp/q4_smoke_ckpt",
                   help="where the random checkpoint is written, overwritten each run (default "
                        "%(default)s; about 10 GB at the default cut)")
    p.add_argument("--ple-backend", default="auto", choices=["auto", "disk", "memory", "device"],
                   help="where the PLE n-gram tables live (default %(default)s; device: on "
                        "the GPU, looked up inside the programs, no host callback)")
    p.add_argument("--ple-lookup", nargs="+", default=["auto"], choices=ple_native.CHOICES,
                   help="host tables: how the programs look their rows up, per run "
                        "($MTP_JAX_PLE_LOOKUP; default auto = native on a GPU: the FFI call "
                        "that does not block the launch; callback: jax.pure_callback), e.g. "
                        "callback native for an A/B")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="folder of q4_smoke.json and the profiles (default: $OUT, else .)")
    p.add_argument("--profile", action="store_true",
                   help="also trace 10 rounds at batch 1 (python -m mtp_jax.bench profile's "
                        "analysis: device busy time per round, top kernels, the first 600 "
                        "kernels in order; the whole report in "
                        "$OUT/q4_profile_k<k>_norm_<n>_gemv_<g>_merge_<m>.txt; GPU only)")
    p.add_argument("--k", type=int, nargs="+", default=[0, 3],
                   help="speculative_num_steps of each run, 0 = MTP off (default 0 3)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8],
                   help="requests per row (default 1 8; at most 8)")
    for op in ("gdn", "moe"):
        p.add_argument(f"--{op}-backend", default="auto", choices=["auto", "xla", "pallas"],
                       help=f"the {'GDN' if op == 'gdn' else 'MoE'} kernels (default auto: the "
                            "Pallas kernels on a "
                            "GPU, XLA on the CPU; pallas needs a GPU)")
    p.add_argument("--norm-backend", nargs="+", default=["auto"],
                   choices=["auto", "xla", "pallas"],
                   help="the hyper-connections of each run (--norm-backend), e.g. xla pallas "
                        "for an A/B (default auto: XLA, the kernels measured no faster)")
    p.add_argument("--gguf", default=None, choices=TYPES, metavar="TYPE",
                   help="write a GGUF target + Strata pack with routed experts in TYPE "
                        f"({', '.join(TYPES)}) and run them (default: a bf16 safetensors "
                        "checkpoint)")
    p.add_argument("--gguf-dense-type", default="BF16", choices=TYPES,
                   help="with --gguf: the other matrices' type (default %(default)s)")
    p.add_argument("--quantization", nargs="+", default=["auto"],
                   choices=["auto", "keep", "dequantize"],
                   help="LLM(quantization=...) of each run, e.g. keep dequantize: keep = "
                        "packed weights stay packed on the device (default auto = dequantize)")
    p.add_argument("--gemv-backend", nargs="+", default=["auto"],
                   choices=["auto", "xla", "reduce"],
                   help="one-row projections of each run (default auto = reduce on a GPU: "
                        "XLA's multiply-reduce form; xla = XLA's GEMM), e.g. xla reduce for an "
                        "A/B. The list-valued flags (--quantization, --norm-backend, "
                        "--gemv-backend, --merge-projections, --ple-lookup, --k) run every "
                        "combination, each with a fresh LLM")
    p.add_argument("--merge-projections", nargs="+", default=["on"], choices=["on", "off"],
                   help="load with the projections that read one input merged (on, the "
                        "default) and/or without (off), e.g. on off for an A/B")
    a = p.parse_args(argv)
    if max(a.batches) > 8:
        p.error(f"--batches {max(a.batches)}: at most 8 (max_running_requests=8)")
    top_k = json.load(open(a.config))["text_config"].get("num_experts_per_tok", 1)
    if a.experts < top_k:
        p.error(f"--experts {a.experts}: at least num_experts_per_tok = {top_k} of {a.config}")
    os.makedirs(a.out, exist_ok=True)  # before the checkpoint is written: a bad path fails now
    out = os.path.join(a.out, "q4_smoke.json")
    model, draft = write_checkpoint(a)
    rng = np.random.default_rng(0)
    rows = []
    for quantization, norm, gemv, merge, look, k in [
            (q, n, g, m, lk, k) for k in a.k for q in a.quantization for n in a.norm_backend
            for g in a.gemv_backend for m in a.merge_projections for lk in a.ple_lookup]:
        kernels = (f"gdn={a.gdn_backend},moe={a.moe_backend},norm={norm},gemv={gemv},"
                   f"merge={merge}")
        os.environ["MTP_JAX_PLE_LOOKUP"] = look  # read when the tables load
        with merging(merge == "on"):
            llm = LLM(model, dtype="bfloat16", max_running_requests=8, max_model_len=512,
                      speculative_algorithm="mtp" if k else "none",
                      speculative_num_steps=k if k else 3, ple_backend=a.ple_backend,
                      gdn_backend=a.gdn_backend, moe_backend=a.moe_backend,
                      norm_backend=norm, gemv_backend=gemv, quantization=quantization,
                      speculative_draft_model_path=draft if k else None)
        for b in a.batches:
            prompts = [rng.integers(100, 200_000, a.prompt_len).tolist() for _ in range(b)]
            used = a.ple_backend if a.ple_backend != "auto" else (
                "disk" if llm.model.host_callbacks else "device")  # what auto chose
            rows.append(dict(run_row(llm, prompts, k, a.max_tokens, rng, used, kernels),
                             gguf=a.gguf, quantization=quantization))
            print(rows[-1], flush=True)
            _write_rows(out, rows)  # after each row: a run cut short keeps what it measured
        print("weights GB (as held):", held_weights_gb(llm), flush=True)
        if a.profile:
            rows[-1]["profile"] = device_profile(llm.model, k, a.prompt_len, a.out,
                                                 tag=f"_norm_{norm}_gemv_{gemv}_merge_{merge}")
            _write_rows(out, rows)
        del llm
    return 0


def _write_rows(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
