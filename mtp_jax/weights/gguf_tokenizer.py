"""The tokenizer and chat template of a GGUF, from its ``tokenizer.*`` metadata.

llama.cpp's converter writes (``gguf.constants.Keys.Tokenizer``):

* ``tokenizer.ggml.model``: the vocabulary's kind; ``"gpt2"`` is byte-level BPE (the Qwen
  vocabularies). Any other kind is refused (:class:`~mtp_jax.config.ConfigError` naming it and
  the fix); a GGUF without the key has no tokenizer (prompts are token ids).
* ``tokenizer.ggml.pre``: the pre-tokenizer, by name. Known here: ``qwen2`` and ``qwen35``
  (Qwen3.5 / Qwen3.6 / Flash-Next), :data:`PRE_TOKENIZERS` (the split regexes of the models'
  ``tokenizer.json``; ``qwen35`` adds combining marks ``\\p{M}`` to letters).
* ``tokenizer.ggml.tokens`` (id -> text: byte-level strings, added tokens as their text) and
  ``tokenizer.ggml.token_type``: NORMAL (1) tokens are the BPE vocabulary, CONTROL (3) the
  special added tokens, USER_DEFINED (4) the other added tokens, UNUSED (5) the padding rows
  (``[PAD{i}]``, up to the model's vocabulary) which are left out, so they decode to nothing
  as the HF tokenizer's missing ids do. A missing ``token_type`` counts every token NORMAL, as
  llama.cpp does.
* ``tokenizer.ggml.merges``: ``"a b"`` strings, highest priority first.
* ``tokenizer.ggml.{bos,eos,padding,eot,eom}_token_id``; ``add_bos_token`` /
  ``add_eos_token`` true are refused (mtp_jax never adds tokens to a prompt);
  ``tokenizer.chat_template``.

The result is an HF ``tokenizers`` tokenizer built as the Qwen ``tokenizer.json`` is: NFC
normalizer, ``Split(regex, isolated)`` then ``ByteLevel(use_regex=False)``, byte-level decoder,
BPE with ``ignore_merges``: a pre-token that is itself a token is that one token (tiktoken's
rule, which Qwen's vocabulary is made for: about 200 of its tokens, e.g. ``加拿大``, no merge
reaches). llama.cpp itself applies that rule only for llama3-style pre-tokenizers and does not
normalize, so its own tokenization of such words can differ from this (and from the HF
tokenizer's). EOS ids: ``eos``, ``eot``, ``eom`` and the added tokens llama.cpp also ends
generation at (:data:`END_TEXTS`).
"""

from __future__ import annotations

import json

from mtp_jax.config import ConfigError
from mtp_jax.tokenizer import Tokenizer
from mtp_jax.weights.gguf_reader import GGUFFile

__all__ = ["PRE_TOKENIZERS", "END_TEXTS", "tokenizer_from_gguf", "tokenizer_json"]

_QWEN_HEAD = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?"
PRE_TOKENIZERS = {
    "qwen2": _QWEN_HEAD + r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": _QWEN_HEAD + r"[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
                           r"|\s+(?!\S)|\s+",
}
END_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
             "<end_of_turn>", "<|end_of_text|>")
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
_K = "tokenizer.ggml."
_FIX_NO_TOKENIZER = ("to run it on token ids instead, write a copy without its tokenizer: "
                     "gguf-new-metadata {path} OUT.gguf --remove-metadata tokenizer.ggml.model")


def _check_kind(g: GGUFFile) -> str:
    """The pre-tokenizer's name, after refusing what cannot be built (ConfigError)."""
    model, pre = g.metadata.get(_K + "model"), g.metadata.get(_K + "pre")
    fix = _FIX_NO_TOKENIZER.format(path=g.path)
    if model != "gpt2":
        raise ConfigError(f"{g.path}: tokenizer.ggml.model is {model!r}; mtp_jax builds a "
                          "tokenizer from GGUF metadata only for 'gpt2' (byte-level BPE, the "
                          f"Qwen vocabularies' kind); {fix}.")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"{g.path}: tokenizer.ggml.pre is {pre!r}; mtp_jax knows the "
                          f"pre-tokenizers {sorted(PRE_TOKENIZERS)}. If the vocabulary is "
                          f"Qwen3.5's or Flash-Next's, name it: gguf-new-metadata {g.path} "
                          f"OUT.gguf --pre-tokenizer qwen35; else, {fix}.")
    for key in ("add_bos_token", "add_eos_token"):
        if g.metadata.get(_K + key):
            raise ConfigError(f"{g.path}: tokenizer.ggml.{key} is true, but mtp_jax never adds "
                              "special tokens to a prompt (Qwen models use none), so prompts "
                              "would differ from llama.cpp's. Write a copy without the key: "
                              f"gguf-new-metadata {g.path} OUT.gguf --remove-metadata "
                              f"tokenizer.ggml.{key}")
    return pre


def _split(g: GGUFFile) -> tuple[dict[str, int], list[dict]]:
    """(BPE vocabulary, added-token entries) from the token list and types."""
    tokens = g.metadata.get(_K + "tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"{g.path}: tokenizer.ggml.model is set but tokenizer.ggml.tokens is "
                          "missing or empty: the file's tokenizer is incomplete; "
                          + _FIX_NO_TOKENIZER.format(path=g.path) + ".")
    types = g.metadata.get(_K + "token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ConfigError(f"{g.path}: tokenizer.ggml.token_type has {len(types)} entries for "
                          f"{len(tokens)} tokens; the file is inconsistent.")
    vocab, added = {}, []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == NORMAL:
            if vocab.setdefault(text, i) != i:
                raise ConfigError(f"{g.path}: token {text!r} is listed twice (ids {vocab[text]} "
                                  f"and {i}); the file's vocabulary is inconsistent.")
        elif kind in (CONTROL, USER_DEFINED):
            added.append({"id": i, "content": text, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": kind == CONTROL})
        elif kind != UNUSED:
            raise ConfigError(f"{g.path}: token {i} ({text!r}) has token type {kind}, which a "
                              "byte-level BPE ('gpt2') vocabulary does not use (NORMAL 1, "
                              "CONTROL 3, USER_DEFINED 4, UNUSED 5); the file is inconsistent.")
    return vocab, added


def _merges(g: GGUFFile) -> list[list[str]]:
    out = []
    for m in g.metadata.get(_K + "merges") or []:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ConfigError(f"{g.path}: tokenizer.ggml.merges holds {m!r}; each merge is two "
                              "tokens separated by one space. The file is corrupt.")
        out.append([left, right])
    if not out:
        raise ConfigError(f"{g.path}: a 'gpt2' tokenizer without tokenizer.ggml.merges cannot "
                          "encode text; " + _FIX_NO_TOKENIZER.format(path=g.path) + ".")
    return out


def tokenizer_json(g: GGUFFile) -> dict:
    """The HF ``tokenizer.json`` content of ``g``'s tokenizer metadata (see the module
    docstring); ConfigError for a tokenizer that cannot be built."""
    pre = _check_kind(g)
    vocab, added = _split(g)
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRE_TOKENIZERS[pre]}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": _merges(g)},
    }


def _token(tokens: list, tid) -> str | None:
    return tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else None


def _eos_ids(g: GGUFFile, spec: dict) -> list[int]:
    meta = g.metadata
    ids = [meta[_K + k] for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if isinstance(meta.get(_K + k), int)]
    ids += [t["id"] for t in spec["added_tokens"] if t["content"] in END_TEXTS]
    return list(dict.fromkeys(int(i) for i in ids))


def tokenizer_from_gguf(g: GGUFFile) -> Tokenizer | None:
    """``g``'s tokenizer and chat template as a :class:`~mtp_jax.tokenizer.Tokenizer`; None
    when the file has no ``tokenizer.ggml.model`` (prompts are then token ids). Raises
    ConfigError (naming the key, its value and the fix) for a tokenizer that cannot be built.
    The chat template's ``bos_token`` / ``eos_token`` / ``pad_token`` are the texts of the
    ``bos`` / ``eos`` / ``padding`` ids, as llama.cpp renders templates."""
    from tokenizers import Tokenizer as HFTokenizer

    if _K + "model" not in g.metadata:
        return None
    spec = tokenizer_json(g)
    hf = HFTokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    tokens, meta = g.metadata[_K + "tokens"], g.metadata
    template = meta.get("tokenizer.chat_template")
    return Tokenizer(hf, template if isinstance(template, str) else None, _eos_ids(g, spec),
                     bos_token=_token(tokens, meta.get(_K + "bos_token_id")),
                     eos_token=_token(tokens, meta.get(_K + "eos_token_id")),
                     pad_token=_token(tokens, meta.get(_K + "padding_token_id")))
