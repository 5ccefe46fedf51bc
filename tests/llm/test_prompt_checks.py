"""Newcomer friction (issue 32, item 7): prompts are tokenized and checked before the weights
load (CLI and ``LLM.check_prompts``), each refusal naming the prompt, its token count, the limit
and the fix; a non-UTF-8 prompts file names its line; ``--stop`` and ``--stream``; no argparse
abbreviations. Every test here but the last runs no JAX program: the weights must not load
(``no_load`` makes loading them fail the test)."""

import ast
import json
import os

import pytest

from mtp_jax import LLM, generate
from mtp_jax.cli_prompts import read_prompts_file
from mtp_jax.prompt_checks import load_tokenizer, read_limits
from mtp_jax.prompts import prompt_ids, too_long_message
from tests.helpers.paths import REPO, fixture_path
from tests.helpers.tiny_folders import folder_with_tokenizer

CKPT = fixture_path("tiny_moe_fused")  # no tokenizer files
ENGINE = ["--dtype", "float32", "--speculative-num-steps", "2", "--max-running-requests", "2"]


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> str:
    """tiny_moe_fused with a word-level tokenizer: ``"t5 t6"`` is ``[5, 6]``."""
    return folder_with_tokenizer(str(tmp_path_factory.mktemp("words")))


@pytest.fixture
def no_load(monkeypatch):
    """Loading weights fails the test (an AssertionError the CLI does not catch)."""
    import mtp_jax.llm as llm_module

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(llm_module, "load_model", refuse)


def _text(n: int) -> str:
    return " ".join(f"t{5 + i % 200}" for i in range(n))


def _err(capsys) -> str:
    return capsys.readouterr().err


# ---- prompts checked before the load ---------------------------------------------------------
def test_cli_empty_prompt_refused_before_load(words, no_load, capsys):
    assert generate.main(["--model", words, "--prompt", ""]) == 2
    assert "error: --prompt: empty prompt: a prompt needs at least one token; pass some" \
           in _err(capsys)


def test_cli_too_long_prompts_name_file_line_count_limit_and_flag(words, no_load, tmp_path,
                                                                    capsys):
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n" + json.dumps({"prompt": _text(20)}) + "\n"
                 + json.dumps({"prompt": [5] * 30}) + "\n")
    assert generate.main(["--model", words, "--prompts-file", str(f),
                          "--max-model-len", "16"]) == 1  # several refused: each reported
    err = _err(capsys)
    assert (f"error: {f}:2 (request 1): prompt of 20 tokens does not fit max_model_len 16 (it "
            "needs room for one output token); raise max_model_len (--max-model-len) to at least "
            "21 (the model allows up to 4096), or shorten the prompt to at most 15 tokens."
            ) in err
    assert f"error: {f}:3 (request 2): prompt of 30 tokens does not fit max_model_len 16" in err


def test_cli_checks_the_prompt_the_chat_template_makes(words, no_load, capsys):
    # "t1 t5 t6 t7 t2 t3": 6 tokens, where the bare prompt has 3.
    assert generate.main(["--model", words, "--chat", "--prompt", "t5 t6 t7",
                          "--max-model-len", "6"]) == 2
    assert "--prompt: prompt of 6 tokens does not fit max_model_len 6" in _err(capsys)


def test_cli_chat_refuses_prompts_that_are_not_text(words, no_load, tmp_path, capsys):
    """--chat wraps text in the template: a file's token-id prompt and a message list are
    refused, each by its line (not sent unwrapped, not loaded for)."""
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in
                           ([5, 6, 7], [{"role": "user", "content": "t5"}])) + "\n")
    assert generate.main(["--model", words, "--chat", "--prompts-file", str(f), "--json"]) == 1
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["finish_reason"] for r in recs] == ["error", "error"]
    assert recs[0]["error"] == (
        f"{f}:1 (request 1): --chat wraps a text prompt in the chat template as one user "
        "message, and this prompt is token ids; give it as text, or drop --chat (token ids "
        "then go to the model as they are).")
    assert recs[1]["error"].startswith(f"{f}:2 (request 2): ")
    assert recs[1]["error"].endswith("this prompt is a list, not text; give the user message's "
                                     "text as the prompt (a conversation of several messages "
                                     "goes through LLM.chat).")


def test_cli_limit_capped_by_the_model_says_to_shorten(tmp_path, no_load, capsys):
    capped = folder_with_tokenizer(str(tmp_path / "capped"), max_position_embeddings=8)
    assert generate.main(["--model", capped, "--prompt", _text(10)]) == 2
    err = _err(capsys)
    assert ("prompt of 10 tokens does not fit max_model_len 8 (it needs room for one output "
            "token); the model's max_position_embeddings (8) caps max_model_len, so shorten the "
            "prompt to at most 7 tokens.") in err
    assert "--max-model-len" not in err


def test_cli_warns_when_the_context_cuts_max_tokens(words, no_load, capsys):
    """A prompt that fits but leaves less room than --max-tokens: one warning before the load
    (the run goes on), naming the counts, what its output stops at and the two fixes; none for
    a request with room."""
    with pytest.raises(AssertionError, match="weights were loaded"):
        generate.main(["--model", words, "--prompt", _text(5), "--prompt", "t5",
                       "--max-model-len", "12", "--max-tokens", "10"])
    err = _err(capsys)
    assert ("warning: --prompt 1 of 2: 5 prompt tokens + max_tokens 10 exceed the context of 12 "
            "tokens (--max-model-len, capped by the model's max_position_embeddings), so its "
            "output stops after 7 tokens (finish_reason=length); raise --max-model-len or lower "
            "--max-tokens.") in err
    assert err.count("warning:") == 1


def test_cli_good_prompt_among_bad_ones_goes_on_to_load(words, no_load, capsys):
    """A bad prompt among several fails alone: the run goes on to load the model."""
    with pytest.raises(AssertionError, match="weights were loaded"):
        generate.main(["--model", words, "--prompt", "t5 t6", "--prompt", ""])


def test_cli_several_prompts_all_refused_report_each_without_loading(words, no_load, capsys):
    assert generate.main(["--model", words, "--prompt", "", "--prompt", _text(20),
                          "--max-model-len", "16", "--json"]) == 1
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["finish_reason"] for r in recs] == ["error", "error"]
    assert recs[0]["error"].startswith("--prompt 1 of 2: empty prompt")
    assert recs[1]["error"].startswith("--prompt 2 of 2: prompt of 20 tokens does not fit "
                                       "max_model_len 16")


def test_cli_text_output_gives_a_refused_request_its_header(words, no_load, capsys):
    """Without --json, stdout keeps one section per request, a refused one too (its header and
    a pointer to stderr, which holds its error), so piped stdout still counts every request."""
    assert generate.main(["--model", words, "--prompt", "", "--prompt", _text(20),
                          "--max-model-len", "16"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == ["--- request 1 of 2 ---", "(refused; its error is on stderr)",
                                "--- request 2 of 2 ---", "(refused; its error is on stderr)"]
    assert "error: --prompt 1 of 2: empty prompt" in err
    assert "error: --prompt 2 of 2: prompt of 20 tokens" in err


def test_llm_check_prompts_before_construction(words, no_load):
    assert LLM.check_prompts(["t5 t6", [7, 8, 9]], words) == [[5, 6], [7, 8, 9]]
    with pytest.raises(ValueError) as e:
        LLM.check_prompts(["t5", "", _text(10), [5, 300]], words, max_model_len=8)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("prompts[1]: empty prompt")
    assert lines[1].startswith("prompts[2]: prompt of 10 tokens does not fit max_model_len 8")
    assert lines[2].startswith("prompts[3]: prompt token ids [300] are outside the vocabulary")
    with pytest.raises(ValueError, match=r"prompts\[0\]: stop strings \['x'\] need a tokenizer"):
        from mtp_jax import SamplingParams

        LLM.check_prompts([[5]], CKPT, sampling_params=SamplingParams(stop=["x"]))


def test_llm_chat_refuses_conversations_that_are_not_text(words, no_load):
    """A conversation the template cannot render as text is refused naming the message: no
    message, a role that is missing or unknown, content missing (but from an assistant) or of
    the wrong type; text parts (as the server takes them) and an assistant's absent content
    (empty text) render like their strings."""
    import types

    tok = load_tokenizer(words)
    llm = types.SimpleNamespace(tokenizer=tok, generate=lambda ps, sp, *a: ps)
    for conv, pattern in [
            ([], r"the conversation is empty; pass at least one message"),
            ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] 5 \(int\) must "
             r"be a string, or a list of \{'type': 'text', 'text': \.\.\.\} parts"),
            ([{"role": "user", "content": "t5"}, {"role": "user", "content": [{"text": "t6"}]}],
             r"messages\[1\]\['content'\]\[0\] \{'text': 't6'\} is not a text part"),
            ([{"role": "user", "content": [{"type": "text", "text": "t5"},
                                           {"type": "image_url", "image_url": {"url": "x" * 80}}]}],
             r"messages\[0\]\['content'\]\[1\] \{'type': 'image_url'.*\.\.\. is not a text "
             r"part; only \{'type': 'text', 'text': \.\.\.\} parts are supported"),
            ([{"content": "t5"}], r"messages\[0\]\['role'\] is missing; give each message one "
             r"of 'system', 'user', 'assistant', 'tool'"),
            ([{"role": "wizard", "content": "t5"}], r"messages\[0\]\['role'\] 'wizard' is not a "
             r"role"),
            ([{"role": "user"}], r"messages\[0\] \('user'\) has no content; give it a string"),
            ([{"role": "system", "content": None}], r"messages\[0\] \('system'\) has no content")]:
        with pytest.raises(ValueError, match=pattern):
            LLM.chat(llm, conv)
    text = LLM.chat(llm, [{"role": "user", "content": "t5 t6"}])
    parts = [{"type": "text", "text": "t5 "}, {"type": "text", "text": "t6"}]
    assert LLM.chat(llm, [{"role": "user", "content": parts}]) == text
    empty = [{"role": "user", "content": "t5"}, {"role": "assistant", "content": ""}]
    assert LLM.chat(llm, [empty[0], {"role": "assistant"}]) == LLM.chat(llm, empty)
    # several conversations (vLLM's batch form): one reply each, in order
    assert LLM.chat(llm, [[{"role": "user", "content": "t5 t6"}], empty]) == \
        [text, LLM.chat(llm, empty)]
    with pytest.raises(ValueError, match=r"the conversation is empty"):
        LLM.chat(llm, [[{"role": "user", "content": "t5"}], []])


def test_llm_check_prompts_chat_checks_the_text_chat_generates_from(words, no_load):
    """``chat=True``: a conversation is checked as the chat template renders it ("t1 t5 t6 t7
    t2 t3": 6 tokens, where the message has 3), the ids :meth:`LLM.chat` would generate from;
    one too long for the context is refused naming its count and the limit, a fitting one
    beside it passes; without a tokenizer there is no template to render."""
    import types

    conv = [{"role": "user", "content": "t5 t6 t7"}]
    ids = LLM.check_prompts(conv, words, max_model_len=7, chat=True)
    assert ids == [[1, 5, 6, 7, 2, 3]]
    tok = load_tokenizer(words)
    rendered = LLM.chat(types.SimpleNamespace(tokenizer=tok, generate=lambda ps, sp, *a: ps), conv)
    assert [tok.encode(rendered)] == ids
    short = [{"role": "user", "content": "t5"}]
    assert LLM.check_prompts([conv, short], words, max_model_len=7, chat=True)[1] == [1, 5, 2, 3]
    with pytest.raises(ValueError) as e:
        LLM.check_prompts([conv, short], words, max_model_len=6, chat=True)
    assert str(e.value).startswith("prompts[0]: prompt of 6 tokens does not fit max_model_len 6 "
                                   "(it needs room for one output token)")
    assert "prompts[1]" not in str(e.value)
    with pytest.raises(ValueError, match=r"prompts\[0\]: this checkpoint folder has no "
                                         r"tokenizer, so it has no chat template"):
        LLM.check_prompts(conv, CKPT, chat=True)
    with pytest.raises(ValueError, match=r"prompts\[0\]: a conversation is a list of"):
        LLM.check_prompts(["t5 t6"], words, chat=True)


def test_limits_and_tokenizer_are_the_loaded_engines(tmp_path):
    """The limit known before the load is the engine's (max_position_embeddings caps
    max_model_len), the tokenizer read by the check is the one LLM keeps, and generate after
    the load still refuses with the same advice (no program runs: the prompt is refused first)."""
    capped = folder_with_tokenizer(str(tmp_path / "capped"), max_position_embeddings=64)
    before = load_tokenizer(capped)
    llm = LLM(capped, dtype="float32", speculative_num_steps=2, max_running_requests=2)
    assert llm.engine.max_model_len == read_limits(capped, 4096).context == 64
    assert llm.tokenizer is before
    with pytest.raises(ValueError, match=r"prompt of 70 tokens .* max_position_embeddings \(64\) "
                                         r"caps max_model_len"):
        llm.generate([_text(70)])


def test_too_long_message_fix_depends_on_what_caps_the_limit():
    assert "raise max_model_len (--max-model-len) to at least 11 (the model allows up to 64)" \
           in too_long_message(10, 8, 64)
    assert "caps max_model_len, so shorten the prompt to at most 63" in too_long_message(70, 64,
                                                                                          64)
    assert "raise max_model_len (--max-model-len) to at least 11, or" in too_long_message(10, 8,
                                                                                           None)


def test_prompt_text_that_is_not_utf8_is_refused(words):
    with pytest.raises(ValueError, match="holds byte 0xff at character 2, which is not UTF-8"):
        prompt_ids("t5\udcff", load_tokenizer(words), 300, 4096)


# ---- prompts file encoding ---------------------------------------------------------------------
def test_non_utf8_prompts_file_names_file_line_and_fix(tmp_path, no_load, capsys):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"prompt": [1, 2]}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{f}:2: not UTF-8 text \(byte 0xe9 at byte 16 of the "
                                         r"line\).*save the file as UTF-8 \(e\.g\. iconv"):
        read_prompts_file(str(f), {})
    assert generate.main(["--model", CKPT, "--prompts-file", str(f)]) == 2
    assert f"error: {f}:2: not UTF-8 text" in _err(capsys)
    f.write_bytes(b'\xef\xbb\xbf{"prompt": [1, 2]}\n\n{"prompt": [3]}\n')  # a BOM, a blank line
    assert read_prompts_file(str(f), {"max_tokens": 2}) == (
        [[1, 2], [3]], [{"max_tokens": 2}, {"max_tokens": 2}], [1, 3])


# ---- --stop and --stream -----------------------------------------------------------------------
def test_stop_flags_are_sampling_params_stop(words, tmp_path):
    parse = generate.build_parser().parse_args
    _, _, params, errors = generate._read_run(parse(["--model", words, "--prompt", "t5",
                                                     "--stop", "t9", "--stop", "t8 t7"]))
    assert params[0].stop == ["t9", "t8 t7"] and errors == {}
    f = tmp_path / "reqs.jsonl"
    f.write_text(json.dumps({"prompt": "t5"}) + "\n"
                 + json.dumps({"prompt": "t6", "stop": "t4"}) + "\n")
    _, _, params, _ = generate._read_run(parse(["--model", words, "--prompts-file", str(f),
                                                "--stop", "t9"]))
    assert [p.stop for p in params] == [["t9"], ["t4"]]  # a line's own stop replaces the flag's


def test_file_field_errors_spell_the_value_as_the_json_line_does(words, tmp_path):
    """A prompts-file line's bad sampling value is named as the file writes it (key in quotes,
    JSON spelling) with the JSON type where Python's spelling would hide it; each line fails
    alone."""
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "t5", "max_tokens": True}, {"prompt": "t5", "max_tokens": 2.0},
        {"prompt": "t5", "stop": ["x", ""]}, {"prompt": "t5", "max_tokens": 3},
        {"prompt": "t5", "min_p": 1.5}]) + "\n")
    _, _, params, errors = generate._read_run(generate.build_parser().parse_args(
        ["--model", words, "--prompts-file", str(f)]))
    assert errors == {
        0: f'{f}:1 (request 1): "max_tokens": true (a boolean) must be an int >= 1 (the most '
           "tokens to generate, e.g. 128).",
        1: f'{f}:2 (request 2): "max_tokens": 2.0 (a number written with a decimal point) must '
           "be an int >= 1 (the most tokens to generate, e.g. 128).",
        2: f'{f}:3 (request 3): "stop": ["x", ""] must hold non-empty strings.',
        4: f'{f}:5 (request 5): "min_p": 1.5 must be a number in [0, 1]; 0 turns it off.'}
    assert params[3].max_tokens == 3


@pytest.mark.parametrize("argv, message", [
    (["--model", "WORDS", "--stop", ""], "error: stop (--stop) [''] must hold non-empty strings"),
    (["--model", CKPT, "--prompts-file", "IDS", "--stop", "x"],  # the flag's, not the line's
     "error: --stop ['x']: stop strings are matched in the text, and this checkpoint folder "
     "has no tokenizer"),
    (["--model", "WORDS", "--stream", "--json"], "error: --stream prints text as it is generated "
                                                 "and --json prints one object"),
    (["--model", "WORDS", "--stream", "--prompt", "t5", "--prompt", "t6"],
     "this run has 2 prompts; pass one --prompt (or a one-line --prompts-file), or drop --stream"),
    (["--model", CKPT, "--stream", "--prompts-file", "IDS"],
     "--stream prints text, and this checkpoint folder has no tokenizer files"),
], ids=["empty_stop", "stop_without_tokenizer", "stream_json", "stream_two", "stream_ids"])
def test_stop_and_stream_refusals_before_load(words, tmp_path, no_load, capsys, argv, message):
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt": [5, 6]}) + "\n")
    argv = [words if a == "WORDS" else str(ids) if a == "IDS" else a for a in argv]
    assert generate.main(argv) == 2
    assert message in _err(capsys)


def test_stream_flag_conflicts_are_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    """--stream with --json, or with two prompts, is refused from the flags alone: a model
    folder that does not exist is never reached (its error would name the folder)."""
    missing = str(tmp_path / "no_such_model")
    for argv, message in ((["--stream", "--json"], "--stream prints text as it is generated "
                                                   "and --json prints one object"),
                          (["--stream", "--prompt", "a", "--prompt", "b"],
                           "this run has 2 prompts")):
        assert generate.main(["--model", missing, *argv]) == 2
        err = _err(capsys)
        assert message in err and "no_such_model" not in err, err


def test_a_missing_dependency_names_the_set_up(monkeypatch, capsys):
    """Run by a Python without the set-up's packages: exit 2 with the set-up command, not a
    traceback."""
    def missing(argv):
        raise ModuleNotFoundError("No module named 'tqdm'")

    monkeypatch.setattr(generate, "_main", missing)
    assert generate.main([]) == 2
    err = _err(capsys)
    assert err.startswith("error: No module named 'tqdm': this Python (")
    assert "scripts/setup_venv.sh" in err and ".venv/bin/python -m mtp_jax.generate" in err


# ---- argparse abbreviations ----------------------------------------------------------------------
def test_every_argument_parser_refuses_abbreviations():
    missing = []
    for folder, _, files in os.walk(os.path.join(REPO, "mtp_jax")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if (isinstance(node, ast.Call) and getattr(node.func, "attr", None)
                        == "ArgumentParser" and not any(
                            k.arg == "allow_abbrev" and getattr(k.value, "value", None) is False
                            for k in node.keywords)):
                    missing.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert missing == [], f"ArgumentParser without allow_abbrev=False: {missing}"


def test_abbreviated_flag_is_an_error(capsys):
    from mtp_jax.serve.cli import build_parser as serve_parser

    for parser in (generate.build_parser(), serve_parser()):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-model-le", "64"])
        assert "unrecognized arguments: --max-model-le" in _err(capsys)
    with pytest.raises(SystemExit) as e:
        generate.build_parser().parse_args(["--max-token", "3"])
    # one line naming the closest flag, not argparse's usage block of every flag first
    err = _err(capsys)
    assert e.value.code == 2 and "usage:" not in err
    assert err.startswith("python -m mtp_jax.generate: error: unrecognized arguments: "
                          "--max-token 3 (--max-token: did you mean --max-tokens?)\n")


# ---- a run: --stream prints the final text as it comes, --stop cuts it (compiles) --------------
def test_cli_stream_and_stop(words, monkeypatch, capsys):
    args = ["--model", words, "--prompt", "t5 t6 t7", "--max-tokens", "12", "--ignore-eos",
            *ENGINE]
    assert generate.main(args + ["--json"]) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]
    words_out = full.split(" ")
    assert len(words_out) == 12
    stop = " ".join(words_out[4:6])
    assert generate.main(args + ["--json", "--stop", stop]) == 0
    cut = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cut["text"] == full[:full.index(stop)] and cut["finish_reason"] == "stop"

    class Writes:  # stdout, keeping each write
        def __init__(self):
            self.parts = []

        def write(self, s):
            self.parts.append(s)

        def flush(self):
            pass

    for extra, want in (([], full), (["--stop", stop], cut["text"])):
        out = Writes()
        monkeypatch.setattr("sys.stdout", out)
        assert generate.main(args + ["--stream"] + extra) == 0
        text = "".join(out.parts)
        assert text[:text.index("\n[stats] ")] == want  # the text, then the stats line
        deltas = out.parts[:out.parts.index("\n")]
        assert "".join(deltas) == want
        if not extra:
            assert len(deltas) > 2  # written as it came, not at the end


def test_chat_template_kwargs_reach_the_template_and_unread_ones_are_refused(words, no_load):
    """``chat_template_kwargs`` (vLLM's name) are variables for the template: with the
    built-in model's Qwen-style template ``enable_thinking=False`` closes an empty think block
    after the generation prompt; a key the template does not read (a typo), one the engine
    sets itself, or a value that is not a dict is refused naming it, in ``LLM.chat`` and in
    ``LLM.check_prompts`` before the load."""
    import types

    from mtp_jax.tokenizer import Tokenizer
    from mtp_jax.tools.qwen_vocab import CHAT_TEMPLATE

    base = load_tokenizer(words)
    tok = Tokenizer(base._tok, CHAT_TEMPLATE, base.eos_token_ids)
    assert {"messages", "add_generation_prompt", "enable_thinking"} <= tok.template_variables()
    llm = types.SimpleNamespace(tokenizer=tok, generate=lambda ps, sp, *a: ps)
    conv = [{"role": "user", "content": "t5"}]
    plain = LLM.chat(llm, conv)
    assert plain.endswith("<|im_start|>assistant\n")
    off = LLM.chat(llm, conv, chat_template_kwargs={"enable_thinking": False})
    assert off == plain + "<think>\n\n</think>\n\n"
    assert LLM.chat(llm, conv, chat_template_kwargs={"enable_thinking": True}) == \
        plain + "<think>\n"
    for kwargs, pattern in [
            ({"enable_thinkng": False}, r"\['enable_thinkng'\]: this checkpoint's chat template "
             r"does not read it; it reads \['enable_thinking'\]"),
            ({"add_generation_prompt": False}, r"\['add_generation_prompt'\] are set by the "
             r"engine itself"),
            ([("enable_thinking", False)], r"must be a dict of template variables")]:
        with pytest.raises(ValueError, match=pattern):
            LLM.chat(llm, conv, chat_template_kwargs=kwargs)
    # a template that sets a default for a missing input still takes it
    own = Tokenizer(base._tok, "{% if enable_thinking is not defined %}{% set enable_thinking "
                    "= true %}{% endif %}{{ messages[0].content }} {{ enable_thinking }}")
    llm_own = types.SimpleNamespace(tokenizer=own, generate=lambda ps, sp, *a: ps)
    assert LLM.chat(llm_own, conv, chat_template_kwargs={"enable_thinking": False}) == "t5 False"
    assert LLM.chat(llm_own, conv) == "t5 True"
    # the words fixture's own template reads no such variable: refused before the load
    with pytest.raises(ValueError, match=r"prompts\[0\]: chat_template_kwargs "
                                         r"\['enable_thinking'\]: this checkpoint's chat"):
        LLM.check_prompts(conv, words, chat=True,
                          chat_template_kwargs={"enable_thinking": False})


def test_cli_chat_template_kwargs_are_checked_before_the_load(words, no_load, capsys,
                                                              tmp_path):
    """``--chat-template-kwargs``: a JSON object for the template, which renders with it (a
    template reading ``extra``: its two more words make the prompt one token too long), refused
    (exit 2, before the load) when it is not one, without ``--chat``, or with a key the
    template does not read."""
    extra = folder_with_tokenizer(str(tmp_path / "extra"))
    with open(os.path.join(extra, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}t1 {{ m.content }} t2 {% endfor %}"
                   "t3{% if extra is defined %} {{ extra }}{% endif %}"}, f)
    run = ["--model", extra, "--chat", "--prompt", "t5", "--max-model-len", "6"]
    assert generate.main([*run, "--chat-template-kwargs", '{"extra": "t9 t9"}']) == 2
    assert "prompt of 6 tokens does not fit max_model_len 6" in _err(capsys)
    with pytest.raises(AssertionError, match="the weights were loaded"):  # 4 tokens: it fits
        generate.main(run)
    for flags, want in [
            (["--chat", "--chat-template-kwargs", "{enable"], "is not JSON"),
            (["--chat", "--chat-template-kwargs", "[1]"], "is a JSON list, not an object"),
            (["--chat-template-kwargs", '{"enable_thinking": false}'], "add --chat, or drop it"),
            (["--chat", "--chat-template-kwargs", '{"enable_thinking": false}'],
             "chat_template_kwargs ['enable_thinking']: this checkpoint's chat template does not "
             "read it")]:
        try:
            status = generate.main(["--model", words, "--prompt", "t5", *flags])
        except SystemExit as e:  # argparse's own refusal of the value
            status = e.code
        assert status == 2, flags
        assert want in _err(capsys), flags


def test_prompts_file_errors_show_the_form_and_the_closest_key(tmp_path):
    """A plain-text line is refused with the JSON form a line takes; a misspelt key with the
    key it is closest to."""
    f = tmp_path / "p.txt"
    f.write_text("Hello there\n")
    with pytest.raises(ValueError, match=r'p.txt:1: not JSON .*; each line is one JSON object '
                                         r'such as \{"prompt": "Hello", "max_tokens": 32\} \(a '
                                         r'file of plain-text lines: wrap each'):
        read_prompts_file(str(f), {})
    f.write_text('{"prompt": "t5", "temprature": 0.5, "zzz": 1}\n')
    with pytest.raises(ValueError, match=r"unknown keys \['temprature', 'zzz'\] \(did you mean "
                                         r"temprature -> temperature\?\); allowed: prompt, "):
        read_prompts_file(str(f), {})
    # vLLM's "prompt_token_ids" key: ids only, and one prompt key a line
    f.write_text('{"prompt_token_ids": [5, 6], "max_tokens": 2}\n{"prompt": [7]}\n')
    assert read_prompts_file(str(f), {})[0] == [[5, 6], [7]]
    for line, pattern in [('{"prompt": "a", "prompt_token_ids": [1]}', r"one \"prompt\" .* or "
                           r"\"prompt_token_ids\" \(not both\)"),
                          ('{"max_tokens": 3}', r"one \"prompt\" \(text or token ids\) or "
                           r"\"prompt_token_ids\"\.$"),
                          ('{"prompt_token_ids": "t5"}', r"must be a list of ints; text goes in")]:
        f.write_text(line + "\n")
        with pytest.raises(ValueError, match=pattern):
            read_prompts_file(str(f), {})


def test_generate_stream_new_text_adds_up_to_the_final_text(words):
    """``StreamOutput.new_text``: a request's pieces concatenate to its final text, with a
    stop string left out (held back until the request ends); without text the same holds for
    the empty string."""
    from mtp_jax import SamplingParams

    llm = LLM(words, dtype="float32", speculative_num_steps=2, max_running_requests=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    full = llm.generate(["t5 t6 t7"], params)[0].text
    stop = " ".join(full.split(" ")[3:5])
    for p in (params, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop])):
        pieces, final = [], None
        for u in llm.generate_stream(["t5 t6 t7"], p):
            pieces.append(u.new_text)
            final = u.output if u.finished else final
        assert "".join(pieces) == final.text
        if p is params:
            assert final.text == full and sum(bool(x) for x in pieces) >= 2  # as it came
    assert final.text == full[:full.index(stop)]
