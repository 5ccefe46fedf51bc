"""``python -m mtp_jax.bench.quant_gemv`` on the CPU (tiny shapes, wall time): every variant
row is written, the Triton kernel (interpret mode) in each tiling reproduces the dequantized
weights' products, a split of K is swept (fp8's 4 steps in 4 slices), ``--variants`` keeps
only the named rows, and the random fp8 codes are finite (a NaN code would hide any error)."""

from __future__ import annotations

import json

import jax
import numpy as np

from mtp_jax.bench import quant_gemv

TRITON = ("triton", "triton_s1", "triton_wide", "triton_s4", "triton_s8", "triton_wide_s1")


def test_rows_and_kernel_error(tmp_path):
    out = tmp_path / "q.json"
    assert quant_gemv.main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    got = {(r["kind"], r["variant"]) for r in rows}
    assert got == {("bf16", "reduce"), ("bf16", "xla_dot"),
                   *((k, v) for k in ("fp8", "nvfp4")
                     for v in ("xla_dequant_reduce", "xla_dequant_dot", *TRITON))}
    triton = [r for r in rows if "tiles" in r]
    assert {r["variant"] for r in triton} == set(TRITON) and len(triton) == 2 * len(TRITON)
    assert all(np.isfinite(r["rel_err"]) and r["rel_err"] < 1e-2 for r in triton)
    fp8 = {r["variant"]: r["tiles"] for r in triton if r["kind"] == "fp8"}
    assert fp8["triton_s1"].endswith(" S1") and fp8["triton_s4"].endswith(" S4")
    codes, _, _ = quant_gemv.random_parts(jax.random.PRNGKey(1), "fp8", 64, 256)
    assert np.isfinite(np.asarray(codes, np.float32)).all()


def test_variants_filter(tmp_path):
    out = tmp_path / "q.json"
    assert quant_gemv.main(["--out", str(out), "--variants", "xla_dot,triton_s4"]) == 0
    got = {(r["kind"], r["variant"]) for r in json.loads(out.read_text())}
    assert got == {("bf16", "xla_dot"), ("fp8", "triton_s4"), ("nvfp4", "triton_s4")}
