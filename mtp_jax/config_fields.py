"""Config fields that mtp_jax implements one way only: a checkpoint asking for another way is
refused at config time, before any weight loads, instead of running with the one way silently.

Every released Qwen3.5 / 3.6 / 3.8 / Flash-Next config (``../shared/real_configs``) holds the
values in :data:`FIXED_FIELDS` (or leaves the field out); a config with another value (an edited
or future checkpoint: ``hidden_act: gelu``, ``attention_bias: true``, sliding windows, a draft
with its own embedding table) describes a model whose maths the engine does not run.
"""

from __future__ import annotations

from typing import Any

from mtp_jax.errors import ConfigError

__all__ = ["FIXED_FIELDS", "MTP_SECTION_KEYS", "check_fixed_fields", "check_mtp_section",
           "check_shared_expert"]

# field -> (the values mtp_jax implements, what the field sets)
FIXED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "hidden_act": (("silu", "swish"), "the MLP and experts' activation (mtp_jax runs SwiGLU "
                   "with SiLU)"),
    "attention_bias": ((False,), "biases on the attention projections (mtp_jax's have none)"),
    "attn_output_gate": ((True,), "the full-attention output gate (mtp_jax's q_proj always "
                         "holds the gate half)"),
    "use_sliding_window": ((False,), "sliding-window attention (mtp_jax's full-attention "
                           "layers attend to the whole context)"),
    "mtp_use_dedicated_embeddings": ((False,), "an MTP draft with an embedding table of its "
                                     "own (mtp_jax's draft shares the target's)"),
    "mamba_ssm_dtype": (("float32",), "the dtype of the GDN recurrent state (mtp_jax keeps it "
                        "in float32)"),
    "mlp_only_layers": (([],), "layers with a dense MLP in place of the experts (mtp_jax "
                        "gives every layer of a MoE model its experts)"),
    "decoder_sparse_step": ((1,), "experts on every n-th layer only (mtp_jax gives every "
                            "layer of a MoE model its experts)"),
}

# the keys of qwen4_exp's ``mtp`` section that mtp_jax reads (their values: check_mtp_section
# and the config's own parsing of the draft's RoPE)
MTP_SECTION_KEYS = ("hybrid", "layer_types", "mtp_use_hidden_state_from_layer",
                    "num_hidden_layers", "rope_theta", "rope_parameters", "rope_scaling")


def _same(a: Any, b: Any) -> bool:
    """``a == b`` that tells booleans from the integers 0 and 1."""
    return type(a) is type(b) and a == b


def check_fixed_fields(sections: list[dict], model_type: str) -> None:
    """Raise ConfigError when a field of :data:`FIXED_FIELDS` in ``sections`` (the config's
    dicts: ``text_config`` and the top level) holds a value mtp_jax does not implement; a
    field left out or ``null`` takes the one implemented. ``model_type`` names the family in
    the message."""
    for section in sections:
        for field, (accepted, what) in FIXED_FIELDS.items():
            value = section.get(field)
            if value is None or any(_same(value, a) for a in accepted):
                continue
            shown = " or ".join(repr(a) for a in accepted).replace("True", "true").replace(
                "False", "false")
            raise ConfigError(
                f"config.json sets {field} = {value!r}, {what}; mtp_jax runs {model_type} "
                f"with {field} = {shown} only (every released checkpoint's value), so this "
                "checkpoint would run different maths than it was trained with. Use a "
                f"checkpoint with {field} {shown}, or drop the key if it was edited by mistake.")


def check_mtp_section(mtp: dict, mtp_num_hidden_layers: int | None,
                      qsa_spellings: tuple[str, ...]) -> None:
    """qwen4_exp's ``mtp`` config section: only the keys of :data:`MTP_SECTION_KEYS`, ``hybrid``
    true (or absent), every ``layer_types`` entry a QSA (full-attention) layer, no
    ``mtp_use_hidden_state_from_layer`` (the draft reads the target's last streams), and
    ``num_hidden_layers`` equal to ``mtp_num_hidden_layers`` when both are set. Raises
    ConfigError naming the key and the value."""
    unknown = sorted(set(mtp) - set(MTP_SECTION_KEYS))
    if unknown:
        raise ConfigError(f"config.json's mtp section holds keys mtp_jax does not know: "
                          f"{unknown}; they may change the draft's maths, so the config is "
                          f"refused (known: {', '.join(MTP_SECTION_KEYS)}). Use the checkpoint's "
                          "own config.")
    if mtp.get("hybrid") not in (None, True):
        raise ConfigError(f"config.json sets mtp.hybrid = {mtp['hybrid']!r}; mtp_jax runs the "
                          "Flash-Next draft as released (hybrid: true: a QSA layer over the "
                          "hyper-connection streams). Use the checkpoint's own config.")
    types = mtp.get("layer_types") or []
    bad = [t for t in types if t not in qsa_spellings]
    if bad:
        raise ConfigError(f"config.json's mtp.layer_types holds {bad}; mtp_jax's Flash-Next "
                          f"draft layers are QSA layers only ({', '.join(qsa_spellings)}). Use "
                          "the checkpoint's own config.")
    source = mtp.get("mtp_use_hidden_state_from_layer")
    if source is not None:
        raise ConfigError(f"config.json sets mtp.mtp_use_hidden_state_from_layer = {source!r}; "
                          "mtp_jax's draft reads the target's last hidden streams (null). Use "
                          "a checkpoint whose draft does.")
    n = mtp.get("num_hidden_layers")
    if n is not None and mtp_num_hidden_layers is not None and n != mtp_num_hidden_layers:
        raise ConfigError(f"config.json's mtp.num_hidden_layers {n!r} and mtp_num_hidden_layers "
                          f"{mtp_num_hidden_layers!r} disagree; use the checkpoint's own config, "
                          "where they are equal.")
    if types and n is not None and len(types) != n:
        raise ConfigError(f"config.json's mtp.layer_types has {len(types)} entries but "
                          f"mtp.num_hidden_layers is {n}; use the checkpoint's own config, where "
                          "they agree.")


def check_shared_expert(size: int) -> None:
    """A MoE config's ``shared_expert_intermediate_size`` ``size``: ConfigError below 1 (mtp_jax
    runs every MoE block with its shared expert, as every released checkpoint has one)."""
    if size < 1:
        raise ConfigError(f"config.json sets shared_expert_intermediate_size = {size}, a MoE "
                          "block without a shared expert; mtp_jax runs every MoE block with "
                          "its shared expert (every released checkpoint has one, >= 1), so "
                          "this config is not supported. Use a checkpoint with a shared expert.")
