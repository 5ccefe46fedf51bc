"""Train the built-in default model's target on the project's own docs (run by hand).

    .venv/bin/python -m mtp_jax.tools.train_default_model --out trained_target.safetensors

The default model (:mod:`mtp_jax.default_model`) has random weights: its text is gibberish and
nothing an MTP head could learn to predict. This trains its decoder layers and final norm
(``embed_tokens`` and ``lm_head`` stay at their seed-0 random values, regenerated at build time)
on README.md and docs/*.md, tokenized with the model's Qwen tokenizer, for about 6 minutes on 2
CPU cores (500 steps of 16 x 128 tokens), then writes the trained tensors (every target tensor
but ``embed_tokens`` and ``lm_head``; no ``mtp.*``), bfloat16, under their on-disk names, to one
safetensors file (1.3 MB; the MoE experts are most of it). It trains from the random checkpoint
it writes itself (seed 0, as the build's first step), whatever the cache holds, and prints the
exact full-vocabulary loss and greedy continuations of a few prompts, run through
:class:`mtp_jax.LLM` on a temporary copy of the model with the trained tensors.

The loss (:func:`doc_softmax_loss`) scores the ~3.9k ids of the docs exactly and the other
244k rows of the frozen random head through their Gaussian moments: 0.35 s per 1,024 tokens
on 2 cores, against 3.6 s for the full softmax. What it reaches: a full-vocabulary cross-entropy of about 2.2 on the
docs, the docs recited where the context is a few dozen doc tokens, but greedy continuations of
short prompts that mix doc fragments with unrelated ids: with a 64-wide hidden state, a hedged
guess loses to the largest of 244k random rows. ``--zero-other-head-rows`` (the head's rows of
ids outside the docs zeroed, which the build would have to do too) removes that: loss about 1.0
and continuations made of doc tokens only.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx

from mtp_jax.default_model import default_config
from mtp_jax.home import cache_root
from mtp_jax.models.loaded import LoadedModel
from mtp_jax.models.loader import load_model
from mtp_jax.models.params import param_name
from mtp_jax.tokenizer import Tokenizer
from mtp_jax.tools.random_checkpoint import write_random_checkpoint
from mtp_jax.weights.names import disk_name
from mtp_jax.weights.safetensors_write import save_file

__all__ = ["doc_files", "doc_token_ids", "line_starts", "window_batches", "doc_softmax_loss",
           "zero_head_rows", "trained_tensors", "random_base", "main"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FROZEN = ("embed_tokens.", "lm_head.", "mtp.")
PROMPTS = ("The engine", "MTP speculative decoding", "The prefix cache")
XLA = dict(attention_backend="xla", gdn_backend="xla", moe_backend="xla", norm_backend="xla",
           gemv_backend="xla")


def doc_files(root: str = REPO) -> list[str]:
    """README.md and docs/*.md under ``root``; ``FileNotFoundError`` when README.md is absent
    (an installed package without its repository: pass ``--docs-root``)."""
    readme = os.path.join(root, "README.md")
    if not os.path.isfile(readme):
        raise FileNotFoundError(f"{readme} not found; pass --docs-root, the repository folder.")
    return [readme] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def doc_token_ids(tokenizer: Tokenizer, files: list[str]) -> list[np.ndarray]:
    """Each file's text as ``[n] int32`` token ids."""
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            out.append(np.asarray(tokenizer.encode(f.read()), np.int32))
    return out


def line_starts(tokenizer: Tokenizer, doc: np.ndarray) -> np.ndarray:
    """Indices of the tokens of ``doc`` that start a line or follow a full stop."""
    ends = {int(t) for t in np.unique(doc)
            if tokenizer.decode([int(t)]).endswith(("\n", "."))}
    return np.flatnonzero(np.isin(doc[:-1], list(ends))) + 1


def window_batches(docs: list[np.ndarray], starts: list[np.ndarray], batch: int, seq_len: int,
                   steps: int, seed: int, aligned: float = 0.5):
    """``steps`` batches ``(ids [batch, seq_len] int32, lengths [batch] int32)`` of windows:
    each row picks a file uniformly (so the short prose files are not drowned by the long
    tables of docs/benchmarks.md), then a window that begins at one of its ``starts`` (line and
    sentence starts, as prompts do) with probability ``aligned``, anywhere otherwise. Rows that
    run past the file's end are padded with 0 and their ``lengths`` say so."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.zeros((batch, seq_len), np.int32)
        lengths = np.zeros(batch, np.int32)
        for r in range(batch):
            f = int(rng.integers(len(docs)))
            doc = docs[f]
            if rng.random() < aligned and len(starts[f]):
                start = int(rng.choice(starts[f]))
            else:
                start = int(rng.integers(max(1, len(doc) - seq_len + 1)))
            row = doc[start:start + seq_len]
            ids[r, :len(row)], lengths[r] = row, len(row)
        yield ids, lengths


def doc_softmax_loss(model: LoadedModel, candidates: np.ndarray, margin: float = 0.0,
                     hinge_weight: float = 0.1):
    """A ``loss(params, ids, lengths, key)`` for :func:`mtp_jax.train.target.train_target`
    that scores only the LM head's ``candidates`` rows (``[C]`` ids, the docs' tokens; every
    label must be one) and stands in for the other ``N`` rows by their moments, taking them as
    draws from a Gaussian of mean ``mu`` and covariance ``S`` (which the frozen random head's
    rows are). Per real row, with ``h`` the final hidden state and ``s = sqrt(h^T S h)``:

        ce    = cross-entropy over [w_c . h for c in candidates] + [rest]
        rest  = log sum_{j not in C} exp(w_j . h) ~ log N + mu . h + s^2 / 2
        hinge = relu(mu . h + sqrt(2 log N) s + margin - max_c w_c . h)
        loss  = ce + hinge_weight * hinge

    ``rest`` is the expectation of the others' share of the normaliser (the Gaussian's moment
    generating function); ``mu . h + sqrt(2 log N) s`` is about the largest of the others'
    logits, so the hinge pushes greedy decoding onto a doc token where the model is unsure
    which (at the start of a prompt, say); otherwise a random row wins there and the text
    leaves the docs (a weight of 0.5 collapsed onto one large-norm row; 0.1 helps a little).
    Rows of the head that are all zero (past the tokenizer's ids)
    add ``log(count)`` to ``rest``. Cost: one ``[H, H]`` product per row instead of the
    vocabulary's ``V`` dot products. Returns ``(loss, accuracy)``: accuracy counts rows whose
    label beats the other candidates and the others' estimated maximum."""
    head = np.asarray(model.params["lm_head"]["weight"][...], np.float64)  # [V, H]
    vocab = head.shape[0]
    candidates = np.unique(candidates).astype(np.int32)
    others = np.setdiff1d(np.arange(vocab), candidates)
    zero = ~head[others].any(axis=1)
    rows = head[others[~zero]]
    if len(rows) > 1:
        mu, cov = rows.mean(axis=0), np.cov(rows, rowvar=False)
        log_n = float(np.log(len(rows)))
        z = float(np.sqrt(2 * log_n))
    else:  # every other row is zero (--zero-other-head-rows): rest is exact, its max 0
        mu, cov, log_n, z = np.zeros(head.shape[1]), np.zeros((head.shape[1],) * 2), -np.inf, 0.0
    log_zero = float(np.log(zero.sum())) if zero.any() else -np.inf
    index_of = np.zeros(vocab, np.int32)
    index_of[candidates] = np.arange(len(candidates), dtype=np.int32)
    mu, cov = jnp.asarray(mu, jnp.float32), jnp.asarray(cov, jnp.float32)
    candidates, index_of = jnp.asarray(candidates), jnp.asarray(index_of)

    def loss(params, ids, lengths, key):
        del key
        _, hidden = model.forward(ids, params=params)  # its full logits are unused: dropped
        w = params["lm_head"]["weight"][...][candidates]  # [C, H]
        doc = hidden @ w.T  # [B, T, C]
        mean = hidden @ mu
        var = jnp.einsum("bth,hk,btk->bt", hidden, cov, hidden)
        rest = jnp.logaddexp(log_n + mean + var / 2, log_zero)
        rest_max = mean + z * jnp.sqrt(jnp.maximum(var, 1e-12))  # no inf gradient at 0
        labels = index_of[jnp.roll(ids, -1, axis=1)]
        mask = (jnp.arange(ids.shape[1])[None, :] + 1 < lengths[:, None]).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(
            jnp.concatenate([doc, rest[..., None]], axis=-1), labels)
        top = doc.max(axis=-1)
        label_logit = jnp.take_along_axis(doc, labels[..., None], axis=-1)[..., 0]
        hinge = jax.nn.relu(rest_max + margin - top)
        hit = ((label_logit >= top) & (label_logit > rest_max)).astype(jnp.float32)
        n = jnp.maximum(mask.sum(), 1.0)
        return ((ce + hinge_weight * hinge) * mask).sum() / n, (hit * mask).sum() / n

    return loss


def zero_head_rows(model: LoadedModel, keep: np.ndarray) -> LoadedModel:
    """``model`` with every ``lm_head`` row but ``keep``'s set to zero (logit 0)."""
    mask = np.zeros(model.cfg.vocab_size, bool)
    mask[keep] = True
    flat = [(p, v.replace(v.get_value() * jnp.asarray(mask, v.get_value().dtype)[:, None])
             if param_name(p) == "lm_head.weight" else v)
            for p, v in nnx.to_flat_state(model.params)]
    return dataclasses.replace(model, params=nnx.from_flat_state(flat))


def trained_tensors(model: LoadedModel, params: nnx.State) -> dict[str, np.ndarray]:
    """On-disk name -> bfloat16 array of every target parameter but ``embed_tokens`` and
    ``lm_head`` (no ``mtp.*``)."""
    return {disk_name(model.cfg, param_name(p)): np.asarray(v.get_value()).astype(
        ml_dtypes.bfloat16) for p, v in nnx.to_flat_state(params)
        if not param_name(p).startswith(FROZEN)}


def full_vocab_loss(model: LoadedModel, params, docs, batch: int, seq_len: int, seed: int):
    """Exact next-token cross-entropy (whole vocabulary) on ``batch`` random windows of the
    docs (seeded by ``seed``; windows of the training text, not held out)."""
    from mtp_jax.train.target import next_token_loss

    ids, lengths = next(window_batches(docs, [np.zeros(0, int)] * len(docs), batch, seq_len, 1,
                                       seed))
    logits, _ = model.forward(ids, params=params)
    return float(next_token_loss(logits, jnp.asarray(ids), jnp.asarray(lengths))[0])


def random_base(folder: str) -> str:
    """Write the default model's random checkpoint (seed 0, bfloat16, with the tokenizer) into
    ``folder``, as :func:`mtp_jax.default_model.default_model_path` builds it before any trained
    tensor is applied; returns ``folder``."""
    return write_random_checkpoint(default_config(), folder, dtype="bfloat16", experts="fused",
                                   include_mtp=True, seed=0, tokenizer=True,
                                   cache_dir=cache_root())


def greedy_samples(base: str, model: LoadedModel, params, prompts, max_tokens: int) -> list[str]:
    """Greedy continuations of ``prompts`` through :class:`mtp_jax.LLM` on a copy of the
    checkpoint folder ``base`` whose tensors are ``params`` (stored bfloat16, run float32)."""
    from mtp_jax import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        for name in os.listdir(base):
            if not name.startswith("model"):  # config, generation config, tokenizer files
                shutil.copy(os.path.join(base, name), tmp)
        save_file({disk_name(model.cfg, param_name(p)): np.asarray(v.get_value()).astype(
            ml_dtypes.bfloat16) for p, v in nnx.to_flat_state(params)},
            os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        llm = LLM(tmp, dtype="float32", speculative_algorithm="none")
        outs = llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.text for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp_jax.tools.train_default_model",
                                 description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="the safetensors file to write")
    ap.add_argument("--steps", type=int, default=500, help="optimizer steps (%(default)s)")
    ap.add_argument("--batch", type=int, default=16, help="rows per step (%(default)s)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per row (%(default)s)")
    ap.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (%(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="window sampling seed (%(default)s)")
    ap.add_argument("--zero-other-head-rows", action="store_true",
                    help="train with the lm_head rows of ids that are not in the docs set to "
                         "zero (the ids kept go into the file's metadata, lm_head_kept_ids): "
                         "a build must zero the same rows")
    ap.add_argument("--docs-root", default=REPO, help="folder holding README.md and docs/")
    ap.add_argument("--docs", nargs="+", default=None,
                    help="train on these text files instead of README.md and docs/*.md")
    args = ap.parse_args(argv)
    # jax's CPU triangular solves (the GDN chunked form) call OpenBLAS, whose own threads
    # fight XLA's on a small machine: a step took 6x longer. scipy loads it lazily, so this
    # still applies when set here.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        return _train(args, random_base(tmp), start)


def _train(args, path: str, start: float) -> int:
    from mtp_jax.train.target import train_target

    tokenizer = Tokenizer.from_folder(path)
    docs = doc_token_ids(tokenizer, args.docs or doc_files(args.docs_root))
    print(f"[docs] {len(docs)} files, {sum(map(len, docs))} tokens, "
          f"{len(np.unique(np.concatenate(docs)))} distinct ids", flush=True)
    model = load_model(path, dtype="float32", merge_projections=False, with_mtp=True, **XLA)
    kept = np.unique(np.concatenate(docs))
    if args.zero_other_head_rows:
        model = zero_head_rows(model, kept)
    loss = doc_softmax_loss(model, np.concatenate(docs))
    starts = [line_starts(tokenizer, d) for d in docs]
    params = train_target(model, window_batches(docs, starts, args.batch, args.seq_len,
                                                args.steps, args.seed),
                          args.steps, lr=args.lr, seed=args.seed, loss=loss,
                          trainable=lambda name: not name.startswith(FROZEN))
    train_s = time.perf_counter() - start
    full = full_vocab_loss(model, params, docs, args.batch, args.seq_len, args.seed + 1)
    tensors = trained_tensors(model, params)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meta = {"format": "pt"}
    if args.zero_other_head_rows:
        meta["lm_head_kept_ids"] = json.dumps(kept.tolist())
    save_file(tensors, args.out, metadata=meta)
    print(f"[out] {args.out}: {len(tensors)} tensors, {os.path.getsize(args.out) / 1024:.0f} KiB")
    print(f"[loss] full-vocabulary cross-entropy on {args.batch} windows: {full:.3f}")
    for prompt, text in zip(PROMPTS, greedy_samples(path, model, params, PROMPTS, 40)):
        print(f"[sample] {prompt!r} -> {text!r}")
    print(f"[time] {train_s:.0f} s to train, {time.perf_counter() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
