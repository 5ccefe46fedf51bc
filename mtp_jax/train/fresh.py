"""A new MTP head, initialised as the HF model initialises one (``_init_weights`` of the
Qwen3.5 family): every projection matrix and expert stack ``N(0, initializer_range^2)``, every
RMSNorm weight 0 (the family's norms are zero-centred, ``x / rms(x) * (1 + w)``, so 0 is the
identity scale; MODEL_FACTS.md, "Norms"), a GDN output norm (plain ``w``) 1.

For training a draft on a checkpoint that ships none, or from scratch. Values depend on
``seed`` and the tensor's canonical name only (as in
:mod:`mtp_jax.models.qwen3_5.random_checkpoint`, whose init differs: it makes tame random
benchmark weights, not a trainable start).
"""

from __future__ import annotations

import zlib

import numpy as np

from mtp_jax.config import ConfigError, config_dict
from mtp_jax.train.export import mtp_tensor_shapes

__all__ = ["DEFAULT_INITIALIZER_RANGE", "read_initializer_range", "fresh_draft_tensors"]

DEFAULT_INITIALIZER_RANGE = 0.02  # HF PretrainedConfig's default


def read_initializer_range(config: dict | str) -> float:
    """``initializer_range`` of an HF config (a dict, ``config.json`` or a checkpoint folder):
    the text config's, else the top level's, else :data:`DEFAULT_INITIALIZER_RANGE`. Raises
    :class:`ConfigError` for a value that is not a positive number."""
    raw = config_dict(config)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    value = text.get("initializer_range", raw.get("initializer_range",
                                                  DEFAULT_INITIALIZER_RANGE))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"config.json key 'initializer_range' is {value!r}; expected a "
                          f"positive number (HF's default is {DEFAULT_INITIALIZER_RANGE}).")
    return float(value)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8"))])


def fresh_draft_tensors(cfg, seed: int = 0, *,
                        initializer_range: float | None = None) -> dict[str, np.ndarray]:
    """Canonical ``mtp.*`` name -> float32 array of a new head for ``cfg`` (one MTP layer when
    ``cfg`` declares none; names and shapes :func:`mtp_jax.train.export.mtp_tensor_shapes`).

    ``initializer_range``: the std of the matrices; default ``cfg.initializer_range`` when the
    config class has one, else 0.02 (:func:`read_initializer_range` reads it from the
    checkpoint's config.json). Raises ``ValueError`` for a 1-D tensor that is not a norm (no
    rule for it) or a std that is not positive.
    """
    std = initializer_range
    if std is None:
        std = getattr(cfg, "initializer_range", DEFAULT_INITIALIZER_RANGE)
    if not std > 0:
        raise ValueError(f"initializer_range {std!r} must be positive.")
    out = {}
    for name, shape in mtp_tensor_shapes(cfg).items():
        if len(shape) >= 2:
            a = _rng(seed, name).standard_normal(shape, dtype=np.float32) * np.float32(std)
        elif name.endswith("linear_attn.norm.weight"):
            a = np.ones(shape, np.float32)
        elif name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]:
            a = np.zeros(shape, np.float32)
        else:
            raise ValueError(f"no init rule for the 1-D tensor {name!r} {list(shape)}; add one "
                             "in mtp_jax/train/fresh.py.")
        out[name] = a
    return out
