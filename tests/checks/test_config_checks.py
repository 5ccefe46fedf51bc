"""Config-time refusals (issue 4, part 1): each raised before any weight file is opened, with a
message naming the value, what is supported and the fix; through every entry point (LLM,
load_model, the CLI, check_before_load)."""

import dataclasses
import json
import os
import re

import pytest

from mtp_jax import LLM, ConfigError, SpeculativeConfig, load_model
from mtp_jax.checks import DUMMY_WEIGHT_MTP_MESSAGE, check_before_load
from mtp_jax.models import registry
from mtp_jax.weights import hub
from mtp_jax.weights.safetensors_files import CheckpointError
from tests.helpers.paths import DOCS, fixture_path
from tests.helpers.refusals import (MOE, config_only, edit_config, split_moe,  # noqa: F401
                                    weight_spy, write_gguf)


QWEN4 = fixture_path("tiny_qwen4_exp")
CONFIGS = os.path.join(os.path.dirname(DOCS), "configs")


def _qwen4_config(tmp_path, **text_changes) -> str:
    """A folder holding only tiny_qwen4_exp's config.json with ``text_changes`` made in its
    text_config."""
    folder = config_only(QWEN4, tmp_path / "qwen4")
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg["text_config"].update(text_changes)
    json.dump(cfg, open(path, "w"))
    return folder


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return split_moe(tmp_path_factory.mktemp("split"))


@pytest.fixture
def no_mtp_draft_family(monkeypatch):
    spec = registry.REGISTRY["qwen3_5_moe"]
    monkeypatch.setitem(registry.REGISTRY, "qwen3_5_moe",
                        dataclasses.replace(spec, drafts=("external",)))


@pytest.fixture
def unhandled_slot_state(monkeypatch):
    spec = registry.REGISTRY["qwen3_5_moe"]
    extra = registry.SlotState("ngram_context", "n-gram context of the last tokens", None)
    monkeypatch.setitem(registry.REGISTRY, "qwen3_5_moe",
                        dataclasses.replace(spec, slot_states=spec.slot_states + (extra,)))


def _draft_with_config(tmp_path, split, **changes):
    import shutil

    d = tmp_path / "draft_cfg"
    shutil.copytree(split[1], d)
    edit_config(d, **changes)
    return str(d)


# (id, builder(tmp_path, split) -> LLM kwargs, fixtures to activate, message regex, which weight
# files may be opened for their header: "none", "draft" (a draft folder's tensor names), "gguf")
CASES = [
    ("num_steps_0", lambda t, s: dict(speculative_num_steps=0), (),
     r"speculative_num_steps \(--speculative-num-steps\) 0 is outside 1\.\.8", "none"),
    ("num_steps_9", lambda t, s: dict(speculative_num_steps=9), (),
     r"9 is outside 1\.\.8; pick k in that range .*--speculative-algorithm none", "none"),
    ("num_steps_bool", lambda t, s: dict(speculative_num_steps=True), (),
     r"speculative_num_steps True is of type bool, not an int; pass a value of that type, "
     r"e\.g\. speculative_num_steps=3 \(the default\)", "none"),
    ("num_steps_str", lambda t, s: dict(speculative_num_steps="3"), (),
     r"speculative_num_steps '3' is of type str, not an int; pass speculative_num_steps=3\.",
     "none"),
    ("engine_int_as_str", lambda t, s: dict(max_prefill_batch="8"), (),
     r"max_prefill_batch '8' is of type str, not an int; pass max_prefill_batch=8\.", "none"),
    ("engine_size_as_str", lambda t, s: dict(chunked_prefill_size="2k"), (),
     r"chunked_prefill_size '2k' is of type str, not an int; pass a value of that type, e\.g\. "
     r"chunked_prefill_size=2048 \(the default\)", "none"),
    ("model_gguf_missing", lambda t, s: dict(model=str(t / "nope" / "model.gguf")), (),
     r"model path '\S*/nope/model\.gguf' does not exist: no such file on this machine\. Pass "
     r"an existing checkpoint folder", "none"),
    ("model_folder_missing", lambda t, s: dict(model=str(t / "nope")), (),
     r"model path '\S*/nope' does not exist: no such file or folder on this machine", "none"),
    ("draft_gguf_missing", lambda t, s: dict(speculative_draft_model_path=str(t / "mtp.gguf")),
     (), r"speculative_draft_model_path '\S*/mtp\.gguf' does not exist: no such file on this "
     r"machine\. Pass the path of an existing Strata MTP pack", "none"),
    ("num_steps_negative_spec_off", lambda t, s: dict(speculative_algorithm="none",
                                                      speculative_num_steps=-1), (),
     r"-1 is outside 0\.\.8; leave it at the default 3 or 0 \(it is unused with speculation "
     r"off\)", "none"),
    ("unknown_algorithm", lambda t, s: dict(speculative_algorithm="medusa"), (),
     r"'medusa' is unknown; use one of none, mtp, external", "none"),
    ("draft_with_spec_off", lambda t, s: dict(speculative_algorithm="none",
                                              speculative_draft_model_path=s[1]), (),
     r"was given but speculative_algorithm is 'none'; it only applies with "
     r"speculative_algorithm='mtp'", "none"),
    ("draft_with_external", lambda t, s: dict(speculative_algorithm="external",
                                              speculative_draft_model_path=s[1],
                                              proposer=lambda r, ids, k: [0] * k), (),
     r"it only applies with speculative_algorithm='mtp'", "none"),
    ("dummy_weight_mtp", lambda t, s: dict(dummy_weight=True), (),
     r"MTP reads its draft from the checkpoint, so it cannot run with --dummy-weight", "none"),
    ("external_without_proposer", lambda t, s: dict(speculative_algorithm="external"), (),
     r"'external' needs a proposer callable", "none"),
    ("proposer_with_mtp", lambda t, s: dict(proposer=lambda r, ids, k: [0] * k), (),
     r"a proposer was given but speculative_algorithm is 'mtp'", "none"),
    ("engine_page_size", lambda t, s: dict(page_size=12), (),
     r"page_size \(--page-size\) 12 must be a power of two", "none"),
    ("engine_running", lambda t, s: dict(max_running_requests=0), (),
     r"max_running_requests \(--max-running-requests\) 0 must be >= 1", "none"),
    ("family_without_mtp_draft", lambda t, s: {}, ("no_mtp_draft_family",),
     r"speculative_algorithm='mtp' is not available for model_type 'qwen3_5_moe': the family "
     r"has no MTP draft registered \(registered: external\)", "none"),
    ("config_without_mtp_layer",
     lambda t, s: dict(model=config_only(MOE, t / "nomtp", mtp_num_hidden_layers=0)), (),
     r"declares no MTP layer \(mtp_num_hidden_layers is 0\) and no "
     r"speculative_draft_model_path was given", "none"),
    ("qwen4_config_without_mtp_layer",  # no draft folder for qwen4_exp: only 'none' is offered
     lambda t, s: dict(model=_qwen4_config(t, mtp_num_hidden_layers=0, mtp=None)), (),
     r"declares no MTP layer \(mtp_num_hidden_layers is 0\), and qwen4_exp checkpoints cannot "
     r"take their draft from a separate folder yet; use speculative_algorithm='none'", "none"),
    # config fields mtp_jax implements one way only (mtp_jax.config_fields)
    *[(f"fixed_{key}", (lambda key, value: lambda t, s: dict(model=config_only(
        MOE, t / "fixed", **{key: value})))(key, value), (),
       rf"config\.json sets {key} = {re.escape(repr(value))}, .*mtp_jax runs qwen3_5_moe with "
       rf"{key} = .* only", "none")
      for key, value in [("hidden_act", "gelu"), ("attention_bias", True),
                         ("attn_output_gate", False), ("use_sliding_window", True),
                         ("mtp_use_dedicated_embeddings", True), ("mamba_ssm_dtype", "bfloat16"),
                         ("mlp_only_layers", [0]), ("decoder_sparse_step", 2)]],
    ("no_shared_expert", lambda t, s: dict(model=config_only(
        MOE, t / "noshared", shared_expert_intermediate_size=0)), (),
     r"shared_expert_intermediate_size = 0, a MoE block without a shared expert", "none"),
    ("qwen4_hidden_act", lambda t, s: dict(model=_qwen4_config(t, hidden_act="relu2")), (),
     r"hidden_act = 'relu2', .*mtp_jax runs qwen4_exp with hidden_act = 'silu' or 'swish'",
     "none"),
    ("qwen4_hc_lowrank", lambda t, s: dict(model=_qwen4_config(t, hc_lowrank=0)), (),
     r"hc_lowrank 0 must be >= 1", "none"),
    *[(f"qwen4_mtp_{name}", (lambda mtp: lambda t, s: dict(model=_qwen4_config(
        t, mtp=mtp)))(mtp), (), pattern, "none")
      for name, mtp, pattern in [
          ("unknown_key", {"num_hidden_layers": 1, "tie_heads": True},
           r"mtp section holds keys mtp_jax does not know: \['tie_heads'\]"),
          ("hybrid", {"hybrid": False}, r"mtp\.hybrid = False"),
          ("layer_types", {"layer_types": ["linear_attention"]},
           r"mtp\.layer_types holds \['linear_attention'\]"),
          ("hidden_from_layer", {"mtp_use_hidden_state_from_layer": 2},
           r"mtp\.mtp_use_hidden_state_from_layer = 2"),
          ("layers", {"num_hidden_layers": 2}, r"mtp\.num_hidden_layers 2 and "
           r"mtp_num_hidden_layers 1 disagree")]],
    ("slot_state_without_handler", lambda t, s: {}, ("unhandled_slot_state",),
     r"slot state 'ngram_context' whose verify handler is None: it declares no way to commit "
     r"a speculative verify \(handlers: replay, checkpoint\)", "none"),
    ("gguf_target_mtp", lambda t, s: dict(model=write_gguf(t / "m.gguf", "qwen35moe")), (),
     r"MTP is not supported for qwen35moe yet", "gguf"),
    ("gguf_dense_target_mtp", lambda t, s: dict(model=write_gguf(t / "m.gguf", "qwen35")), (),
     r"MTP is not supported for qwen35 yet", "gguf"),
    ("gguf_folder_target_mtp",
     lambda t, s: (os.makedirs(t / "g"), write_gguf(t / "g" / "x.gguf", "qwen35moe"),
                   dict(model=str(t / "g")))[-1], (),
     r"MTP is not supported for qwen35moe yet", "gguf"),
    ("gguf_target_no_spec", lambda t, s: dict(model=write_gguf(t / "m.gguf", "qwen35moe"),
                                              speculative_algorithm="none"), (),
     r"is a GGUF checkpoint \(qwen35moe\); mtp_jax does not load Qwen3\.5-family GGUF weights "
     r"yet\. Pass the model's HF safetensors checkpoint folder", "gguf"),
    ("gguf_other_arch", lambda t, s: dict(model=write_gguf(t / "m.gguf", "llama")), (),
     r"GGUF of architecture 'llama'; mtp_jax reads GGUF targets of architecture qwen4exp "
     r"\(Qwen3\.8-Flash-Next\) only", "gguf"),
    ("gguf_corrupt", lambda t, s: ((t / "c.gguf").write_bytes(b"GGUF\x03\0\0\0garbage"),
                                   dict(model=str(t / "c.gguf")))[-1], (),
     r"cannot read the GGUF header", "gguf"),
    ("draft_gguf", lambda t, s: dict(
        speculative_draft_model_path=write_gguf(t / "d.gguf", "qwen35moe")), (),
     r"is a GGUF file \(qwen35moe\); a GGUF draft cannot supply the MTP draft of a "
     r"qwen3_5_moe target", "gguf"),
    ("draft_without_mtp", lambda t, s: dict(speculative_draft_model_path=s[0]), (),
     r"holds no mtp\.\* tensors, so the MTP draft cannot be read from it", "draft"),
    ("draft_relative_missing", lambda t, s: dict(speculative_draft_model_path="./missing"), (),
     r"'\./missing' is not a folder on this machine, and it is a local path rather than a "
     r"Hugging Face repo id", "none"),
    ("draft_nested_missing",
     lambda t, s: dict(speculative_draft_model_path="models/x/missing"), (),
     r"'models/x/missing' is not a folder on this machine", "none"),
    ("draft_absolute_missing",
     lambda t, s: dict(speculative_draft_model_path=str(t / "missing")), (),
     r"missing' is not a folder on this machine", "none"),
    ("draft_model_type", lambda t, s: dict(speculative_draft_model_path=_draft_with_config(
        t, s, model_type="qwen3_5_text", intermediate_size=64)), (),
     r"has model_type='qwen3_5' but the target has 'qwen3_5_moe'", "none"),
    ("draft_hidden_size", lambda t, s: dict(speculative_draft_model_path=_draft_with_config(
        t, s, hidden_size=128)), (), r"has hidden_size=128 but the target has 64", "none"),
    ("draft_vocab", lambda t, s: dict(speculative_draft_model_path=_draft_with_config(
        t, s, vocab_size=512)), (), r"has vocab_size=512 but the target has 300", "none"),
    ("draft_experts", lambda t, s: dict(speculative_draft_model_path=_draft_with_config(
        t, s, num_experts=16)), (), r"has num_experts=16 but the target has 8", "none"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_llm_refuses_before_weights(case, split, tmp_path, monkeypatch, request):
    name, build, fixtures, pattern, may_open = case
    monkeypatch.chdir(tmp_path)
    kwargs = build(tmp_path, split)
    for f in fixtures:
        request.getfixturevalue(f)
    spy = request.getfixturevalue("weight_spy")
    model = kwargs.pop("model", MOE)
    with pytest.raises(ConfigError, match=pattern) as ei:
        LLM(model, dtype="float32", **kwargs)
    assert spy.data == [], f"{name}: tensor data was read: {spy.data}"
    if may_open == "none":
        assert spy.opened == [], f"{name}: weight files opened: {spy.opened}"
    elif may_open == "gguf":
        assert all(p.endswith(".gguf") for p in spy.opened), spy.opened
    else:  # the draft folder's headers, never the target's files
        assert all(p.startswith(split[0]) for p in spy.opened), spy.opened
    msg = str(ei.value)
    assert len(msg) > 60 and ("use" in msg or "pass" in msg or "Pass" in msg or "Use" in msg
                              or "pick" in msg or "drop" in msg or "Run" in msg), msg


def test_dummy_weight_message_exact():
    assert DUMMY_WEIGHT_MTP_MESSAGE.startswith(
        "MTP reads its draft from the checkpoint, so it cannot run with --dummy-weight")


@pytest.mark.parametrize("repo_id", ["org/name", "name", "Qwen/Qwen3.6-35B-A3B-MTP"])
def test_repo_id_draft_passes_config_time(repo_id, tmp_path, monkeypatch, weight_spy):
    monkeypatch.chdir(tmp_path)
    cfg = check_before_load(MOE, speculative=SpeculativeConfig("mtp", 3, repo_id))
    assert cfg.model_type == "qwen3_5_moe"
    assert weight_spy.opened == [] and weight_spy.data == []


@pytest.mark.parametrize("path", ["./missing", "models/x/missing", "/abs/missing", "~/missing",
                                  "a/b/c", "../up", "missing.gguf", "org/name.safetensors"])
def test_local_looking_paths_are_not_repo_ids(path):
    assert not hub.looks_like_repo_id(path)


def test_repo_id_draft_download_error_comes_before_target_weights(split, tmp_path, monkeypatch,
                                                                  weight_spy):
    def offline(repo_id):
        raise OSError("network is unreachable")

    monkeypatch.setattr(hub, "_snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"'org/name' is not a local folder, so it was taken "
                                              r"as a Hugging Face repo id, but downloading it "
                                              r"failed \(OSError: network is unreachable\)"):
        LLM(split[0], dtype="float32", speculative_draft_model_path="org/name")
    assert weight_spy.data == [] and weight_spy.opened == []


def test_repo_id_draft_downloaded_folder_is_used(split, tmp_path, monkeypatch):
    seen = []

    def fake_download(repo_id):
        seen.append(repo_id)
        return split[1]

    monkeypatch.setattr(hub, "_snapshot_download", fake_download)
    monkeypatch.chdir(tmp_path)
    m = load_model(split[0], "float32", draft_path="org/draft")
    own = load_model(MOE, "float32")
    assert seen == ["org/draft"] and m.has_mtp
    import jax
    import numpy as np
    a = jax.tree_util.tree_leaves(m.params)
    b = jax.tree_util.tree_leaves(own.params)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_load_model_entry_point(tmp_path, weight_spy):
    with pytest.raises(ConfigError, match="MTP is not supported for qwen35moe yet"):
        load_model(write_gguf(tmp_path / "m.gguf", "qwen35moe"))
    with pytest.raises(ConfigError, match="does not load Qwen3.5-family GGUF weights yet"):
        load_model(str(tmp_path / "m.gguf"), with_mtp=False)
    with pytest.raises(ConfigError, match="it only applies with speculative_algorithm='mtp'"):
        load_model(MOE, with_mtp=False, draft_path=str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_model(str(tmp_path / "empty"))
    assert weight_spy.data == [] and all(p.endswith(".gguf") for p in weight_spy.opened)


def test_load_model_family_without_mtp_draft(no_mtp_draft_family, weight_spy):
    with pytest.raises(ConfigError, match="has no MTP draft registered"):
        load_model(MOE)
    assert weight_spy.opened == [] and weight_spy.data == []


CLI_CASES = [
    (["--speculative-num-steps", "0"], "speculative_num_steps (--speculative-num-steps) 0"),
    (["--spec-algo", "medusa"], "'medusa' is unknown"),
    (["--dummy-weight"], "MTP reads its draft from the checkpoint, so it cannot run with "
                         "--dummy-weight"),
    (["--spec-algo", "none", "--spec-draft-model", "models/x/missing"], "only applies"),
    (["--spec-draft-model", "./missing"], "'./missing' is not a folder on this machine"),
    (["--spec-algo", "external"], "'external' needs a proposer callable"),
    (["--max-running-requests", "0"], "max_running_requests (--max-running-requests) 0"),
    (["--max-total-tokens", "-3"], "max_total_tokens (--max-total-tokens) -3 must be an int >= 1"),
    (["--mem-fraction", "2"], "mem_fraction (--mem-fraction) 2.0 must be in (0, 1]"),
    (["--chunked-prefill-size", "0"], "chunked_prefill_size (--chunked-prefill-size) 0 must be"),
]


def test_num_steps_zero_taken_with_speculation_off_only():
    """SGLang users pass --speculative-num-steps 0 with speculation off: taken there (k = 0),
    refused with MTP, which needs a draft."""
    from mtp_jax.config import ConfigError, SpeculativeConfig

    off = SpeculativeConfig(algorithm="none", num_steps=0)
    off.validate()
    assert off.k == 0
    with pytest.raises(ConfigError, match=r"0 is outside 1\.\.8"):
        SpeculativeConfig(algorithm="mtp", num_steps=0).validate()


@pytest.mark.parametrize("args,message", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_cli_refuses_before_weights(args, message, tmp_path, monkeypatch, capsys, weight_spy):
    from mtp_jax import generate

    monkeypatch.chdir(tmp_path)
    assert generate.main(["--model", MOE] + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert weight_spy.opened == [] and weight_spy.data == []


def test_cli_gguf_target(tmp_path, capsys):
    from mtp_jax import generate

    assert generate.main(["--model", write_gguf(tmp_path / "m.gguf", "qwen35moe")]) == 2
    assert "MTP is not supported for qwen35moe yet" in capsys.readouterr().err


def test_registry_declares_replay_for_gdn_states():
    for t in ("qwen3_5", "qwen3_5_moe"):
        states = registry.REGISTRY[t].slot_states
        assert {s.name for s in states} == {"gdn_recurrent", "gdn_conv"}
        assert all(s.verify_handler == "replay" for s in states)


def test_slot_state_check_only_with_speculation(unhandled_slot_state, weight_spy):
    cfg = check_before_load(MOE, speculative=SpeculativeConfig("none"))
    assert cfg.model_type == "qwen3_5_moe" and weight_spy.opened == []


def test_docs_cli_lists_every_flag():
    from mtp_jax.generate import build_parser

    doc = open(os.path.join(DOCS, "cli.md")).read()
    flags = [s for a in build_parser()._actions for s in a.option_strings]
    assert "--dummy-weight" in flags and "--spec-algo" in flags
    missing = [f for f in flags if f"`{f}" not in doc]
    assert missing == [], f"docs/cli.md does not document {missing}"


def test_algorithm_synonyms_documented():
    """SGLang's names for drafting with the checkpoint's own MTP layer map to mtp, and the
    refusal of an unknown name lists them."""
    from mtp_jax.config import ConfigError, SpeculativeConfig, normalize_algorithm

    assert [normalize_algorithm(n) for n in ("MTP", "NEXTN", "eagle", None, "off")] == [
        "mtp", "mtp", "mtp", "none", "none"]
    with pytest.raises(ConfigError, match="mtp also accepts nextn and eagle"):
        SpeculativeConfig(algorithm="medusa").validate()


def test_engine_fields_checked_by_type():
    """Every int, number and bool field of EngineConfig is checked against its type first,
    naming the value, its type and the type expected (a string chunked_prefill_size used to
    reach the range check and fail there with a TypeError); numpy scalars pass."""
    import numpy as np

    from mtp_jax.config import EngineConfig

    for kwargs, message in [
            (dict(mem_fraction="0.5"), "mem_fraction '0.5' is of type str, not a number; pass "
                                       "mem_fraction=0.5."),
            (dict(num_pages=2.0), "num_pages 2.0 is of type float, not an int or None; pass a "
                                  "value of that type, e.g. num_pages=None (the default)."),
            (dict(enable_prefix_cache=1), "enable_prefix_cache 1 is of type int, not True or "
                                          "False"),
            (dict(max_running_requests=True), "max_running_requests True is of type bool")]:
        with pytest.raises(ConfigError) as e:
            EngineConfig(**kwargs).validate()
        assert message in str(e.value), str(e.value)
    EngineConfig(max_prefill_batch=np.int64(4), mem_fraction=np.float32(0.5)).validate()


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(CONFIGS) if f.endswith(".json")
                                        and not f.startswith("Qwen3-Next")))
def test_released_configs_pass_the_fixed_fields(name):
    """Every released config kept in configs/ (Qwen3-Next, another model_type, aside) holds the
    values mtp_jax implements: none is refused by the fixed-field checks."""
    raw = {k: v for k, v in json.load(open(os.path.join(CONFIGS, name))).items()
           if not k.startswith("_")}
    cfg = registry.config_from_dict(raw)
    assert cfg.num_hidden_layers >= 1
