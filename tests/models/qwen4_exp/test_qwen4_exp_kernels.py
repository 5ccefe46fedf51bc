"""qwen4_exp kernel backends: GDN and MoE take ``pallas`` on a GPU (``auto`` too, where the kernels
take the model; a GPU is faked where a load must pass the checks), the hyper-connection kernels
(``norm``) when asked for, the multiply-reduce form of one-row projections (``gemv``
``reduce``; ``auto`` on a GPU), XLA on the CPU and for every other op; ``pallas`` for QSA
attention is refused before any weight is read, ``pallas`` / ``fused`` for gemv at the kernels'
resolution, also before.
The GDN kernels' path through the model (decode rows, verify, partial commit) runs in Pallas
interpret mode on the CPU against the golden logits of tests/fixtures/tiny_qwen4_exp. The Triton
lowering at Flash-Next's shapes: tests/kernels/test_pallas_gdn_fused.py,
tests/kernels/test_pallas_moe.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.config import ConfigError
from mtp_jax.kernels import KernelBackends
from mtp_jax.models import registry
from mtp_jax.models.qwen4_exp import Qwen4ExpConfig
from mtp_jax.models.qwen4_exp.kernels import resolve_kernels
from tests.helpers.paths import CONFIGS, fixture_path

FIX = fixture_path("tiny_qwen4_exp")
FLASH = os.path.join(CONFIGS, "Qwen3.8-Flash-Next.json")


@pytest.fixture
def fake_gpu(monkeypatch):
    """JAX's default backend reads ``gpu`` (the load-time checks and resolution); nothing runs
    while it does."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.fixture
def no_weights(monkeypatch):
    """The registry entry's load refuses to run: a refusal must come before it."""
    def load(*a, **k):
        raise AssertionError("the load was reached: the refusal came too late")
    monkeypatch.setitem(registry.REGISTRY, "qwen4_exp", dataclasses.replace(
        registry.REGISTRY["qwen4_exp"], load=load))


def _flash() -> Qwen4ExpConfig:
    return Qwen4ExpConfig.from_dict(json.load(open(FLASH)))


def test_pallas_attention_is_refused_before_weights(fake_gpu, no_weights):
    with pytest.raises(ConfigError, match=r"qwen4_exp runs attention on XLA \(its GPU kernels "
                                          r"run gdn, moe, norm and gemv only\), but "
                                          r"attention_backend 'pallas' was asked for; use "
                                          r"--attention-backend xla"):
        mtp_jax.load_model(FIX, dtype="bfloat16", attention_backend="pallas")
    with pytest.raises(ConfigError, match=r"runs attention on XLA"):  # the loader's own check
        resolve_kernels(_flash(), "bfloat16", {"attention": "pallas"}, platform="gpu")


@pytest.mark.parametrize("choice", ["pallas", "fused"])
def test_gemv_kernels_are_refused_at_resolution(choice, fake_gpu, monkeypatch):
    """The Triton GEMV and the fused dense-MLP kernel are not run for qwen4_exp: refused when
    the loader resolves the kernels, before it reads a tensor."""
    from mtp_jax.models.qwen4_exp import loader

    def read(*a, **k):
        raise AssertionError("a tensor was read: the refusal came too late")
    monkeypatch.setattr(loader, "read_checkpoint", read)
    why = rf"gemv_backend '{choice}' is not supported for qwen4_exp"
    with pytest.raises(ConfigError, match=why):
        resolve_kernels(_flash(), "bfloat16", {"gemv": choice}, platform="gpu")
    with pytest.raises(ConfigError, match=why):
        mtp_jax.load_model(FIX, dtype="bfloat16", gemv_backend=choice)


@pytest.fixture
def auto_hyper(monkeypatch):
    """``auto`` takes the hyper-connection kernels on a GPU (the measured default or not)."""
    monkeypatch.setattr("mtp_jax.models.qwen4_exp.kernels.AUTO_HYPER_ON_GPU", True)


def test_auto_takes_the_gdn_moe_and_hyper_connection_kernels_on_a_gpu_only(auto_hyper):
    cfg = _flash()
    kernels = KernelBackends(gdn="pallas", moe="pallas", norm="pallas", gemv="reduce")
    for backends in ({}, {op: "auto" for op in ("attention", "gdn", "moe", "norm", "gemv")},
                     {"gdn": None, "moe": "pallas"}):
        assert resolve_kernels(cfg, "bfloat16", backends, platform="gpu") == kernels
        if "pallas" not in backends.values():
            assert resolve_kernels(cfg, "bfloat16", backends,
                                   platform="cpu") == KernelBackends()
    assert resolve_kernels(cfg, "bfloat16", {"gdn": "xla", "norm": "xla", "gemv": "xla"},
                           platform="gpu") == KernelBackends(moe="pallas")
    assert resolve_kernels(cfg, "bfloat16", {"gemv": "reduce"},
                           platform="cpu") == KernelBackends(gemv="reduce")
    # auto takes XLA where a kernel cannot run: float32 MoE, MoE tiles, GDN head sizes,
    # stream counts and ranks the hyper-connection kernels cannot block
    hyper = {"norm": "xla", "gemv": "xla"}
    assert resolve_kernels(cfg, "float32", hyper, platform="gpu") == KernelBackends(gdn="pallas")
    odd = dataclasses.replace(cfg, moe_intermediate_size=648)
    assert resolve_kernels(odd, "bfloat16", hyper, platform="gpu") == KernelBackends(
        gdn="pallas")
    odd = dataclasses.replace(cfg, linear_key_head_dim=96)
    assert resolve_kernels(odd, "bfloat16", hyper, platform="gpu") == KernelBackends(
        moe="pallas")
    for change, why in ((dict(hc_count=3), "hc_count 3 is not a power of two"),
                        (dict(hc_lowrank=8), "hc_lowrank 8 is not a multiple of 16")):
        odd = dataclasses.replace(cfg, **change)
        assert resolve_kernels(odd, "bfloat16", {}, platform="gpu").norm == "xla"
        with pytest.raises(ConfigError, match=f"norm_backend 'pallas' cannot run this model: "
                                              f"{why}"):
            resolve_kernels(odd, "bfloat16", {"norm": "pallas"}, platform="gpu")
    with pytest.raises(ConfigError, match="norm_backend 'pallas' needs a CUDA GPU"):
        resolve_kernels(cfg, "bfloat16", {"norm": "pallas"}, platform="cpu")


def test_pallas_refusals_at_resolution():
    cfg = _flash()
    with pytest.raises(ConfigError, match="gdn_backend 'pallas' needs a CUDA GPU"):
        resolve_kernels(cfg, "bfloat16", {"gdn": "pallas"}, platform="cpu")
    with pytest.raises(ConfigError, match="moe_backend 'pallas' needs 16-bit weights"):
        resolve_kernels(cfg, "float32", {"moe": "pallas"}, platform="gpu")
    assert resolve_kernels(cfg, "float32", {"gdn": "pallas"}, platform="gpu").gdn == "pallas"
    odd = dataclasses.replace(cfg, linear_key_head_dim=96)
    with pytest.raises(ConfigError, match="linear_key_head_dim 96 is not a power of two"):
        resolve_kernels(odd, "bfloat16", {"gdn": "pallas"}, platform="gpu")
    odd = dataclasses.replace(cfg, moe_intermediate_size=648)
    with pytest.raises(ConfigError, match="moe_intermediate_size 648 is not a multiple of 16"):
        resolve_kernels(odd, "bfloat16", {"moe": "pallas"}, platform="gpu")


def _backends(m) -> tuple[set, set]:
    """The GDN layers' and the MoE blocks' (target and MTP layers) backends of a load."""
    model = nnx.merge(m.graphdef, m.params)
    layers = list(model.layers) + list(model.mtp.layers if model.mtp is not None else [])
    gdn = {la.linear_attn.backend for la in layers if la.layer_type != "full_attention"}
    moe = {b for la in layers for b in (la.mlp.backend, la.mlp.experts.backend)}
    return gdn, moe


def test_explicit_pallas_reaches_the_layers(fake_gpu, auto_hyper):
    auto = mtp_jax.load_model(FIX, dtype="bfloat16", ple_backend="disk", gdn_backend="xla",
                              moe_backend="xla", gemv_backend="xla")
    assert auto.cfg.kernels == KernelBackends() and _backends(auto) == ({"xla"}, {"xla"})
    m = mtp_jax.load_model(FIX, dtype="bfloat16", ple_backend="disk")  # auto, on a "GPU"
    assert m.cfg.kernels == KernelBackends(gdn="pallas", moe="pallas", gemv="reduce")
    assert m.has_mtp
    assert _backends(m) == ({"pallas"}, {"pallas"})
    assert hash(m.cfg) != hash(auto.cfg) and m.cfg != auto.cfg  # static args, cache keys
    assert m.cfg == dataclasses.replace(auto.cfg, kernels=m.cfg.kernels)
    kept = mtp_jax.load_model(FIX, dtype="bfloat16", ple_backend="disk", quantization="keep")
    # kept experts: XLA decodes few
    assert kept.cfg.kernels == KernelBackends(gdn="pallas", gemv="reduce")


def _verify_commit(m, cache, ids, accept: int):
    """A verify of ``ids [B, T]`` after the cache's tokens, then a commit of the first
    ``accept`` rows (the engine's round, outside the engine). Returns the verify logits."""
    ids = np.asarray(ids)
    b, t = ids.shape
    rows = m.host_rows(np.stack([m.ngram_context(h) for h in cache.tokens]), ids)
    pos = np.broadcast_to(np.arange(cache.length, cache.length + t, dtype=np.int32), (b, t))
    batch = AttentionBatch(jnp.asarray(pos), jnp.ones((b, t), bool), cache.page_table)

    @jax.jit
    def round_(params, ids, rows, batch, paged, slots):
        model = nnx.merge(m.graphdef, params)
        streams, paged, kept = model(ids, batch, paged, slots, "verify", host_rows=rows)
        return model.logits(streams), paged, model.commit(slots, kept, jnp.full((b,), accept))

    logits, cache.paged, cache.slots = round_(m.params, jnp.asarray(ids, jnp.int32),
                                              jnp.asarray(rows), batch, cache.paged,
                                              cache.slots)
    for h, row in zip(cache.tokens, ids[:, :accept].tolist()):
        h.extend(row)
    cache.length += accept
    return logits


def test_pallas_gdn_decode_verify_and_commit_match_golden(monkeypatch):
    """float32, the GDN fused kernels interpreted: multi-row and one-row decode calls (the
    step form, <= 8 rows), a verify window of 4 rows and a commit of 2 give the golden
    logits of the whole sequence."""
    with monkeypatch.context() as mp:
        mp.setattr(jax, "default_backend", lambda: "gpu")
        m = mtp_jax.load_model(FIX, dtype="float32", ple_backend="disk", gdn_backend="pallas",
                               with_mtp=False)
    assert _backends(m)[0] == {"pallas"}
    with np.load(f"{FIX}/golden.npz") as z:
        ids, greedy, full = z["input_ids"], z["greedy_tokens"], z["full_logits"]
    seq = np.concatenate([ids, greedy], axis=1)
    n = ids.shape[1]
    close = lambda got, want: np.testing.assert_allclose(np.asarray(got, np.float32), want,
                                                         rtol=1e-4, atol=1e-4)
    cache = m.new_cache(ids.shape[0], seq.shape[1] + 1)
    close(m.extend(cache, seq[:, :n - 3]), full[:, :n - 3])  # prefill (XLA's chunked form)
    close(m.extend(cache, seq[:, n - 3:n]), full[:, n - 3:n])  # 3 rows: the step form
    close(_verify_commit(m, cache, seq[:, n:n + 4], 2), full[:, n:n + 4])
    close(m.extend(cache, seq[:, n + 2:n + 3]), full[:, n + 2:n + 3])  # one row
    close(m.extend(cache, seq[:, n + 3:n + 5]), full[:, n + 3:n + 5])


@pytest.mark.parametrize("b", [1, 4])
def test_flash_next_gdn_layer_lowers_for_cuda(b, fake_gpu):
    """The qwen4_exp GDN layer at Flash-Next's shapes with ``pallas``: its decode of 1 and 4
    rows and a verify window of 4 rows with its commit lower to the Triton kernels."""
    from mtp_jax.models.qwen4_exp.decoder import GatedDeltaNetGate
    from tests.helpers.triton_lowering import lower_for_cuda

    cfg = _flash()
    cfg = dataclasses.replace(cfg, kernels=resolve_kernels(cfg, "bfloat16", {"gdn": "pallas"}))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GatedDeltaNetGate(cfg, jnp.bfloat16)))
    spec = jax.ShapeDtypeStruct
    state = (spec((b, cfg.linear_num_value_heads, 128, 128), jnp.float32),
             spec((b, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1), jnp.bfloat16))

    def fn(p, x, state, valid):
        layer = nnx.merge(graphdef, p)
        out1, s1 = layer.decode(x[:, :1], state, valid[:, :1])
        out4, s4 = layer.decode(x, s1, valid)
        out, rows = layer.verify(x, s4, valid)
        return out1, out4, out, layer.commit(s4, rows, jnp.full((b,), 2, jnp.int32))

    text = lower_for_cuda(fn, params, spec((b, 4, cfg.hidden_size), jnp.bfloat16), state,
                          spec((b, 4), jnp.bool_))
    for name in ("gdn_conv_write", "gdn_fused_decode", "gdn_fused_verify", "gdn_fused_commit"):
        assert name in text


def test_hyper_connection_kernels_in_the_model_match_xla(tmp_path, monkeypatch, auto_hyper):
    """float32, a random checkpoint of 4 streams (the kernels' blocks; the golden fixture has
    3), the hyper-connection kernels interpreted around every block and in the final mixer:
    a 5-row prefill, one-row decode steps and a verify of 4 rows with a commit of 2 give the
    XLA model's logits, so the previous block's inject is folded in where the XLA path adds it."""
    from mtp_jax.models.qwen4_exp.random_checkpoint import write_random_qwen4_exp
    from tests.models.qwen4_exp.test_qwen4_exp_shapes import BASE, L, Q

    text = dict(BASE, hc_count=4, hc_lowrank=16, layer_types=[L, Q, L], ple_layer_ids=[1],
                indexer_compress_ratio=2, indexer_budget=4, num_hidden_layers=3)
    write_random_qwen4_exp(text, str(tmp_path), dtype="float32", seed=3)
    load = lambda **kw: mtp_jax.load_model(str(tmp_path), dtype="float32", ple_backend="memory",
                                           with_mtp=False, **kw)
    ref = load()
    with monkeypatch.context() as mp:
        mp.setattr(jax, "default_backend", lambda: "gpu")
        # auto: the hyper-connection kernels
        m = load(gdn_backend="xla", moe_backend="xla", gemv_backend="xla")
    assert m.cfg.kernels == KernelBackends(norm="pallas") and ref.cfg.kernels.norm == "xla"
    model = nnx.merge(m.graphdef, m.params)
    assert {la.mlp_hyper_connection.backend for la in model.layers} == {"pallas"}
    assert model.hyper_connection_mixer.backend == "pallas"
    seq = np.asarray([[5, 9, 1, 12, 3, 33, 8, 40, 2, 17]])
    caches = [x.new_cache(1, 16) for x in (ref, m)]
    both = lambda f: [np.asarray(f(x, c)) for x, c in zip((ref, m), caches)]
    steps = [lambda x, c: x.extend(c, seq[:, :5]), lambda x, c: x.extend(c, seq[:, 5:6]),
             lambda x, c: _verify_commit(x, c, seq[:, 6:10], 2),
             lambda x, c: x.extend(c, seq[:, 8:9])]
    for i, step in enumerate(steps):
        want, got = both(step)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"step {i}")


def test_reduce_gemv_reaches_the_projections_and_keeps_the_logits():
    """``gemv_backend="reduce"`` (``auto`` on a GPU) sets every projection's one-row form, and
    one-row decode calls in that form give the golden logits."""
    from mtp_jax.models.layers.basic import Linear, MergedLinear

    m = mtp_jax.load_model(FIX, dtype="float32", ple_backend="disk", gemv_backend="reduce")
    assert m.cfg.kernels == KernelBackends(gemv="reduce")
    model = nnx.merge(m.graphdef, m.params)
    forms = {node.backend for _, node in nnx.iter_graph(model)
             if isinstance(node, (Linear, MergedLinear))}
    assert forms == {"reduce"}
    with np.load(f"{FIX}/golden.npz") as z:
        ids, greedy, full = z["input_ids"], z["greedy_tokens"], z["full_logits"]
    seq = np.concatenate([ids, greedy], axis=1)[:1]
    n = ids.shape[1]
    cache = m.new_cache(1, seq.shape[1] + 1)
    m.extend(cache, seq[:, :n])
    for t in range(n, n + 3):  # one-row calls: the reduce form
        np.testing.assert_allclose(np.asarray(m.extend(cache, seq[:, t:t + 1]), np.float32),
                                   full[:1, t:t + 1], rtol=1e-4, atol=1e-4)
