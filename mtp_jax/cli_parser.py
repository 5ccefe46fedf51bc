"""The argument parser of the commands a user types (``python -m mtp_jax.generate``,
``python -m mtp_jax.serve``): argparse without abbreviations (``--max-token`` is an error, not
``--max-tokens``), whose errors are one line naming the problem, the closest flag for a
mistyped one, and ``--help``, instead of argparse's usage block of every flag first."""

from __future__ import annotations

import argparse
import difflib
import json

__all__ = ["CliParser", "add_sampling_flags", "json_object"]


def json_object(text: str) -> dict:
    """An argparse ``type``: ``text`` read as a JSON object (a dict); else argparse's error
    naming the value and the form, e.g. ``'{"enable_thinking": false}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e.msg}); give an object such "
                                         "as '{\"enable_thinking\": false}'.") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}, not an "
                                         "object; give one such as '{\"enable_thinking\": "
                                         "false}'.")
    return value


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """The sampling flags (``SamplingParams``' fields of the same names; the CLI's
    temperature default is 0, greedy)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass, in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=-1,
                   help="keep the k most likely tokens; -1 or 0 = off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep the tokens at least this fraction as likely as the most likely "
                        "one, in [0, 1]; 0 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="lower the logit of every token already in the output by this, in "
                        "[-2, 2]; 0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="lower each token's logit by this times its count in the output, in "
                        "[-2, 2]; 0 = off")


class CliParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with ``allow_abbrev=False`` and short errors (exit status
    2, as argparse)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)

    def error(self, message: str):
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        if message.startswith("unrecognized arguments:"):
            for word in message.split(":", 1)[1].split():
                name = word.split("=", 1)[0]
                close = difflib.get_close_matches(name, flags, n=1) if name[:2] == "--" else []
                if close:
                    hints.append(f"{name}: did you mean {close[0]}?")
        text = f"{self.prog}: error: {message}" + (f" ({'; '.join(hints)})" if hints else "")
        self.exit(2, f"{text}\nRun {self.prog} --help for every flag.\n")
