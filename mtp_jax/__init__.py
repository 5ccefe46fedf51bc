"""mtp_jax: a JAX/Flax/Pallas inference engine for Qwen3.5-family models with MTP speculative
decoding.

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput` (engine level) and
:func:`load_model` (research level: ``forward`` / ``mtp_forward`` functions).
"""

from mtp_jax.config import ConfigError, EngineConfig, ModelConfig, SpecConfig
from mtp_jax.models.loader import LoadedModel, load_model

__all__ = ["ConfigError", "EngineConfig", "LoadedModel", "ModelConfig", "SpecConfig",
           "load_model", "LLM", "SamplingParams", "RequestOutput", "StreamOutput"]


def __getattr__(name):
    if name in ("LLM", "SamplingParams", "RequestOutput", "StreamOutput"):
        from mtp_jax.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'mtp_jax' has no attribute {name!r}")
