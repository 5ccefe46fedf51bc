"""Settings checks and the model a training run starts from (the target, frozen, and its draft:
the checkpoint's own ``mtp.*`` layer or a fresh one)."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from mtp_jax.config import ConfigError
from mtp_jax.models.checks import read_model_config
from mtp_jax.models.registry import entry_of

__all__ = ["TrainSettings", "checkpoint_dir", "check_settings", "check_model",
           "load_for_training"]

XLA = dict(attention_backend="xla", gdn_backend="xla", moe_backend="xla", norm_backend="xla",
           gemv_backend="xla")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """A run's settings (the CLI's flags; ``docs/train.md``)."""

    model: str
    out: str
    data: str | None = None
    self_generate: int = 0
    generate_tokens: int = 256
    generate_temperature: float = 0.0
    k: int = 3
    loss: str = "ce"
    step_decay: float = 1.0
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    eval_fraction: float = 0.05
    eval_every: int = 200
    checkpoint_dir: str | None = None
    checkpoint_every: int = 200
    resume: bool = False
    fresh_head: bool = False
    draft_only: bool = False
    dtype: str | None = "auto"
    seed: int = 0
    chunk: int = 1024

    def run_key(self) -> dict:
        """The settings a resumed run must share with the saved one."""
        keys = ("model", "data", "self_generate", "generate_tokens", "generate_temperature",
                "k", "loss", "step_decay", "steps", "batch_size", "seq_len", "lr",
                "warmup_steps", "weight_decay", "clip_norm", "eval_fraction", "fresh_head",
                "seed")
        return {k: getattr(self, k) for k in keys}


def _positive(name: str, flag: str, value, minimum=1) -> None:
    if not isinstance(value, (int, float)) or value < minimum:
        raise ConfigError(f"{name} ({flag}) is {value!r}; it must be >= {minimum}.")


def checkpoint_dir(s: TrainSettings) -> str:
    """Where the run's train states go: ``--checkpoint-dir``, default ``OUT.train``."""
    return os.path.abspath(s.checkpoint_dir or s.out.rstrip("/") + ".train")


def check_settings(s: TrainSettings) -> None:
    """Every setting that can be checked without the model; raises :class:`ConfigError`
    naming the value and the fix."""
    from mtp_jax.train.loss import LOSSES

    if s.data is None and not s.self_generate:
        raise ConfigError("no training data: pass --data FILE.jsonl (texts, prompts or token "
                          "ids), and/or --self-generate N to continue N of its prompts with "
                          "the target itself.")
    if s.data is not None and not os.path.isfile(s.data):
        raise ConfigError(f"--data {s.data!r} is not a file; pass a JSONL file.")
    if s.self_generate and s.data is None:
        raise ConfigError(f"--self-generate {s.self_generate} continues prompts, but no --data "
                          "file gives them; pass --data PROMPTS.jsonl.")
    if s.loss not in LOSSES:
        raise ConfigError(f"--loss {s.loss!r} is unknown; use one of {', '.join(LOSSES)}.")
    for name, flag, minimum in (("k", "--speculative-num-steps", 1), ("steps", "--steps", 1),
                                ("batch_size", "--batch-size", 1),
                                ("eval_every", "--eval-every", 1),
                                ("checkpoint_every", "--checkpoint-every", 1),
                                ("chunk", "--chunk", 1), ("self_generate", "--self-generate", 0),
                                ("generate_tokens", "--generate-tokens", 1),
                                ("warmup_steps", "--warmup-steps", 0)):
        _positive(name, flag, getattr(s, name), minimum)
    if s.seq_len < s.k + 3:
        raise ConfigError(f"--seq-len {s.seq_len} is too short for --speculative-num-steps "
                          f"{s.k}: a row needs k + 3 = {s.k + 3} tokens to score every chain "
                          "step; raise --seq-len.")
    for name, flag, value in (("lr", "--lr", s.lr), ("clip_norm", "--clip-norm", s.clip_norm)):
        if not value > 0:
            raise ConfigError(f"{name} ({flag}) is {value!r}; it must be > 0.")
    if not 0 <= s.eval_fraction < 1:
        raise ConfigError(f"--eval-fraction {s.eval_fraction!r} must be in [0, 1).")
    if not 0 < s.step_decay <= 1:
        raise ConfigError(f"--step-decay {s.step_decay!r} must be in (0, 1].")
    if s.generate_temperature < 0:
        raise ConfigError(f"--generate-temperature {s.generate_temperature!r} must be >= 0.")
    if os.path.exists(s.out) and (not os.path.isdir(s.out) or os.listdir(s.out)):
        raise ConfigError(
            f"--out {s.out!r} exists and is not an empty folder; pass a new path (the trained "
            "checkpoint is written there). To continue a finished run's saved train state, pass "
            f"a new --out with --resume --checkpoint-dir {checkpoint_dir(s)!r} (and more --steps "
            "only if the saved run had them: other settings are refused).")


def check_model(s: TrainSettings):
    """The checkpoint's config, checked for training (before weights load): its family must
    have a trainable draft chain with one MTP layer. Returns ``(cfg, entry)``."""
    cfg = read_model_config(s.model, mtp=True)
    entry = entry_of(cfg)
    if entry.draft_chain is None:
        raise ConfigError(f"{s.model!r} is a {cfg.model_type} checkpoint; training its MTP draft "
                          f"is not supported yet (the trainer has no teacher-forced chain for "
                          "this family). Train a qwen3_5 or qwen3_5_moe checkpoint.")
    n = cfg.mtp_num_hidden_layers
    if n > 1:
        raise ConfigError(f"{s.model!r} has mtp_num_hidden_layers={n}; the trainer trains one "
                          "MTP layer (every released checkpoint has one), since with several the "
                          "round's later steps read draft KV left by earlier rounds.")
    return cfg, entry


def load_for_training(s: TrainSettings, cfg):
    """The model with its draft, every op on XLA (differentiable), one parameter per tensor.

    The checkpoint's own draft, unless it has none or ``s.fresh_head``: then a fresh head
    (:func:`mtp_jax.train.fresh.fresh_draft_tensors`) is written to a temporary draft folder
    and read from there. Returns ``(model, fresh)``."""
    import mtp_jax
    from mtp_jax.train.export import write_draft_checkpoint
    from mtp_jax.train.fresh import fresh_draft_tensors, read_initializer_range

    fresh = s.fresh_head or not cfg.has_mtp
    if not fresh:
        # Training reads and updates the draft's float weights: a quantized checkpoint is
        # dequantized at load (docs/quantization.md).
        return mtp_jax.load_model(s.model, s.dtype, with_mtp=True, merge_projections=False,
                                  quantization="dequantize", **XLA), False
    with tempfile.TemporaryDirectory(prefix="mtp_jax-fresh-head-") as tmp:
        folder = os.path.join(tmp, "draft")
        tensors = fresh_draft_tensors(cfg, s.seed,
                                      initializer_range=read_initializer_range(s.model))
        write_draft_checkpoint(s.model, cfg, tensors, folder, draft_only=True)
        return mtp_jax.load_model(s.model, s.dtype, with_mtp=True, draft_path=folder,
                                  merge_projections=False, quantization="dequantize",
                                  **XLA), True
