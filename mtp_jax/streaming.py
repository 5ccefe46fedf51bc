"""The text of :meth:`mtp_jax.LLM.generate_stream`'s updates: each
:class:`~mtp_jax.engine.requests.StreamOutput` gets ``new_text``, the text its new tokens add
(:class:`~mtp_jax.tokenizer.TextStream`: held back while it is an incomplete UTF-8 character
or could be the start of a stop string), so that a request's deltas concatenate to its final
text."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from mtp_jax.engine.requests import StreamOutput
from mtp_jax.tokenizer import TextStream

__all__ = ["with_text"]


def with_text(updates: Iterator[StreamOutput], tokenizer,
              stops: dict[int, list[str] | None]) -> Iterator[StreamOutput]:
    """``updates`` with ``new_text`` set (``""`` without a tokenizer); ``stops``: each output
    index's stop strings. Closing this closes ``updates`` (its requests are aborted there)."""
    texts: dict[int, TextStream] = {}
    try:
        for u in updates:
            text = texts.setdefault(u.index, TextStream(tokenizer, stops.get(u.index)))
            if u.finished:  # the final text, cut at a stop string its last tokens made
                delta = text.finish(u.output.text if u.output is not None else "")
            else:
                delta = text.push(u.new_token_ids)
            yield dataclasses.replace(u, new_text=delta)
    finally:
        updates.close()
