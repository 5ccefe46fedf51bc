"""Qwen3.8-Flash-Next (``qwen4_exp``): hyper-connections, QSA, PLE, MTP draft, weight names,
loader and registry entry (:mod:`~mtp_jax.models.qwen4_exp.entry`)."""

from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.models.qwen4_exp.loader import LoadedQwen4Exp, load_qwen4_exp

__all__ = ["LoadedQwen4Exp", "Qwen4ExpConfig", "load_qwen4_exp"]
