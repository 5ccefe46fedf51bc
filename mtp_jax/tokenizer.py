"""Text <-> token ids, chat prompts and streamed text (:class:`TextStream`: the text deltas
of a request as its tokens arrive), for a checkpoint folder.

Reads the HF files a released checkpoint ships:

- ``tokenizer.json`` (HF ``tokenizers``; required),
- the chat template: ``chat_template.jinja`` if present, else ``tokenizer_config.json`` key
  ``chat_template`` (a string, or a list of ``{"name", "template"}`` where ``default`` is used),
- EOS ids: ``generation_config.json`` ``eos_token_id`` (int or list) then
  ``tokenizer_config.json`` ``eos_token``; duplicates dropped, order kept.

Templates render in a sandboxed jinja2 environment set up as transformers does
(``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``; globals ``raise_exception``,
``strftime_now``; ``tojson`` without ASCII escaping).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any, Iterable, Sequence


class TemplateError(ValueError):
    """The chat template rejected the messages (its ``raise_exception``) or cannot render."""


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(tok: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class Tokenizer:
    """A checkpoint's tokenizer and chat template.

    ``vocab_size`` counts every id the tokenizer can produce, added tokens included (248077 for
    Qwen3.5); the model's embedding may have more rows (248320), which decode to nothing.
    """

    def __init__(self, tokenizer, chat_template: str | None = None,
                 eos_token_ids: Sequence[int] = (), bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None):
        self._tok = tokenizer
        self.chat_template = chat_template
        self.eos_token_ids: tuple[int, ...] = tuple(int(i) for i in eos_token_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self._template = None
        self._variables = None  # (read, read and not set): template_variables, parsed once

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_folder(cls, path: str) -> "Tokenizer | None":
        """Load from a checkpoint folder; None when it holds no ``tokenizer.json``."""
        from tokenizers import Tokenizer as HFTokenizer

        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            return None
        hf = HFTokenizer.from_file(tok_file)
        tcfg = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        gcfg = _read_json(os.path.join(path, "generation_config.json")) or {}

        template = None
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        else:
            template = tcfg.get("chat_template")
            if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in template
                         if isinstance(t, dict)}
                template = named.get("default") or next(iter(named.values()), None)
        if template is not None and not isinstance(template, str):
            template = None

        eos_ids: list[int] = []
        g_eos = gcfg.get("eos_token_id")
        if isinstance(g_eos, int):
            eos_ids.append(g_eos)
        elif isinstance(g_eos, list):
            eos_ids.extend(int(i) for i in g_eos)
        eos_token = _token_text(tcfg.get("eos_token"))
        if eos_token is not None:
            tid = hf.token_to_id(eos_token)
            if tid is not None:
                eos_ids.append(tid)
        eos_ids = list(dict.fromkeys(eos_ids))
        return cls(hf, template, eos_ids, bos_token=_token_text(tcfg.get("bos_token")),
                   eos_token=eos_token, pad_token=_token_text(tcfg.get("pad_token")))

    # ---- ids ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids. Nothing is
        added unless ``add_special_tokens`` (the tokenizer's post-processor, e.g. a BOS; Qwen's
        adds none)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids the tokenizer does not know (embedding padding) are dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self.token_to_id(self.pad_token)

    # ---- chat ---------------------------------------------------------------------------
    def _compiled_template(self):
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            if self.chat_template is None:
                raise TemplateError("this checkpoint has no chat template (no chat_template.jinja "
                                    "and no chat_template in tokenizer_config.json); send a raw "
                                    "prompt instead of messages.")
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        return self._template

    def template_variables(self, assigned: bool = True) -> frozenset[str]:
        """The names the chat template reads from its context (``messages``,
        ``add_generation_prompt``, ``enable_thinking``, ``tools``, ...; jinja2's own analysis
        of the source). jinja2 also counts a name a branch inside a loop sets before it is read
        there; ``assigned=False`` leaves out every name the template sets itself (for naming
        its inputs to a user; a default it sets for a missing input goes too). Raises
        :class:`TemplateError` without a template."""
        from jinja2 import meta, nodes

        template = self._compiled_template()  # raises without one
        if self._variables is None:  # parsed once, not per request
            tree = template.environment.parse(self.chat_template)
            read = set(meta.find_undeclared_variables(tree)) - set(template.environment.globals)
            stored = {n.name for n in tree.find_all(nodes.Name) if n.ctx == "store"}
            self._variables = (frozenset(read), frozenset(read - stored))
        return self._variables[0 if assigned else 1]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) to a prompt string,
        or with ``tokenize`` to its token ids (:meth:`encode`; HF's ``tokenize=True``, which
        is HF's default and not this one's).

        Extra keyword arguments (``tools``, ``enable_thinking``, ...) are passed to the template.
        Raises :class:`TemplateError` when the template rejects the input (or there is none),
        ``ValueError`` for a keyword the template does not read (named, with those it reads).
        """
        import jinja2

        unread = sorted(k for k in kwargs if k not in self.template_variables())
        if unread:
            raise ValueError(f"apply_chat_template: the chat template does not read {unread}; "
                             f"it reads {sorted(self.template_variables(assigned=False))}.")
        if tokenize:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                        **kwargs))

        ctx = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                   pad_token=self.pad_token or "")
        ctx.update(kwargs)
        try:
            return self._compiled_template().render(
                messages=messages, add_generation_prompt=add_generation_prompt, **ctx)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e


@dataclasses.dataclass
class DetokenizeState:
    """Streaming detokenization state of one request.

    ``ids`` are all generated ids so far; text is emitted for ``ids[prefix:read]`` ->
    ``ids[prefix:]`` differences, and held back while the tail decodes to an incomplete UTF-8
    character (U+FFFD).
    """

    ids: list[int] = dataclasses.field(default_factory=list)
    prefix: int = 0
    read: int = 0


def decode_incremental(tokenizer: Tokenizer, state: DetokenizeState, new_ids: Sequence[int],
                       skip_special_tokens: bool = True) -> str:
    """Append ``new_ids`` to ``state`` and return the newly completed text (may be "")."""
    state.ids.extend(int(i) for i in new_ids)
    prev = tokenizer.decode(state.ids[state.prefix:state.read], skip_special_tokens)
    full = tokenizer.decode(state.ids[state.prefix:], skip_special_tokens)
    if len(full) > len(prev) and not full.endswith("\ufffd"):
        # Decoding from a few ids back keeps byte-level merges of the boundary right.
        state.prefix, state.read = state.read, len(state.ids)
        return full[len(prev):]
    return ""


class TextStream:
    """Deltas of one choice: :meth:`push` the new token ids of each update but the last, and
    :meth:`finish` with the final text at the last (not :meth:`push` then: its tokens may
    complete a stop string, whose first characters push would give out). ``tokenizer`` None
    gives empty text."""

    def __init__(self, tokenizer, stops: list[str] | None):
        self.tokenizer = tokenizer
        self.state = DetokenizeState()
        self.text = ""  # decoded so far
        self.sent = ""  # given out so far
        self.hold = max((len(s) for s in stops or ()), default=1) - 1

    def push(self, token_ids: list[int]) -> str:
        """The text to send for ``token_ids`` (may be "")."""
        if self.tokenizer is None or not token_ids:
            return ""
        self.text += decode_incremental(self.tokenizer, self.state, token_ids)
        upto = max(len(self.sent), len(self.text) - self.hold)
        delta = self.text[len(self.sent):upto]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the request's output text) after what was sent."""
        if not final_text.startswith(self.sent):  # cannot happen with a prefix-stable decode
            return ""
        rest = final_text[len(self.sent):]
        self.sent = final_text
        return rest
