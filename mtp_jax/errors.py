"""``ConfigError``: the one error type of a configuration that cannot work, and
:func:`check_field_types`, the type check of a settings dataclass's fields.

Its own module so that the leaf modules that parse parts of a config (:mod:`mtp_jax.config`,
:mod:`mtp_jax.rope`) raise the same class without importing each other;
``mtp_jax.config.ConfigError`` is the same class.
"""

from __future__ import annotations

import dataclasses
import numbers

__all__ = ["ConfigError", "check_field_types"]


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the value and the fix."""


# Annotation word -> (accepted class, its name in messages, parser of a string that spells one).
_KINDS = {"int": (numbers.Integral, "an int", int), "float": (numbers.Real, "a number", float),
          "bool": (bool, "True or False", None)}


def _fits(value, cls) -> bool:
    return isinstance(value, cls) and (cls is bool or not isinstance(value, bool))


def check_field_types(obj, names: dict[str, str] | None = None) -> None:
    """Check each field of dataclass ``obj`` annotated ``int``, ``float`` or ``bool`` (each
    optionally ``| None``) against its annotation: a bool is not an int, an int is a number.
    Fields of other annotations are left to their own checks. ``names`` maps a field to the
    name users pass it by (default: the field's name).

    Raises:
      ConfigError: the first field that does not fit, naming it, its value, the value's type
        and the type expected, e.g. ``max_prefill_batch '8' is of type str, not an int; pass
        max_prefill_batch=8``.
    """
    for f in dataclasses.fields(obj):
        spelled = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        parts = [p.strip() for p in spelled.split("|")]
        kinds = [_KINDS[p] for p in parts if p in _KINDS]
        value = getattr(obj, f.name)
        if (not kinds or len(kinds) + ("None" in parts) != len(parts)
                or (value is None and "None" in parts)
                or any(_fits(value, cls) for cls, _, _ in kinds)):
            continue
        name = (names or {}).get(f.name, f.name)
        want = " or ".join([w for _, w, _ in kinds] + ["None"] * ("None" in parts))
        fix = ("a value of that type" if f.default is dataclasses.MISSING
               else f"a value of that type, e.g. {name}={f.default!r} (the default)")
        for parse in [p for _, _, p in kinds if p is not None and isinstance(value, str)]:
            try:  # a number spelled as a string: the call that works
                fix = f"{name}={parse(value.strip())!r}"
                break
            except ValueError:
                continue
        raise ConfigError(f"{name} {value!r} is of type {type(value).__name__}, not {want}; "
                          f"pass {fix}.")
