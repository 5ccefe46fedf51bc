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
                 "--prefill-batch", "1,4", "--settings", "off", "--call-times",
                 "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| off | 1 |" in table and "| off | 4 |" in table
    assert "| off | 4 | all |" in table  # the --call-times table's total line
    rows = json.loads(out.read_text())["results"]
    lengths = json.loads(out.read_text())["meta"]["prompt_lengths"]
    for r in rows:  # --call-times: a burst of the same lengths, planned as the timed one
        calls, shapes = r["prefill_call_times"], r["call_shapes"]
        assert len(calls) == r["prefill_calls"] == sum(x["calls"] for x in shapes)
        assert sum(sum(c["lengths"]) for c in calls) == sum(lengths)
        assert all(len(c["lengths"]) <= c["shape"][0] and max(c["lengths"]) <= c["shape"][1]
                   and c["s"] > 0 for c in calls)
        assert sum(x["tokens"] for x in shapes) == sum(lengths)
        assert sum(x["padded"] for x in shapes) == sum(b * t for b, t in
                                                       (c["shape"] for c in calls))
    assert max(c["shape"][0] for c in rows[1]["prefill_call_times"]) > 1
    assert {c["shape"][0] for c in rows[0]["prefill_call_times"]} == {1}
    one, batched = rows
    assert [r["prefill_batch"] for r in rows] == [1, 4]
    assert one["prefill_chunks"] == batched["prefill_chunks"] == one["prefill_calls"]
    assert batched["prefill_calls"] < one["prefill_calls"]
    for r in rows:
        assert r["output_tokens"] == 5 * 3 and len(r["ttft_s"]) == 5
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["ttft_max_s"] <= r["wall_s"]
        assert r["compiles_timed"] == 0 and r["warmup_compiles"] >= 0
        # the burst's own counters: 3 tokens a request = the first + 2 from rounds
        assert 0 < r["prefill_s"] < r["wall_s"] and 0 < r["round_s"] < r["wall_s"]
        assert r["plain_rounds"] == 0 and 2 <= r["rounds"] and 1 <= r["round_calls"]
        assert r["round_calls"] <= r["rounds"]


def test_gguf_mtp_refusal_names_the_bench_options(tmp_path, capsys):
    """A Flash-Next GGUF file with mtp rows: the refusal names what this bench takes (the
    folder holding the target and its pack as --model, or --settings off), not the
    --speculative-* flags of generate, which the bench has not; the folder passes."""
    import shutil

    from mtp_jax.bench.prefill_burst import build_parser, check_gguf_draft
    from tests.gguf.writer import write_pack, write_target

    qwen4 = fixture_path("tiny_qwen4_exp")
    d = tmp_path / "g"
    d.mkdir()
    target = write_target(qwen4, str(d / "model.gguf"))
    write_pack(qwen4, str(d / "mtp.gguf"))
    assert main(["prefill-burst", "--model", target, "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert f"Pass --model {d} (its folder, whose pack is mtp.gguf), or --settings off" in err
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    named = {w.strip("(),.;") for w in err.split() if w.startswith("--")}
    assert named <= flags, named - flags
    check_gguf_draft(str(d), ["off", "mtp"])  # the folder brings its pack
    check_gguf_draft(target, ["off"])  # no mtp rows
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(target, lone / "model.gguf")
    assert main(["prefill-burst", "--model", str(lone), "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert "is a GGUF folder with no Strata MTP pack" in err and "--settings off" in err
    bench_part = err.replace("python -m mtp_jax.tools.random_checkpoint --format gguf", "")
    assert {w.strip("(),.;") for w in bench_part.split() if w.startswith("--")} <= flags


def test_mtp_burst_compiles_nothing_in_the_timed_burst(tmp_path):
    """With MTP the warm-up runs two bursts: the first starts every greedy request drafting,
    the timed one starts from the engine's acceptance estimate (random head: plain steps),
    so it calls plain-step variants at batch sizes the first burst drafted at."""
    out = tmp_path / "burst.json"
    assert main(["prefill-burst", "--model", fixture_path("tiny_dense"), "--requests", "5",
                 "--prompt-len", "3", "40", "--max-tokens", "12", "--chunked-prefill-size",
                 "64", "--prefill-batch", "1", "--settings", "mtp", "--k", "2",
                 "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["output_tokens"] == 5 * 12 and row["accepted_tokens"] <= row["draft_tokens"]
    assert row["compiles_timed"] == 0, row["compiles_timed"]
