"""From a validated body to engine requests: the prompts (text, token ids, or the chat
template over messages), ``max_tokens`` resolved, each turned into a :class:`Request` by
``LLM.new_requests`` (``n`` per prompt, prompt-major: OpenAI's choice order); a 400 naming the
field for anything the engine refuses."""

from __future__ import annotations

from mtp_jax.engine.requests import Request
from mtp_jax.prompts import chat_prompt as prompts_chat_prompt
from mtp_jax.prompts import check_template_kwargs, prompt_ids
from mtp_jax.serve.errors import APIError
from mtp_jax.serve.protocol import ChatBody, CompletionBody, sampling_params
from mtp_jax.tokenizer import TemplateError

__all__ = ["check_model", "completion_prompts", "chat_prompt", "check_room", "make_requests"]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_model(name: str | None, served: list[str]) -> None:
    """404 for a ``model`` this server does not serve (None: the served one)."""
    if name is not None and name not in served:
        raise APIError(404, f"model {name!r} does not exist here; this server serves "
                            f"{served}.", param="model", code="model_not_found")


def completion_prompts(body: CompletionBody) -> list:
    """The prompts of a completion: one string or id list, or a list of either."""
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]
    if not p:
        raise APIError(400, "prompt is empty; pass a string or a list of token ids.",
                       param="prompt")
    return list(p)


def chat_prompt(body: ChatBody, tokenizer) -> str:
    """The prompt text of a chat completion: the checkpoint's chat template over
    ``messages`` with the generation prompt (as the CLI's ``--chat``) and the
    ``chat_template_kwargs`` (:func:`mtp_jax.prompts.check_template_kwargs`)."""
    if tokenizer is None or not tokenizer.chat_template:
        raise APIError(400, "this checkpoint has no tokenizer with a chat template; use "
                            "/v1/completions with token ids.", param="messages")
    try:
        kwargs = check_template_kwargs(body.chat_template_kwargs, tokenizer)
    except ValueError as e:
        raise APIError(400, str(e), param="chat_template_kwargs") from None
    try:
        return prompts_chat_prompt([m.model_dump() for m in body.messages], tokenizer, kwargs)
    except (TemplateError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from None


def check_room(prompt_len: int, max_tokens: int, max_len: int, field: str, chat: bool) -> None:
    """A 400 (``context_length_exceeded``) when the prompt and ``max_tokens`` together exceed
    the context (as vLLM answers: a request is refused, not cut short without a word);
    ``field``: the request's name for ``max_tokens``."""
    if max_tokens <= 0 or prompt_len + max_tokens <= max_len:
        return  # a non-positive value is sampling_params' to refuse
    room = max_len - prompt_len
    rest = " or leave it out (the rest of the context)" if chat else ""
    raise APIError(400, f"{field} {max_tokens} + the prompt's {prompt_len} tokens = "
                        f"{prompt_len + max_tokens} exceed this server's context "
                        f"(max_model_len {max_len}); pass {field} <= {room}{rest}, or start "
                        "the server with a larger --max-model-len.", param=field,
                   code="context_length_exceeded")


def make_requests(llm, body, prompts: list, chat: bool) -> list[Request]:
    """``n`` engine requests (samples) per prompt, prompt-major; ``max_tokens`` defaults to 16
    for completions and to the rest of the context for chat (as OpenAI's API); one that runs
    past the context is a 400 (:func:`check_room`)."""
    out = []
    vocab, max_len = llm.model.cfg.vocab_size, llm.engine.max_model_len
    for p in prompts:
        try:
            _, ids = prompt_ids(p, llm.tokenizer, vocab, max_len)
        except ValueError as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) else None
            raise APIError(400, str(e), param="messages" if chat else "prompt",
                           code=code) from None
        field, max_tokens = "max_tokens", body.max_tokens
        if chat and body.max_completion_tokens is not None:
            field, max_tokens = "max_completion_tokens", body.max_completion_tokens
        if max_tokens is None:
            max_tokens = max_len - len(ids) if chat else COMPLETION_MAX_TOKENS
        check_room(len(ids), max_tokens, max_len, field, chat)
        params = sampling_params(body, max_tokens)
        try:
            out += llm.new_requests(ids, params)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
    return out
