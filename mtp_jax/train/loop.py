"""The training loop: steps, a progress bar, eval passes and resumable checkpoints."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import numpy as np
from tqdm import tqdm

__all__ = ["Metrics", "evaluate", "train"]


@dataclasses.dataclass
class Metrics:
    """Summed over batches: ``loss`` (weighted total x batches), ``hits`` / ``count`` per chain
    step (teacher-forced top-1 accuracy = hits / count), ``batches``, ``tokens`` (real tokens
    through the target), ``seconds``."""

    k: int
    loss: float = 0.0
    hits: np.ndarray = None
    count: np.ndarray = None
    batches: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def __post_init__(self):
        self.hits = np.zeros(self.k) if self.hits is None else self.hits
        self.count = np.zeros(self.k) if self.count is None else self.count

    def add(self, m: dict, tokens: int) -> None:
        self.loss += float(m["loss"])
        self.hits = self.hits + np.asarray(m["hits"])
        self.count = self.count + np.asarray(m["count"])
        self.batches += 1
        self.tokens += tokens

    @property
    def mean_loss(self) -> float:
        return self.loss / max(self.batches, 1)

    @property
    def accuracy(self) -> np.ndarray:
        """Teacher-forced top-1 accuracy per chain step ``[k]``."""
        return self.hits / np.maximum(self.count, 1)

    def text(self) -> str:
        acc = "/".join(f"{a:.2f}" for a in self.accuracy)
        return f"loss {self.mean_loss:.4f} acc@step {acc}"

    def as_dict(self) -> dict:
        return {"loss": self.mean_loss, "accuracy": [float(a) for a in self.accuracy],
                "batches": self.batches, "tokens": self.tokens, "seconds": self.seconds}


def evaluate(eval_step: Callable, params, frozen, batches, k: int) -> Metrics:
    """One pass of ``eval_step`` over ``batches`` (iterable of ``(ids, lengths)``)."""
    out = Metrics(k)
    t0 = time.perf_counter()
    for ids, lengths in batches:
        out.add(eval_step(params, frozen, ids, lengths), int(np.sum(lengths)))
    out.seconds = time.perf_counter() - t0
    return out


def train(state, train_step: Callable, frozen, batches, *, steps: int, k: int,
          on_interval: Callable | None = None, interval: int = 0, log_every: int = 10):
    """Run ``train_step`` until ``state.step == steps``.

    Args:
      state: the :class:`~mtp_jax.train.step.TrainState` (donated to each step).
      batches: an iterator of ``(ids [B, T], lengths [B])`` numpy arrays, endless.
      on_interval: called as ``on_interval(state, step)`` every ``interval`` steps and after
        the last (eval passes, checkpoints).
      log_every: steps per progress-bar update of the running loss and accuracies.
    Returns: ``(state, Metrics of the whole run)``; ``Metrics.seconds`` excludes the first
    step (compilation).
    """
    done = int(state.step)
    total, window = Metrics(k), Metrics(k)
    t_start = None
    with tqdm(total=steps, initial=done, desc="train", unit="step", disable=None) as bar:
        while done < steps:
            ids, lengths = next(batches)
            state, m = train_step(state, frozen, ids, lengths)
            m = jax.device_get(m)
            n = int(np.sum(lengths))
            done += 1
            if t_start is None:  # the first step compiled; time from its end
                t_start = time.perf_counter()
            else:
                total.add(m, n)
            window.add(m, n)
            if done % log_every == 0 or done == steps:
                bar.set_postfix_str(window.text())
                window = Metrics(k)
            bar.update(1)
            if on_interval is not None and (interval and done % interval == 0 or done == steps):
                on_interval(state, done)
    total.seconds = time.perf_counter() - t_start if t_start is not None else 0.0
    return state, total
