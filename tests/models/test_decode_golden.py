"""Cached decoding (paged KV + GDN step form + commit) against HF transformers' cached decode
logits and greedy continuation (golden fixtures, float32)."""

import numpy as np
import pytest

from mtp_jax import LLM, SamplingParams
from tests.helpers.paths import fixture_path

FIXTURES = ["tiny_dense", "tiny_moe_fused", "tiny_moe_mtp_per_expert"]


@pytest.mark.parametrize("name", FIXTURES)
def test_cached_decode_logits_match_hf(name):
    import jax.numpy as jnp
    from flax import nnx

    from mtp_jax.cache.paged import AttentionBatch
    from mtp_jax.cache.pools import make_pools
    from mtp_jax.models.loader import load_model

    g = np.load(fixture_path(name) + "/golden.npz")
    m = load_model(fixture_path(name), "float32", with_mtp=False)
    model = nnx.merge(m.graphdef, m.params)
    ids = g["input_ids"]
    b, t = ids.shape
    n = g["greedy_tokens"].shape[1]
    pools = make_pools(m.cfg, num_pages=1 + b * 4, page_size=8, slots=b, k=0, mtp=False,
                       dtype=jnp.float32)
    table = jnp.asarray(1 + np.arange(b * 4).reshape(b, 4), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    gdn = pools.gdn
    _, kv, gdn = model(jnp.asarray(ids), AttentionBatch(pos, jnp.ones((b, t), bool), table),
                       pools.kv, gdn, "prefill")
    tokens = g["greedy_tokens"]
    for step in range(n - 1):
        p = jnp.full((b, 1), t + step, jnp.int32)
        tok = jnp.asarray(tokens[:, step:step + 1])
        hidden, kv, rows = model(tok, AttentionBatch(p, jnp.ones((b, 1), bool), table), kv, gdn,
                                 "verify")
        gdn = model.commit(gdn, rows, jnp.ones((b,), jnp.int32))
        logits = np.asarray(model.logits(hidden))[:, 0]
        np.testing.assert_allclose(logits, g["decode_logits"][:, step], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_generation_matches_hf(name):
    g = np.load(fixture_path(name) + "/golden.npz")
    llm = LLM(fixture_path(name), dtype="float32", speculative_algorithm="none")
    outs = llm.generate([row.tolist() for row in g["input_ids"]],
                        SamplingParams(temperature=0, max_tokens=g["greedy_tokens"].shape[1],
                                       ignore_eos=True))
    for out, ref in zip(outs, g["greedy_tokens"]):
        assert out.token_ids == ref.tolist()
        assert out.finish_reason == "length"
