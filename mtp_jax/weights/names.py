"""Canonical tensor names and shapes of the Qwen3.5 family.

Canonical names are the HF text-model names without their prefix (``model.language_model.`` in
the released composite checkpoints, ``model.`` in text-only re-exports); ``lm_head.weight`` and
``mtp.*`` are top-level in both. MoE experts are always canonically fused:
``...mlp.experts.gate_up_proj [E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up) and
``...mlp.experts.down_proj [E, H, I]``; readers stack per-expert files into that form.

The same names are the paths of the Flax parameters (``mtp_jax.models.qwen3_5``), so loading is
a name-for-name fill.
"""

from __future__ import annotations

from mtp_jax.config import ModelConfig

Shape = tuple[int, ...]


def attention_tensors(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        f"{p}self_attn.q_proj.weight": (2 * hq * d, h),  # per head [query(D) | gate(D)]
        f"{p}self_attn.k_proj.weight": (hkv * d, h),
        f"{p}self_attn.v_proj.weight": (hkv * d, h),
        f"{p}self_attn.o_proj.weight": (h, hq * d),
        f"{p}self_attn.q_norm.weight": (d,),
        f"{p}self_attn.k_norm.weight": (d,),
    }


def linear_attention_tensors(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    h = cfg.hidden_size
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {
        f"{p}linear_attn.in_proj_qkv.weight": (cfg.linear_conv_dim, h),
        f"{p}linear_attn.in_proj_z.weight": (hv * dv, h),
        f"{p}linear_attn.in_proj_b.weight": (hv, h),
        f"{p}linear_attn.in_proj_a.weight": (hv, h),
        f"{p}linear_attn.conv1d.weight": (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim),
        f"{p}linear_attn.A_log": (hv,),
        f"{p}linear_attn.dt_bias": (hv,),
        f"{p}linear_attn.norm.weight": (dv,),
        f"{p}linear_attn.out_proj.weight": (h, hv * dv),
    }


def mlp_tensors(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    """The dense MLP, or the MoE block with its shared expert (``cfg.is_moe``)."""
    h = cfg.hidden_size
    if not cfg.is_moe:
        i = cfg.intermediate_size
        return {f"{p}mlp.gate_proj.weight": (i, h), f"{p}mlp.up_proj.weight": (i, h),
                f"{p}mlp.down_proj.weight": (h, i)}
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    return {
        f"{p}mlp.gate.weight": (e, h),
        f"{p}mlp.experts.gate_up_proj": (e, 2 * i, h),
        f"{p}mlp.experts.down_proj": (e, h, i),
        f"{p}mlp.shared_expert.gate_proj.weight": (s, h),
        f"{p}mlp.shared_expert.up_proj.weight": (s, h),
        f"{p}mlp.shared_expert.down_proj.weight": (h, s),
        f"{p}mlp.shared_expert_gate.weight": (1, h),
    }


def decoder_layer_tensors(cfg: ModelConfig, p: str, layer_type: str) -> dict[str, Shape]:
    """Tensors of one decoder layer under prefix ``p`` (e.g. ``"layers.3."``)."""
    h = cfg.hidden_size
    out = {f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,)}
    out.update(attention_tensors(cfg, p) if layer_type == "full_attention"
               else linear_attention_tensors(cfg, p))
    out.update(mlp_tensors(cfg, p))
    return out


def target_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """Canonical name -> shape of every target tensor (no ``mtp.*``)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, Shape] = {"embed_tokens.weight": (v, h)}
    for i, t in enumerate(cfg.layer_types):
        out.update(decoder_layer_tensors(cfg, f"layers.{i}.", t))
    out["norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def mtp_tensors(cfg: ModelConfig) -> dict[str, Shape]:
    """Canonical name -> shape of the ``mtp.*`` draft tensors (15 dense, more for MoE)."""
    h = cfg.hidden_size
    out: dict[str, Shape] = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    }
    for i in range(cfg.mtp_num_hidden_layers):
        out.update(decoder_layer_tensors(cfg, f"mtp.layers.{i}.", "full_attention"))
    return out


def mtp_projections(cfg: ModelConfig) -> dict[str, Shape]:
    """The ``mtp.*`` tensors that are projection weights ``[out, in]`` (the 2-D ``.weight``
    tensors: ``fc``, attention, dense MLP or the MoE router, shared gate and shared expert;
    not norms or routed experts), all of them. An int8 draft layer
    (``speculative_draft_layer_dtype``) stores these as int8 rows, less the shared expert's
    where the loader folds it into the routed experts
    (:func:`mtp_jax.models.draft_head.int8_layer_projections` applies that rule)."""
    return {name: shape for name, shape in mtp_tensors(cfg).items()
            if name.endswith(".weight") and len(shape) == 2}


def disk_name(cfg: ModelConfig, canonical: str) -> str:
    """The on-disk name of a canonical tensor in the layout ``cfg.composite`` says."""
    if canonical.startswith(("mtp.", "lm_head.")):
        return canonical
    return ("model.language_model." if cfg.composite else "model.") + canonical


def canonical_name(disk: str) -> str | None:
    """Map an on-disk tensor name to its canonical name; None for tensors mtp_jax never reads
    (``model.visual.*`` and other towers)."""
    if disk.startswith(("mtp.", "lm_head.")):
        return disk
    for prefix in ("model.language_model.", "model."):
        if disk.startswith(prefix):
            rest = disk[len(prefix):]
            if rest.startswith(("visual.", "vision_tower.", "audio")):
                return None
            return rest
    if disk.startswith(("visual.", "vision_tower.")):
        return None
    return disk
