"""``python -m mtp_jax.bench``'s subcommands: the dispatch and its help, each subcommand's
refusal of bad values (exit status 2), one op benchmark end to end on the CPU (``sampling``,
all XLA) with its JSON, the GPU-only paths refused without a GPU, and the shared helpers
(timing, profiler-trace reading, op rows, the registry-parsed configs). No timing is
asserted."""

import gzip
import json
import os
import subprocess
import sys

import jax
import pytest

from mtp_jax.bench import main, report, timing
from mtp_jax.bench.commands import SUBCOMMANDS
from tests.helpers.paths import REPO

ROOT = REPO
CONFIG_2B = os.path.join(ROOT, "configs", "Qwen3.5-2B.json")
ON_GPU = jax.default_backend() == "gpu"


def test_help_lists_every_subcommand_and_the_engine_flags(capsys):
    for argv in (["--help"], ["engine", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        for name, module in SUBCOMMANDS.items():
            assert f"  {name} " in out and module.SUMMARY[:30] in out
        assert "--prefill-reps" in out and "--num-scheduler-steps" in out  # the engine's


def test_python_m_help_lists_the_subcommands():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "mtp_jax.bench", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert all(f"  {name} " in done.stdout for name in SUBCOMMANDS)


def test_attention_sweep_cases_default_to_three_8k_cases_and_take_long_context_ones():
    from mtp_jax.bench.ops import attention

    p = attention.build_parser()
    assert p.parse_args([]).sweep_cases == [("2B", 1, 1, 8192), ("27B", 8, 4, 8192),
                                            ("35B", 32, 4, 8192)]
    got = p.parse_args(["--sweep-cases", "35B,1,1,131072", "35B,1,4,131072"]).sweep_cases
    assert got == [("35B", 1, 1, 131072), ("35B", 1, 4, 131072)]


def test_attention_grid_with_sweep_is_refused(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["attention", "--grid", "--sweep", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("error: --grid and --sweep do not run together (--grid times its "
                   "--grid-cases only); run them one at a time.")
    assert not out.exists()


@pytest.mark.parametrize("argv,names,mode", [
    (["--grid-heads", "3"], "--grid-heads", "grid"),
    (["--grid-splits", "auto", "--grid-prefetch", "on"], "--grid-splits, --grid-prefetch",
     "grid"),
    (["--sweep-cases", "35B,1,1,131072"], "--sweep-cases", "sweep"),
])
def test_attention_mode_flags_without_their_mode_are_refused(argv, names, mode, tmp_path,
                                                             capsys):
    out = tmp_path / "r.json"
    assert main(["attention", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"error: {names} only apply with --{mode}; add --{mode} or leave them out."
    assert not out.exists()


def test_unknown_subcommand_is_refused(capsys):
    assert main(["atention", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'atention'" in err and "attention" in err


@pytest.mark.parametrize("name", [n for n in SUBCOMMANDS if n != "engine"])
def test_each_subcommand_documents_its_flags(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"python -m mtp_jax.bench {name}" in out and "--out" in out
    # prefix-hits counts tokens, prefill-burst and qwen4-smoke time workloads end to end;
    # every other subcommand reports a fraction of the HBM floor
    assert ("--hbm-tbps" in out) == (name not in ("prefix-hits", "prefill-burst", "qwen4-smoke"))
    assert "``" not in out and ":func:" not in out  # plain text


@pytest.mark.parametrize("argv,message", [
    (["attention", "--batch", "0"], "--batch"),
    (["attention", "--sweep-cases", "35B,1,131072"], "is not LAYOUT,BATCH,T,CONTEXT"),
    (["gdn", "--parts", "step,bogus"], "--parts"),
    (["moe", "--shapes", "8:9:64:32"], "TOPK <= E"),
    (["gemv", "--norm-shapes", "256:512:silu"], "at least K"),
    (["sampling", "--vocab", "100"], "pass --vocab 4096 or more"),
    (["draft-head", "--heads", "full,bogus"], "choose from full, hot, int8"),
    (["ab", "--config", "x.json", "--variant", "b=norm=xla"], "a name, then a colon"),
    (["profile", "--config", "x.json", "--rounds", "0"], "--rounds"),
    (["prefill-burst", "--requests", "0"], "--requests"),
    (["prefill-burst", "--prompt-len", "90", "10"], "need 1 <= LO <= HI"),
    (["prefill-burst", "--settings", "off,eagle"], "choose from off, mtp"),
])
def test_bad_values_exit_with_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_sampling_runs_on_cpu_and_writes_op_rows(tmp_path, capsys):
    out = tmp_path / "sampling.json"
    rc = main(["sampling", "--vocab", "4096", "--rows", "2", "--reps", "2", "--kinds", "peaked",
               "--filters", "top_p", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["meta"]["subcommand"] == "sampling"
    assert data["meta"]["args"]["vocab"] == 4096 and data["meta"]["jax_version"]
    rows = data["results"]
    assert [r["variant"] for r in rows] == ["sort", "candidates"]
    for r in rows:
        assert set(report.OP_FIELDS) <= set(r)
        assert r["op"] == "sampling" and r["case"] == "peaked rows=2 V=4096 top_p"
        assert r["timing"] == "wall" and r["bytes"] == 2 * 4096 * 6
        floor = r["bytes"] / 4.2e12
        assert r["fraction_of_floor"] == pytest.approx(floor / (r["time_us"] / 1e6))
        assert r["reference"] == "sort" and r["error"] < 1e-6  # the same kept set, same probs
        assert r["notes"]["same"] is True and r["notes"]["valid"] == "2/2"
    stdout = capsys.readouterr().out
    assert stdout.startswith("| op | case | variant | time us |")
    assert "| sampling | peaked rows=2 V=4096 top_p | candidates |" in stdout


@pytest.mark.skipif(ON_GPU, reason="checks the refusals without a GPU")
@pytest.mark.parametrize("argv,message", [
    (["attention", "--variants", "pallas"],
     "attention --variants pallas needs a CUDA GPU (the Pallas kernels use the Triton "
     "lowering) but JAX runs on 'cpu'; pass --variants xla to time the XLA variants only"),
    (["gemv", "--sweep"], "gemv --sweep needs a CUDA GPU"),
    (["profile", "--config", CONFIG_2B, "--op-by-op"], "profile needs a CUDA GPU"),
    (["ab", "--config", CONFIG_2B, "--variant", "a:", "--variant", "b:norm=pallas"],
     "--variant b: norm_backend 'pallas' needs a CUDA GPU"),
])
def test_gpu_only_paths_are_refused_on_cpu(argv, message, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1]
    assert not out.exists()  # refused before any row


def test_wall_seconds_calls_warmup_then_reps_of_calls():
    made = []

    def call():
        made.append(1)
        return jax.numpy.ones(2)

    assert timing.wall_seconds(call, reps=3, calls=4, warmup=2) > 0
    assert len(made) == 2 + 3 * 4
    with pytest.raises(ValueError, match="reps 0"):
        timing.wall_seconds(call, reps=0)


def _write_trace(folder) -> None:
    """A profiler trace: a GPU kernel line, XLA's annotation line on the GPU, a host line."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "stream 7"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "tf"}}]
    x = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name,
                                         "ts": ts, "dur": dur}
    events = [x(1, 7, "gemv_fma", 0, 10), x(1, 7, "loop_fusion", 5, 10),
              x(1, 7, "gemv_fma", 40, 10), x(1, 8, "the op", 0, 50),
              x(2, 1, "ExecuteThunks", 0, 3)]
    os.makedirs(folder / "plugins" / "x")
    with gzip.open(folder / "plugins" / "x" / "h.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_trace_reading_and_the_profile_analysis(tmp_path):
    from mtp_jax.bench.profile_round import analyse

    _write_trace(tmp_path)
    trace = timing.load_trace(str(tmp_path))
    assert timing.kernel_durations(trace) == {"gemv_fma": [10.0, 10.0], "loop_fusion": [10.0]}
    s = analyse(trace, rounds=2, sequence=2)
    assert s["kernels"] == 1.5 and s["busy_us"] == 12.5 and s["span_us"] == 25.0
    assert s["idle_us"] == 12.5
    assert s["by_category"] == [["gemm", 1.0, 10.0], ["xla fusion", 0.5, 5.0]]
    assert s["executable"] == [["ExecuteThunks", 0.5, 1.5]]
    assert s["sequence"] == [[0, 0, 10, "gemv_fma"], [5, -5, 10, "loop_fusion"]]
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
        timing.load_trace(str(tmp_path / "plugins" / "none"))


def test_op_row_fields_and_table():
    r = report.op_row("gemv", "2B N=8 K=4", "reduce", 2e-6, 4.2e6, error=1e-3,
                      reference="xla", wall_us=3.0, turns=[1, 2])
    assert r["time_us"] == pytest.approx(2.0) and r["floor_us"] == pytest.approx(1.0)
    assert r["fraction_of_floor"] == pytest.approx(0.5) and r["tb_per_s"] == pytest.approx(2.1)
    table = report.op_table([r, report.op_row("x", "c", "v", 1.0, None)])
    assert "| gemv | 2B N=8 K=4 | reduce | 2.00 | wall | 4.20 | 2.10 | 50.0% | 1.0e-03 (xla) " \
           "| wall_us=3 |" in table
    assert "| x | c | v | 1000000.00 | wall | - | - | - | - |  |" in table
    with pytest.raises(ValueError, match="time 0.0 s must be positive"):
        report.op_row("x", "c", "v", 0.0, 1)


def test_configs_are_parsed_by_their_family_in_the_registry(tmp_path, capsys, monkeypatch):
    from mtp_jax.bench import main as bench_main
    from mtp_jax.bench.floor import load_config
    from mtp_jax.config import ConfigError, config_dict
    from mtp_jax.models import registry

    for name in ("Qwen3.5-2B", "Qwen3.8-Flash-Next"):  # qwen3_5, qwen4_exp
        path = os.path.join(ROOT, "configs", f"{name}.json")
        want = registry.entry_for_raw(config_dict(path)).config_class
        assert type(load_config(path)) is want
    raw = json.loads(open(CONFIG_2B).read())
    raw["_note"] = {"nested": 1}
    raw["text_config"]["_derived"] = 3
    (tmp_path / "noted.json").write_text(json.dumps(raw))
    assert load_config(str(tmp_path / "noted.json")) == load_config(CONFIG_2B)
    (tmp_path / "other.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported"):
        load_config(str(tmp_path / "other.json"))
    # a family the engine bench cannot run (no random weights): one line, before any weights
    # (every registered family has them today, so the entry is faked without its dummy_weight)
    import dataclasses

    import mtp_jax.bench.cli as bench_cli

    real_entry_of = bench_cli.entry_of
    monkeypatch.setattr(bench_cli, "entry_of",
                        lambda cfg: dataclasses.replace(real_entry_of(cfg), dummy_weight=None))
    assert bench_main(["--config", os.path.join(ROOT, "configs", "Qwen3.8-Flash-Next.json"),
                       "--out", str(tmp_path / "o.json")]) == 2
    assert "model_type 'qwen4_exp' cannot be benchmarked yet" in capsys.readouterr().err
    monkeypatch.undo()
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="holds no JSON object"):
        load_config(str(tmp_path / "list.json"))


def test_profile_counts_every_round_of_a_call(monkeypatch, tmp_path):
    """With several rounds per program call, the trace is analysed per round, not per call
    (an H100 profile of 4-round calls once reported 4x a step's time), and the untraced wall
    time is per round too."""
    from argparse import Namespace

    import mtp_jax.bench.profile_round as pr
    from mtp_jax.models.loader import load_model
    from tests.helpers.paths import fixture_path

    model = load_model(fixture_path("tiny_dense"), "float32", with_mtp=False)
    seen, calls = {}, []
    monkeypatch.setattr(pr, "load_trace", lambda d: "trace")
    monkeypatch.setattr(pr, "analyse", lambda t, rounds, seq: seen.setdefault("rounds", rounds))
    real = pr.Engine

    def engine(*args, **kw):
        eng = real(*args, **kw)
        seen["per_call"] = eng.scheduler.settings.rounds_per_call
        run = eng.scheduler.run_round
        eng.scheduler.run_round = lambda reqs: calls.append(1) or run(reqs)
        return eng

    monkeypatch.setattr(pr, "Engine", engine)
    a = Namespace(batch=1, prompt_len=8, rounds=2, num_scheduler_steps=3, sequence=0,
                  trace_dir=str(tmp_path), phase="round")
    wall, rounds, _ = pr.profile(a, model, model.cfg, 0)
    assert seen["per_call"] == 3 and rounds == 2 * 3  # 2 traced calls of 3 rounds each
    assert len(calls) == 5 + 2 + 2 and wall > 0


@pytest.mark.parametrize("k,drafts", [(0, "yes"), (3, "yes"), (3, "no")])
def test_profile_prefill_phase_times_one_batched_prefill_call(monkeypatch, tmp_path, k, drafts):
    """``--phase prefill``: one prefill call over every prompt (their final chunks, so the
    first tokens and, with k > 0, the MTP drafts), the same call again and again (5 warm-up,
    then timed and traced ones), analysed per call."""
    from argparse import Namespace

    import mtp_jax.bench.profile_round as pr
    from mtp_jax.engine.device import DeviceState
    from mtp_jax.models.loader import load_model
    from tests.helpers.paths import fixture_path

    model = load_model(fixture_path("tiny_trained"), "float32", with_mtp=True)
    seen, calls = {}, []
    monkeypatch.setattr(pr, "load_trace", lambda d: "trace")
    monkeypatch.setattr(pr, "analyse", lambda t, rounds, seq: seen.setdefault("calls", rounds))
    real = DeviceState.prefill
    monkeypatch.setattr(DeviceState, "prefill", lambda self, batch, variant: calls.append(
        (batch.input_ids.shape, batch.length.tolist(), variant)) or real(self, batch, variant))
    a = Namespace(batch=3, prompt_len=20, rounds=2, sequence=0, trace_dir=str(tmp_path),
                  phase="prefill", prefill_drafts=drafts)
    wall, per_call, _ = pr.profile(a, model, model.cfg, k)
    assert seen["calls"] == 2 and wall > 0
    assert len(calls) == 5 + 2 + 2
    shape, lengths, variant = calls[0]
    assert shape == (4, 32) and lengths == [20, 20, 20, 0]  # 3 prompts, a padding row
    assert variant.mtp == (k > 0) and variant.drafts == (k > 0 and drafts == "yes")
    assert variant.k == k


def test_shape_names_of_config_files_and_checkpoint_folders():
    from mtp_jax.bench.report import shape_name

    assert shape_name("configs/Qwen3.5-2B.json") == "Qwen3.5-2B"
    assert shape_name("tests/fixtures/tiny_trained/config.json") == "tiny_trained"
