"""Random-weight Flash-Next GGUFs: a ``qwen4exp`` target and a Strata MTP pack.

    python -m mtp_jax.tools.random_checkpoint --config CFG --out DIR --format gguf \
        [--gguf-expert-type Q8_0|Q4_K|IQ3_XXS|Q2_0|F16|BF16|F32] \
        [--gguf-dense-type BF16|F16|F32|Q8_0|Q4_K|IQ3_XXS|Q2_0] [--no-mtp] [--tokenizer]

writes ``DIR/model.gguf`` (architecture ``qwen4exp``; names, metadata and conventions as
llama.cpp's converter writes them, :mod:`mtp_jax.tools.gguf_layout`,
:mod:`mtp_jax.tools.gguf_meta`) and ``DIR/mtp.gguf`` (a Strata pack, ``qwen4exp-mtp``), for a
qwen4_exp ``config.json`` (``model_type`` qwen4_exp). Load them with
``LLM("DIR/model.gguf", speculative_draft_model_path="DIR/mtp.gguf")``.

Stored types (:mod:`mtp_jax.tools.gguf_blocks`): routed experts (target and pack) in
``expert_type``; the target's other 2-D matrices in ``dense_type``; 1-D tensors, norms,
convolutions and routers F32; the n-gram table and the pack's 2-D tensors in ``dense_type``
when it is a float type, else BF16. A block type needs rows of whole blocks: other rows fall
back to Q8_0 (else F32), reported in the summary (:func:`write_random_gguf` returns it; the
tool prints it).

Values: float tensors are drawn in the HF layout (matrices ``N(0, 1/fan_in)``, embeddings and
n-gram rows ``N(0, 1)``, zero-centred norms ``N(0, 0.02)``, ``A_log = log U(1, 16)``,
``dt_bias ~ U(-0.5, 0.5)``, the GDN output norm ones) and converted as the converter does;
block tensors are random blocks of the same root-mean-square. Each tensor's values depend on
the seed and its name only. ``values_from`` (a safetensors qwen4_exp folder, fused experts)
writes that checkpoint's values instead (float types and Q8_0 only), so a test can compare
the GGUF load with the safetensors one. ``tokenizer``: the real Qwen vocabulary and chat
template as ``tokenizer.*`` metadata (:mod:`mtp_jax.tools.qwen_vocab`), embedding / LM head
rows past its ids zero. Tensors are written one at a time (``GGUFWriter``'s tensor-info then
data path), so memory holds one tensor.
"""

from __future__ import annotations

import glob
import os
import tempfile
import zlib

import numpy as np

from mtp_jax.config import ConfigError, config_dict
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.rope import DEFAULT_ROPE
from mtp_jax.tools import gguf_blocks as gb
from mtp_jax.tools import gguf_meta
from mtp_jax.tools.gguf_layout import Planned, convert, pack_plan, target_plan

__all__ = ["write_random_gguf", "TARGET_FILE", "PACK_FILE"]

TARGET_FILE, PACK_FILE = "model.gguf", "mtp.gguf"
_ZEROED = ("embed_tokens.weight", "lm_head.weight")


def _check_config(cfg: Qwen4ExpConfig, pack: bool) -> None:
    """What a qwen4exp GGUF (and, with ``pack``, a Strata pack) cannot say (ConfigError
    naming the field)."""
    if cfg.rope_scaling != DEFAULT_ROPE:
        raise ConfigError("the config asks for RoPE scaling, which the qwen4exp GGUF metadata "
                          "the reader knows cannot hold; use a config without rope scaling.")
    if cfg.output_gate_type != "sigmoid":
        raise ConfigError(f"output_gate_type {cfg.output_gate_type!r}: a qwen4exp GGUF's GDN "
                          "gate is sigmoid (not stored); use a sigmoid config.")
    if pack and not cfg.full_layer_ids:
        raise ConfigError(f"the config's {cfg.num_hidden_layers} layers hold no QSA "
                          "(full_attention) layer: a qwen4exp GGUF then stores no QSA compress "
                          "ratio, which the MTP layer needs, so the pack could not load. Keep a "
                          "full_attention layer (e.g. 4 layers of the released layout) or "
                          "write no pack (--no-mtp).")
    if pack and cfg.mtp_rope_theta != cfg.rope_theta:
        raise ConfigError(f"the MTP layer's rope_theta {cfg.mtp_rope_theta} differs from the "
                          f"target's {cfg.rope_theta}; a Strata pack cannot hold its own, so "
                          "use a config where they are equal.")


def _draw(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random float32 values of canonical tensor ``name`` (module docstring)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(-0.5, 0.5, shape).astype(np.float32)
    if name.endswith("linear_attn.norm.weight"):
        return np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(_rms(name, shape))


def _rms(name: str, shape: tuple[int, ...]) -> float:
    if len(shape) == 1:
        return 0.02
    return 1.0 if ("embed_tokens" in name or "ngram_embedding" in name) else shape[-1] ** -0.5


class _Values:
    """Canonical float32 values: drawn (seed) or read from a safetensors folder."""

    def __init__(self, seed: int, folder: str | None, zero_from: int | None):
        self.seed, self.zero_from, self.files, self.last = seed, zero_from, {}, (None, None)
        if folder is not None:
            self._index(folder)

    def _index(self, folder: str) -> None:
        from safetensors import safe_open

        from mtp_jax.weights.names import canonical_name
        for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            with safe_open(path, "np") as f:
                for disk in f.keys():
                    if (c := canonical_name(disk)) is not None:
                        self.files[c] = (path, disk)
        if not self.files:
            raise ValueError(f"values_from {folder!r} holds no safetensors tensors.")

    def _per_expert(self, name: str) -> np.ndarray | None:
        """A fused expert stack from per-expert tensors (``experts.{e}.gate_proj.weight`` ...:
        gate rows then up rows, ``[E, 2I, H]``; ``down_proj [E, H, I]``), None if absent."""
        prefix, _, fused = name.rpartition(".")
        parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
        if f"{prefix}.0.{parts[0]}.weight" not in self.files:
            return None
        n = sum(1 for k in self.files if k.startswith(prefix + ".") and k.endswith(parts[0]
                                                                                   + ".weight"))
        return np.stack([np.concatenate([self._read(f"{prefix}.{e}.{p}.weight") for p in parts])
                         for e in range(n)])

    def _read(self, name: str) -> np.ndarray:
        from safetensors import safe_open
        if name not in self.files:
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                if (x := self._per_expert(name)) is not None:
                    return x
            shards = sorted((k for k in self.files
                             if k.startswith(name[:-len("weight")] + "shard_")),
                            key=lambda k: int(k.rsplit("_", 1)[1].split(".")[0]))
            if not shards:
                raise ValueError(f"values_from has no {name!r}; the folder is not a qwen4_exp "
                                 "checkpoint of this config.")
            return np.concatenate([self._read(s) for s in shards])
        path, disk = self.files[name]
        with safe_open(path, "np") as f:
            return np.asarray(f.get_tensor(disk), np.float32)

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The values of canonical tensor ``name`` (the last one is kept: split tensors, the
        experts' gate and up, read it twice in a row). Do not modify them."""
        if self.last[0] == name:
            return self.last[1]
        x = self._read(name) if self.files else _draw(name, shape, self.seed)
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"values_from {name} has shape {list(x.shape)}; the config gives "
                             f"{list(shape)}.")
        if self.zero_from is not None and name in _ZEROED:
            x[self.zero_from:] = 0
        self.last = (name, x)
        return x


def _stored(e: Planned, expert: str, dense: str) -> str:
    if e.role == "f32":
        return "F32"
    if e.role in ("table", "pack_dense"):
        return dense if dense in gb.FLOAT_TYPES else "BF16"
    return gb.stored_type(expert if e.role == "expert" else dense, e.shape[-1])


def _data(e: Planned, kind: str, cfg, values: _Values) -> np.ndarray:
    """The bytes-carrying array of tensor ``e`` stored as ``kind``."""
    if kind in gb.BLOCK_TYPES and not values.files:
        rng = np.random.default_rng([values.seed, zlib.crc32(e.name.encode())])
        out = gb.random_blocks(rng, kind, e.shape, _rms(e.source, e.source_shape))
        if values.zero_from is not None and e.source in _ZEROED:
            out[values.zero_from:] = 0
        return out
    return gb.encode(convert(cfg, e.kind, values.get(e.source, e.source_shape)), kind)


def _write(path: str, arch: str, add_meta, plan: list[Planned], kinds: dict, make) -> int:
    """Stream ``plan`` into a GGUF at ``path``: tensor infos and metadata, then each tensor's
    data as ``make(entry, kind)`` gives it. Returns the file's bytes."""
    import gguf
    w = gguf.GGUFWriter(path, arch)
    add_meta(w)
    for e in plan:
        w.add_tensor_info(e.name, e.shape, np.dtype(np.float32), gb.nbytes(kinds[e.name], e.shape),
                          raw_dtype=gb.type_id(kinds[e.name]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for e in plan:
        w.write_tensor_data(make(e, kinds[e.name]))
    w.close()
    return os.path.getsize(path)


def _summary(path: str, size: int, plan: list[Planned], kinds: dict, asked: dict) -> dict:
    """Per stored type: tensors and bytes; the tensors whose type is not the one asked."""
    by_type: dict[str, list[int]] = {}
    for e in plan:
        n = by_type.setdefault(kinds[e.name], [0, 0])
        n[0] += 1
        n[1] += gb.nbytes(kinds[e.name], e.shape)
    fallback = {e.name: f"{kinds[e.name]} (rows of {e.shape[-1]} are not whole "
                        f"{asked[e.role]} blocks)"
                for e in plan if e.role in asked and kinds[e.name] != asked[e.role]}
    return {"path": path, "bytes": size, "types": {k: tuple(v) for k, v in by_type.items()},
            "fallback": fallback}


def _tokenizer_folder(cfg: Qwen4ExpConfig, cache_dir: str | None, tmp: str) -> int:
    """Write the real Qwen tokenizer files into ``tmp``; returns its id count."""
    from mtp_jax.tools import qwen_vocab
    n_tok = len(qwen_vocab.load_ranks()) + len(qwen_vocab.special_tokens())
    if cfg.vocab_size < n_tok:
        raise ValueError(f"tokenizer=True (--tokenizer) writes the real Qwen vocabulary "
                         f"({n_tok} ids) but the config's vocab_size is {cfg.vocab_size}; use "
                         f"a config with vocab_size >= {n_tok} (the released ones have 248320), "
                         "or drop it.")
    qwen_vocab.write_tokenizer_files(tmp, cache_dir=cache_dir)
    return n_tok


def write_random_gguf(config: dict | str, out_dir: str, *, expert_type: str = "Q8_0",
                      dense_type: str = "BF16", include_mtp: bool = True, seed: int = 0,
                      tokenizer: bool = False, cache_dir: str | None = None,
                      values_from: str | None = None) -> list[dict]:
    """Write ``out_dir/model.gguf`` (and ``out_dir/mtp.gguf`` unless ``include_mtp`` is
    False or the config has no MTP layer) for qwen4_exp ``config`` (dict, config.json or a
    folder); returns one summary per file (``path``, ``bytes``, ``types``: stored type ->
    (tensors, bytes), ``fallback``: tensor -> the type it got instead of the one asked).
    ``cache_dir``: where the Qwen vocabulary conversion is cached (``tokenizer``).
    ValueError / ConfigError for an option or config this writer cannot honour."""
    gb.check_type(expert_type, "expert_type (--gguf-expert-type)")
    gb.check_type(dense_type, "dense_type (--gguf-dense-type)")
    made = {"Q8_0"} | set(gb.FLOAT_TYPES)
    if values_from is not None and not {expert_type, dense_type} <= made:
        raise ValueError(f"values_from stores real values, which this writer quantizes to "
                         f"{sorted(made)} only; got expert_type {expert_type}, dense_type "
                         f"{dense_type}.")
    raw = config_dict(config)
    cfg = Qwen4ExpConfig.from_dict(raw)
    pack = include_mtp and cfg.mtp_num_hidden_layers > 0
    _check_config(cfg, pack)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        zero_from = _tokenizer_folder(cfg, cache_dir, tmp) if tokenizer else None
        values = _Values(seed, values_from, zero_from)
        make = (lambda e, kind: _data(e, kind, cfg, values))
        asked = {"expert": expert_type, "dense": dense_type}

        def target_meta(w):
            gguf_meta.add_target_metadata(w, cfg, raw)
            if tokenizer:
                gguf_meta.add_tokenizer_metadata(w, tmp, cfg.vocab_size)
            elif cfg.eos_token_ids:
                w.add_uint32("tokenizer.ggml.eos_token_id", cfg.eos_token_ids[0])

        plan = target_plan(cfg)
        kinds = {e.name: _stored(e, expert_type, dense_type) for e in plan}
        path = os.path.join(out_dir, TARGET_FILE)
        out = [_summary(path, _write(path, gguf_meta.ARCH, target_meta, plan, kinds, make),
                        plan, kinds, asked)]
    if pack:
        plan = pack_plan(cfg)
        kinds = {e.name: _stored(e, expert_type, dense_type) for e in plan}
        path = os.path.join(out_dir, PACK_FILE)
        source = values_from or f"random (mtp_jax.tools.random_checkpoint, seed {seed})"

        def pack_meta(w):
            gguf_meta.add_pack_metadata(w, source, expert_type)

        out.append(_summary(path, _write(path, gguf_meta.PACK_ARCH, pack_meta, plan, kinds,
                                         make), plan, kinds, asked))
    return out


def _size(n: int) -> str:
    """``n`` bytes in GB, MB or kB (decimal), whichever shows it with a leading digit."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n / 1e3:.1f} kB"


def describe(summary: dict) -> str:
    """One line per file of a :func:`write_random_gguf` summary."""
    types = ", ".join(f"{k}: {n} tensors {_size(b)}" for k, (n, b) in
                      sorted(summary["types"].items()))
    text = f"{summary['path']} ({_size(summary['bytes'])}; {types})"
    if summary["fallback"]:
        first = sorted(summary["fallback"].items())[:3]
        text += (f"; {len(summary['fallback'])} tensor(s) in another type than asked, e.g. "
                 + "; ".join(f"{n}: {why}" for n, why in first))
    return text
