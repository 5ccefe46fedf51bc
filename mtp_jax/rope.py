"""RoPE scaling read from a checkpoint's ``config.json``: which variant, with which parameters.

Where it is read (the text config, or the top level of a composite config):

* ``rope_parameters`` (transformers 5): ``{rope_type, rope_theta, partial_rotary_factor,
  mrope_section, mrope_interleaved}`` plus the variant's keys (``factor``,
  ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``attention_factor``,
  ``mscale``, ``mscale_all_dim``, ``truncate``);
* ``rope_scaling`` (legacy, what Qwen documents for long contexts): ``{"type" or "rope_type":
  "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}``. Its keys are laid over
  ``rope_parameters`` (transformers lets ``rope_scaling`` replace ``rope_parameters``).

Supported types: ``default`` (and ``mrope``, the Qwen2-VL spelling, which is plain RoPE for text
positions), ``linear`` and ``yarn``. Any other type (``dynamic``, ``longrope``, ``llama3``,
``proportional``, ...) and any key the chosen type does not read is a :class:`ConfigError`,
raised while the config is parsed, before any weight is read: a scaling silently dropped would
run the model with the wrong positions.

The parsed :class:`RopeScaling` is frozen and hashable, so configs holding it stay static jit
arguments. The maths that uses it (inverse frequencies, ``cos`` / ``sin`` tables) is
:mod:`mtp_jax.models.layers.rotary`; the host-side numbers (YaRN's correction range and
attention factor) are here. Source: HF transformers 5.23 ``modeling_rope_utils.py``
(``_compute_yarn_parameters``, ``_compute_linear_scaling_rope_parameters``,
``RotaryEmbeddingConfigMixin.standardize_rope_params``); YaRN, Peng et al. 2023,
arXiv:2309.00071, section 3.
"""

from __future__ import annotations

import dataclasses
import math

from mtp_jax.errors import ConfigError

ROPE_TYPES = ("default", "linear", "yarn")
_ALIASES = {"mrope": "default"}  # Qwen2-VL's name: sections of one position stream for text
# Keys every type may carry: read elsewhere (rope_theta, partial_rotary_factor) or meaningless
# for text positions (the mRoPE sections collapse to 1-D RoPE when the three streams are equal).
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor",
                          "mrope_section", "mrope_interleaved"})
_TYPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE variant with its parameters resolved (defaults filled, attention factor computed).

    ``rope_type``: ``"default"``, ``"linear"`` (every inverse frequency divided by ``factor``) or
    ``"yarn"`` (frequencies blended between divided and kept, by rotary dimension, and
    ``cos`` / ``sin`` multiplied by ``attention_factor``). ``factor``: the context extension
    (>= 1). ``original_max_position_embeddings``: the pretraining context, in tokens (YaRN's
    correction range is measured against it). ``beta_fast`` / ``beta_slow``: rotations over that
    context where the ramp from kept (extrapolated) to divided (interpolated) frequencies
    starts and ends. ``truncate``: round the range's ends outward to whole dimensions.
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


DEFAULT_ROPE = RopeScaling()


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``);
    arXiv:2309.00071 eq. 22, transformers' ``get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor: float, attention_factor: float | None = None,
                          mscale: float | None = None,
                          mscale_all_dim: float | None = None) -> float:
    """The factor YaRN multiplies ``cos`` and ``sin`` by (so attention logits by its square on
    the rotary dims): ``attention_factor`` when given; else, with both ``mscale`` and
    ``mscale_all_dim`` set (DeepSeek's form), ``yarn_mscale(factor, mscale) /
    yarn_mscale(factor, mscale_all_dim)``; else ``yarn_mscale(factor)``."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return float(yarn_mscale(factor))


def yarn_correction_dim(num_rotations: float, rotary_dim: int, theta: float,
                        max_positions: int) -> float:
    """The (fractional) rotary dimension whose frequency turns ``num_rotations`` times over
    ``max_positions`` tokens: ``rotary_dim * ln(max_positions / (2 pi num_rotations)) /
    (2 ln theta)`` (arXiv:2309.00071 eq. 17 inverted)."""
    return (rotary_dim * math.log(max_positions / (num_rotations * 2 * math.pi))
            / (2 * math.log(theta)))


def yarn_correction_range(scaling: RopeScaling, rotary_dim: int,
                          theta: float) -> tuple[float, float]:
    """``(low, high)``: the frequency-index range over which YaRN ramps from kept to divided
    frequencies. ``low`` from ``beta_fast``, ``high`` from ``beta_slow``; rounded outward
    (floor / ceil) when ``truncate``; clamped to ``[0, rotary_dim - 1]`` (transformers clamps
    with the rotary width, not the half of it that indexes frequencies)."""
    low = yarn_correction_dim(scaling.beta_fast, rotary_dim, theta,
                              scaling.original_max_position_embeddings)
    high = yarn_correction_dim(scaling.beta_slow, rotary_dim, theta,
                               scaling.original_max_position_embeddings)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


# ---- parsing -------------------------------------------------------------------------------


def _section(cfg: dict, raw: dict, key: str) -> dict:
    """``key`` (``rope_parameters`` or ``rope_scaling``) from the text config, else the top
    level; ``{}`` when absent or null. A non-dict, or two different dicts, is refused."""
    found = [src[key] for src in (cfg, raw) if src.get(key) is not None]
    for value in found:
        if not isinstance(value, dict):
            raise ConfigError(f"config.json key {key!r} is {value!r}; expected an object such "
                              "as {\"rope_type\": \"yarn\", \"factor\": 4.0, ...} or null.")
    if len(found) == 2 and found[0] != found[1]:
        raise ConfigError(f"config.json has {key!r} both in text_config ({found[0]}) and at the "
                          f"top level ({found[1]}), and they differ; keep one.")
    return dict(found[0]) if found else {}


def _type_of(section: dict, key: str) -> str | None:
    """The section's ``rope_type`` (or legacy ``type``); both given and different is refused."""
    t, legacy = section.get("rope_type"), section.get("type")
    if t is not None and legacy is not None and t != legacy:
        raise ConfigError(f"config.json {key} says rope_type {t!r} but type {legacy!r}; "
                          "keep one of them.")
    t = t if t is not None else legacy
    if t is not None and not isinstance(t, str):
        raise ConfigError(f"config.json {key} rope_type is {t!r}; expected a string such as "
                          f"{' or '.join(map(repr, ROPE_TYPES))}.")
    return t


def rope_section(cfg: dict, raw: dict) -> tuple[dict, str]:
    """The RoPE keys in force: ``rope_parameters`` with ``rope_scaling`` laid over it, nulls
    and ``_`` notes dropped, and the canonical type. ``cfg`` is the text config, ``raw`` the
    whole file. Raises :class:`ConfigError` for conflicting or malformed sections and
    unsupported types."""
    params, scaling = _section(cfg, raw, "rope_parameters"), _section(cfg, raw, "rope_scaling")
    t_params, t_scaling = _type_of(params, "rope_parameters"), _type_of(scaling, "rope_scaling")
    t_params_c, t_scaling_c = (_ALIASES.get(t, t) for t in (t_params, t_scaling))
    if (t_params_c not in (None, "default") and t_scaling_c not in (None, "default")
            and t_params_c != t_scaling_c):
        raise ConfigError(f"config.json rope_parameters has rope_type {t_params!r} but "
                          f"rope_scaling has {t_scaling!r}; keep one RoPE scaling.")
    # nulls are absent keys; "_" keys are notes (as in configs/, mtp_jax.config.strip_private_keys)
    merged = {k: v for k, v in {**params, **scaling}.items()
              if v is not None and not str(k).startswith("_")}
    given = t_scaling if t_scaling is not None else t_params
    rope_type = _ALIASES.get(given, given) if given is not None else "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"config.json asks for RoPE scaling type {given!r}, which mtp_jax does "
                          f"not apply; supported: {', '.join(ROPE_TYPES)} (and 'mrope' as "
                          "default). Remove rope_scaling / set rope_parameters.rope_type to a "
                          "supported type, or use an engine that implements it.")
    _check_repeated_keys(cfg, raw, merged)
    unknown = sorted(set(merged) - _COMMON_KEYS - _TYPE_KEYS[rope_type])
    if unknown:
        users = "; ".join(f"{t}: {', '.join(sorted(k))}" for t, k in _TYPE_KEYS.items() if k)
        raise ConfigError(f"config.json RoPE keys {unknown} are not read by rope_type "
                          f"{rope_type!r}, and ignoring them could change the positions' maths; "
                          f"remove them or set the rope_type that uses them ({users}).")
    return merged, rope_type


def _check_repeated_keys(cfg: dict, raw: dict, merged: dict) -> None:
    """A key the config gives both beside and inside its RoPE section (``rope_theta``,
    ``partial_rotary_factor``) must have one value: the engine reads the outer one, and
    readers that take the section's would run other positions. Raises :class:`ConfigError`
    naming both values."""
    for key in ("rope_theta", "partial_rotary_factor"):
        inner = merged.get(key)
        outer = next((src[key] for src in (cfg, raw) if src.get(key) is not None), None)
        if inner is None or outer is None or isinstance(inner, bool) or isinstance(outer, bool):
            continue
        if isinstance(inner, (int, float)) and isinstance(outer, (int, float)) and (
                float(inner) != float(outer)):
            raise ConfigError(f"config.json gives {key} = {outer!r} beside rope_parameters / "
                              f"rope_scaling but {inner!r} inside; they must agree: set both "
                              "to the value the checkpoint was trained with, or remove one.")


def _number(merged: dict, key: str, *, low: float = 0.0, strict: bool = True) -> float | None:
    """``merged[key]`` as a float (``None`` when absent), refused unless a finite number above
    ``low`` (or at it, without ``strict``)."""
    v = merged.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
            v <= low if strict else v < low):
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise ConfigError(f"config.json RoPE key {key!r} is {v!r}; expected a number {bound}.")
    return float(v)


def parse_rope_scaling(cfg: dict, raw: dict, max_position_embeddings: int) -> RopeScaling:
    """:class:`RopeScaling` from the text config ``cfg`` and the whole file ``raw``.

    ``factor`` is required for ``linear`` and ``yarn`` (a number >= 1). YaRN's
    ``original_max_position_embeddings`` comes, as in transformers, from the text config's top
    level when set there, else from the RoPE section, else is ``max_position_embeddings``.
    Raises :class:`ConfigError` naming the key for anything missing, malformed or unsupported.
    """
    merged, rope_type = rope_section(cfg, raw)
    if rope_type == "default":
        return DEFAULT_ROPE
    if merged.get("factor") is None:
        raise ConfigError(f"config.json rope_type {rope_type!r} needs 'factor' (the context "
                          "extension, e.g. 4.0) in rope_parameters / rope_scaling.")
    factor = _number(merged, "factor", low=1.0, strict=False)
    if rope_type == "linear":
        return RopeScaling("linear", factor=factor)
    original = cfg.get("original_max_position_embeddings",
                       merged.get("original_max_position_embeddings", max_position_embeddings))
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(f"config.json RoPE key 'original_max_position_embeddings' is "
                          f"{original!r}; expected the pretraining context in tokens (an "
                          "integer >= 1, e.g. 262144).")
    truncate = merged.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"config.json RoPE key 'truncate' is {truncate!r}; expected true or "
                          "false.")
    # transformers reads beta_fast / beta_slow with `or`, so 0 also means the default
    beta_fast = _number(merged, "beta_fast", strict=False) or 32.0
    beta_slow = _number(merged, "beta_slow", strict=False) or 1.0
    attention = yarn_attention_factor(factor, _number(merged, "attention_factor"),
                                      _number(merged, "mscale", low=0.0, strict=False),
                                      _number(merged, "mscale_all_dim", low=0.0, strict=False))
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=beta_fast, beta_slow=beta_slow, attention_factor=attention,
                       truncate=truncate)


def describe(scaling: RopeScaling) -> str:
    """One line for logs and errors: ``default`` or e.g. ``yarn(factor=4, original=262144)``."""
    if scaling.rope_type == "default":
        return "default"
    if scaling.rope_type == "linear":
        return f"linear(factor={scaling.factor:g})"
    return (f"yarn(factor={scaling.factor:g}, original={scaling.original_max_position_embeddings}"
            f", attention_factor={scaling.attention_factor:.6g})")

