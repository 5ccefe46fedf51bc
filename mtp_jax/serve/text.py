"""Streamed text: the text deltas of one choice as its tokens arrive, such that they
concatenate to the final (non-streamed) text. Text is held back while its tail is an
incomplete UTF-8 character (the tokenizer's incremental decode) and while it could be the start
of a stop string (which the final text leaves out)."""

from __future__ import annotations

from mtp_jax.tokenizer import DetokenizeState, decode_incremental

__all__ = ["TextStream"]


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
