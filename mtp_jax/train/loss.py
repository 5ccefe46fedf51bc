"""Losses of the draft chain against the frozen target, through the LM head in row chunks.

A vocabulary of 248,320 makes ``[rows, V]`` float32 logits the largest tensors of a step (4 GB
for 4,096 rows), so the head, its softmax and the loss run over chunks of rows inside a
rematerialised scan: the backward pass recomputes each chunk's logits instead of keeping them.

Targets (self-distillation): draft step j of the chain started at row t predicts token t+j+2,
the target's next token after row t+j+1:

* ``"ce"``: cross-entropy to the target's own greedy token there (what greedy verification
  accepts);
* ``"kl"``: ``KL(p_target || q_draft)`` to the target's distribution there (temperature 1; what
  rejection sampling accepts in proportion to).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["LOSSES", "target_greedy", "head_loss"]

LOSSES = ("ce", "kl")


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``[N, ...]`` -> ``[ceil(N / chunk), chunk, ...]``, zero-padded."""
    n = x.shape[0]
    pad = -n % chunk
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(-1, chunk, *x.shape[1:])


def target_greedy(head, hidden: jax.Array, chunk: int) -> jax.Array:
    """The target's greedy next token per row: ``hidden [B, T, H]`` (after the final norm) ->
    ``[B, T]`` int32, ``argmax head(hidden)``, without gradient. ``head``: ``[rows, H] ->
    [rows, V]`` float32 logits (the model's ``logits``)."""
    b, t, h = hidden.shape
    xs = _chunks(jax.lax.stop_gradient(hidden).reshape(b * t, h), chunk)
    out = jax.lax.map(lambda c: jnp.argmax(head(c), -1).astype(jnp.int32), xs)
    return out.reshape(-1)[:b * t].reshape(b, t)


def head_loss(head, z: jax.Array, labels: jax.Array, mask: jax.Array, kind: str, chunk: int,
              target_hidden: jax.Array | None = None):
    """Summed loss and top-1 hits of draft rows.

    Args:
      head: ``[rows, H] -> [rows, V]`` float32 logits (the shared, frozen LM head).
      z: ``[N, H]`` draft hidden (after ``mtp.norm``).
      labels: ``[N]`` int32, the target's greedy token (for ``"ce"`` and the hit count).
      mask: ``[N]`` bool, rows that count.
      kind: one of :data:`LOSSES`.
      chunk: rows per head call.
      target_hidden: ``[N, H]`` the target's hidden whose distribution ``"kl"`` matches.
    Returns: ``(loss_sum, hits, count)`` float32 scalars (hits: draft argmax == label).
    Raises: ``ValueError`` for an unknown ``kind`` or ``"kl"`` without ``target_hidden``.
    """
    if kind not in LOSSES:
        raise ValueError(f"loss {kind!r} is unknown; use one of {LOSSES}.")
    if kind == "kl" and target_hidden is None:
        raise ValueError("the 'kl' loss needs the target's hidden states (target_hidden).")
    th = jnp.zeros_like(z) if target_hidden is None else jax.lax.stop_gradient(target_hidden)
    xs = (_chunks(z, chunk), _chunks(labels, chunk), _chunks(mask.astype(jnp.float32), chunk),
          _chunks(th.astype(z.dtype), chunk))

    @jax.checkpoint
    def one(carry, x):
        zc, lc, mc, hc = x
        logp = jax.nn.log_softmax(head(zc), -1)
        if kind == "ce":
            loss = -jnp.take_along_axis(logp, lc[:, None], -1)[:, 0]
        else:
            tlogp = jax.nn.log_softmax(jax.lax.stop_gradient(head(hc)), -1)
            loss = jnp.sum(jnp.exp(tlogp) * (tlogp - logp), -1)
        hits = (jnp.argmax(logp, -1) == lc).astype(jnp.float32)
        return (carry[0] + jnp.sum(loss * mc), carry[1] + jnp.sum(hits * mc),
                carry[2] + jnp.sum(mc)), None

    zero = jnp.zeros((), jnp.float32)
    (loss, hits, count), _ = jax.lax.scan(one, (zero, zero, zero), xs)
    return loss, hits, count
