"""Qwen3.5 dense (``qwen3_5``) and MoE (``qwen3_5_moe``): decoder layer, target model, MTP
draft, loader and registry entries (:mod:`~mtp_jax.models.qwen3_5.entry`)."""

from mtp_jax.models.qwen3_5.decoder import DecoderLayer
from mtp_jax.models.qwen3_5.model import Qwen35Model
from mtp_jax.models.qwen3_5.mtp import MTPDraft

__all__ = ["DecoderLayer", "MTPDraft", "Qwen35Model"]
