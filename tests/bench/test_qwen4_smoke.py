"""``python -m mtp_jax.bench.qwen4_smoke`` keeps what it measured: its ``--out`` folder is made
before the checkpoint is written, and ``q4_smoke.json`` holds every row finished before a run
is cut short. The checkpoint, the ``LLM`` and the timed rows are stand-ins here (the real ones
take a GPU and about 10 GB)."""

from __future__ import annotations

import json
import os
import types

import pytest

from mtp_jax.bench import qwen4_smoke


def test_out_folder_made_first_and_rows_kept_when_cut_short(tmp_path, monkeypatch):
    out = tmp_path / "new" / "q4"
    seen = []

    def checkpoint(a):
        seen.append(os.path.isdir(out))  # the folder exists before the checkpoint is written
        return "ckpt", None

    def row(llm, prompts, k, max_tokens, rng, backend="disk", kernels=""):
        if len(seen) == 2:
            raise RuntimeError("the call's time ran out")
        seen.append("row")
        return {"batch": len(prompts), "tok_s": 1.0}

    class FakeLLM:
        def __init__(self, *args, **kwargs):
            self.model = types.SimpleNamespace(host_callbacks=True)

    monkeypatch.setenv("MTP_JAX_PLE_LOOKUP", "auto")  # main sets it per row; restored after
    monkeypatch.setattr(qwen4_smoke, "write_checkpoint", checkpoint)
    monkeypatch.setattr(qwen4_smoke, "LLM", FakeLLM)
    monkeypatch.setattr(qwen4_smoke, "run_row", row)
    monkeypatch.setattr(qwen4_smoke, "held_weights_gb", lambda llm: 0.0)
    with pytest.raises(RuntimeError, match="time ran out"):
        qwen4_smoke.main(["--k", "0", "--batches", "1", "2", "--out", str(out)])
    assert seen == [True, "row"]
    rows = json.load(open(out / "q4_smoke.json"))
    assert [r["batch"] for r in rows] == [1]
