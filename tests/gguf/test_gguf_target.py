"""A qwen4exp GGUF target and a Strata MTP pack, written by the test's own writer
(tests/gguf/writer.py, gguf.GGUFWriter from the format text) from the trained tiny fixture,
load to the safetensors checkpoint's parameters and logits, and serve the same tokens: MTP
greedy output equals plain decoding, and the accept counts of every round equal the
safetensors model's. A file written without the GDN value-head tiling loads to other
parameters (the reorder is exercised), and llama.cpp's nextn blocks are skipped.

Teeth (shown by hand, then restored): without the reader's ``-1`` on norms
(gguf_names.convert ``norm``) test_params_and_logits fails by 1.0 on every hc / q / k norm; with
the reader's value-head untiling skipped, it fails on layers 0, 1, 3 (GDN).
"""

import numpy as np
import pytest
from flax import nnx

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.models.loader import load_model
from tests.fixtures.make_qwen4_trained_fixture import fixture_prompts
from tests.gguf.writer import write_pack, write_target
from tests.helpers.engine_runs import greedy_requests, run_per_round
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_qwen4_trained")
K = 3
MAX_NEW = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return write_target(CKPT, str(d / "t.gguf")), write_pack(CKPT, str(d / "mtp.gguf"))


@pytest.fixture(scope="module")
def models(files):
    ref = load_model(CKPT, "float32", with_mtp=True)
    gg = load_model(files[0], "float32", with_mtp=True, draft_path=files[1])
    return ref, gg


def _flat(m):
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(m.params)}


def _assert_params_close(a, b, atol=2e-7):
    fa, fb = _flat(a), _flat(b)
    assert set(fa) == set(fb)
    bad = {k: float(np.abs(fa[k] - fb[k]).max()) for k in fa
           if fa[k].shape != fb[k].shape or not np.allclose(fa[k], fb[k], rtol=0, atol=atol)}
    assert not bad, bad


def test_params_and_logits(models):
    ref, gg = models
    assert gg.has_mtp and gg.cfg.mtp_num_hidden_layers == 1
    assert gg.cfg.layer_types == ref.cfg.layer_types and gg.cfg.ple_layers == ref.cfg.ple_layers
    _assert_params_close(ref, gg)  # +1 norms and -exp(A_log) round trips: one or two ulps
    ids = np.array([[5, 9, 1, 7, 7, 30, 2, 11]], np.int32)
    la, ha = ref.forward(ids)
    lb, hb = gg.forward(ids)
    np.testing.assert_allclose(np.asarray(lb), np.asarray(la), rtol=0, atol=2e-5)
    nxt = np.roll(ids, -1, axis=1)
    da, _ = ref.mtp_forward(ha, nxt)
    db, _ = gg.mtp_forward(hb, nxt)
    np.testing.assert_allclose(np.asarray(db), np.asarray(da), rtol=0, atol=2e-5)


def test_ple_table_served_from_the_file(models, files):
    table = models[1].ple[0].table
    assert table.backend == "disk" and len(table._parts) == 1
    part = table._parts[0]
    assert part.base is not None and isinstance(part.base, np.memmap)
    assert part.base.filename.endswith("t.gguf")


def _engine(model, k):
    cfg = EngineConfig(max_running_requests=1, dtype="float32", page_size=4, max_model_len=96,
                       enable_prefix_cache=False, chunked_prefill_size=16, overlap_schedule=False,
                       num_scheduler_steps=1)  # rounds observed one by one
    return Engine(model, cfg, SpeculativeConfig(algorithm="mtp" if k else "none",
                                                num_steps=k or 3))


def _plain_greedy(model, prompt, n, width=24):
    """Plain greedy decoding through ``forward`` on one padded shape (causal: the padding
    after the last real token changes nothing before it)."""
    ids = list(prompt)
    for _ in range(n):
        row = np.zeros((1, width), np.int32)
        row[0, :len(ids)] = ids
        logits, _ = model.forward(row)
        ids.append(int(np.argmax(np.asarray(logits)[0, len(ids) - 1])))
    return ids[len(prompt):]


def mtp_runs(models: dict) -> tuple[list, dict]:
    """Three fixture prompts decoded greedily with MTP k = ``K`` by each of ``models`` (name ->
    model), one round per call: ``(prompts, {name: (output ids per prompt, per-request
    (drafted, accepted) after each round)})``."""
    vocab = next(iter(models.values())).cfg.vocab_size
    prompts = [p for p in fixture_prompts(vocab) if len(p) <= 24 - MAX_NEW][:3]
    assert len(prompts) == 3
    tags = [f"p{i}" for i in range(len(prompts))]
    out = {}
    for name, m in models.items():
        reqs = greedy_requests(prompts, tags, MAX_NEW)
        seen = run_per_round(_engine(m, K), reqs)
        out[name] = ([r.output_ids for r in reqs], seen)
    return prompts, out


def test_mtp_tokens_and_accepts_equal_safetensors(models):
    ref, gg = models
    prompts, out = mtp_runs({"ref": ref, "gguf": gg})
    assert out["gguf"][0] == out["ref"][0] == [_plain_greedy(gg, p, MAX_NEW) for p in prompts]
    assert out["gguf"][1] == out["ref"][1]
    assert sum(s[-1][1] for s in out["gguf"][1].values()) > 0  # drafts were accepted


def test_untiled_file_loads_other_params(tmp_path, models):
    """The fixture has 2 key and 4 value heads: a file written without tiling loads to other
    GDN parameters, so the reader's untiling is what makes test_params_and_logits pass."""
    bad = write_target(CKPT, str(tmp_path / "flat.gguf"), tile=False)
    m = load_model(bad, "float32", with_mtp=False)
    with pytest.raises(AssertionError, match="linear_attn"):
        _assert_params_close(models[0], _mtp_free(models[0], m))


def _mtp_free(ref, m):
    """``m`` with ``ref``'s mtp.* parameters (so only the target's are compared)."""
    class _View:
        params = nnx.from_flat_state(
            [(p, v) for p, v in nnx.to_flat_state(ref.params) if str(p[0]) == "mtp"]
            + list(nnx.to_flat_state(m.params)))
    return _View


def test_nextn_blocks_are_skipped(tmp_path, models):
    t = write_target(CKPT, str(tmp_path / "nextn.gguf"), nextn=True)
    m = load_model(t, "float32", with_mtp=False)
    assert m.cfg.num_hidden_layers == models[0].cfg.num_hidden_layers and not m.has_mtp
    _assert_params_close(models[0], _mtp_free(models[0], m))
