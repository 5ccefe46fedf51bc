"""Plain next-token training of a loaded model's target parameters, to make trained fixtures.

A random target's greedy continuations are chaotic, so nothing an MTP head could learn from them;
this trains the target itself first (tests/fixtures/make_trained_fixture.py,
``python -m mtp_jax.tools.train_default_model``). It is a fixture tool, not a user feature.

The model is a :class:`~mtp_jax.models.loaded.LoadedModel` loaded for training: float32,
``merge_projections=False`` (one parameter per checkpoint tensor, so trained parameters map back
to their names) and every kernel backend ``"xla"``::

    m = mtp_jax.load_model(path, dtype="float32", merge_projections=False, with_mtp=False,
                           attention_backend="xla", gdn_backend="xla", moe_backend="xla",
                           norm_backend="xla", gemv_backend="xla")
    params = train_target(m, batches, steps=300)
    logits, _ = m.forward(ids, params=params)
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mtp_jax.models.params import param_name

__all__ = ["next_token_loss", "split_trainable", "train_target"]


def next_token_loss(logits, ids, lengths):
    """Mean cross-entropy and greedy accuracy of next-token predictions over the real rows.

    Args: ``logits [B, T, V]`` float32 (row t scores token t+1), ``ids [B, T]`` int,
    ``lengths [B]`` int (row b's tokens are ``ids[b, :lengths[b]]``; the rest is padding).
    Returns: ``(loss, accuracy)`` float32 scalars over the ``sum(lengths - 1)`` predicted
    tokens (0 when there are none); a prediction counts as right when the label's logit is the
    row's largest (ties included).
    """
    # Rolled labels with the last row masked, not logits[:, :-1]: slicing copies [B, T, V].
    labels = jnp.roll(ids, -1, axis=1)
    mask = (jnp.arange(ids.shape[1])[None, :] + 1 < lengths[:, None]).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    hit = (label_logit >= logits.max(axis=-1)).astype(jnp.float32)  # cheaper than argmax on CPU
    n = jnp.maximum(mask.sum(), 1.0)
    return (ce * mask).sum() / n, (hit * mask).sum() / n


def split_trainable(params: nnx.State, trainable: Callable[[str], bool]):
    """``(train, frozen)`` nnx States of ``params`` by canonical name
    (``trainable("layers.3.self_attn.q_proj.weight") -> bool``); ``nnx.merge_state(train,
    frozen)`` gives ``params`` back. Only ``nnx.Param`` leaves train: other variables (e.g.
    qwen4_exp's device n-gram tables, :class:`~mtp_jax.models.qwen4_exp.ple_device.PLETable`)
    stay frozen. Raises ``ValueError`` when nothing is trainable."""
    train, frozen = nnx.split_state(
        params, lambda path, v: isinstance(v, nnx.Param) and bool(trainable(param_name(path))),
        ...)
    if not jax.tree.leaves(train):
        raise ValueError("trainable() selected no parameter; names look like "
                         "'layers.3.self_attn.q_proj.weight', 'norm.weight', 'lm_head.weight'.")
    return train, frozen


def _batch_stream(batches, steps: int, seed: int):
    """``batches`` as an iterator of ``steps`` items: a list/tuple is cycled, each pass in an
    order shuffled by ``seed``; any other iterable is consumed as it comes."""
    if not isinstance(batches, (list, tuple)) or not batches:
        return itertools.islice(iter(batches), steps)
    rng = np.random.default_rng(seed)
    order = itertools.chain.from_iterable(rng.permutation(len(batches))
                                          for _ in range(-(-steps // len(batches))))
    return (batches[i] for i in itertools.islice(order, steps))


def train_target(model, batches: Iterable, steps: int, *, lr: float = 3e-3,
                 warmup: int | None = None, weight_decay: float = 0.01, clip: float = 1.0,
                 trainable: Callable[[str], bool] = lambda name: True, seed: int = 0,
                 loss: Callable | None = None, log_every: int | None = None,
                 log: Callable[[str], None] = print) -> nnx.State:
    """Train ``model``'s target parameters by next-token cross-entropy; returns the new params.

    Args:
      model: a float32 :class:`~mtp_jax.models.loaded.LoadedModel` (see the module docstring);
        it is not changed.
      batches: ``(ids [B, T] int32, lengths [B] int32)`` pairs, ``steps`` of them (a list or
        tuple of pairs is cycled, each pass in an order shuffled by ``seed``). Keep ``[B, T]``
        fixed: each new shape compiles the step again.
      steps: optimizer steps. ``lr``: peak AdamW learning rate, reached after ``warmup`` steps
        (default ``steps // 10``) of linear warm-up, then cosine decay to ``lr / 10``.
        ``weight_decay``: AdamW's. ``clip``: global gradient norm limit.
      trainable: which parameters train, by canonical name; the rest stay as loaded.
      seed: the order of a cycled list of batches, and the PRNG key passed to ``loss``
        (``fold_in(key(seed), step)``).
      loss: ``loss(params, ids, lengths, key) -> (loss, accuracy)`` float32 scalars, traced
        inside the step (``params``: the full nnx State); default :func:`next_token_loss` of
        ``model.forward``'s logits over the whole vocabulary.
      log_every: print ``step, loss, accuracy`` every this many steps (default ``steps // 20``)
        through ``log``.
    Returns: an :class:`nnx.State` shaped like ``model.params`` (the trained parameters merged
      with the frozen ones): pass it as ``model.forward(ids, params=...)``, or
      ``dataclasses.replace(model, params=...)``; ``.to_pure_dict()`` gives nested dicts.
    Raises: ``ValueError`` for a model that is not float32, no trainable parameter, or
      ``batches`` that run out before ``steps``.
    """
    if model.dtype != "float32":
        raise ValueError(f"train_target trains in float32; the model was loaded as "
                         f"{model.dtype!r}: load it with dtype='float32'.")
    warmup = max(1, steps // 10) if warmup is None else warmup
    log_every = max(1, steps // 20) if log_every is None else log_every
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1),
                                                  end_value=lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(clip),
                     optax.adamw(schedule, weight_decay=weight_decay))
    train, frozen = split_trainable(model.params, trainable)
    # Copies: the step donates its inputs, and the model's own arrays must survive.
    train = jax.tree.map(jnp.copy, train)
    opt_state = tx.init(train)

    if loss is None:
        def loss(params, ids, lengths, key):
            return next_token_loss(model.forward(ids, params=params)[0], ids, lengths)

    # frozen is an argument, not a closure: closed over, it would be baked into the program.
    def _step(train, frozen, opt_state, ids, lengths, key):
        value_and_grad = jax.value_and_grad(
            lambda t: loss(nnx.merge_state(t, frozen), ids, lengths, key), has_aux=True)
        (value, acc), grads = value_and_grad(train)
        updates, opt_state = tx.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state, value, acc

    step_fn = jax.jit(_step, donate_argnums=(0, 2))
    key = jax.random.key(seed)
    start, done = time.perf_counter(), 0
    for i, (ids, lengths) in enumerate(_batch_stream(batches, steps, seed)):
        ids, lengths = jnp.asarray(ids, jnp.int32), jnp.asarray(lengths, jnp.int32)
        train, opt_state, value, acc = step_fn(train, frozen, opt_state, ids, lengths,
                                               jax.random.fold_in(key, i))
        done = i + 1
        if done % log_every == 0 or done == steps or i == 0:
            log(f"[train_target] step {done}/{steps}  loss {float(value):.4f}  "
                f"acc {float(acc):.4f}  lr {float(schedule(i)):.2e}  "
                f"{time.perf_counter() - start:.1f}s")
    if done < steps:
        raise ValueError(f"batches ran out after {done} of {steps} steps; pass at least "
                         f"{steps} batches, or a list (cycled).")
    return nnx.merge_state(train, frozen)
