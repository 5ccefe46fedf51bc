"""An independent float64 dequantization of stored quantized tensors, written from the formats'
descriptions (/work/shared/FORMATS.md), for the tests: none of mtp_jax's quantization code is
used here. FP8 values are decoded by ``ml_dtypes`` (``float8_e4m3fn``), FP4 codes through the
e2m1 table below, nibble by nibble."""

import numpy as np

# e2m1: sign = bit 3, magnitude index = bits 0-2.
E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


SCALE_SUFFIXES = ("_scale", "_scale_inv", "_scale_2")  # every companion name ends so


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    mags = np.array([E2M1[k] for k in range(8)])[codes & 0b0111]
    return np.where(codes & 0b1000, -mags, mags)


def unpack(packed: np.ndarray) -> np.ndarray:
    """[..., out, in/2] bytes -> [..., out, in]: column 2j = low nibble, 2j+1 = high nibble."""
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],))
    out[..., 0::2] = decode_e2m1(packed & 0x0F)
    out[..., 1::2] = decode_e2m1(packed >> 4)
    return out


def per_matrix(s: np.ndarray, lead: tuple) -> np.ndarray:
    s = np.asarray(s, np.float64).reshape(-1)
    return s.reshape((1,) * (len(lead) + 2)) if s.size == 1 else s.reshape(lead + (1, 1))


def block_fp8(w, scale_inv, block=(128, 128)):
    r, c = w.shape[-2:]
    rows = (np.arange(r) // block[0])[:, None]
    cols = (np.arange(c) // block[1])[None, :]
    return w.astype(np.float64) * scale_inv.astype(np.float64)[..., rows, cols]


def nvfp4(packed, scale, scale_2=None, global_scale=None, group=16):
    v = unpack(packed)
    cols = np.arange(v.shape[-1]) // group
    s = scale.astype(np.float64)[..., cols]
    lead = packed.shape[:-2]
    if global_scale is not None:
        return v * s / per_matrix(global_scale, lead)
    return v * s * per_matrix(scale_2, lead)


def dequantize_stored(stored: dict) -> dict:
    """Stored name -> array (as stored) => logical weight name -> float64 weight, for the
    four formats (dotted ``X.weight_*`` companions, or stacked experts' ``X_*``)."""
    out, used = {}, set()

    def comp(base, dotted, suffix):
        name = base[:-len("weight")] + suffix if dotted else base + "_" + suffix.removeprefix(
            "weight_")
        if name in stored:
            used.add(name)
            return stored[name]
        return None

    for name, arr in stored.items():
        if name.endswith(".weight_packed") or name.endswith("experts.gate_up_proj_packed") or \
                name.endswith("experts.down_proj_packed"):
            dotted = name.endswith(".weight_packed")
            base = name[:-len("_packed")]  # "X.weight" or the stacked "X"
            out[base] = nvfp4(arr, comp(base, dotted, "weight_scale"),
                              global_scale=comp(base, dotted, "weight_global_scale"))
            comp(base, dotted, "input_global_scale")
            used.add(name)
    for name, arr in stored.items():
        if name in used or name.endswith(SCALE_SUFFIXES) or (
                arr.dtype != np.uint8 and "float8" not in str(arr.dtype)):
            continue
        dotted = name.endswith(".weight")
        comp(name, dotted, "input_scale")
        if "float8" in str(arr.dtype):
            inv = comp(name, dotted, "weight_scale_inv")
            if inv is not None:
                out[name] = block_fp8(arr, inv)
            else:
                s = comp(name, dotted, "weight_scale")
                out[name] = arr.astype(np.float64) * per_matrix(s, arr.shape[:-2])
        else:
            out[name] = nvfp4(arr, comp(name, dotted, "weight_scale"),
                              scale_2=comp(name, dotted, "weight_scale_2"))
        used.add(name)
    for name, arr in stored.items():
        if name not in used and name not in out:
            out[name] = np.asarray(arr, np.float64)
    return out
