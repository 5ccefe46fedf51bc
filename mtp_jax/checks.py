"""Config-time checks: everything that can be refused before a weight is read.

:func:`check_before_load` is the one gate that every entry point goes through
(``python -m mtp_jax.generate`` via ``LLM``, ``LLM``, the bench; ``load_model`` runs its
model-side part, :mod:`mtp_jax.models.checks`). It reads at most ``config.json`` files, a GGUF
header, a token map and the tensor names of a separate draft folder (its index or its
safetensors headers), never tensor data, and raises :class:`ConfigError` with a message that
names the bad value, what is supported and the fix. In order:

1. the settings alone (:func:`check_settings`): algorithm, ``speculative_num_steps`` 1..8 (0
   too with speculation off), a draft path or draft options with speculation off, engine
   sizing, MTP with dummy (random) weights, a proposer with the wrong algorithm;
2. the target (:func:`mtp_jax.models.checks.read_model_config`): a GGUF file, ``config.json``
   (missing, unreadable, unknown ``model_type``);
3. the family (:func:`mtp_jax.models.checks.check_family`): a speculative algorithm with no draft
   registered for it, a per-request slot state without a verify handler; an MTP request on a
   config with no MTP layer and no draft path; the reduced draft vocabulary (its size against
   the vocabulary, the token map file); what the engine that serves the family supports;
   what the load asks of it (:func:`mtp_jax.models.checks.check_request`);
4. the draft source: a missing local path (a Hugging Face repo id, ``name`` or ``org/name``,
   passes and is downloaded at load), a GGUF draft, a folder without ``mtp.*`` tensors, a draft
   config whose architecture, hidden size, vocabulary or expert count differs from the target's.

It sits above :mod:`mtp_jax.speculative` (the token map reader) and :mod:`mtp_jax.models` (the
registry) and below the engine and the faces.
"""

from __future__ import annotations

from mtp_jax.config import ConfigError, EngineConfig, SpeculativeConfig, check_scheduler_steps
from mtp_jax.models.checks import (check_draft_folder, check_draft_source, check_family,
                                   check_request, read_model_config)
from mtp_jax.models.entry import LoadRequest
from mtp_jax.speculative.draft_vocab import hot_token_ids

__all__ = ["check_before_load", "check_settings", "check_draft_folder", "check_draft_source",
           "read_model_config", "DUMMY_WEIGHT_MTP_MESSAGE"]

DUMMY_WEIGHT_MTP_MESSAGE = ("MTP reads its draft from the checkpoint, so it cannot run with "
                            "--dummy-weight; use --speculative-algorithm none "
                            "(speculative_algorithm='none') with dummy weights, or drop "
                            "--dummy-weight.")


def check_settings(speculative: SpeculativeConfig, engine: EngineConfig | None = None, *,
                   dummy_weight: bool = False, dummy_draft_ok: bool = False,
                   has_proposer: bool | None = None, vocab_size: int | None = None) -> None:
    """Checks of the settings alone (no weight file is read; a token map file is, with its
    ids checked against ``vocab_size`` when given)."""
    speculative.validate()
    hot_token_ids(speculative.algorithm, speculative.draft_vocab_size,
                  speculative.token_map_path, vocab_size)
    if engine is not None:
        engine.validate()
    if speculative.algorithm == "mtp" and dummy_weight and not dummy_draft_ok:
        raise ConfigError(DUMMY_WEIGHT_MTP_MESSAGE)
    if has_proposer is not None:
        if speculative.algorithm == "external" and not has_proposer:
            raise ConfigError("speculative_algorithm='external' needs a proposer callable "
                              "(request_id, token_ids_so_far, k) -> k token ids, passed as "
                              "LLM(..., proposer=fn); the command line has none, so use mtp or "
                              "none there.")
        if speculative.algorithm != "external" and has_proposer:
            raise ConfigError(f"a proposer was given but speculative_algorithm is "
                              f"{speculative.algorithm!r}; the proposer is only used with "
                              "speculative_algorithm='external'. Pass that, or drop the proposer.")
    if engine is not None:
        check_scheduler_steps(speculative, engine)


def check_before_load(model: str | None, *, speculative: SpeculativeConfig,
                      engine: EngineConfig | None = None, dummy_weight: bool = False,
                      cfg=None, dummy_draft_ok: bool = False, has_proposer: bool | None = None,
                      request: LoadRequest | None = None):
    """Run every config-time check; returns the target's config (its family's config class).

    Args:
      model: the target checkpoint path (may be None when ``cfg`` is given).
      speculative: the speculative settings; engine: the engine sizing (None: not checked).
      dummy_weight: random weights instead of the checkpoint's (refused with MTP unless
        ``dummy_draft_ok``, which benchmarks of random-weight models use).
      cfg: an already parsed config (skips reading ``config.json``).
      has_proposer: whether an external proposer callable was given (None: not checked).
      request: what the load will ask of the family
        (:func:`mtp_jax.models.loader.load_request`; None: not checked).
    Raises:
      ConfigError: the first check that fails; no weight has been read.
    """
    check_settings(speculative, engine, dummy_weight=dummy_weight,
                   dummy_draft_ok=dummy_draft_ok, has_proposer=has_proposer)
    if cfg is None:
        cfg = read_model_config(model, mtp=speculative.algorithm == "mtp",
                                draft_path=speculative.draft_model_path)
    family = check_family(cfg, speculative.algorithm)
    if engine is not None and family.check_engine is not None:
        family.check_engine(cfg, engine, speculative)
    if (speculative.algorithm == "mtp" and not cfg.has_mtp
            and not speculative.draft_model_path and not family.draft_folder):
        raise ConfigError(f"speculative_algorithm='mtp' but the checkpoint's config declares no "
                          f"MTP layer (mtp_num_hidden_layers is 0), and {cfg.model_type} "
                          "checkpoints cannot take their draft from a separate folder yet; use "
                          "speculative_algorithm='none' (--speculative-algorithm none), or a "
                          "checkpoint with its mtp.* layer.")
    speculative.validate(cfg)
    hot_token_ids(speculative.algorithm, speculative.draft_vocab_size,
                  speculative.token_map_path, cfg.vocab_size)
    if request is not None:
        check_request(cfg, request)
    if speculative.algorithm == "mtp" and speculative.draft_model_path:
        check_draft_source(cfg, speculative.draft_model_path, target=model)
    return cfg
