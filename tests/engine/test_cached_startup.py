"""A cached start-up's program loads (issue 32 item 5): a call whose program the background build
is loading waits for that load instead of loading it a second time beside it, and the programs
the last start-up with the same settings built first are loaded ahead on a thread of their own
(:mod:`mtp_jax.engine.executable_prefetch`), which the table then takes by key. The engines and
cache folders are those of ``tests/engine/test_executable_cache.py``."""

import json
import os
import shutil
import threading
import time

import pytest

from mtp_jax.engine import executable_cache as xc
from mtp_jax.engine import executable_prefetch as prefetch
from mtp_jax.engine.executable_store import ExecutableStore
from tests.engine.test_executable_cache import (_engine, _fresh, _generate, _programs,  # noqa: F401
                                                _restore_jax_cache, _use_cache, cold, model)


@pytest.fixture
def loads(monkeypatch):
    """Every ``ExecutableStore.load``, as ``(thread name, disk key)``; each takes 0.3 s more
    (so that a call comes while its program's load is under way)."""
    seen = []
    real = ExecutableStore.load

    def load(self, name, key, *args, **kwargs):
        seen.append((threading.current_thread().name, key))
        time.sleep(0.3)
        return real(self, name, key, *args, **kwargs)

    monkeypatch.setattr(ExecutableStore, "load", load)
    yield seen
    prefetch.start(None, "")  # no session left for the tests after this one


def _filled(cold, tmp_path) -> str:
    """A copy of the filled cache folder, in use; returns its executables folder."""
    shutil.copytree(cold[0], tmp_path / "xla")
    _use_cache(tmp_path / "xla")
    return xc.cache_dir()


def test_call_waits_for_the_load_of_its_program(model, cold, tmp_path, loads):
    """On a filled cache the prefill call comes while the background build loads its program:
    it waits for that load; each program is loaded once and none traced; the cold tokens."""
    _filled(cold, tmp_path)
    m = _fresh(model)
    eng = _engine(m)
    eng.warmup(sampled=False, background=True)
    assert _generate(eng) == cold[1]
    eng.wait_for_programs()
    keys = [k for _, k in loads]
    table = _programs(m).executables
    assert len(keys) == len(set(keys)) == 3 and (table.loads, table.traces) == (3, 0)


def test_next_start_loads_the_first_programs_ahead(model, cold, tmp_path, loads):
    """The first build after ``start(folder, settings)`` names its programs (the hint); the next
    start with those settings loads them on its own thread, the table takes them by key
    (loading nothing itself) and the tokens are the cold ones. Other settings have no hint; a
    hint's program that is not on disk is left to the table."""
    folder = _filled(cold, tmp_path)
    prefetch.start(folder, "settings")
    eng = _engine(_fresh(model))
    eng.warmup(sampled=False)
    with open(os.path.join(folder, prefetch.HINT_FILE)) as f:
        (hint,) = json.load(f).values()
    assert [name for name, _ in hint["programs"]] == ["prefill", "round", "round"]
    loads.clear()
    prefetch.start(folder, "settings")
    m = _fresh(model)
    eng = _engine(m)
    eng.warmup(sampled=False)
    assert [t for t, _ in loads] == ["mtp_jax-program-prefetch"] * 3
    assert _generate(eng) == cold[1]
    assert (_programs(m).executables.loads, _programs(m).executables.traces) == (3, 0)

    loads.clear()
    prefetch.start(folder, "other settings")
    eng = _engine(_fresh(model))
    eng.warmup(sampled=False)
    assert len(loads) == 3 and "mtp_jax-program-prefetch" not in {t for t, _ in loads}

    prefetch._write_hint(folder, prefetch._key("stale"),
                         {"devices": hint["devices"], "programs": [["prefill", "0" * 64]]})
    loads.clear()
    prefetch.start(folder, "stale")
    m = _fresh(model)
    eng = _engine(m)
    eng.warmup(sampled=False)
    assert [t for t, _ in loads].count("mtp_jax-program-prefetch") == 1 and len(loads) == 4
    assert _generate(eng) == cold[1] and _programs(m).executables.traces == 0
