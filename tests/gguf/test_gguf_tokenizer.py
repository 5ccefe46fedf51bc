"""A GGUF's tokenizer metadata (mtp_jax.weights.gguf_tokenizer) against the HF tokenizer it was
converted from: the project's real Qwen3.5 vocabulary (mtp_jax.tools.qwen_vocab) written into a
GGUF here as llama.cpp's converter does, independent of the reader and of the random-GGUF tool:
the tokens by id (added tokens CONTROL when special, else USER_DEFINED; ``[PAD{i}]`` UNUSED up
to the model's 248,320 rows) and, through ``gguf.SpecialVocab`` (llama.cpp's own code), the
merges, special ids and chat template. Encoding and decoding varied text and rendering
conversations must equal the HF-folder tokenizer's token for token. The tool's ``--tokenizer``
metadata gives the same tokenizer, and ``LLM.check_prompts`` / ``LLM.chat`` read it.

Teeth (shown by hand, then restored), each failing test_encode_decode_equal: ``ignore_merges``
False (" terdapat документа Материал": three tokens no merge reaches, each encoded in pieces);
no NFC normalizer (the decomposed ``e\\u0301`` sample); the merges in reverse order (the CJK
sample); the qwen2 regex for qwen35 (the Devanagari sample, combining marks).
"""

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer

from mtp_jax import LLM
from mtp_jax.config import ConfigError
from mtp_jax.prompt_checks import load_tokenizer
from mtp_jax.tokenizer import Tokenizer
from mtp_jax.tools import qwen_vocab
from mtp_jax.weights.gguf_reader import open_gguf
from mtp_jax.weights.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_from_gguf

VOCAB = 248320  # the released configs' embedding rows
SAMPLES = [
    "Hello world! It's 5 o'clock; we'll see, I'D say.",
    "你好,世界!我们今天去哪里吃饭?加拿大的俱乐部很有名。",
    "日本語のテキスト、カタカナ。한국어 문장입니다. Привет, мир! Γειά σου κόσμε",
    "नमस्ते दुनिया مرحبا بالعالم שלום עולם",
    "🙂👍🏽 emoji 🇺🇸 family 👨‍👩‍👧 ❤️🔥 ✨",
    "1234567890 3.14159 -42 1e-9 0x1F 1,000,000 2024-06-01T12:00:00Z",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok</think><tool_call>",
    "  leading spaces and   runs of   spaces\n\n\n\ttabs\t\t and trailing   ",
    "  \n  \n\n   \r\n\r\n \u3000\u00a0\u2028x\u2029 \u200b",
    "def f(x):\n    return x ** 2  # square\n",
    "cafe\u0301 e\u0301te\u0301 (decomposed) café été (composed)",
    " terdapat документа Материал",
    "a" * 120 + " " + "ab" * 40,
]


def write_tokenizer_gguf(folder: str, path: str, *, model: str = "gpt2", pre: str = "qwen35",
                         extra: dict | None = None) -> str:
    """The tokenizer files of ``folder`` as a GGUF's ``tokenizer.*`` metadata (no tensors)."""
    hf = HFTokenizer.from_file(f"{folder}/tokenizer.json")
    by_id = {i: t for t, i in hf.get_vocab(with_added_tokens=True).items()}
    special = {i: t.special for i, t in hf.get_added_tokens_decoder().items()}
    tokens, types = [], []
    for i in range(VOCAB):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL if i not in special else
                         gguf.TokenType.CONTROL if special[i] else gguf.TokenType.USER_DEFINED)
    w = gguf.GGUFWriter(path, "qwen4exp")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=VOCAB).add_to_gguf(w, quiet=True)
    for key, value in (extra or {}).items():
        w.add_bool(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, vocab_cache) -> str:
    out = str(tmp_path_factory.mktemp("qwen_hf"))
    qwen_vocab.write_tokenizer_files(out, cache_dir=vocab_cache)
    return out


@pytest.fixture(scope="module")
def pair(hf_dir, tmp_path_factory):
    """(the HF folder's tokenizer, the GGUF's, as the engine reads it)."""
    path = write_tokenizer_gguf(hf_dir, str(tmp_path_factory.mktemp("tok") / "tok.gguf"))
    return Tokenizer.from_folder(hf_dir), load_tokenizer(path)


def test_encode_decode_equal(pair):
    hf, gg = pair
    assert gg.vocab_size == hf.vocab_size == 248077  # the [PAD] rows are not tokens
    for text in SAMPLES:
        ids = hf.encode(text)
        assert gg.encode(text) == ids, text
        assert gg.decode(ids) == hf.decode(ids)
        assert gg.decode(ids, skip_special_tokens=False) == hf.decode(ids, False) == \
            text.replace("e\u0301", "é")  # NFC
    assert len(hf.encode("加拿大")) == 1 and hf.encode("<|im_start|>") == [248045]
    assert gg.decode([248100, 248319, 100]) == hf.decode([248100, 248319, 100])


def test_specials_and_eos(pair):
    hf, gg = pair
    assert gg.eos_token_ids == hf.eos_token_ids == (248046, 248044)  # <|im_end|>, <|endoftext|>
    assert gg.eos_token == hf.eos_token == "<|im_end|>"
    assert gg.pad_token_id == hf.pad_token_id == 248044


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True},
                                    {"add_generation_prompt": False}])
def test_chat_template_renders_the_same(pair, kwargs):
    hf, gg = pair
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Explain QSA 你好"}]},
                {"role": "assistant", "content": "Sparse attention."},
                {"role": "user", "content": "More?"}]
    text = hf.apply_chat_template(messages, **kwargs)
    assert gg.apply_chat_template(messages, **kwargs) == text
    assert gg.encode(text) == hf.encode(text)


def test_qwen35_regex_is_the_qwen_packages():
    assert PRE_TOKENIZERS["qwen35"] == qwen_vocab.split_pattern()


def test_the_tools_tokenizer_metadata(pair, tmp_path, vocab_cache):
    """``random_checkpoint --format gguf --tokenizer``: the same tokenizer, read by
    ``LLM.check_prompts`` (text and conversations) before any weight loads."""
    import json

    from mtp_jax.tools.random_gguf import write_random_gguf
    from tests.helpers.paths import fixture_path

    hf, _ = pair
    raw = json.load(open(fixture_path("tiny_qwen4_exp") + "/config.json"))
    raw["text_config"].update(vocab_size=VOCAB, eos_token_id=248044)
    write_random_gguf(raw, str(tmp_path), tokenizer=True, cache_dir=vocab_cache)
    model = str(tmp_path / "model.gguf")
    tool = load_tokenizer(model)
    for text in SAMPLES[:7]:
        assert tool.encode(text) == hf.encode(text)
    assert tool.eos_token_ids == hf.eos_token_ids
    assert LLM.check_prompts(["Hello 你好"], model) == [hf.encode("Hello 你好")]
    chat = [{"role": "user", "content": "Hi"}]
    assert LLM.check_prompts([chat], model, chat=True) == [
        hf.encode(hf.apply_chat_template(chat))]


def _tiny(tmp_path, name, **kw) -> str:
    """A GGUF with a three-token tokenizer (refusals only look at the kind keys)."""
    w = gguf.GGUFWriter(str(tmp_path / name), "qwen4exp")
    if kw.get("model") is not None:
        w.add_tokenizer_model(kw["model"])
    if kw.get("pre") is not None:
        w.add_tokenizer_pre(kw["pre"])
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    if kw.get("add_bos"):
        w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(tmp_path / name)


@pytest.mark.parametrize("kw,message", [
    (dict(model="llama", pre="default"),
     r"tokenizer.ggml.model is 'llama'; .*only for 'gpt2'.*--remove-metadata "
     r"tokenizer.ggml.model"),
    (dict(model="gpt2", pre="gpt-4o"),
     r"tokenizer.ggml.pre is 'gpt-4o'; .*--pre-tokenizer qwen35"),
    (dict(model="gpt2", pre=None), r"tokenizer.ggml.pre is None"),
    (dict(model="gpt2", pre="qwen35", add_bos=True),
     r"add_bos_token is true.*--remove-metadata tokenizer.ggml.add_bos_token"),
])
def test_refusals_name_the_value_and_the_fix(tmp_path, kw, message):
    path = _tiny(tmp_path, "bad.gguf", **kw)
    with pytest.raises(ConfigError, match=message):
        load_tokenizer(path)
    with pytest.raises(ConfigError, match=message):
        LLM.check_prompts(["hi"], path)  # before anything else is read


def test_no_tokenizer_metadata_means_token_ids(tmp_path):
    path = _tiny(tmp_path, "none.gguf", model=None, pre=None)
    assert tokenizer_from_gguf(open_gguf(path)) is None and load_tokenizer(path) is None
    small = tokenizer_from_gguf(open_gguf(_tiny(tmp_path, "ok.gguf", model="gpt2",
                                                pre="qwen2")))
    assert small.encode("abab") == [2, 2] and small.decode([2, 0]) == "aba"


def test_llm_chat_on_a_gguf(tmp_path, vocab_cache):
    """``LLM(model.gguf).chat`` renders with the GGUF's template and decodes the reply."""
    import json

    from mtp_jax import SamplingParams
    from mtp_jax.tools.random_gguf import write_random_gguf
    from tests.helpers.paths import fixture_path

    raw = json.load(open(fixture_path("tiny_qwen4_exp") + "/config.json"))
    raw["text_config"].update(vocab_size=VOCAB, eos_token_id=248044)
    write_random_gguf(raw, str(tmp_path), tokenizer=True, cache_dir=vocab_cache,
                      include_mtp=False)
    llm = LLM(str(tmp_path / "model.gguf"), dtype="float32", speculative_algorithm="none",
              max_running_requests=1, max_model_len=64)
    reply = llm.chat([{"role": "user", "content": "Hi"}],
                     SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(reply.token_ids) == 3
    assert reply.text == llm.tokenizer.decode(reply.token_ids)
    assert reply.prompt_token_ids == llm.tokenizer.encode(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
