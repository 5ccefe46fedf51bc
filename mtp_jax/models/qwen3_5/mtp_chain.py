"""The MTP draft chain, teacher-forced over whole sequences, as the engine's round runs it.

In a round (:mod:`mtp_jax.speculative.mtp`), with ``t`` the last committed row of a request:

    step 0   row t: (target hidden h_t, token x_{t+1}) at position t          -> z_0, predicts x_{t+2}
             it attends to the draft KV of rows 0..t, all written by step-0 rows (the prompt's
             draft extend and each round's extend over its verify rows)
    step j   (z_{j-1}, token x_{t+j+1}) at position t+j                         -> z_j, predicts x_{t+j+2}
             it attends to the step-0 KV of rows 0..t and to the KV that steps 1..j of the same
             chain wrote at positions t+1..t+j (its own included)

Training (:mod:`mtp_jax.train`) runs every row t of a sequence as a chain start at once: step 0 is causal attention over
the sequence; step j adds, per row, the j keys of its own chain. Tokens are teacher-forced (the
data's, which are the target's own when the data is self-generated), so a trained head's drafts are
exactly what the round drafts on that text.

The draft layer is the family's own module (``model.mtp``: ``fc``, its norms, one full-attention
decoder layer, ``norm``); only the attention's key set differs from a plain forward, so this module
calls the layer's pieces (projections, rotary, gated output, MLP) and does the attention itself, in
float32, with XLA (differentiable; no kernel backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["draft_inputs", "chain_attention", "draft_chain"]


def draft_inputs(mtp, embed, hidden: jax.Array, next_ids: jax.Array) -> jax.Array:
    """``fc(concat(pre_fc_norm_embedding(embed(next_ids)), pre_fc_norm_hidden(hidden)))``:
    ``hidden [B, T, H]``, ``next_ids [B, T]`` int32 -> ``[B, T, H]`` (MODEL_FACTS.md, MTP)."""
    e = mtp.pre_fc_norm_embedding(embed(next_ids))
    h = mtp.pre_fc_norm_hidden(hidden.astype(e.dtype))
    return mtp.fc(jnp.concatenate([e, h], axis=-1))


def chain_attention(q, k0, v0, own_k, own_v, scale: float) -> jax.Array:
    """Attention of chain step j over the round's key set.

    Args:
      q: ``[B, T, Hq, D]`` the step's queries (row t = the chain started at row t).
      k0, v0: ``[B, T, Hkv, D]`` step-0 keys/values at positions 0..T-1; row t sees ``s <= t``.
      own_k, own_v: lists of j arrays ``[B, T, Hkv, D]``, row t's own chain keys (steps 1..j).
      scale: the softmax scale (``head_dim ** -0.5``).
    Returns: ``[B, T, Hq, D]`` in ``q.dtype`` (scores and softmax in float32; GQA by groups).
    """
    b, t, hq, d = q.shape
    hkv = k0.shape[2]
    f32 = jnp.float32
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(f32)
    s0 = jnp.einsum("btkgd,bskd->btkgs", qg, k0.astype(f32)) * scale
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [t (query row), s]
    s0 = jnp.where(causal[None, :, None, None, :], s0, -jnp.inf)
    own = [jnp.einsum("btkgd,btkd->btkg", qg, kj.astype(f32))[..., None] * scale
           for kj in own_k]
    p = jax.nn.softmax(jnp.concatenate([s0, *own], axis=-1), axis=-1)
    o = jnp.einsum("btkgs,bskd->btkgd", p[..., :t], v0.astype(f32))
    for i, vj in enumerate(own_v):
        o = o + p[..., t + i:t + i + 1] * vj.astype(f32)[:, :, :, None, :]
    return o.reshape(b, t, hq, d).astype(q.dtype)


def _layer_step(mtp, layer, u, positions, k0, v0, own_k, own_v):
    """One draft decoder layer on inputs ``u [B, T, H]`` at ``positions [B, T]``; returns
    ``(z after mtp.norm, k, v)`` of these rows. ``k0 is None``: this is step 0 (its own keys
    are the step-0 keys)."""
    attn = layer.self_attn
    x, hn = layer.input_layernorm.add_norm(u, None)
    q, gate, k, v = attn.project(hn, positions)
    if k0 is None:
        o = chain_attention(q, k, v, [], [], attn.head_dim ** -0.5)
    else:
        o = chain_attention(q, k0, v0, [*own_k, k], [*own_v, v], attn.head_dim ** -0.5)
    h, hn = layer.post_attention_layernorm.add_norm(x, attn.gated_output(o, gate))
    return mtp.norm.add_norm(h, layer.mlp(hn))[1], k, v


def shifted(ids: jax.Array, n: int) -> jax.Array:
    """``ids[:, t + n]`` per row t, zero past the end: ``[B, T]`` -> ``[B, T]``."""
    return jnp.pad(ids[:, n:], ((0, 0), (0, n)))


def draft_chain(module, hidden: jax.Array, ids: jax.Array, k: int) -> list[jax.Array]:
    """The draft chain of every row, teacher-forced.

    Args:
      module: the merged nnx model (``module.mtp``, ``module.embed_tokens``); its draft has
        one layer (checked by the caller).
      hidden: ``[B, T, H]`` the target's hidden after the final norm.
      ids: ``[B, T]`` int32 token ids of the rows.
      k: chain steps (``speculative_num_steps``), >= 1.
    Returns: ``k`` arrays ``z_j [B, T, H]`` (after ``mtp.norm``): row t of ``z_j`` is the draft's
    hidden for token ``t + j + 2`` (valid where ``t + j + 1 < length``).
    """
    mtp, embed = module.mtp, module.embed_tokens
    layer = mtp.layers[0]
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    z, k0, v0 = _layer_step(mtp, layer, draft_inputs(mtp, embed, hidden, shifted(ids, 1)),
                            pos, None, None, [], [])
    zs, own_k, own_v = [z], [], []
    for j in range(1, k):
        u = draft_inputs(mtp, embed, z, shifted(ids, j + 1))
        z, kj, vj = _layer_step(mtp, layer, u, pos + j, k0, v0, own_k, own_v)
        own_k.append(kj)
        own_v.append(vj)
        zs.append(z)
    return zs
