"""``python -m mtp_jax.bench.hyper_mix`` on the CPU (a tiny shape, wall time, interpret mode):
an XLA row and one per tile choice, the kernels' chain within a bf16 step of XLA's, the
``--tiles`` overrides reach the kernels, rows record the shape and timing, and a shape the
kernels cannot take is refused naming the value."""

from __future__ import annotations

import json

import pytest

from mtp_jax.bench import hyper_mix


def test_rows_tiles_and_difference(tmp_path):
    assert hyper_mix.main(["--rows", "2", "--hidden", "64", "--rank", "32", "--layers", "2",
                           "--tiles", "bn=2,bj=16", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "hyper_mix.json").read_text())
    assert [r["variant"] for r in rows] == ["xla", "pallas", "pallas"]
    assert all(r["rows"] == 2 and r["us"] > 0 for r in rows)
    assert [(r["tiles"]["bn"], r["tiles"]["bj"]) for r in rows[1:]] == [(4, 8), (2, 16)]
    assert all(0 <= r["max_diff"] <= 0.0625 for r in rows[1:])  # bf16 steps of values ~8
    assert {(r["hc"], r["hidden"], r["rank"], r["layers"], r["timing"]) for r in rows} == {
        (4, 64, 32, 2, "wall")}


def test_a_shape_the_kernels_cannot_take_is_refused(capsys):
    with pytest.raises(SystemExit):
        hyper_mix.main(["--rows", "1", "--rank", "8"])
    assert "hc_lowrank 8 is not a multiple of 16" in capsys.readouterr().err
