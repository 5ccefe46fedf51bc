"""python -m mtp_jax.train_mtp: the chain it trains is the round's (checked against teacher-forced
``mtp_forward`` calls, tests/helpers/mtp_oracle.py), its losses against float64 numpy, a short
run learns and resumes, and bad settings are refused before any weight loads."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.models.registry import entry_of
from mtp_jax.train.loss import head_loss
from mtp_jax.train.prepare import XLA
from mtp_jax.train.synthetic import motif_sequences
from mtp_jax.train_mtp import main
from tests.helpers.mtp_oracle import chain_outputs
from tests.helpers.paths import fixture_path

TRAINED = fixture_path("tiny_trained")


@pytest.mark.parametrize("name", ["tiny_trained", "tiny_moe_fused"])
def test_the_trained_chain_is_the_rounds_chain(name):
    """Every chain step of ``entry.draft_chain`` (dense attention over the round's key set)
    equals the teacher-forced ``mtp_forward`` rows built as the round builds them."""
    m = mtp_jax.load_model(fixture_path(name), "float32", merge_projections=False, **XLA)
    rng = np.random.default_rng(0)
    ids = rng.integers(2, m.cfg.vocab_size, (2, 12)).astype(np.int32)
    _, hidden = m.forward(ids)
    chain = entry_of(m.cfg).draft_chain
    zs = jax.jit(lambda p, h, i: chain(nnx.merge(m.graphdef, p), h, i, 3))(m.params, hidden,
                                                                            ids)
    for b in range(2):
        logits, z = chain_outputs(m, np.asarray(hidden)[b], ids[b], 3)
        for j in range(3):
            valid = np.arange(12) + j + 1 < 12
            np.testing.assert_allclose(np.asarray(zs[j])[b][valid], z[j][valid], atol=2e-5,
                                       err_msg=f"{name} step {j}")


def test_losses_match_numpy():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(8, 11)).astype(np.float32)  # H = 8, V = 11
    z, th = rng.normal(size=(2, 7, 8)).astype(np.float32)
    labels = rng.integers(0, 11, 7).astype(np.int32)
    mask = np.array([1, 1, 0, 1, 1, 1, 0], bool)
    head = lambda x: x @ jnp.asarray(w)

    def logsm(x):
        x = x.astype(np.float64) @ w.astype(np.float64)
        return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
            x.max(-1, keepdims=True)

    lq, lp = logsm(z), logsm(th)
    ce = -lq[np.arange(7), labels]
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    hits = (lq.argmax(-1) == labels)
    for kind, ref in (("ce", ce), ("kl", kl)):
        loss, h, count = head_loss(head, jnp.asarray(z), jnp.asarray(labels), jnp.asarray(mask),
                                   kind, 3, jnp.asarray(th))
        np.testing.assert_allclose(float(loss), ref[mask].sum(), rtol=1e-5)
        assert float(h) == hits[mask].sum() and float(count) == mask.sum()


def _data(path, n=48, length=40):
    with open(path, "w") as f:
        for s in motif_sequences(n, length, seed=9):
            f.write(json.dumps({"token_ids": s}) + "\n")
    return str(path)


def _args(tmp_path, data, out, *extra):
    return ["--model", TRAINED, "--data", data, "--out", str(out), "--steps", "12",
            "--warmup-steps", "2", "--batch-size", "8", "--seq-len", "40", "--lr", "1e-2",
            "--eval-every", "12", "--checkpoint-every", "6", "--chunk", "128",
            "--checkpoint-dir", str(tmp_path / "states"), "--dtype", "float32", *extra]


def test_a_fresh_head_learns_exports_and_resumes(tmp_path, capsys):
    data = _data(tmp_path / "d.jsonl")
    assert main(_args(tmp_path, data, tmp_path / "out", "--fresh-head")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    before, after = summary["eval_before"]["accuracy"], summary["eval"][-1]["accuracy"]
    assert summary["fresh_head"] and before[0] < 0.2 and after[0] > before[0] + 0.3, summary
    # The output is a checkpoint whose draft is the trained one (and only the draft changed).
    out = mtp_jax.load_model(str(tmp_path / "out"), "float32", merge_projections=False)
    src = mtp_jax.load_model(TRAINED, "float32", merge_projections=False)
    flat = lambda m: {"/".join(map(str, k)): np.asarray(v) for k, v in
                      nnx.to_flat_state(m.params)}
    a, b = flat(out), flat(src)
    assert a.keys() == b.keys()
    changed = {k for k in a if not np.array_equal(a[k], b[k])}
    assert changed and all(k.startswith("mtp/") for k in changed)
    # Resuming the finished run restores its state: the same tensors are exported again.
    assert main(_args(tmp_path, data, tmp_path / "again", "--fresh-head", "--resume")) == 0
    again = flat(mtp_jax.load_model(str(tmp_path / "again"), "float32",
                                    merge_projections=False))
    assert all(np.array_equal(again[k], a[k]) for k in a)
    # Starting afresh over a saved run, or resuming with other settings, is refused.
    assert main(_args(tmp_path, data, tmp_path / "x", "--fresh-head")) == 2
    assert main(_args(tmp_path, data, tmp_path / "y", "--fresh-head", "--resume", "--loss",
                      "kl")) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "loss" in err


@pytest.mark.parametrize("extra,match", [
    (["--speculative-num-steps", "0"], "speculative-num-steps"),
    (["--seq-len", "5"], "seq-len"),
    (["--lr", "0"], "--lr"),
    (["--eval-fraction", "1.5"], "eval-fraction"),
])
def test_bad_settings_are_refused(tmp_path, extra, match, capsys):
    data = _data(tmp_path / "d.jsonl", n=4)
    assert main(_args(tmp_path, data, tmp_path / "out", *extra)) == 2
    assert match in capsys.readouterr().err


def test_refusals_before_weights_load(tmp_path, capsys, monkeypatch):
    import mtp_jax.models.loader as loader

    def no_load(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loader, "load_model", no_load)
    monkeypatch.setattr(mtp_jax, "load_model", no_load)
    data = _data(tmp_path / "d.jsonl", n=4)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "f").write_text("x")
    assert main(_args(tmp_path, data, tmp_path / "used")) == 2
    assert "not an empty folder" in capsys.readouterr().err
    args = _args(tmp_path, data, tmp_path / "out")
    args[1] = fixture_path("tiny_qwen4_exp")
    assert main(args) == 2
    assert "qwen4_exp" in capsys.readouterr().err
    assert main(["--model", TRAINED, "--out", str(tmp_path / "o")]) == 2
    assert "no training data" in capsys.readouterr().err
    assert main(_args(tmp_path, data, tmp_path / "out", "--resume")) == 2
    assert "holds no train state" in capsys.readouterr().err


def test_a_moe_checkpoint_trains_on_its_own_continuations(tmp_path, capsys):
    """qwen3_5_moe with per-expert mtp experts, --self-generate: the head trains on the
    target's continuations and is written back per expert, as the source stores it."""
    from safetensors import safe_open

    src = fixture_path("tiny_moe_mtp_per_expert")
    data = tmp_path / "p.jsonl"
    rng = np.random.default_rng(3)
    data.write_text("".join(json.dumps({"token_ids": rng.integers(2, 200, n).tolist()}) + "\n"
                            for n in (5, 9, 14, 20)))
    out = tmp_path / "draft"
    assert main(["--model", src, "--data", str(data), "--self-generate", "4",
                 "--generate-tokens", "12", "--out", str(out), "--draft-only", "--steps", "3",
                 "--batch-size", "4", "--seq-len", "32", "--eval-fraction", "0",
                 "--checkpoint-every", "3", "--chunk", "64", "--dtype", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # 4 prompts of 48 tokens in all, each continued by up to 12 (EOS may end one early), all
    # four texts in each batch of 4; two steps counted (the first compiles).
    assert 2 * 48 < summary["train"]["tokens"] <= 2 * (48 + 48)
    with safe_open(str(out / "mtp.safetensors"), "numpy") as f:
        names = set(f.keys())
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in names
    m = mtp_jax.load_model(src, "float32", draft_path=str(out))
    assert m.has_mtp
