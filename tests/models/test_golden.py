"""mtp_jax against golden outputs of HF transformers 5.23 and the float64 numpy MTP oracle.

Fixtures (``tests/fixtures/<name>/``, built by ``tests/fixtures/make_golden.py``; see its docstring):

* ``tiny_dense``: qwen3_5 composite layout, 2 shards + index, untied lm_head, a ``model.visual.*``
  tensor the loader must skip.
* ``tiny_moe_fused``: flat qwen3_5_moe_text layout, fused experts everywhere.
* ``tiny_moe_mtp_per_expert``: qwen3_5_moe composite, fused trunk experts, per-expert MTP experts,
  tied embeddings (no ``lm_head.weight`` on disk).

Trunk logits / hidden come from HF (float32); MTP rows come from ``tests/fixtures/numpy_reference.py``
(float64) fed the GOLDEN hidden, so the MTP tests check mtp_jax's MTP head alone. The engine-level
cached-decode / greedy tests live elsewhere and reuse ``decode_logits`` / ``greedy_tokens``.
No torch is needed here.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import mtp_jax
from tests.helpers.paths import FIXTURES

NAMES = ["tiny_dense", "tiny_moe_fused", "tiny_moe_mtp_per_expert"]
ATOL = 1e-4
RTOL = 1e-4

V, H, T, N, B = 300, 64, 11, 6, 2


def _golden(name: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(FIXTURES, name, "golden.npz")) as z:
        return {k: z[k] for k in z.files}


_MODELS: dict[str, object] = {}


def _model(name: str):
    if name not in _MODELS:
        _MODELS[name] = mtp_jax.load_model(os.path.join(FIXTURES, name), dtype="float32")
    return _MODELS[name]


def _close(actual, expected, what: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    actual = np.asarray(actual, dtype=np.float32)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = float(np.max(np.abs(actual - expected)))
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol,
                               err_msg=f"{what}: max |diff| {err:.3e}")


@pytest.mark.parametrize("name", NAMES)
def test_golden_npz_shapes(name):
    g = _golden(name)
    expect = {
        "input_ids": ((B, T), np.int32), "logits": ((B, T, V), np.float32),
        "hidden": ((B, T, H), np.float32), "decode_logits": ((B, N, V), np.float32),
        "greedy_tokens": ((B, N), np.int32), "mtp_next_ids": ((B, T), np.int32),
        "mtp_logits": ((B, T, V), np.float32), "mtp_hidden": ((B, T, H), np.float32),
        "mtp_chain_token": ((B,), np.int32), "mtp_chain_logits": ((B, V), np.float32),
    }
    assert set(g) == set(expect)
    for k, (shape, dtype) in expect.items():
        assert g[k].shape == shape and g[k].dtype == dtype, (k, g[k].shape, g[k].dtype)
        assert np.all(np.isfinite(g[k])), k
    # internal consistency of the token bookkeeping (no model maths involved)
    assert np.array_equal(g["greedy_tokens"][:, 0], g["logits"][:, -1].argmax(-1))
    assert np.array_equal(g["greedy_tokens"][:, 1:], g["decode_logits"][:, :-1].argmax(-1))
    assert np.array_equal(g["mtp_next_ids"][:, :-1], g["input_ids"][:, 1:])
    assert np.array_equal(g["mtp_next_ids"][:, -1], g["greedy_tokens"][:, 0])
    assert np.array_equal(g["mtp_chain_token"], g["mtp_logits"][:, -1].argmax(-1))
    assert g["input_ids"].min() >= 0 and g["input_ids"].max() < V
    # logits are not degenerate: rows differ clearly
    assert float(g["logits"].std()) > 0.1 and float(g["mtp_logits"].std()) > 0.1


@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_hf(name):
    g = _golden(name)
    m = _model(name)
    _check_forward(name, g, m)


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe_fused"])
def test_unmerged_forward_matches_hf(name):
    """``load_model(merge_projections=False)``: one parameter per checkpoint tensor (the path a
    model built without the loader takes) against the same golden outputs."""
    m = mtp_jax.load_model(os.path.join(FIXTURES, name), dtype="float32",
                           merge_projections=False)
    _check_forward(name, _golden(name), m)


def _check_forward(name, g, m):
    logits, hidden = m.forward(g["input_ids"])
    _close(hidden, g["hidden"], f"{name} hidden (after model.norm)")
    _close(logits, g["logits"], f"{name} logits")
    assert np.array_equal(np.asarray(logits)[:, -1].argmax(-1), g["greedy_tokens"][:, 0])


@pytest.mark.parametrize("name", NAMES)
def test_mtp_teacher_forced_matches_numpy(name):
    g = _golden(name)
    m = _model(name)
    mtp_logits, mtp_hidden = m.mtp_forward(g["hidden"], g["mtp_next_ids"])
    _close(mtp_hidden, g["mtp_hidden"], f"{name} mtp hidden (after mtp.norm)")
    _close(mtp_logits, g["mtp_logits"], f"{name} mtp logits")
    assert np.array_equal(np.asarray(mtp_logits).argmax(-1), g["mtp_logits"].argmax(-1))


@pytest.mark.parametrize("name", NAMES)
def test_mtp_chained_step_matches_numpy(name):
    """Row T: hidden = MTP hidden of row T-1 (z), token = the drafted token, position T."""
    g = _golden(name)
    m = _model(name)
    hidden = np.concatenate([g["hidden"], g["mtp_hidden"][:, T - 1:T]], axis=1)  # [B, T+1, H]
    next_ids = np.concatenate([g["mtp_next_ids"], g["mtp_chain_token"][:, None]], axis=1)
    mtp_logits, _ = m.mtp_forward(hidden, next_ids.astype(np.int32))
    mtp_logits = np.asarray(mtp_logits, dtype=np.float32)
    assert mtp_logits.shape == (B, T + 1, V)
    _close(mtp_logits[:, :T], g["mtp_logits"], f"{name} mtp logits (chained call, rows < T)")
    _close(mtp_logits[:, T], g["mtp_chain_logits"], f"{name} mtp chained-step logits")


def test_forward_takes_params_as_an_argument():
    """``forward(ids, params=p)`` inside the caller's own ``jax.jit`` (parameters as program
    arguments, not constants) matches HF; all-zero parameters give all-zero logits, so the
    passed pytree, not the loaded one, is what runs (``mtp_forward`` alike)."""
    import jax

    name = "tiny_dense"
    g, m = _golden(name), _model(name)
    forward = jax.jit(lambda p, ids: m.forward(ids, params=p)[0])
    _close(forward(m.params, g["input_ids"]), g["logits"], f"{name} logits (params argument)")
    zero = jax.tree_util.tree_map(np.zeros_like, m.params)
    assert not np.any(np.asarray(forward(zero, g["input_ids"])))
    mtp_logits, _ = m.mtp_forward(g["hidden"], g["mtp_next_ids"], params=zero)
    assert not np.any(np.asarray(mtp_logits))
    _close(m.mtp_forward(g["hidden"], g["mtp_next_ids"], params=m.params)[0], g["mtp_logits"],
           f"{name} mtp logits (params argument)")
