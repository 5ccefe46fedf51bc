"""Checkpoint folders for tests of the faces: a fixture's weights (symlinked) with a
word-level tokenizer of its own, so that text prompts, stop strings, streamed text and
``--chat`` work on the tiny fixtures (which ship no tokenizer)."""

from __future__ import annotations

import json
import os

from tests.helpers.paths import fixture_path

# short, so that a chat prompt stays within a few tokens
CHAT_TEMPLATE = ("{% for m in messages %}t1 {{ m.content }} t2 {% endfor %}"
                 "{% if add_generation_prompt %}t3{% endif %}")


def write_word_tokenizer(folder: str, vocab_size: int) -> None:
    """Token ``i`` is the word ``t{i}`` (text ``"t5 t6"`` encodes to ``[5, 6]``, ids decode to
    words joined by spaces), so every token adds text; ``t0`` is the unknown word. A chat
    template wraps each message in ``t1 ... t2`` and ends with ``t3``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE}, f)


def folder_with_tokenizer(out: str, fixture: str = "tiny_moe_fused", vocab_size: int = 300,
                          **config_changes) -> str:
    """``out`` holding ``fixture``'s weights (symlinks), its ``config.json`` with
    ``config_changes`` applied to the top level, and :func:`write_word_tokenizer`."""
    src = fixture_path(fixture)
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.symlink(os.path.join(src, name), os.path.join(out, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_changes)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_word_tokenizer(out, vocab_size)
    return out
