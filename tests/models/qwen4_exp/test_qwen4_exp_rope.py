"""qwen4_exp with YaRN (issue 32, item 6) against HF transformers 5.23: the ``tiny_qwen4_exp``
weights under a YaRN config (``tests/fixtures/tiny_qwen4_yarn``, built by
``tests/fixtures/make_golden_qwen4_yarn.py``): prompt logits and pre-mixer streams past the
original context of 4 positions (attention heads, QSA index heads and block keys all roped with
the scaling), and the MTP draft on its own ``mtp.rope_theta`` under the same scaling.

The fixture's ``plain_logits`` (plain RoPE, same weights) are 0.24 away from its YaRN logits past
position 4: a model that dropped the scaling anywhere in the target fails here.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mtp_jax.models.qwen4_exp import Qwen4ExpConfig, load_qwen4_exp
from tests.helpers.paths import fixture_path

FIX = fixture_path("tiny_qwen4_yarn")
ATOL = RTOL = 1e-4
ORIGINAL = 4


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(FIX, "golden.npz")) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def model():
    return load_qwen4_exp(FIX, "float32", ple_backend="memory")


def test_config_and_fixture_discriminate(golden):
    cfg = Qwen4ExpConfig.from_folder(FIX)
    s = cfg.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("yarn", 3.0, ORIGINAL)
    assert cfg.rope_theta == 1000 and cfg.mtp_rope_theta == 3000
    far = np.abs(golden["logits"] - golden["plain_logits"])[:, ORIGINAL:]
    assert far.max() > 100 * ATOL


def test_prompt_logits_and_streams(model, golden):
    logits, streams = model.forward(golden["input_ids"])
    np.testing.assert_allclose(np.asarray(streams), golden["streams"], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(np.asarray(logits), golden["logits"], atol=ATOL, rtol=RTOL)


def test_mtp_draft(model, golden):
    logits, _ = model.mtp_forward(golden["streams"], golden["mtp_next_ids"])
    np.testing.assert_allclose(np.asarray(logits), golden["mtp_logits"], atol=ATOL, rtol=RTOL)
