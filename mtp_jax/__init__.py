"""mtp_jax: a JAX/Flax/Pallas inference engine for Qwen3.5-family models and
Qwen3.8-Flash-Next with MTP speculative decoding.

Public API: :class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput` (engine level) and
:func:`load_model` (research level: ``forward`` / ``mtp_forward`` functions). The map of the
package is docs/design.md.
"""

from mtp_jax.config import ConfigError, EngineConfig, ModelConfig, SpeculativeConfig
from mtp_jax.models.loaded import LoadedModel
from mtp_jax.models.loader import load_model

__all__ = ["ConfigError", "EngineConfig", "LoadedModel", "ModelConfig", "SpeculativeConfig",
           "load_model", "LLM", "SamplingParams", "RequestOutput", "StreamOutput"]


def __getattr__(name):
    # The face is imported on first use: `import mtp_jax` for load_model stays light.
    if name in ("LLM", "SamplingParams", "RequestOutput", "StreamOutput"):
        from mtp_jax import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'mtp_jax' has no attribute {name!r}")
