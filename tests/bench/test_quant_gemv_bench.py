"""``python -m mtp_jax.bench.quant_gemv`` on the CPU (tiny shapes, wall time): every default
variant has its row, the Triton kernel (interpret mode) in each distinct tiling reproduces the
dequantized weights' products, variants resolving to the same tiles and split run once
(``same_as``), a split of K is swept (fp8's 4 steps in 4 slices), ``--variants`` picks rows
(keep's XLA forms too), and the random fp8 codes are finite (a NaN code would hide any error)."""

from __future__ import annotations

import json

import jax
import numpy as np

from mtp_jax.bench import quant_gemv

TRITON = quant_gemv.TRITON


def test_rows_and_kernel_error(tmp_path):
    out = tmp_path / "q.json"
    assert quant_gemv.main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    got = {(r["kind"], r["variant"]) for r in rows}
    assert got == {("bf16", "reduce"), ("bf16", "xla_dot"),
                   *((k, v) for k in ("fp8", "nvfp4") for v in TRITON)}
    timed = {(r["kind"], r["variant"]): r for r in rows if "same_as" not in r}
    assert all("us" in r for r in timed.values())
    same = {(r["kind"], r["variant"]): r["same_as"] for r in rows if "same_as" in r}
    assert same == {("fp8", "triton_s1"): "triton", ("fp8", "triton_s8"): "triton_s4",
                    ("nvfp4", "triton_s1"): "triton", ("nvfp4", "triton_s4"): "triton",
                    ("nvfp4", "triton_s8"): "triton"}
    errs = [r["rel_err"] for r in timed.values() if "tiles" in r]
    assert len(errs) == 5 and all(np.isfinite(e) and e < 1e-2 for e in errs)
    assert timed["fp8", "triton"]["tiles"] == "bn16 bk128 w4 S1"
    assert timed["fp8", "triton_s4"]["tiles"] == "bn16 bk128 w4 S4"
    codes, _, _ = quant_gemv.random_parts(jax.random.PRNGKey(1), "fp8", 64, 256)
    assert np.isfinite(np.asarray(codes, np.float32)).all()


def test_variants_filter(tmp_path):
    out = tmp_path / "q.json"
    pick = "xla_dequant_reduce,xla_dequant_dot,triton_s4"
    assert quant_gemv.main(["--out", str(out), "--variants", pick]) == 0
    rows = json.loads(out.read_text())
    assert {(r["kind"], r["variant"]) for r in rows} == {
        (k, v) for k in ("fp8", "nvfp4") for v in pick.split(",")}
    assert all("us" in r for r in rows)
