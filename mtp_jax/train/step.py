"""One jitted train step (and eval step) of the MTP draft against the frozen target.

Per batch of token rows ``ids [B, T]`` with ``lengths [B]``:

1. the target's forward (its own dtype, no gradient): hidden after the final norm, and its
   greedy token per row (chunked through the LM head, :func:`mtp_jax.train.loss.target_greedy`);
2. the family's draft chain teacher-forced as the round runs it (``entry.draft_chain``): k
   steps, step j of the chain started at row t predicting token t+j+2;
3. per step the loss to the target's token (``ce``) or distribution (``kl``), over rows with
   ``t + j + 1 < length``; the total is the weighted mean over steps.

The draft's float32 master weights, the optimizer state and the step count form
:class:`TrainState`, donated to the step. Optimizer (optax): AdamW with linear warm-up then
cosine decay, after global-norm clipping.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mtp_jax.train.loss import head_loss, target_greedy
from mtp_jax.train.params import DraftParams

__all__ = ["TrainState", "StepSettings", "make_optimizer", "init_state", "make_steps"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """``step`` (int32 scalar), ``params`` ({canonical name: float32 array} of the draft),
    ``opt_state`` (optax)."""

    step: jax.Array
    params: dict
    opt_state: object


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What a step computes (static).

    Attributes:
      k: chain steps trained (``speculative_num_steps``), >= 1.
      loss: ``"ce"`` or ``"kl"`` (:mod:`mtp_jax.train.loss`).
      step_decay: weight of chain step j is ``step_decay ** j`` (normalised to sum 1).
      chunk: rows per LM-head call in the losses.
    """

    k: int = 3
    loss: str = "ce"
    step_decay: float = 1.0
    chunk: int = 1024

    def weights(self) -> jnp.ndarray:
        w = jnp.asarray([self.step_decay ** j for j in range(self.k)], jnp.float32)
        return w / jnp.sum(w)


def make_optimizer(lr: float, total_steps: int, warmup_steps: int, weight_decay: float = 0.01,
                   clip_norm: float = 1.0) -> optax.GradientTransformation:
    """AdamW (b2 0.95) with ``warmup_steps`` linear warm-up to ``lr`` then cosine decay to 10% of
    it at ``total_steps``, after clipping the global gradient norm to ``clip_norm``."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(1, warmup_steps), max(total_steps, warmup_steps + 1), end_value=lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))


def init_state(flat: dict, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh :class:`TrainState` from the draft's float32 weights (copied: the train step
    donates the state)."""
    flat = jax.tree.map(jnp.copy, flat)
    return TrainState(jnp.zeros((), jnp.int32), flat, optimizer.init(flat))


def _losses(flat, frozen, ids, lengths, *, model, draft: DraftParams, chain, settings):
    """``(total loss, (loss [k], hits [k], count [k]))`` of one batch."""
    module = nnx.merge(model.graphdef, frozen, draft.to_state(flat))
    full = nnx.state(module)
    _, hidden = model.forward_program(model.graphdef, full, ids)
    hidden = jax.lax.stop_gradient(hidden)
    b, t = ids.shape
    greedy = target_greedy(module.logits, hidden, settings.chunk)
    zs = chain(module, hidden, ids, settings.k)
    rows = jnp.arange(t)[None, :]
    out = []
    for j, z in enumerate(zs):
        n = j + 1  # the label's row: t + j + 1
        labels = jnp.pad(greedy[:, n:], ((0, 0), (0, n)))
        mask = rows + n < lengths[:, None]
        th = None
        if settings.loss == "kl":
            th = jnp.pad(hidden[:, n:], ((0, 0), (0, n), (0, 0))).reshape(b * t, -1)
        out.append(head_loss(module.logits, z.reshape(b * t, -1), labels.reshape(-1),
                             mask.reshape(-1), settings.loss, settings.chunk, th))
    loss, hits, count = (jnp.stack(x) for x in zip(*out))
    mean = loss / jnp.maximum(count, 1.0)
    return jnp.sum(settings.weights() * mean), (mean, hits, count)


def make_steps(model, entry, draft: DraftParams, settings: StepSettings,
               optimizer: optax.GradientTransformation):
    """``(train_step, eval_step)``, jitted.

    ``train_step(state, frozen, ids [B, T] int32, lengths [B] int32) -> (state, metrics)``
    donates ``state``; ``eval_step(params, frozen, ids, lengths) -> metrics``. ``metrics``:
    ``loss`` (weighted total), ``step_loss [k]``, ``hits [k]``, ``count [k]`` (rows scored per
    chain step; top-1 accuracy = hits / count).
    """
    losses = functools.partial(_losses, model=model, draft=draft, chain=entry.draft_chain,
                               settings=settings)

    def train(state: TrainState, frozen, ids, lengths):
        (total, (mean, hits, count)), grads = jax.value_and_grad(losses, has_aux=True)(
            state.params, frozen, ids, lengths)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": total, "step_loss": mean, "hits": hits, "count": count,
                   "grad_norm": optax.global_norm(grads)}
        return TrainState(state.step + 1, params, opt_state), metrics

    def evaluate(params, frozen, ids, lengths):
        total, (mean, hits, count) = losses(params, frozen, ids, lengths)
        return {"loss": total, "step_loss": mean, "hits": hits, "count": count}

    return jax.jit(train, donate_argnums=(0,)), jax.jit(evaluate)
