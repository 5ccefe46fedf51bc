"""A cached start-up's program loads (issue 32 item 5): a call whose program the background build
is loading waits for that load instead of loading it a second time beside it. The engines and
cache folders are those of ``tests/engine/test_executable_cache.py``."""

import shutil
import threading
import time

import pytest

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
    return seen


def _filled(cold, tmp_path) -> None:
    """A copy of the filled cache folder, in use."""
    shutil.copytree(cold[0], tmp_path / "xla")
    _use_cache(tmp_path / "xla")


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
