"""The research API on qwen4_exp is jit- and grad-able as on qwen3_5: the README's pattern
``jax.jit(lambda p, x: m.forward(x, params=p)[0])(m.params, ids)`` runs (the PLE rows come
from a host callback inside the trace) and gives the eager forward's logits, which equal
transformers' (golden fixture); a gradient with respect to the parameters flows."""

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.models.loader import load_model
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_qwen4_exp")


def test_forward_under_jit_and_grad():
    m = load_model(CKPT, "float32", with_mtp=True)
    g = np.load(CKPT + "/golden.npz")
    ids = jnp.asarray(g["input_ids"], jnp.int32)
    jitted = jax.jit(lambda p, x: m.forward(x, params=p)[0])(m.params, ids)
    eager = np.asarray(m.forward(np.asarray(ids))[0])
    np.testing.assert_allclose(np.asarray(jitted), eager, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(eager, g["logits"], atol=2e-4, rtol=2e-4)

    def loss(p):
        logits, streams = m.forward(ids, params=p)
        mtp_logits, _ = m.mtp_forward(streams[:, :-1], ids[:, 1:], params=p)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + jnp.mean(mtp_logits ** 2)

    grads = jax.jit(jax.grad(loss))(m.params)
    norms = [float(jnp.linalg.norm(x)) for x in jax.tree_util.tree_leaves(grads)]
    assert all(np.isfinite(norms)) and sum(norms) > 0
