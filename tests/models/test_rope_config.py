"""RoPE scaling in config.json (issue 32, item 6): ``rope_parameters`` (transformers 5) and the
legacy ``rope_scaling`` (Qwen's long-context recipe) are read into ``cfg.rope_scaling`` for both
families; every other type, and keys the chosen type would ignore, are refused at config time,
before any weight file is opened. No compile here."""

from __future__ import annotations

import copy
import json
import math
import os

import jax.numpy as jnp
import pytest
from flax import nnx

from mtp_jax import LLM, ConfigError, ModelConfig, load_model
from mtp_jax.models.qwen4_exp import Qwen4ExpConfig
from mtp_jax.rope import DEFAULT_ROPE, RopeScaling
from tests.helpers import refusals
from tests.helpers.paths import CONFIGS, FIXTURES
from tests.helpers.refusals import config_only

weight_spy = refusals.weight_spy  # the fixture: records weight-file access

QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
WANT = RopeScaling("yarn", factor=4.0, original_max_position_embeddings=262144,
                   attention_factor=0.1 * math.log(4.0) + 1.0)


def _real(name: str) -> dict:
    with open(os.path.join(CONFIGS, name)) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def _qwen35(**text_changes) -> dict:
    raw = _real("Qwen3.5-2B.json")
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if not k.startswith("_")}
    raw["text_config"].update(text_changes)
    return raw


def _flash(**text_changes) -> dict:
    raw = copy.deepcopy(_real("Qwen3.8-Flash-Next.json"))
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if not k.startswith("_")}
    raw["text_config"].update(text_changes)
    return raw


def _params(**changes) -> dict:
    """The released Qwen3.5 rope_parameters with ``changes``."""
    return dict(_qwen35()["text_config"]["rope_parameters"], **changes)


def test_released_configs_are_plain_rope():
    assert ModelConfig.from_dict(_qwen35()).rope_scaling == DEFAULT_ROPE
    assert Qwen4ExpConfig.from_dict(_flash()).rope_scaling == DEFAULT_ROPE


@pytest.mark.parametrize("where", ["text_config", "top_level", "rope_parameters", "type_key"])
def test_yarn_spellings_read_alike(where):
    if where == "text_config":  # Qwen's recipe: rope_scaling beside the released rope_parameters
        raw = _qwen35(rope_scaling=dict(QWEN_YARN))
    elif where == "top_level":
        raw = dict(_qwen35(), rope_scaling=dict(QWEN_YARN))
    elif where == "rope_parameters":  # transformers 5: everything in one section
        raw = _qwen35(rope_parameters=_params(**QWEN_YARN))
    else:  # legacy "type"
        raw = _qwen35(rope_scaling={"type": "yarn", "factor": 4,
                                    "original_max_position_embeddings": 262144})
    cfg = ModelConfig.from_dict(raw)
    assert cfg.rope_scaling == WANT
    assert cfg.rope_theta == 1e7 and cfg.rotary_dim == 64  # still read beside the scaling


def test_yarn_options_and_linear():
    cfg = ModelConfig.from_dict(_qwen35(rope_parameters=_params(
        **QWEN_YARN, beta_fast=16, beta_slow=2, truncate=False, attention_factor=1.5)))
    assert cfg.rope_scaling == RopeScaling("yarn", 4.0, 262144, 16.0, 2.0, 1.5, False)
    cfg = ModelConfig.from_dict(_qwen35(rope_parameters=_params(
        rope_type="yarn", factor=40, mscale=0.707, mscale_all_dim=1.0)))
    assert cfg.rope_scaling.original_max_position_embeddings == 262144  # max_position_embeddings
    assert cfg.rope_scaling.attention_factor == pytest.approx(
        (0.0707 * math.log(40) + 1) / (0.1 * math.log(40) + 1))
    cfg = ModelConfig.from_dict(_qwen35(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert cfg.rope_scaling == RopeScaling("linear", factor=2.0)
    # Qwen2-VL's "mrope" is plain RoPE for text; nulls are absent keys
    cfg = ModelConfig.from_dict(_qwen35(rope_scaling={"type": "mrope", "factor": None}))
    assert cfg.rope_scaling == DEFAULT_ROPE


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "llama3", "proportional", "su",
                                       "ntk"])
def test_unsupported_types_refused(rope_type):
    for raw in (_qwen35(rope_scaling={"type": rope_type, "factor": 4.0}),
                _qwen35(rope_parameters=_params(rope_type=rope_type, factor=4.0))):
        with pytest.raises(ConfigError, match=rf"RoPE scaling type '{rope_type}'.*supported: "
                                              r"default, linear, yarn"):
            ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match=rf"type '{rope_type}'"):
        Qwen4ExpConfig.from_dict(_flash(rope_scaling={"rope_type": rope_type, "factor": 2}))


@pytest.mark.parametrize("text, pattern", [
    (dict(rope_scaling={"factor": 4.0}), r"keys \['factor'\] are not read by rope_type "
                                         r"'default'.*yarn: attention_factor"),
    (dict(rope_scaling=dict(QWEN_YARN, low_freq_factor=1.0)), r"\['low_freq_factor'\]"),
    (dict(rope_parameters=_params(rope_type="yarn"), rope_scaling={"type": "linear",
                                                                   "factor": 2}),
     r"rope_type 'yarn' but rope_scaling has 'linear'"),
    (dict(rope_scaling={"type": "yarn", "rope_type": "linear", "factor": 2}),
     r"says rope_type 'linear' but type 'yarn'"),
    (dict(rope_scaling={"type": "yarn"}), r"'yarn' needs 'factor'"),
    (dict(rope_scaling={"type": "yarn", "factor": 0.5}), r"'factor' is 0.5; expected a number "
                                                         r">= 1"),
    (dict(rope_scaling={"type": "yarn", "factor": "4"}), r"'factor' is '4'"),
    (dict(rope_scaling=dict(QWEN_YARN, original_max_position_embeddings=1.5e5)),
     r"'original_max_position_embeddings' is 150000.0"),
    (dict(rope_scaling=dict(QWEN_YARN, truncate="yes")), r"'truncate' is 'yes'"),
    (dict(rope_scaling=[1, 2]), r"'rope_scaling' is \[1, 2\]; expected an object"),
])
def test_malformed_rope_refused(text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ModelConfig.from_dict(_qwen35(**text))


def test_two_different_sections_refused():
    raw = dict(_qwen35(rope_scaling=dict(QWEN_YARN)), rope_scaling={"type": "linear", "factor": 2})
    with pytest.raises(ConfigError, match="both in text_config .* and at the top level"):
        ModelConfig.from_dict(raw)


def test_configs_stay_static_keys():
    """Frozen and hashable: equal files give equal, equally hashed configs; the scaling is part
    of the identity (compiled programs take the config as a static argument)."""
    a = ModelConfig.from_dict(_qwen35(rope_scaling=dict(QWEN_YARN)))
    b = ModelConfig.from_dict(_qwen35(rope_parameters=_params(**QWEN_YARN)))
    c = ModelConfig.from_dict(_qwen35(rope_scaling=dict(QWEN_YARN, factor=2.0)))
    assert a == b and hash(a) == hash(b) and a != c and a != ModelConfig.from_dict(_qwen35())
    assert "yarn" in repr(a)  # what the executable cache's graphdef digest reads


def test_qwen4_exp_target_and_draft_take_the_scaling():
    from mtp_jax.models.qwen4_exp.model import Qwen4ExpModel
    from mtp_jax.models.qwen4_exp.qsa import QSAAttention

    raw = json.load(open(os.path.join(FIXTURES, "tiny_qwen4_exp", "config.json")))
    raw["text_config"]["rope_scaling"] = {"type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 8}
    cfg = Qwen4ExpConfig.from_dict(raw)
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.factor == 4.0
    model = Qwen4ExpModel(cfg, jnp.float32, with_mtp=True)
    attn = [m for _, m in nnx.iter_modules(model) if isinstance(m, QSAAttention)]
    in_mtp = [m for _, m in nnx.iter_modules(model.mtp) if isinstance(m, QSAAttention)]
    assert attn and in_mtp and all(m.rope_scaling == cfg.rope_scaling for m in attn)
    assert all(m.rope_theta == cfg.mtp_rope_theta for m in in_mtp)


def test_qwen4_exp_draft_rope():
    mtp = dict(_flash()["text_config"]["mtp"], rope_theta=5e6)
    assert Qwen4ExpConfig.from_dict(_flash(mtp=mtp)).mtp_rope_theta == 5e6
    same = dict(mtp, rope_scaling=dict(QWEN_YARN))
    cfg = Qwen4ExpConfig.from_dict(_flash(mtp=same, rope_scaling=dict(QWEN_YARN)))
    assert cfg.rope_scaling == WANT and cfg.mtp_rope_theta == 5e6
    with pytest.raises(ConfigError, match=r"MTP layer but the model has default; mtp_jax runs "
                                          r"the draft with the target's scaling"):
        Qwen4ExpConfig.from_dict(_flash(mtp=same))


@pytest.mark.parametrize("key,outer,inner", [("partial_rotary_factor", 0.5, 0.25),
                                             ("rope_theta", 1e6, 1e7)])
def test_a_key_given_twice_must_agree(key, outer, inner):
    """``rope_theta`` / ``partial_rotary_factor`` beside and inside rope_parameters with two
    values is refused (the engine reads the outer one; a reader of the section would run other
    positions); equal values are fine."""
    for parse, make in ((ModelConfig.from_dict, _qwen35), (Qwen4ExpConfig.from_dict, _flash)):
        params = dict(make()["text_config"]["rope_parameters"], **{key: inner})
        with pytest.raises(ConfigError, match=rf"{key} = {outer!r} beside .* but {inner!r}"):
            parse(make(rope_parameters=params, **{key: outer}))
        cfg = parse(make(rope_parameters=params, **{key: inner}))
        assert (cfg.rotary_dim == int(cfg.head_dim * inner) if key == "partial_rotary_factor"
                else cfg.rope_theta == inner)


@pytest.mark.parametrize("fixture", ["tiny_yarn", "tiny_qwen4_exp"])
def test_refused_before_weights(fixture, tmp_path, weight_spy):
    """Through LLM and load_model: the refusal comes from config.json alone (the folder holds no
    weights at all, and no weight file is opened)."""
    raw = json.load(open(os.path.join(FIXTURES, fixture, "config.json")))
    text = raw.get("text_config", raw)
    text["rope_parameters"] = dict(text["rope_parameters"], rope_type="longrope")
    folder = config_only(os.path.join(FIXTURES, fixture), tmp_path / "m")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f)
    for load in (lambda: LLM(folder, dtype="float32"), lambda: load_model(folder)):
        with pytest.raises(ConfigError, match="RoPE scaling type 'longrope'"):
            load()
    assert weight_spy.opened == [] and weight_spy.data == []
