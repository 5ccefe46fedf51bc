"""mtp_jax: a JAX/Flax/Pallas inference engine for Qwen3.5-family models and
Qwen3.8-Flash-Next with MTP speculative decoding.

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput` (engine level) and
:func:`load_model` (research level: ``forward`` / ``mtp_forward`` functions). The map of the
package is docs/design.md.

Every name is imported on first use (PEP 562): ``import mtp_jax`` itself imports neither jax
nor flax, so ``python -m mtp_jax.generate`` parses (and refuses) its flags before jax loads,
and a Ctrl-C while the engine imports is the CLI's, not a traceback.
"""

__all__ = ["ConfigError", "EngineConfig", "LoadedModel", "ModelConfig", "SpeculativeConfig",
           "load_model", "LLM", "SamplingParams", "RequestOutput", "StreamOutput"]

_HOMES = {  # public name -> the module that defines it
    "ConfigError": "mtp_jax.config", "EngineConfig": "mtp_jax.config",
    "ModelConfig": "mtp_jax.config", "SpeculativeConfig": "mtp_jax.config",
    "LoadedModel": "mtp_jax.models.loaded", "load_model": "mtp_jax.models.loader",
    "LLM": "mtp_jax.llm", "SamplingParams": "mtp_jax.llm", "RequestOutput": "mtp_jax.llm",
    "StreamOutput": "mtp_jax.llm",
}


def __getattr__(name):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'mtp_jax' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
