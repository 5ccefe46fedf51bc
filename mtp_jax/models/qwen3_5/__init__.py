"""Qwen3.5 dense (``qwen3_5``) and MoE (``qwen3_5_moe``) target model and MTP draft."""

from mtp_jax.models.qwen3_5.model import DecoderLayer, Qwen35Model
from mtp_jax.models.qwen3_5.mtp import MTPDraft

__all__ = ["DecoderLayer", "MTPDraft", "Qwen35Model"]
