"""One training run of ``python -m mtp_jax.train_mtp``: checks, data, model, steps, export."""

from __future__ import annotations

import gc
import sys
import time

import jax
import numpy as np

from mtp_jax.train import checkpoint as ckpt
from mtp_jax.train import data as train_data
from mtp_jax.train.export import write_draft_checkpoint
from mtp_jax.train.loop import Metrics, evaluate, train
from mtp_jax.train.params import split_draft, to_numpy
from mtp_jax.config import ConfigError
from mtp_jax.train.prepare import (TrainSettings, check_model, check_settings, checkpoint_dir,
                                   load_for_training)
from mtp_jax.train.step import StepSettings, init_state, make_optimizer, make_steps

__all__ = ["run", "read_sequences"]


def _log(msg: str) -> None:
    print(f"[train_mtp] {msg}", file=sys.stderr, flush=True)


def read_sequences(s: TrainSettings, cfg) -> list[list[int]]:
    """The token rows to train on: the texts of ``s.data``, or (``s.self_generate``) its first
    N prompts continued by the target through the engine."""
    from mtp_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(s.model)
    seqs = train_data.read_jsonl(s.data, tok, vocab_size=cfg.vocab_size)
    if not s.self_generate:
        return seqs
    import mtp_jax

    prompts = seqs[:s.self_generate]
    if len(prompts) < s.self_generate:
        _log(f"--self-generate {s.self_generate}: {s.data} has {len(prompts)} prompts; "
             "continuing all of them")
    _log(f"continuing {len(prompts)} prompts by {s.generate_tokens} tokens with the target")
    llm = mtp_jax.LLM(s.model, dtype=s.dtype, speculative_algorithm="none")
    out = train_data.self_generate(llm, prompts, s.generate_tokens, s.generate_temperature,
                                   s.seed)
    del llm
    gc.collect()
    return out


def run(s: TrainSettings) -> dict:
    """Train and export; returns a summary (train/eval metrics, tokens/s, the output path).
    Raises :class:`~mtp_jax.config.ConfigError` for bad settings, data or checkpoints (before
    weights load where the settings alone show it)."""
    check_settings(s)
    cfg, entry = check_model(s)
    ckpt_dir = checkpoint_dir(s)
    saved = ckpt.latest(ckpt_dir)
    if not s.resume and saved is not None:
        raise ConfigError(f"{ckpt_dir} already holds a train state (step {saved}); pass --resume "
                          "to continue it, or another --checkpoint-dir (or delete it) to start "
                          "afresh.")
    if s.resume and saved is None:
        raise ConfigError(f"--resume: {ckpt_dir} holds no train state; pass the "
                          "--checkpoint-dir the run saved into (default: its --out + '.train'), "
                          "or drop --resume to start afresh.")
    seqs = read_sequences(s, cfg)
    train_seqs, eval_seqs = train_data.split_eval(seqs, s.eval_fraction, s.seed)
    batches = train_data.Batches(train_seqs, s.batch_size, s.seq_len, seed=s.seed)
    model, fresh = load_for_training(s, cfg)
    draft_text = "a fresh head" if fresh else "the checkpoint's own"
    _log(f"{len(train_seqs)} train / {len(eval_seqs)} eval texts, {batches.num_windows} rows "
         f"of <= {s.seq_len} tokens; draft: {draft_text}")
    frozen, flat, draft = split_draft(model)
    optimizer = make_optimizer(s.lr, s.steps, s.warmup_steps, s.weight_decay, s.clip_norm)
    settings = StepSettings(k=s.k, loss=s.loss, step_decay=s.step_decay, chunk=s.chunk)
    train_step, eval_step = make_steps(model, entry, draft, settings, optimizer)
    state = init_state(flat, optimizer)
    if s.resume:
        state, meta = ckpt.restore(ckpt_dir, state, run=s.run_key())
        batches.restore(meta["data"])
        _log(f"resumed from step {int(state.step)} in {ckpt_dir}")

    def eval_batches():
        return train_data.Batches(eval_seqs, s.batch_size, s.seq_len, seed=s.seed,
                                  train=False)

    history = []

    def on_interval(st, step):
        if eval_seqs and (step % s.eval_every == 0 or step == s.steps):
            m = evaluate(eval_step, st.params, frozen, eval_batches(), s.k)
            history.append({"step": step, **m.as_dict()})
            _log(f"step {step} eval {m.text()}")
        if step % s.checkpoint_every == 0 or step == s.steps:
            ckpt.save(ckpt_dir, step, st, {"run": s.run_key(), "data": batches.state()})

    before = (evaluate(eval_step, state.params, frozen, eval_batches(), s.k)
              if eval_seqs else Metrics(s.k))
    if eval_seqs:
        _log(f"eval before training: {before.text()}")
    interval = np_gcd(s.eval_every, s.checkpoint_every)
    state, totals = train(state, train_step, frozen, iter(batches), steps=s.steps, k=s.k,
                          on_interval=on_interval, interval=interval)
    t0 = time.perf_counter()
    path = write_draft_checkpoint(s.model, cfg, to_numpy(jax.device_get(state.params)), s.out,
                                  draft_only=s.draft_only)
    _log(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    return {"out": path, "steps": int(state.step), "fresh_head": fresh,
            "peak_memory_bytes": _peak_memory(),
            "train": totals.as_dict(),
            "train_tokens_per_s": totals.tokens / totals.seconds if totals.seconds else None,
            "eval_before": before.as_dict() if eval_seqs else None, "eval": history}


def _peak_memory() -> int | None:
    """The device's peak bytes in use (None where the backend does not report it)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def np_gcd(a: int, b: int) -> int:
    return int(np.gcd(a, b))
