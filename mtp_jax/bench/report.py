"""The run's metadata and the markdown tables printed on stdout (pasteable into
docs/benchmarks.md): the engine benchmark's rows, and the subcommands' op rows
(:func:`op_row`, :func:`op_table`)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import jax


SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(*args: str, root: str = SOURCE_ROOT) -> str | None:
    """``git *args`` in ``root`` when ``root`` is the top of a git checkout, else ``None``.

    A copy of the sources inside another repository (e.g. a snapshot folder copied to a GPU
    machine) is not that repository's commit, so it reports none rather than a wrong one."""
    def run(*a: str) -> str | None:
        try:
            out = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True,
                                 timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = run("rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(root):
        return None
    return run(*args)


def run_metadata(args: dict, cache_dir: str | None, kernels: dict | None) -> dict:
    """Date, commit, versions, device, XLA_FLAGS, compilation cache and the command's args."""
    dev = jax.devices()[0]
    try:
        import jaxlib

        jaxlib_version = jaxlib.__version__
    except (ImportError, AttributeError):
        jaxlib_version = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "jax_version": jax.__version__, "jaxlib_version": jaxlib_version,
        "python": sys.version.split()[0], "host": platform.node(),
        "platform": dev.platform, "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "compilation_cache_dir": cache_dir, "kernel_backends": kernels, "args": args,
    }


def shape_name(path: str) -> str:
    """A config's name in tables: its file name without ``.json`` (``configs/Qwen3.5-2B.json``
    -> ``Qwen3.5-2B``), or its folder's name for a checkpoint's own ``config.json``."""
    name = os.path.splitext(os.path.basename(path))[0]
    if name == "config":
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or name
    return name


def _n(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _k_cell(r: dict) -> str:
    """k, with the rounds (decode steps, or speculative rounds) per program call when above 1
    the weights' quantized form (``bench --quantization``), the draft head's and layer's dtypes
    when set, and the sampling of a sampled row (``0 (4/call)``, ``0 (fp8-block)``,
    ``3 (4/call, int8 head, int8 layer)``, ``3 (sampled T=0.6 top_k=20)``)."""
    steps = r.get("steps_per_call", 1)
    notes = [f"{steps}/call"] if steps > 1 else []
    notes += [r["quantization"]] if r.get("quantization") else []
    notes += [f"{r['draft_head_dtype']} head"] if r.get("draft_head_dtype") else []
    notes += [f"{r['draft_layer_dtype']} layer"] if r.get("draft_layer_dtype") else []
    notes += [f"sampled {sampling_text(r['sampling'])}"] if r.get("sampling") else []
    return f"{r['k']} ({', '.join(notes)})" if notes else str(r["k"])


def sampling_text(sampling: dict) -> str:
    """``T=0.6 top_p=0.95 top_k=20`` (top_p / top_k left out when off)."""
    out = [f"T={sampling['temperature']:g}"]
    out += [f"top_p={sampling['top_p']:g}"] if sampling["top_p"] < 1 else []
    out += [f"top_k={sampling['top_k']}"] if sampling["top_k"] > 0 else []
    return " ".join(out)


def main_table(results: list[dict]) -> str:
    """One row per (config, batch, prompt length, k): times, floor, tokens/s, exactness,
    compiles, memory."""
    head = ("| shape | batch | prompt | k | round ms (p10-p90) | floor ms | of floor | context | "
            "tokens/s (k=0) or at AL " + " / ".join(_al_names(results)) + " | e2e tokens/s "
            "(measured AL) | exact | prefill tok/s | start-up s (built, cached) | timed compiles "
            "| peak GiB |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        if r["k"]:
            derived = " / ".join(_n(v) for v in r["tokens_per_s_at_accept_length"].values())
            runs = r.get("forced") or [r]  # a drafted row (rounds per call > 1): its own run
            e2e = " / ".join(f"{_n(f['tokens_per_s_e2e'])} ({f['accept_length_measured']:.2f})"
                             for f in runs)
        else:
            derived, e2e = _n(r["tokens_per_s"]), _n(r["tokens_per_s_e2e"])
        built = sum(p["compiles"] for p in r["programs"])
        hits = sum(p["cache_hits"] for p in r["programs"])
        peak = r.get("peak_device_bytes")
        ctx = r["context"]
        timed = r["compiles_timed"]
        lines.append(
            f"| {shape_name(r['config'])} | {r['batch']} | {r['prompt_len']} | {_k_cell(r)} | "
            f"{r['round_ms']:.2f} "
            f"({r['round_ms_p10']:.2f}-{r['round_ms_p90']:.2f}) | {r['floor_ms']:.2f} | "
            f"{r['fraction_of_floor']:.0%} | {ctx['start']}-{ctx['end']} | {derived} | {e2e} | "
            f"{exact_cell(r)} | {_n(r['prefill_tokens_per_s'])} | "
            f"{r['startup_s']:.1f} ({built}, {hits}) | {timed if not timed else f'**{timed}**'} "
            f"| {'-' if peak is None else f'{peak / 2**30:.1f}'} |")
    return "\n".join(lines)


def exact_cell(r: dict) -> str:
    """``-`` (k = 0), ``yes``, ``**NO**`` (a forced run, or a drafted row, left the round
    program's own greedy continuation), or ``rounds yes, decode from N`` (the rounds
    reproduced it, but it parts from plain decoding at token N: a 16-bit near-tie between
    verify and decode shapes)."""
    if r["exact"] is None:
        return "-"
    if r["exact"]:
        return "yes"
    if r.get("rounds_exact"):
        return f"rounds yes, decode from {r['decode_match']['first_mismatch']['index']}"
    return "**NO**"


def _al_names(results: list[dict]) -> list[str]:
    for r in results:
        if r["k"]:
            return list(r["tokens_per_s_at_accept_length"])
    return ["2.5", "3.0", "3.5"]


def programs_table(results: list[dict]) -> str:
    """First call of every program: seconds (compile included), executables built, of which
    loaded from the persistent cache."""
    lines = ["| shape | batch | k | program | first call s | built | from cache |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        w = r.get("engine_warmup")
        if w:
            lines.append(f"| {shape_name(r['config'])} | {r['batch']} | {r['k']} | Engine.warmup() "
                         f"(prefill T={w['buckets']['prefill']}, B={w['buckets']['batch']}) | "
                         f"{w['seconds']:.2f} | {w['compiles']} | {w['cache_hits']} |")
        for p in r["programs"]:
            lines.append(f"| {shape_name(r['config'])} | {r['batch']} | {_k_cell(r)} | "
                         f"{p['program']} | {p['first_call_s']:.2f} | {p['compiles']} | "
                         f"{p['cache_hits']} |")
    return "\n".join(lines)


def bytes_table(results: list[dict]) -> str:
    """Bytes a round must move (GB = 1e9 bytes) and the floor they set."""
    kinds = ["weights", "kv_read", "gdn_state", "draft_weights", "draft_kv_read", "total"]
    lines = ["| shape | batch | k | " + " | ".join(f"{k} GB" for k in kinds) + " | floor ms |",
             "|" + "---|" * (len(kinds) + 4)]
    for r in results:
        by = r["bytes"]
        cells = " | ".join(f"{by[k] / 1e9:.3f}" if k in by else "-" for k in kinds)
        lines.append(f"| {shape_name(r['config'])} | {r['batch']} | {_k_cell(r)} | {cells} | "
                     f"{r['floor_ms']:.2f} |")
    return "\n".join(lines)


def step_ratios(results: list[dict]) -> list[dict]:
    """Each k > 0 row's round time over the decode step (the k = 0 row) of the same shape,
    batch, prompt length, rounds per call and sampling: issue 5's "k = 3 round at most 1.25x
    the decode step". Rows without such a k = 0 row are left out. Returns ``[{config, batch, k,
    prompt_len, steps_per_call, round_ms, step_ms, ratio, draft_head_dtype, draft_layer_dtype,
    sampling}]``."""
    def key_of(r: dict) -> tuple:
        sampling = r.get("sampling")
        return (r["config"], r["batch"], r.get("steps_per_call", 1),
                sampling_text(sampling) if sampling else None, r.get("prompt_len"))

    steps = {key_of(r): r["round_ms"] for r in results if not r["k"]}
    out = []
    for r in results:
        key = key_of(r)
        if r["k"] and key in steps:
            out.append({"config": r["config"], "batch": r["batch"], "k": r["k"],
                        "prompt_len": key[4], "steps_per_call": key[2], "round_ms": r["round_ms"],
                        "step_ms": steps[key], "ratio": r["round_ms"] / steps[key],
                        "draft_head_dtype": r.get("draft_head_dtype"),
                        "draft_layer_dtype": r.get("draft_layer_dtype"),
                        "sampling": r.get("sampling")})
    return out


def ratio_table(results: list[dict]) -> str:
    """:func:`step_ratios` as a markdown table (empty when there are none)."""
    rows = step_ratios(results)
    if not rows:
        return ""
    lines = ["| shape | batch | prompt | k | round ms | decode step ms (k = 0, same rounds "
             "per call) | round / step |", "|---|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {shape_name(x['config'])} | {x['batch']} | {x['prompt_len']} | "
                     f"{_k_cell(x)} | {x['round_ms']:.2f} | {x['step_ms']:.2f} | "
                     f"{x['ratio']:.3f}x |")
    return "\n".join(lines)


def failures(results: list[dict]) -> list[str]:
    """One line per row whose forced rounds (or drafted rounds) did not reproduce the round
    program's own greedy continuation (``MISMATCH``), whose continuation parts from plain
    decoding (``DIVERGENCE``), or that compiled in its timed phase."""
    out = []
    for r in results:
        tag = f"{shape_name(r['config'])} batch={r['batch']} k={_k_cell(r)}"
        drafted = r["k"] and "forced" not in r  # several rounds per call, drafts as drafted
        rm = r.get("rounds_match")
        if rm is not None and not rm["exact"]:
            m = rm["first_mismatch"]
            out.append(f"MISMATCH {tag}: the rounds with their own drafts differ from the "
                       f"rounds with every draft rejected in requests "
                       f"{rm['mismatched_requests']}; first at request {m['request']} token "
                       f"{m['index']}: expected {m['expected']}, got {m['got']}")
        for f in r.get("forced", []):
            if not f["exact"]:
                m = f["first_mismatch"]
                out.append(f"MISMATCH {tag} accept_length={f['accept_length']}: requests "
                           f"{f['mismatched_requests']} differ from the rounds with every "
                           f"draft rejected; first at request {m['request']} token "
                           f"{m['index']}: expected {m['expected']}, got {m['got']}")
        d = r.get("decode_match")
        if d is not None and not d["exact"]:
            m = d["first_mismatch"]
            which = "their own drafts" if drafted else "every draft rejected"
            out.append(f"DIVERGENCE {tag}: the rounds with {which} differ from "
                       f"plain decoding in requests {d['mismatched_requests']}; first at "
                       f"request {m['request']} token {m['index']}: decode {m['expected']}, "
                       f"rounds {m['got']}")
        if r["compiles_timed"]:
            out.append(f"COMPILE IN TIMED PHASE {tag}: {r['compiles_timed']} XLA compilation(s) "
                       "after warm-up")
    return out


# ---- op rows (the subcommands: attention, gdn, moe, gemv, sampling, draft-head, ab, profile) --

OP_FIELDS = ("op", "case", "variant", "time_us", "timing", "bytes", "tb_per_s", "floor_us",
             "fraction_of_floor", "error", "reference", "notes")


def op_row(op: str, case: str, variant: str, seconds: float, nbytes: float | None, *,
           hbm_tbps: float = 4.2, timing: str = "wall", error: float | None = None,
           reference: str | None = None, **notes) -> dict:
    """One result of a subcommand, with the fields of :data:`OP_FIELDS`.

    ``seconds``: one call's time (``timing``: ``"wall"``, the median wall time of jitted calls,
    or ``"device"``, kernel time from a profiler trace; :mod:`mtp_jax.bench.timing`);
    ``nbytes``: the bytes the call must move (``None``: not counted), giving ``tb_per_s``
    (TB = 1e12 bytes), the floor at ``hbm_tbps`` (``floor_us``) and ``fraction_of_floor``
    (floor / time); ``error``: the largest difference from ``reference`` (a variant's name or a
    description; ``None``: not compared); ``notes``: anything else (JSON values). Raises
    ``ValueError`` for a time that is not positive."""
    if not seconds > 0:
        raise ValueError(f"op_row {op} {case} {variant}: time {seconds!r} s must be positive.")
    floor = None if nbytes is None else nbytes / (hbm_tbps * 1e12)
    return {"op": op, "case": case, "variant": variant, "time_us": seconds * 1e6,
            "timing": timing, "bytes": None if nbytes is None else float(nbytes),
            "tb_per_s": None if nbytes is None else nbytes / seconds / 1e12,
            "floor_us": None if floor is None else floor * 1e6,
            "fraction_of_floor": None if floor is None else floor / seconds,
            "error": None if error is None else float(error), "reference": reference,
            "notes": notes}


def _note_text(notes: dict) -> str:
    """``k=v, k=v`` of the scalar notes (lists and dicts stay in the JSON)."""
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    return ", ".join(f"{k}={fmt(v)}" for k, v in notes.items()
                     if not isinstance(v, (list, dict, tuple)))


def op_table(rows: list[dict]) -> str:
    """The op rows as a markdown table: time (us, and whether wall or device), MB moved,
    TB/s, fraction of the HBM floor, error against the reference, notes."""
    lines = ["| op | case | variant | time us | timing | MB | TB/s | of floor | error (vs) | "
             "notes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mb = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.2f}"
        tbps = "-" if r["tb_per_s"] is None else f"{r['tb_per_s']:.2f}"
        frac = "-" if r["fraction_of_floor"] is None else f"{r['fraction_of_floor']:.1%}"
        err = "-" if r["error"] is None else f"{r['error']:.1e} ({r['reference']})"
        lines.append(f"| {r['op']} | {r['case']} | {r['variant']} | {r['time_us']:.2f} | "
                     f"{r['timing']} | {mb} | {tbps} | {frac} | {err} | "
                     f"{_note_text(r['notes'])} |")
    return "\n".join(lines)


def op_progress(r: dict) -> str:
    """One stderr line per op row."""
    frac = "" if r["fraction_of_floor"] is None else f" ({r['fraction_of_floor']:.1%} of floor)"
    err = "" if r["error"] is None else f" err {r['error']:.1e} vs {r['reference']}"
    return f"{r['op']} {r['case']} {r['variant']}: {r['time_us']:.2f} us {r['timing']}{frac}{err}"
