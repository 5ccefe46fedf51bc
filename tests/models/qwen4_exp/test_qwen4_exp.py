"""qwen4_exp (Qwen3.8-Flash-Next) against golden outputs of HF transformers 5.23.

Fixture ``tests/fixtures/tiny_qwen4_exp`` (built by ``tests/fixtures/make_golden_qwen4_exp.py``,
see its docstring): composite layout, hc_count 3, two QSA layers (spelled ``full_attention`` and
``qwen_sparse_attention``) whose budget (2 blocks of 2) is smaller than the prompt, PLE on
one-indexed layer 2 with a 4-shard n-gram table, GDN with sigmoid output gate, MoE + shared
expert (per-expert tensors in the trunk, fused in the MTP layer), one MTP layer. The MTP golden is
a float64 head assembled from HF modules (transformers has no qwen4_exp MTP). No torch needed.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from mtp_jax.config import ConfigError
from mtp_jax.models.qwen4_exp import Qwen4ExpConfig, load_qwen4_exp
from tests.helpers.paths import fixture_path

FIX = fixture_path("tiny_qwen4_exp")
ATOL = RTOL = 1e-4
_M = {}


def _model(backend="disk"):
    if backend not in _M:
        _M[backend] = load_qwen4_exp(FIX, "float32", ple_backend=backend)
    return _M[backend]


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(FIX, "golden.npz")) as z:
        return {k: z[k] for k in z.files}


def _close(a, e, what):
    a = np.asarray(a, np.float32)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    np.testing.assert_allclose(a, e, atol=ATOL, rtol=RTOL,
                               err_msg=f"{what}: max |diff| {np.abs(a - e).max():.3e}")


def test_config_parses_released_spellings():
    cfg = Qwen4ExpConfig.from_folder(FIX)
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention",
                               "linear_attention", "full_attention")
    assert cfg.ple_layers == (1,)  # ple_layer_ids [2] is one-indexed
    assert cfg.output_gate_type == "sigmoid" and cfg.hc_count == 3 and cfg.block_topk == 2
    assert cfg.composite and cfg.mtp_num_hidden_layers == 1
    hash(cfg)


def test_config_rejects_bad_values():
    import json
    raw = json.load(open(os.path.join(FIX, "config.json")))
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["ple_layer_ids"] = [3]  # one-indexed 3 = layer 2, a QSA layer
    with pytest.raises(ConfigError, match="not linear_attention"):
        Qwen4ExpConfig.from_dict(bad)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["layer_types"][0] = "sliding_attention"
    with pytest.raises(ConfigError, match="sliding_attention"):
        Qwen4ExpConfig.from_dict(bad)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["indexer_budget"] = 5
    with pytest.raises(ConfigError, match="indexer_budget"):
        Qwen4ExpConfig.from_dict(bad)


def test_real_config_parses():
    path = "/work/shared/real_configs/Qwen3.8-Flash-Next.json"
    if not os.path.isfile(path):
        pytest.skip("real config not available")
    import json
    cfg = Qwen4ExpConfig.from_dict(json.load(open(path)))
    assert cfg.ple_layers == (1,) and len(cfg.full_layer_ids) == 12 and cfg.hc_hidden == 10240
    assert cfg.block_topk == 512 and cfg.ngram_head_dim == 160


def test_prompt_logits(golden):
    logits, streams = _model().forward(golden["input_ids"])
    _close(logits, golden["logits"], "prompt logits")
    _close(streams, golden["streams"], "pre-mixer streams")


def test_forward_takes_params_as_an_argument(golden):
    """``forward(ids, params=p)``: the passed pytree runs (all zeros: all-zero logits; the
    loaded one, passed back in: the golden logits)."""
    import jax

    m = _model()
    logits, _ = m.forward(golden["input_ids"], params=m.params)
    _close(logits, golden["logits"], "prompt logits (params argument)")
    zero = jax.tree_util.tree_map(np.zeros_like, m.params)
    assert not np.any(np.asarray(m.forward(golden["input_ids"], params=zero)[0]))


def test_cached_decode_and_greedy(golden):
    m = _model()
    ids, greedy = golden["input_ids"], golden["greedy_tokens"]
    cache = m.new_cache(ids.shape[0], ids.shape[1] + greedy.shape[1] + 1)
    rest = np.asarray(m.extend(cache, ids))
    _close(rest, golden["logits"], "cached prefill logits")
    tok = rest[:, -1].argmax(-1)
    got = [tok]
    for n in range(greedy.shape[1]):
        step = np.asarray(m.extend(cache, greedy[:, n:n + 1]))[:, 0]
        _close(step, golden["decode_logits"][:, n], f"decode step {n}")
        if ids.shape[1] + n < golden["full_logits"].shape[1]:  # full forward over prompt+greedy
            _close(step, golden["full_logits"][:, ids.shape[1] + n], f"decode {n} vs full")
        got.append(step.argmax(-1))
    np.testing.assert_array_equal(np.stack(got[:-1], 1), greedy)


def test_mtp_draft(golden):
    logits, streams = _model().mtp_forward(golden["streams"], golden["mtp_next_ids"])
    _close(logits, golden["mtp_logits"], "mtp logits")
    _close(streams, golden["mtp_streams"], "mtp streams")


def test_load_model_and_registry_hooks(golden):
    import mtp_jax
    from mtp_jax.models.registry import REGISTRY

    spec = REGISTRY["qwen4_exp"]
    assert all(s.verify_handler for s in spec.slot_states)
    m = mtp_jax.load_model(FIX, dtype="float32")
    assert m.cfg.model_type == "qwen4_exp" and m.has_mtp
    logits, _ = m.forward(golden["input_ids"])
    _close(logits, golden["logits"], "load_model prompt logits")


def test_load_model_refuses_only_asked_kernels(monkeypatch):
    """qwen4_exp runs attention on XLA: an explicitly asked non-XLA backend for it is refused
    before any weight is read, naming it; ``auto`` is not refused even where it resolves to
    kernels for the other families (on a GPU: the GDN and MoE kernels, the reduce gemv form).
    GDN, MoE, norm and gemv: tests/models/qwen4_exp/test_qwen4_exp_kernels.py."""
    import mtp_jax
    from mtp_jax.config import ConfigError
    from mtp_jax.kernels import KernelBackends
    from mtp_jax.models import registry

    import jax

    with monkeypatch.context() as mp, pytest.raises(
            ConfigError, match=r"qwen4_exp runs attention on XLA .*"
                               r"attention_backend 'pallas' was asked for"):
        mp.setattr(jax, "default_backend", lambda: "gpu")  # else: "needs a CUDA GPU"
        mtp_jax.load_model(FIX, dtype="float32", attention_backend="pallas")
    gpu_auto = KernelBackends.resolve(platform="gpu")
    assert gpu_auto != KernelBackends()  # what auto means for the other families on a GPU
    monkeypatch.setattr(KernelBackends, "resolve", classmethod(lambda cls, *a, **k: gpu_auto))
    monkeypatch.setitem(registry.REGISTRY, "qwen4_exp", dataclasses.replace(
        registry.REGISTRY["qwen4_exp"], load=lambda *a, **k: "loaded"))
    assert mtp_jax.load_model(FIX, dtype="float32") == "loaded"
