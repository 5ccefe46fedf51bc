"""``python -m mtp_jax.bench.quant_gemv`` on the CPU (tiny shapes, wall time): every variant
row is written, the Triton kernel (interpret mode) reproduces the dequantized weights'
products, and the random fp8 codes are finite (a NaN code would hide any error)."""

from __future__ import annotations

import json

import jax
import numpy as np

from mtp_jax.bench import quant_gemv


def test_rows_and_kernel_error(tmp_path):
    out = tmp_path / "q.json"
    assert quant_gemv.main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    got = {(r["kind"], r["variant"]) for r in rows}
    assert got == {("bf16", "reduce"), ("bf16", "xla_dot"),
                   *((k, v) for k in ("fp8", "nvfp4")
                     for v in ("xla_dequant_reduce", "xla_dequant_dot", "triton"))}
    errs = [r["rel_err"] for r in rows if r["variant"] == "triton"]
    assert len(errs) == 2 and all(np.isfinite(e) and e < 1e-2 for e in errs)
    codes, _, _ = quant_gemv.random_parts(jax.random.PRNGKey(1), "fp8", 64, 256)
    assert np.isfinite(np.asarray(codes, np.float32)).all()
