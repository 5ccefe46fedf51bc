"""``python -m mtp_jax.bench prefill-burst`` on the CPU with a tiny checkpoint: a burst of mixed
prompt lengths served with one request per prefill call and with batched prefill, its JSON rows
and table; the batched row makes fewer prefill calls for the same chunks, gives every request a
first token, and compiles nothing in its timed burst. No timing is asserted."""

import json

from mtp_jax.bench import main
from mtp_jax.bench.prefill_burst import percentiles, prompt_lengths
from tests.helpers.paths import fixture_path


def test_percentiles_and_lengths():
    got = percentiles([1.0, 2.0, 3.0, 4.0])
    assert got["p50"] == got["mean"] == 2.5 and got["max"] == 4.0 and abs(got["p99"] - 3.97) < 1e-9
    lengths = prompt_lengths(50, 5, 9, seed=3)
    assert len(lengths) == 50 and min(lengths) >= 5 and max(lengths) <= 9
    assert lengths == prompt_lengths(50, 5, 9, seed=3)


def test_burst_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "burst.json"
    assert main(["prefill-burst", "--model", fixture_path("tiny_dense"), "--requests", "5",
                 "--prompt-len", "3", "40", "--max-tokens", "3", "--chunked-prefill-size", "64",
                 "--prefill-batch", "1,4", "--settings", "off", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| off | 1 |" in table and "| off | 4 |" in table
    rows = json.loads(out.read_text())["results"]
    one, batched = rows
    assert [r["prefill_batch"] for r in rows] == [1, 4]
    assert one["prefill_chunks"] == batched["prefill_chunks"] == one["prefill_calls"]
    assert batched["prefill_calls"] < one["prefill_calls"]
    for r in rows:
        assert r["output_tokens"] == 5 * 3 and len(r["ttft_s"]) == 5
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["ttft_max_s"] <= r["wall_s"]
        assert r["compiles_timed"] == 0 and r["warmup_compiles"] >= 0
