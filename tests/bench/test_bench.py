"""The benchmark (``python -m mtp_jax.bench``) on a tiny random config, its forced-draft exactness
check, and its compilation cache folder.

Every cache folder here is under pytest's tmp_path; the jax cache settings are restored after
the module, so nothing is written to the user's home."""

import contextlib
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import compile_cache
from mtp_jax.bench import forced
from mtp_jax.config import ConfigError
from tests.helpers.paths import CONFIGS

TINY = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 300, "hidden_size": 64,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "full_attention_interval": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "attn_output_gate": True, "attention_bias": False,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "intermediate_size": 128,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True},
        "partial_rotary_factor": 0.25, "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "eos_token_id": 1,
        "tie_word_embeddings": False, "dtype": "float32",
    },
}
DECODE = 8
ARGS = ["--batch", "2", "--prompt-len", "16", "--decode-tokens", str(DECODE),
        "--warmup-rounds", "2", "--prefill-reps", "1", "--dtype", "float32",
        "--accept-lengths", "2.5", "3.0", "3.5", "--disable-prefix-cache"]


@pytest.fixture(scope="module", autouse=True)
def _restore_jax_cache(restore_jax_cache_config):
    yield


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    with open(d / "tiny.json", "w") as f:
        json.dump(TINY, f)
    return d


@contextlib.contextmanager
def _own_cache_folder():
    """Ignore the warning that the compilation cache moves to this module's folder: another
    test in the same process may have opened the suite's shared folder first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compile_cache.CompilationCacheWarning)
        yield


def _bench(workdir, capsys, name, *extra):
    """A bench run of the tiny config with ``ARGS`` (prefix cache off) and ``extra`` flags;
    one round per call unless ``extra`` says otherwise (the bench's mechanics; the defaults
    have their own test)."""
    from mtp_jax.bench import main

    if "--num-scheduler-steps" not in extra:
        extra = (*extra, "--num-scheduler-steps", "1")
    out = workdir / f"{name}.json"
    with _own_cache_folder():
        rc = main(["--config", str(workdir / "tiny.json"), *ARGS, "--out", str(out),
                   "--compilation-cache-dir", str(workdir / "xla"), *extra])
    cap = capsys.readouterr()
    return rc, json.loads(out.read_text()), cap.out, cap.err


@pytest.fixture(scope="module")
def cold(workdir):
    """The first run: k 0 and 2, one and three rounds per call, cold compilation cache (rows:
    k = 0 at 1 and 3 steps per call, k = 2 forced, k = 2 at 3 rounds per call with its own
    drafts). Returns (rc, JSON, stdout, stderr)."""
    import io

    from mtp_jax.bench import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _own_cache_folder():
        rc = main(["--config", str(workdir / "tiny.json"), *ARGS, "--k", "0", "2",
                   "--num-scheduler-steps", "1", "3", "--out", str(workdir / "cold.json"),
                   "--compilation-cache-dir", str(workdir / "xla")])
    return rc, json.loads((workdir / "cold.json").read_text()), out.getvalue(), err.getvalue()


def test_bench_runs_exact_and_reports(cold):
    rc, data, stdout, stderr = cold
    assert rc == 0, stderr
    meta = data["meta"]
    for key in ("date_utc", "git_commit", "jax_version", "device_kind", "xla_flags",
                "compilation_cache_dir"):
        assert key in meta
    assert meta["jax_version"] == jax.__version__
    assert [(r["k"], r["steps_per_call"]) for r in data["results"]] == [
        (0, 1), (0, 3), (2, 1), (2, 3)]
    rows = {r["k"]: r for r in data["results"] if r["steps_per_call"] == 1}
    for r in data["results"]:
        for key in ("round_ms", "round_ms_p10", "round_ms_p90", "context", "floor_ms",
                    "fraction_of_floor", "bytes", "prefill_tokens_per_s", "programs",
                    "compiles_timed", "compiles_warmup", "startup_s", "peak_device_bytes"):
            assert key in r, key
        assert r["round_ms_p10"] <= r["round_ms"] <= r["round_ms_p90"]
        # host time: a part of each round's interval, so its median is at most the round's
        assert 0 < r["host_ms_p10"] <= r["host_ms"] <= r["host_ms_p90"]
        assert r["host_ms"] <= r["round_ms"]
        assert r["compiles_timed"] == 0  # nothing compiles after warm-up
        assert r["compiles_warmup"] >= 1
    assert rows[0]["exact"] is None and rows[2]["exact"] is True
    plain = rows[0]
    assert plain["rounds_timed"] == DECODE
    assert plain["context"]["end"] - plain["context"]["start"] == DECODE - 1
    assert {p["program"] for p in plain["programs"]} == {"prefill[T=16,k=0]", "round[B=2,k=0]"}
    spec = rows[2]
    assert {p["program"] for p in spec["programs"]} == {
        "prefill[T=16,k=2]", "round[B=2,k=2]", "force_on_device[B=2,k=2]"}
    # the cold start compiled every engine program (none came from the fresh cache)
    for p in plain["programs"] + spec["programs"]:
        if not p["program"].startswith("force_on_device"):
            assert p["compiles"] >= 1 and p["cache_hits"] == 0, p
    assert [s["accept_length"] for s in spec["skipped_accept_lengths"]] == [3.5]  # > k + 1
    assert "note: skipped: accept length 3.5 cannot be forced with k=2" in stderr
    assert f"host={plain['host_ms']:.2f}ms" in stderr  # the progress line
    for f, want in zip(spec["forced"], (2.5, 3.0)):
        assert f["accept_length"] == want
        assert f["exact"] and f["mismatched_requests"] == []
        assert abs(f["accept_length_measured"] - want) <= 1 / f["rounds_timed"]
        assert f["accept_length_measured"] * f["rounds_timed"] >= DECODE
        assert f["tokens_per_s_e2e"] > 0 and f["tokens_per_s_derived"] > 0
    assert set(spec["tokens_per_s_at_accept_length"]) == {"2.5", "3.0"}
    lines = stdout.splitlines()
    assert lines[0].startswith("| shape | batch | prompt | k | round ms")
    assert set(lines[1]) <= set("|-")
    assert lines[2].startswith("| tiny | 2 | 16 | 0 |")
    assert lines[4].startswith("| tiny | 2 | 16 | 2 |")
    assert os.listdir(meta["compilation_cache_dir"])  # programs were written to the cache
    # each k > 0 row's round over the k = 0 step at the same rounds per call
    by = {(r["k"], r["steps_per_call"]): r["round_ms"] for r in data["results"]}
    got = [(x["k"], x["steps_per_call"], x["step_ms"], x["ratio"]) for x in data["round_to_step"]]
    assert got == [(2, n, by[0, n], pytest.approx(by[2, n] / by[0, n])) for n in (1, 3)]
    assert f"| tiny | 2 | 16 | 2 | {by[2, 1]:.2f} | {by[0, 1]:.2f} | {by[2, 1] / by[0, 1]:.3f}x |" \
        in stdout


def test_multistep_decode_row(cold):
    """``--num-scheduler-steps 1 3``: a second k = 0 row runs three decode steps per call and
    reports times per step; the calls cover the decode tokens and nothing compiles in the
    timed part."""
    rc, data, stdout, stderr = cold
    r = data["results"][1]
    assert r["k"] == 0 and r["steps_per_call"] == 3 and r["compiles_timed"] == 0
    assert r["rounds_timed"] == 3 * r["calls_timed"]
    assert r["rounds_timed"] >= DECODE > r["rounds_timed"] - 3
    assert 0 < r["host_ms"] <= r["round_ms"]
    assert "k=0 steps/call=3" in stderr
    # the main table (with the prompt), the bytes table, the programs table (prefill, round)
    assert stdout.count("| tiny | 2 | 0 (3/call) |") == 3
    assert stdout.count("| tiny | 2 | 16 | 0 (3/call) |") == 1
    assert {p["program"] for p in r["programs"]} == {"prefill[T=16,k=0]",
                                                    "round[B=2,k=0,steps=3]"}


def test_multiround_spec_row_with_own_drafts(cold):
    """k = 2 at three rounds per call: the MTP drafts as drafted (nothing forced inside a
    call); in float32 every committed token equals both the forced row's rounds with every
    draft rejected and plain decoding; each request committed the decode tokens; times and
    the derived tokens/s are per round. (The tiny random model's drafts are rarely right;
    accepted drafts inside multi-round calls are tests/test_multistep.py's.)"""
    rc, data, stdout, stderr = cold
    forced_row, r = data["results"][2:]
    assert r["k"] == 2 and r["steps_per_call"] == 3 and "forced" not in r
    assert r["exact"] is True and r["rounds_exact"] is True
    assert r["rounds_match"]["tokens_compared"] >= 2 * DECODE
    assert r["decode_match"]["exact"] and r["decode_match"]["tokens_compared"] >= 2 * DECODE
    assert r["compiles_timed"] == 0 and r["rounds_timed"] == 3 * r["calls_timed"]
    assert 1 <= r["accept_length_measured"] <= 3
    assert r["accept_length_measured"] * r["rounds_timed"] >= DECODE
    assert set(r["tokens_per_s_at_accept_length"]) == {"2.5", "3.0"}  # 3.5 > k + 1
    for al, tps in r["tokens_per_s_at_accept_length"].items():
        assert tps == pytest.approx(float(al) * 2 / (r["round_ms"] / 1e3))
    assert {p["program"] for p in r["programs"]} == {"prefill[T=16,k=2]",
                                                    "round[B=2,k=2,steps=3]"}
    assert "k=2 steps/call=3" in stderr
    # the main, bytes, programs (prefill and round) and round / step tables
    assert stdout.count("| tiny | 2 | 2 (3/call) |") == 3
    assert stdout.count("| tiny | 2 | 16 | 2 (3/call) |") == 2  # the main and ratio tables
    assert forced_row["steps_per_call"] == 1 and forced_row["forced"]


def test_corrupted_references_are_detected_and_cached_startup(cold, workdir, monkeypatch,
                                                             capsys):
    """Two wrong continuations, each must be caught (exit status 1 in float32):

    * plain decoding corrupted at request 1, token 4 (as a bf16 near-tie between the decode
      and verify shapes would make it): the rounds with every draft rejected part from it
      there (``DIVERGENCE``), and the forced runs, checked against those rounds, still reach
      their accept length;
    * the rejected-drafts continuation corrupted at request 0, token 6: the forced runs
      differ from it there (``MISMATCH``).

    The row with three rounds per call and its own drafts catches both too. The second
    start-up loads the engine programs from the persistent cache."""
    from mtp_jax.bench import run

    real_plain, real_rounds = run.plain_reference, run.rejected_drafts_reference
    vocab = TINY["text_config"]["vocab_size"]

    def corrupted_plain(*a, **kw):
        ref = real_plain(*a, **kw)
        ref[1][4] = (ref[1][4] + 7) % vocab
        return ref

    def corrupted_rounds(*a, **kw):
        ref = real_rounds(*a, **kw)
        ref[0][6] = (ref[0][6] + 7) % vocab
        return ref

    monkeypatch.setattr(run, "plain_reference", corrupted_plain)
    monkeypatch.setattr(run, "rejected_drafts_reference", corrupted_rounds)
    rc, data, stdout, stderr = _bench(workdir, capsys, "corrupt", "--k", "2",
                                      "--accept-lengths", "3.0", "--num-scheduler-steps", "3")
    assert rc == 1
    row, drafted = data["results"]
    assert drafted["exact"] is False and drafted["rounds_exact"] is False
    for match, request, index in ((drafted["rounds_match"], 0, 6),
                                  (drafted["decode_match"], 1, 4)):
        assert match["mismatched_requests"] == [request]
        assert match["first_mismatch"]["index"] == index
    assert "MISMATCH tiny batch=2 k=2 (3/call): the rounds with their own drafts" in stderr
    assert row["exact"] is False and row["rounds_exact"] is False
    d = row["decode_match"]
    assert d["mismatched_requests"] == [0, 1]  # the plain corruption and the rounds' one
    assert d["first_mismatch"]["request"] == 1 and d["first_mismatch"]["index"] == 4
    f = row["forced"][0]
    assert f["mismatched_requests"] == [0]
    assert f["first_mismatch"]["request"] == 0 and f["first_mismatch"]["index"] == 6
    assert "MISMATCH" in stderr and "DIVERGENCE" in stderr
    assert "**NO**" in stdout
    # (the drafted row's prefill program is the forced row's, compiled once in this process)
    for p in row["programs"] + [p for p in drafted["programs"] if p["program"][:5] == "round"]:
        if p["program"].startswith(("prefill", "round")):
            assert p["compiles"] >= 1 and p["cache_hits"] == p["compiles"], p
    assert row["startup_from_cache"] == drafted["startup_from_cache"] == "cached"


def test_a_decode_divergence_does_not_end_the_forced_accept_length(cold, workdir,
                                                                   monkeypatch, capsys):
    """Plain decoding corrupted at request 1, token 4 only: the forced runs reproduce the
    rounds' own continuation at the forced accept length; the row reports where decoding
    parts (``rounds yes, decode from 4``)."""
    from mtp_jax.bench import run

    real_plain = run.plain_reference

    def corrupted_plain(*a, **kw):
        ref = real_plain(*a, **kw)
        ref[1][4] = (ref[1][4] + 7) % TINY["text_config"]["vocab_size"]
        return ref

    monkeypatch.setattr(run, "plain_reference", corrupted_plain)
    rc, data, stdout, stderr = _bench(workdir, capsys, "diverge", "--k", "2",
                                      "--accept-lengths", "3.0")
    assert rc == 1 and "DIVERGENCE" in stderr and "MISMATCH" not in stderr
    (row,) = data["results"]
    assert row["rounds_exact"] is True and row["exact"] is False
    assert row["decode_match"]["first_mismatch"]["index"] == 4
    f = row["forced"][0]
    assert f["exact"] and abs(f["accept_length_measured"] - 3.0) <= 1 / f["rounds_timed"]
    assert "rounds yes, decode from 4" in stdout


def test_accept_plan_and_drafts():
    a = forced.accept_fraction(2.5, 3)
    assert [forced.commits_of_round(a, r) for r in range(6)] == [2, 3, 2, 3, 2, 3]
    a = forced.accept_fraction(3.5, 3)
    assert [forced.commits_of_round(a, r) for r in range(4)] == [3, 4, 3, 4]
    with pytest.raises(ValueError, match="accept length 3.5 cannot be forced with k=2"):
        forced.accept_fraction(3.5, 2)
    ref = [[5, 6, 7, 8, 9, 10], [20, 21, 22, 23, 24, 25]]
    # request 0 committed [5, 6] (pending 6): drafts 7, 8 right (m=2), 9 wrong
    d = forced.forced_drafts([[5, 6], [20]], ref, m=2, k=3, vocab=300)
    np.testing.assert_array_equal(d, [[7, 8, 10], [21, 22, 24]])
    with pytest.raises(ValueError, match="reference continuation has 6 tokens"):
        forced.forced_drafts([[5, 6, 7, 8, 9]], ref[:1], m=2, k=3, vocab=300)
    ok = forced.compare_to_reference([[5, 6, 7], [20]], ref)
    assert ok["exact"] and ok["tokens_compared"] == 4
    bad = forced.compare_to_reference([[5, 6, 7], [20, 21, 99]], ref)
    assert not bad["exact"] and bad["first_mismatch"] == {"request": 1, "index": 2,
                                                          "expected": 22, "got": 99}


def test_force_on_device_matches_host_drafts():
    """The device-side forced drafts (run between two rounds in flight) equal the host's
    :func:`forced_drafts` for each slot's committed count, keep the pending token and leave
    other slots alone."""
    rng = np.random.default_rng(3)
    vocab, k = 300, 3
    ref = rng.integers(0, vocab, (2, 12)).tolist()
    ref[0][4] = vocab - 1  # a wrong draft of the last id wraps to 0
    nt = jnp.asarray(rng.integers(0, vocab, (5, k + 1)), jnp.int32)
    step = jnp.asarray([0, 0, 3, 0, 5], jnp.int32)  # slots 2 and 4 committed 3 and 5 tokens
    slot = np.asarray([2, 4], np.int32)
    for m in range(k + 1):
        want = forced.forced_drafts([ref[0][:3], ref[1][:5]], ref, m, k, vocab)
        out = np.asarray(forced.force_on_device(jnp.array(nt), step, slot,
                                                jnp.asarray(ref, jnp.int32), jnp.int32(m),
                                                jnp.int32(vocab)))
        np.testing.assert_array_equal(out[slot, 1:], want)
        np.testing.assert_array_equal(out[:, 0], np.asarray(nt)[:, 0])
        np.testing.assert_array_equal(out[[0, 1, 3]], np.asarray(nt)[[0, 1, 3]])


def test_no_merge_projections_flag_reaches_load_model(monkeypatch):
    from mtp_jax.bench import cli

    parser = cli.build_parser()
    merged = cli.backend_kwargs(parser.parse_args(["--config", "x.json"]))
    assert "merge_projections" not in merged  # load_model's default: merged
    plain = cli.backend_kwargs(parser.parse_args(["--config", "x.json",
                                                  "--no-merge-projections"]))
    assert plain["merge_projections"] is False
    assert "pack_small_params" not in merged
    packed = cli.backend_kwargs(parser.parse_args(["--config", "x.json", "--pack-small-params"]))
    assert packed["pack_small_params"] is True

    def old_load_model(path=None, dtype="auto", *, attention_backend="auto",
                       gdn_backend="auto", moe_backend="auto"):
        raise AssertionError("not called")

    monkeypatch.setattr(cli, "load_model", old_load_model)
    with pytest.raises(ConfigError, match="--no-merge-projections"):
        cli.backend_kwargs(parser.parse_args(["--config", "x.json", "--no-merge-projections"]))
    with pytest.raises(ConfigError, match="--pack-small-params"):
        cli.backend_kwargs(parser.parse_args(["--config", "x.json", "--pack-small-params"]))


def test_help_description_is_plain_text():
    import mtp_jax.bench as bench_pkg
    from mtp_jax.bench import cli

    assert cli.plain_text("see ``--prompt-len`` and :mod:`mtp_jax.bench.forced`; a `b`") == (
        "see --prompt-len and mtp_jax.bench.forced; a `b`")
    text = cli.build_parser(bench_pkg.__doc__).format_help()
    assert "``" not in text and ":mod:" not in text and "--prefill-reps" in text


def test_kernel_choices_are_refused_before_weights(monkeypatch, capsys):
    """A kernel this machine cannot run, or a backend this op does not have, ends the bench
    with rc 2 and one error line, before any weight is drawn."""
    import functools

    from mtp_jax.bench import cli, main

    @functools.wraps(cli.load_model)  # the same signature, which backend_kwargs reads
    def no_load(*a, **k):
        raise AssertionError("weights drawn before the kernel choices were checked")

    monkeypatch.setattr(cli, "load_model", no_load)
    config = os.path.join(CONFIGS, "Qwen3.5-2B.json")
    assert main(["--config", config, "--gemv-backend", "pallas"]) == 2
    assert "gemv_backend 'pallas' needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: reduce is a gemv choice only
        main(["--config", config, "--norm-backend", "reduce"])
    assert "invalid choice: 'reduce'" in capsys.readouterr().err


def test_int8_draft_layer_rows(workdir, capsys):
    """``--draft-layer-dtype model int8``: a k = 3 row per layer dtype, labelled, recorded in
    the JSON, exact, and the int8 row's floor counting 1 byte per weight and 4 per row of
    the draft's projections, k times per round."""
    from mtp_jax.bench.floor import load_config
    from mtp_jax.weights import names

    rc, data, stdout, stderr = _bench(workdir, capsys, "int8layer", "--k", "3", "--batch", "1",
                                      "--accept-lengths", "2.0", "--draft-layer-dtype",
                                      "model", "int8")
    assert rc == 0, stderr
    assert "| 3 (int8 layer) |" in stdout
    rows = data["results"]
    assert [r["draft_layer_dtype"] for r in rows] == [None, "int8"]
    assert all(r["exact"] for r in rows)
    proj = names.mtp_projections(load_config(str(workdir / "tiny.json")))
    saved = sum(o * i * 4 - o * (i + 4) for o, i in proj.values())
    assert rows[0]["bytes"]["draft_weights"] - rows[1]["bytes"]["draft_weights"] == 3 * saved


def test_row_plan_orders_forced_before_drafted_rows():
    """A k > 0 row with several rounds per call compares with its forced row's continuation,
    so the forced row (one round per call) runs first, whatever order the steps came in."""
    from mtp_jax.bench.cli import row_plan

    m = (None, None)  # model-dtype head and layer
    assert row_plan([0, 3], (4, 1)) == [(0, 4, *m), (0, 1, *m), (3, 1, *m), (3, 4, *m)]
    assert row_plan([3], (4,)) == [(3, 1, *m), (3, 4, *m)]
    assert row_plan([2], (1,)) == [(2, 1, *m)]
    # sampled rows: no forced row, the k > 0 rows follow the steps as given
    assert row_plan([0, 3], (4, 1), forced=False) == [(0, 4, *m), (0, 1, *m), (3, 4, *m),
                                                      (3, 1, *m)]
    # --draft-head-dtype model int8: one k = 0 row, a set of k > 0 rows per head
    assert row_plan([0, 3], (4,), ["model", "int8"]) == [
        (0, 4, *m), (3, 1, *m), (3, 4, *m), (3, 1, "int8", None), (3, 4, "int8", None)]
    assert row_plan([3], (1,), ["int8", "int8"]) == [(3, 1, "int8", None)]
    # with --draft-layer-dtype model int8: a set per (head, layer) pair, heads outermost
    assert row_plan([0, 3], (1,), ["model", "int8"], ["model", "int8"]) == [
        (0, 1, *m), (3, 1, *m), (3, 1, None, "int8"), (3, 1, "int8", None),
        (3, 1, "int8", "int8")]


def test_commit_is_read_only_at_the_top_of_a_checkout(tmp_path):
    """The run's commit comes from the checkout the sources are the top of; a copy of them
    inside another repository (a snapshot folder) reports none, not that repository's."""
    import shutil
    import subprocess

    from mtp_jax.bench.report import _git

    if shutil.which("git") is None:
        pytest.skip("no git")
    repo = tmp_path / "repo"
    (repo / "copy").mkdir(parents=True)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    for cmd in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True, env=env)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()
    assert _git("rev-parse", "--short", "HEAD", root=str(repo)) == head
    assert _git("rev-parse", "--short", "HEAD", root=str(repo / "copy")) is None
    assert _git("rev-parse", "--short", "HEAD", root=str(tmp_path)) is None  # no checkout


def test_sampled_rows(workdir, capsys, monkeypatch):
    """``--temperature 0.7 --top-p 0.9 --top-k 20``: a sampled k = 0 row and a sampled k = 2 row
    with the drafts as drafted. Every round runs the programs' sampling variant (the engine
    never picks the greedy-only one), nothing compiles in the timed phase, no exactness is
    claimed, and the round / step ratio pairs the sampled rows with each other."""
    from mtp_jax.engine import scheduler as scheduler_mod

    picked = []
    real = scheduler_mod.sampling_choice

    def spy(*args):
        got = real(*args)
        picked.append(got["greedy_only"])
        return got

    monkeypatch.setattr(scheduler_mod, "sampling_choice", spy)
    rc, data, stdout, stderr = _bench(workdir, capsys, "sampled", "--k", "0", "2",
                                      "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20")
    assert rc == 0, stderr
    assert picked and not any(picked)  # every round: the sampling variant
    rows = data["results"]
    assert [(r["k"], r["steps_per_call"]) for r in rows] == [(0, 1), (2, 1)]
    for r in rows:
        assert r["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
        assert r["exact"] is None and r["compiles_timed"] == 0
        assert "forced" not in r and "decode_match" not in r
    plain, spec = rows
    assert plain["rounds_timed"] == DECODE
    assert 1 <= spec["accept_length_measured"] <= 3
    assert spec["accept_length_measured"] * spec["rounds_timed"] >= DECODE
    assert {p["program"] for p in spec["programs"]} == {"prefill[T=16,k=2]",
                                                       "round[B=2,k=2,sampled]"}
    assert [x["sampling"] for x in data["round_to_step"]] == [rows[1]["sampling"]]
    assert data["round_to_step"][0]["step_ms"] == plain["round_ms"]
    assert "| tiny | 2 | 2 (sampled T=0.7 top_p=0.9 top_k=20) |" in stdout
    assert "sampled(T=0.7 top_p=0.9 top_k=20)" in stderr


def test_sampling_flags_are_checked_before_weights(workdir, capsys):
    from mtp_jax.bench import main

    rc = main(["--config", str(workdir / "tiny.json"), "--temperature", "0.7", "--top-p", "0",
               "--out", str(workdir / "bad.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error: --top-p 0.0 must be in (0, 1]" in err
    assert not (workdir / "bad.json").exists()


def test_accept_lengths_are_checked_for_greedy_rows_only(workdir, capsys, monkeypatch):
    """Forced accept lengths concern greedy k > 0 rows only: a sampled-only run takes any
    (it reaches the benchmark), a run with greedy rows is refused with the range to pass;
    --top-p / --top-k without a sampled row get a note."""
    from mtp_jax.bench import cli, main

    class Reached(Exception):
        pass

    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(cli, "bench_one", reached)
    base = ["--config", str(workdir / "tiny.json"), "--k", "1", "--accept-lengths", "3.5",
            "--out", str(workdir / "unused.json")]
    with pytest.raises(Reached), _own_cache_folder():
        main([*base, "--temperature", "0.7", "--compilation-cache-dir", "none"])
    assert "note: no --accept-lengths value is in [1, 2]" in capsys.readouterr().err
    assert main([*base, "--temperature", "0", "0.7"]) == 2
    err = capsys.readouterr().err
    assert "none can be forced with k=1 (a round commits 1..2 tokens); pass values in [1, 2]" \
        in err
    with pytest.raises(Reached), _own_cache_folder():
        main([*base[:2], "--k", "0", "--top-p", "0.9", "--out", str(workdir / "unused.json"),
              "--compilation-cache-dir", "none"])
    assert "note: --top-p / --top-k apply to sampled rows only" in capsys.readouterr().err


def test_qwen4_exp_config_rows(workdir, capsys):
    """``--config`` of a qwen4_exp shape (random weights and synthetic n-gram tables,
    ``mtp_jax.models.qwen4_exp.dummy``): the k = 2 row runs, its forced accept lengths
    reproduce plain decoding, nothing compiles after warm-up, and the floor counts its bytes."""
    from mtp_jax.bench import main
    from tests.helpers.paths import fixture_path

    config = os.path.join(fixture_path("tiny_qwen4_trained"), "config.json")
    out = workdir / "qwen4.json"
    with _own_cache_folder():
        rc = main(["--config", config, "--batch", "1", "--k", "2", "--prompt-len", "16",
                   "--decode-tokens", "6", "--warmup-rounds", "1", "--prefill-reps", "1",
                   "--dtype", "float32", "--accept-lengths", "2.0", "--out", str(out),
                   "--compilation-cache-dir", "none", "--num-scheduler-steps", "1"])
    err = capsys.readouterr().err
    assert rc == 0, err
    (row,) = json.loads(out.read_text())["results"]
    assert row["k"] == 2 and row["exact"] is True and row["compiles_timed"] == 0
    assert all(f["exact"] for f in row["forced"])
    assert row["bytes"]["weights"] > 0 and row["bytes"]["draft_weights"] > 0


def test_default_rows_use_the_prefix_cache_and_the_engines_rounds_per_call(workdir, capsys):
    """Without --num-scheduler-steps / --disable-prefix-cache the rows run as a user's engine
    does: the prefix cache on and the engine's rounds per call (4 here; k > 0 adds its forced
    row at one per call). The round variants, with the snapshot replay among them, compile
    while the engine is set up, so a call that reaches a boundary in the timed phase compiles
    nothing; the drafted row still equals plain decoding."""
    from mtp_jax.bench import main

    out = workdir / "defaults.json"
    args = [a for a in ARGS if a != "--disable-prefix-cache"]
    with _own_cache_folder():
        rc = main(["--config", str(workdir / "tiny.json"), *args, "--batch", "1",
                   "--decode-tokens", "64", "--k", "0", "2", "--out", str(out),
                   "--compilation-cache-dir", str(workdir / "xla")])
    err = capsys.readouterr().err
    assert rc == 0, err
    rows = json.loads(out.read_text())["results"]
    assert [(r["k"], r["steps_per_call"], r["prefix_cache"]) for r in rows] == [
        (0, 4, True), (2, 1, True), (2, 4, True)]
    for r in rows:
        assert r["compiles_timed"] == 0
        assert r["compiles"]["engine_setup"]["compiles"] >= 1
        assert r["context"]["end"] > 64  # the timed calls passed a snapshot boundary
    assert rows[1]["exact"] is True and rows[2]["exact"] is True


def test_quantized_rows_count_the_quantized_bytes(workdir, capsys):
    """``--quantization modelopt-fp8``: the random projections are held as FP8 codes with one
    scale per row (exact rows), and the floor's weight bytes drop by what they save: 1 byte
    per weight and 4 per row instead of 4 (float32) per weight, for every 2-D projection but
    the embedding and the LM head, the draft's counted once per draft call."""
    from mtp_jax.bench.floor import load_config
    from mtp_jax.models.registry import entry_of

    rc, data, stdout, stderr = _bench(workdir, capsys, "fp8", "--k", "0", "2", "--batch", "1",
                                      "--accept-lengths", "2.0", "--quantization",
                                      "modelopt-fp8")
    assert rc == 0, stderr
    assert [r["quantization"] for r in data["results"]] == ["modelopt-fp8"] * 2
    assert "| 0 (modelopt-fp8) |" in stdout
    rc, dense, _, stderr = _bench(workdir, capsys, "dense", "--k", "0", "2", "--batch", "1",
                                  "--accept-lengths", "2.0")
    assert rc == 0, stderr
    assert data["meta"]["args"]["quantization"] == "modelopt-fp8"
    assert [r["exact"] for r in data["results"]] == [None, True]  # k = 0 has no reference
    cfg = load_config(str(workdir / "tiny.json"))
    shapes = entry_of(cfg).tensor_shapes(cfg, True)

    def saving(draft: bool) -> int:
        return sum(n * k * 3 - n * 4 for name, (n, k) in
                   ((name, s) for name, s in shapes.items() if len(s) == 2)
                   if "embed_tokens" not in name and "lm_head" not in name
                   and name.startswith("mtp.") == draft)

    for q, d in zip(data["results"], dense["results"]):
        assert d["bytes"]["weights"] - q["bytes"]["weights"] == saving(False)
        if q["k"]:
            assert (d["bytes"]["draft_weights"] - q["bytes"]["draft_weights"]
                    == q["k"] * saving(True))


def test_several_prompt_lengths_in_chunks(workdir, capsys):
    """``--prompt-len 16 40 --chunked-prefill-size 16``: a set of rows per prompt length on one
    model (long-context rows), each prompt prefilled in 16-token calls; each length's forced
    rows reproduce its own continuation, the timed context starts past its prompt, and the
    round / step ratios pair rows of the same length."""
    rc, data, out, err = _bench(workdir, capsys, "prompts", "--batch", "1", "--k", "0", "2",
                                "--prompt-len", "16", "40", "--chunked-prefill-size", "16",
                                "--accept-lengths", "2.0")
    assert rc == 0, err
    rows = data["results"]
    assert [(r["prompt_len"], r["k"]) for r in rows] == [(16, 0), (16, 2), (40, 0), (40, 2)]
    for r in rows:
        assert r["prefill_chunk"] == 16
        assert r["context"]["start"] >= r["prompt_len"]
        assert r["context"]["end"] < r["prompt_len"] + 64
    assert [r["exact"] for r in rows if r["k"]] == [True, True]
    ratios = data["round_to_step"]
    assert [(x["prompt_len"], x["step_ms"]) for x in ratios] == [
        (16, rows[0]["round_ms"]), (40, rows[2]["round_ms"])]
    assert "| tiny | 1 | 40 | 2 |" in out


def test_chunked_prefill_size_and_context_are_checked_before_weights(workdir, capsys):
    from mtp_jax.bench import main

    rc = main(["--config", str(workdir / "tiny.json"), "--chunked-prefill-size", "0"])
    assert rc == 2
    assert "--chunked-prefill-size 0 must be >= 1" in capsys.readouterr().err
    # the tiny config's max_position_embeddings is 4096
    rc = main(["--config", str(workdir / "tiny.json"), "--prompt-len", "16", "4000"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--prompt-len 4000: the rows need" in err and "max_position_embeddings 4096" in err
