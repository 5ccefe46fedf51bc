"""``/v1/completions`` and ``/v1/chat/completions``: parse, make the requests, run them as one
:class:`~mtp_jax.serve.calls.Call`, and answer with one JSON object or a server-sent-event
stream ending in ``data: [DONE]``."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mtp_jax.serve import responses as R
from mtp_jax.serve.calls import Call
from mtp_jax.serve.errors import APIError
from mtp_jax.serve.logprobs import chat_logprobs, completion_logprobs
from mtp_jax.serve.prepare import chat_prompt, check_model, completion_prompts, make_requests
from mtp_jax.serve.protocol import ChatBody, CompletionBody, parse_body
from mtp_jax.tokenizer import TextStream

__all__ = ["router"]

router = APIRouter()


async def read_json(request: Request):
    """The request's JSON body; a 400 when it is not JSON."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON "
                            "object.", code="invalid_json") from None


@router.post("/v1/completions")
async def completions(request: Request):
    """OpenAI's completions: text or token-id prompts, one choice per prompt."""
    state = request.app.state.server
    body = parse_body(await read_json(request), CompletionBody)
    check_model(body.model, state.served)
    reqs = make_requests(state.llm, body, completion_prompts(body), chat=False)
    return await _serve(request, state, body, reqs, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    """OpenAI's chat completions, the prompt made by the checkpoint's chat template."""
    state = request.app.state.server
    body = parse_body(await read_json(request), ChatBody)
    check_model(body.model, state.served)
    reqs = make_requests(state.llm, body, [chat_prompt(body, state.llm.tokenizer)], chat=True)
    return await _serve(request, state, body, reqs, chat=True)


async def _serve(request: Request, state, body, reqs, chat: bool):
    call = Call(state.worker, reqs, request.is_disconnected)
    model = body.model or state.served[0]
    try:
        await call.start()
    except BaseException:
        call.close()
        raise
    if body.stream:
        gen = _stream(call, state, body, model, chat)
        return StreamingResponse(gen, media_type="text/event-stream")
    async with call:
        outs = [None] * len(reqs)
        async for ev in call.events():
            if ev.finished:
                outs[ev.index] = ev.output
    rid = R.new_id("chatcmpl" if chat else "cmpl")
    make = R.chat_object if chat else R.completion_object
    return JSONResponse(make(rid, model, outs,
                             logprobs=[_logprobs(o.logprobs, state, chat) for o in outs]))


def _logprobs(lps, state, chat: bool, offset: int = 0) -> dict | None:
    """A choice's (or a chunk's) ``logprobs`` object; None when not asked for."""
    if lps is None:
        return None
    tok = state.llm.tokenizer
    return chat_logprobs(lps, tok) if chat else completion_logprobs(lps, tok, offset)


async def _stream(call: Call, state, body, model: str, chat: bool):
    """The SSE body: per-choice deltas (chat: a first role delta), each choice's last chunk
    with its ``finish_reason`` and ``speculative`` stats, a ``usage`` chunk when asked for,
    then ``data: [DONE]``. An engine failure sends an error object before ``[DONE]``."""
    rid, created = R.new_id("chatcmpl" if chat else "cmpl"), int(time.time())
    texts = [TextStream(state.llm.tokenizer, r.params.stop) for r in
             (j.req for j in call.jobs)]
    outs = [None] * len(call.jobs)
    offsets = [0] * len(call.jobs)  # completions' text_offset of each choice's next token
    async with call:
        if chat:
            for i in range(len(call.jobs)):
                yield R.sse(R.chat_chunk(rid, model, created, i,
                                         {"role": "assistant", "content": ""}))
        try:
            async for ev in call.events():
                reason = None
                if ev.finished:  # the final text, cut at a stop string its last tokens made
                    outs[ev.index] = ev.output
                    delta = texts[ev.index].finish(ev.output.text)
                    reason = R.finish_reason(ev.output)
                else:
                    delta = texts[ev.index].push(ev.token_ids)
                if not (delta or ev.token_ids or reason):
                    continue
                lps = _logprobs(ev.logprobs, state, chat, offsets[ev.index])
                if lps is not None and not chat:
                    offsets[ev.index] += sum(len(t) for t in lps["tokens"])
                chunk = (R.chat_chunk(rid, model, created, ev.index,
                                      {"content": delta} if delta or not reason else {},
                                      reason, ev.token_ids, lps) if chat
                         else R.completion_chunk(rid, model, created, ev.index, delta,
                                                 ev.token_ids, reason, lps))
                if reason:
                    chunk["speculative"] = R.speculative([ev.output])
                yield R.sse(chunk)
        except APIError as e:  # after the stream's first bytes: no handler sees it
            state.metrics.count_error(e.status)
            yield R.sse(e.body())
        else:
            if body.stream_options is not None and body.stream_options.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield R.sse({"id": rid, "object": obj, "created": created, "model": model,
                             "choices": [], "usage": R.usage(outs),
                             "speculative": R.speculative(outs)})
    yield R.SSE_DONE
