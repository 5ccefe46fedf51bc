"""Prompts checked before any weight loads.

What a prompt must fit is known before the model loads: the vocabulary and the model's
``max_position_embeddings`` from ``config.json``, ``max_model_len`` from the settings (the
engine's context limit is the smaller of the two, as :class:`~mtp_jax.engine.engine.Engine`
sets it), and its tokens from the tokenizer files (a GGUF: its tokenizer metadata). So an
empty prompt, a prompt too long for the context or stop strings that cannot fire are refused in
seconds, not after minutes of loading weights (``python -m mtp_jax.generate``,
:meth:`mtp_jax.LLM.check_prompts`). The checks are
:func:`mtp_jax.prompts.prompt_ids` and :func:`mtp_jax.prompts.check_stops`, the ones
``LLM.generate`` runs again on the loaded engine.

:func:`load_tokenizer` keeps the last tokenizer it read, so that ``LLM(model)`` after a check
of the same folder does not read it a second time (seconds for a real vocabulary).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from mtp_jax.config import ConfigError
from mtp_jax.prompts import chat_prompt, check_stops, prompt_ids
from mtp_jax.sampling import SamplingParams
from mtp_jax.tokenizer import Tokenizer

__all__ = ["PromptLimits", "read_limits", "load_tokenizer", "check_prompts",
           "check_prompts_before_load"]

# The files Tokenizer.from_folder reads: a change to any of them reads the folder again (a
# GGUF: the file itself).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja")
_LAST_TOKENIZER: dict = {}  # at most one entry: (folder, its files' stats) -> Tokenizer


@dataclasses.dataclass(frozen=True)
class PromptLimits:
    """What a prompt must fit: ids below ``vocab_size``, and fewer tokens than the context
    limit :attr:`context`, ``min(max_model_len, max_positions)`` (one output token needs
    room)."""

    vocab_size: int
    max_model_len: int  # as asked (LLM(max_model_len=...), --max-model-len)
    max_positions: int  # the model's max_position_embeddings

    @property
    def context(self) -> int:
        """The engine's context limit (``Engine.max_model_len``)."""
        return min(self.max_model_len, self.max_positions)

    @classmethod
    def of(cls, model_cfg, max_model_len: int) -> "PromptLimits":
        """The limits of a parsed model config and the asked ``max_model_len``."""
        return cls(vocab_size=int(model_cfg.vocab_size), max_model_len=int(max_model_len),
                   max_positions=int(model_cfg.max_position_embeddings))


def read_limits(model: str, max_model_len: int) -> PromptLimits:
    """The limits of the checkpoint at ``model`` (reads its ``config.json`` or GGUF header
    only; a missing or unknown one raises the ``ConfigError`` that ``LLM(model)`` would)."""
    from mtp_jax.models.checks import read_model_config

    return PromptLimits.of(read_model_config(model, mtp=False), max_model_len)


def _stats(paths: list[str]) -> tuple:
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return tuple(out)


def _read_tokenizer(model: str, gguf: str | None) -> Tokenizer | None:
    if gguf is None:
        return Tokenizer.from_folder(model)
    from mtp_jax.weights.gguf_reader import open_gguf
    from mtp_jax.weights.gguf_tokenizer import tokenizer_from_gguf
    from mtp_jax.weights.safetensors_files import CheckpointError

    try:
        return tokenizer_from_gguf(open_gguf(gguf))
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer of the checkpoint at ``model``: a folder's files
    (:meth:`Tokenizer.from_folder`; None without ``tokenizer.json``) or a GGUF's tokenizer
    metadata (:func:`~mtp_jax.weights.gguf_tokenizer.tokenizer_from_gguf`; None without
    ``tokenizer.ggml.model``, ``ConfigError`` for one it cannot build). The last one read is
    reused while the path and its files are unchanged."""
    from mtp_jax.weights.gguf_header import gguf_file

    gguf = gguf_file(model) if os.path.exists(model) else None
    files = [gguf] if gguf else [os.path.join(model, n) for n in TOKENIZER_FILES]
    key = (os.path.abspath(model), gguf, _stats(files))
    if key not in _LAST_TOKENIZER:
        tokenizer = _read_tokenizer(model, gguf)
        _LAST_TOKENIZER.clear()
        _LAST_TOKENIZER[key] = tokenizer
    return _LAST_TOKENIZER[key]


def check_prompts(prompts: Sequence, labels: Sequence[str], tokenizer, limits: PromptLimits,
                  params: Sequence[SamplingParams | None] | None = None, chat: bool = False,
                  template_kwargs: dict | None = None
                  ) -> tuple[list[list[int] | None], dict[int, str]]:
    """``(ids, errors)``: each prompt's token ids (None where refused) and, by index, the
    message of each refused prompt (empty: every prompt fits) as ``"{labels[i]}: {what is
    wrong and the fix}"``. The checks are :func:`mtp_jax.prompts.prompt_ids` against
    ``limits`` (empty; too long: its token count, the limit and ``--max-model-len``; ids outside
    the vocabulary; text without a tokenizer) and, where ``params[i]`` is given,
    :func:`mtp_jax.prompts.check_stops`. ``chat``: each prompt is a conversation, checked as
    the text :func:`mtp_jax.prompts.chat_prompt` renders (what ``LLM.chat`` generates from;
    no tokenizer or a template refusal is that prompt's error), with ``template_kwargs``."""
    ids: list[list[int] | None] = []
    errors = {}
    for i, (prompt, label) in enumerate(zip(prompts, labels)):
        try:
            if chat:
                prompt = chat_prompt(prompt, tokenizer, template_kwargs)
            got = prompt_ids(prompt, tokenizer, limits.vocab_size, limits.context,
                             max_positions=limits.max_positions)[1]
            if params is not None and params[i] is not None:
                check_stops(params[i], limits.vocab_size, tokenizer)
        except ValueError as e:
            got, errors[i] = None, f"{label}: {e}"
        ids.append(got)
    return ids, errors


def check_prompts_before_load(prompts, model: str, max_model_len: int,
                              sampling_params=None, chat: bool = False,
                              template_kwargs: dict | None = None) -> list[list[int]]:
    """:meth:`mtp_jax.LLM.check_prompts`: each prompt's token ids, or one ``ValueError``
    naming every refused prompt (``prompts[i]``). ``chat``: the prompts are conversations
    (:func:`mtp_jax.prompts.conversation_list`)."""
    from mtp_jax.prompts import conversation_list, params_list, prompt_list

    prompts = conversation_list(prompts) if chat else prompt_list(prompts)
    params = params_list(sampling_params, len(prompts)) if sampling_params is not None else None
    tokenizer, limits = load_tokenizer(model), read_limits(model, max_model_len)
    ids, errors = check_prompts(prompts, [f"prompts[{i}]" for i in range(len(prompts))],
                                tokenizer, limits, params, chat=chat,
                                template_kwargs=template_kwargs)
    if errors:
        raise ValueError("\n".join(errors[i] for i in sorted(errors)))
    return ids
