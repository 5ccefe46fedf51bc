"""The executable cache (:mod:`mtp_jax.engine.executable_cache`): a second engine with fresh
programs loads every program from disk without tracing or compiling and generates the same
tokens as the jit path; changed static keywords, shapes or environment miss; corrupt entries
warn and are rebuilt; the cache off writes nothing; a loaded program's call takes jax's C++
dispatch path and consumes the donated pools; a background build serves each call as soon as
its own program is ready, and hands a failed build's error to its call once.

Traces are counted by a spy around the jitted functions and compiles by jax's own monitoring
events (:mod:`mtp_jax.bench.compiles`), not by the table's counters alone. Every cache folder is
under pytest's tmp_path; jax's cache settings are restored after the module."""

import dataclasses
import os
import shutil
import threading
import warnings

import jax
import pytest

from mtp_jax import compile_cache
from mtp_jax.bench.compiles import CompileWatch
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine import executable_cache as xc
from mtp_jax.engine import executable_key as ek
from mtp_jax.engine.engine import Engine
from mtp_jax.engine import programs as programs_mod
from mtp_jax.engine.programs import Programs, make_programs
from mtp_jax.engine.variants import RoundVariant
from mtp_jax.engine.prefill_batch import padding_prefill_batch
from mtp_jax.engine.warmup import padding_round_batch, round_variants
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from tests.helpers.paths import REPO, fixture_path

CKPT = fixture_path("tiny_dense")
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250, 31, 64, 12, 5, 19, 200, 2, 41]]


class Spy:
    """A jitted function that counts its ``trace`` and ``__call__`` calls."""

    def __init__(self, fn):
        self.fn, self.traces, self.calls = fn, 0, 0

    def trace(self, *a, **kw):
        self.traces += 1
        return self.fn.trace(*a, **kw)

    def lower(self, *a, **kw):
        self.traces += 1
        return self.fn.lower(*a, **kw)

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.fn(*a, **kw)

    def _cache_size(self):
        return self.fn._cache_size()


class JaxTraces:
    """Counts jax's trace-to-jaxpr and jaxpr-to-MLIR events inside a ``with`` block."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration")

    def __enter__(self):
        import jax.monitoring as monitoring

        self.count, self.active = 0, True
        monitoring.register_event_duration_secs_listener(self._on)
        return self

    def _on(self, event, duration, **kw):
        if self.active and event in self.EVENTS:
            self.count += 1

    def __exit__(self, *exc):
        self.active = False  # listeners cannot be removed in every jax version


def _fresh(model, table=True):
    """A copy of ``model`` with freshly made programs (spied jits; no table when False)."""
    m = dataclasses.replace(model, derived={})
    p = make_programs(m.graphdef, m.params)
    spied = Programs(Spy(p.prefill_jit), Spy(p.round_jit), p.treedef,
                     p.executables if table else None)
    programs_mod._BY_MODEL[m] = programs_mod.ModelPrograms(
        spied, tuple(jax.tree_util.tree_leaves(m.params)))
    return m


def _programs(model):
    """The programs the engines on ``model`` call."""
    return programs_mod.programs_for(model).programs


def _traces(model):
    p = _programs(model)
    return p.prefill_jit.traces + p.round_jit.traces


def _engine(model, k=2, chunk=16):
    return Engine(model, EngineConfig(max_running_requests=2, dtype="float32", max_model_len=64,
                                      chunked_prefill_size=chunk, enable_prefix_cache=False,
                                      num_pages=24),
                  SpeculativeConfig(algorithm="mtp", num_steps=k, adaptive=False))


def _generate(eng):
    reqs = [Request(request_id=str(i), index=i, prompt=None, prompt_ids=list(p),
                    params=SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), seed=0)
            for i, p in enumerate(PROMPTS)]
    eng.run(reqs)
    return [r.output_ids for r in reqs]


def _use_cache(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compile_cache.CompilationCacheWarning)
        return compile_cache.enable_compilation_cache(str(folder))


def _files(folder):
    d = os.path.join(folder, xc.SUBFOLDER)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


@pytest.fixture(scope="module", autouse=True)
def _restore_jax_cache(restore_jax_cache_config):
    # the store under test: on for this module (the suite turns it off, tests/conftest.py)
    before = os.environ.pop(xc.SWITCH_ENV, None)
    yield
    if before is not None:
        os.environ[xc.SWITCH_ENV] = before


@pytest.fixture(scope="module")
def model():
    return load_model(CKPT, "float32", with_mtp=True)


@pytest.fixture(scope="module")
def cold(model, tmp_path_factory):
    """A cache folder filled by a first engine's warm-up (greedy: prefill 16, rounds 1 and 2),
    that engine's tokens, and the tokens of the jit path (no table)."""
    folder = _use_cache(tmp_path_factory.mktemp("xla"))
    m = _fresh(model)
    eng = _engine(m)
    with CompileWatch() as w, JaxTraces() as jt:
        eng.warmup(sampled=False)
    assert jt.count >= 6 and w.compiles == 3 and w.cache_hits == 0  # the signals work
    table = _programs(m).executables
    assert (table.traces, table.loads, len(table)) == (3, 0, 3)
    assert len(_files(folder)) == 3
    tokens = _generate(eng)
    reference = _generate(_engine(_fresh(model, table=False)))
    return folder, tokens, reference


def test_second_engine_loads_every_program_and_matches(model, cold):
    folder, tokens, reference = cold
    assert tokens == reference  # the compiled-table path equals the jit path
    _use_cache(folder)
    m = _fresh(model)
    eng = _engine(m)
    with CompileWatch() as w, JaxTraces() as jt:
        eng.warmup(sampled=False)
    table = _programs(m).executables
    # jax's own events: no jaxpr traced or lowered; every executable built was a cache load
    assert _traces(m) == 0 and jt.count == 0 and w.compiles == w.cache_hits == 3
    assert (table.loads, table.traces, table.compiles, len(table)) == (3, 0, 0, 3)
    assert eng.compiled_program_count() == 3
    before = eng.compiled_program_count()
    with CompileWatch() as w, JaxTraces() as jt:
        assert _generate(eng) == tokens
    assert w.compiles == jt.count == _traces(m) == 0 and eng.compiled_program_count() == before
    assert _programs(m).prefill_jit.calls == _programs(m).round_jit.calls == 0  # never the jit


def test_a_build_after_loaded_programs_traces_from_shapes(model, cold, tmp_path):
    """Pools that a program loaded from disk returned carry explicit layouts, which jax 0.12.1
    puts in their types: a program built afterwards from those arrays (a sampled round, not in
    the cache) failed to trace its scan over the rounds ("the layouts do not match"). Builds
    trace from the inputs' shapes, so it runs."""
    folder = tmp_path / "xla"
    shutil.copytree(cold[0], folder)  # the shared folder keeps its three programs
    _use_cache(folder)
    m = _fresh(model)
    eng = _engine(m)
    eng.warmup(sampled=False)
    assert _programs(m).executables.loads == 3 and _traces(m) == 0
    assert _generate(eng) == cold[1]  # the pools are now the loaded programs' outputs
    req = Request(request_id="s", index=0, prompt=None, prompt_ids=list(PROMPTS[1]), seed=1,
                  params=SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True))
    eng.run([req])
    assert len(req.output_ids) == 9 and _traces(m) >= 1  # built here, from the loaded pools


CHILD = """
import json, sys, jax
jax.config.update("jax_default_matmul_precision", "highest")  # as conftest.py (part of the key)
from mtp_jax import compile_cache
compile_cache.enable_compilation_cache(sys.argv[1])
import tests.engine.test_executable_cache as t
m = t._fresh(t.load_model(t.CKPT, "float32", with_mtp=True))
eng = t._engine(m)
eng.warmup(sampled=False)
tokens = t._generate(eng)
print("RESULT", json.dumps(dict(t._programs(m).executables.stats(), spied_traces=t._traces(m),
                                tokens=tokens)))
"""


def test_fresh_process_loads_every_program_and_matches(cold):
    """In a new process nothing was traced or compiled before the load (in this process the
    programs' libraries, e.g. LAPACK for the prefill's triangular solve, were set up by the
    first build)."""
    import json
    import subprocess
    import sys

    if jax.default_backend() != "cpu":
        pytest.skip("the child process runs on the CPU; the programs here were built for "
                    f"{jax.default_backend()}")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(cold[0])], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert (got["loads"], got["traces"], got["compiles"], got["spied_traces"]) == (3, 0, 0, 0)
    assert got["tokens"] == cold[2]


def test_key_holds_after_a_pallas_kernel_in_interpret_mode():
    """Pallas's interpret mode imports a jax module that registers an option when first used;
    the options read into the key must be those of a fresh process all the same."""
    import subprocess
    import sys

    from pallas_kernels.norm import add_rms_norm

    x = jax.numpy.ones((2, 64), jax.numpy.float32)
    add_rms_norm(x, x, jax.numpy.zeros((64,), jax.numpy.float32), 1e-6, backend="pallas",
                 interpret=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [REPO, os.environ.get("PYTHONPATH", "")]))
    child = ("import jax; jax.config.update('jax_default_matmul_precision', 'highest'); "
             "from mtp_jax.engine import executable_key as ek; "
             "print('CONFIG', ek.config_description())")
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                          text=True, timeout=120)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("CONFIG ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    assert lines[-1][len("CONFIG "):] == ek.config_description()


def test_loaded_program_consumes_donated_pools_and_takes_the_cpp_path(model, cold, tmp_path,
                                                                     monkeypatch):
    from jax._src import stages

    folder = tmp_path / "xla"  # a copy: the direct round call below saves a fourth program
    shutil.copytree(cold[0], folder)
    _use_cache(folder)
    m = _fresh(model)
    eng = _engine(m)
    eng.warmup(sampled=False)
    assert _programs(m).executables.loads == 3
    slow = []
    real = stages.Compiled.call
    monkeypatch.setattr(stages.Compiled, "call",
                        staticmethod(lambda *a, **kw: slow.append(1) or real(*a, **kw)))
    batch = padding_round_batch(1, 2, eng.max_pages_per_req)
    variant = RoundVariant(k=2, proposer="mtp", greedy_only=True)
    for i in range(5):
        old = jax.tree_util.tree_leaves(eng.pools)
        out, eng.device.pools = eng.device.programs.round(eng.device.leaves, eng.pools, batch,
                                                          variant)
        jax.block_until_ready(out)
        assert all(a.is_deleted() for a in old)
    assert len(slow) <= 1  # the Python path at most once, to set up the C++ dispatch


def test_changed_static_keyword_or_shape_misses(model, cold, tmp_path):
    folder = tmp_path / "xla"
    shutil.copytree(cold[0], folder)
    _use_cache(folder)
    # max_batch=1: the warm-ups here reach the prefill and the batch-1 round only (of the
    # three programs saved), which is enough to see which keys hit and which miss.
    m = _fresh(model)
    _engine(m, k=1).warmup(sampled=False, max_batch=1)  # static k differs (and pool shapes)
    t = _programs(m).executables
    assert (t.loads, t.traces) == (0, 2) and _traces(m) == 2
    m = _fresh(model)
    # new prefill shapes: [1, 32] and [2, 16] (two requests' chunks, 2 x 16 within 32)
    _engine(m, chunk=32).warmup(sampled=False)
    t = _programs(m).executables
    assert (t.loads, t.traces) == (3, 2) and _traces(m) == 2
    m = _fresh(model)
    # the round's sampled variant with the top-k / top-p filter (the prefill has only one)
    _engine(m).warmup(sampled=True, max_batch=1, filtering=True)
    t = _programs(m).executables
    assert (t.loads, t.traces) == (2, 1)
    m = _fresh(model)
    # both sampled variants: the filtered one now loads, the unfiltered one is new
    _engine(m).warmup(sampled=True, max_batch=1)
    t = _programs(m).executables
    assert (t.loads, t.traces) == (3, 1)


def test_key_changes_with_config_flags_and_source(model, tmp_path, monkeypatch):
    env = ek.environment_digest()
    with jax.default_matmul_precision("bfloat16"):  # a trace-context option
        assert ek.environment_digest() != env
    flags = os.environ.get("XLA_FLAGS")
    monkeypatch.setenv("XLA_FLAGS", (flags or "") + " --xla_cpu_enable_fast_math=true")
    assert ek.environment_digest() != env
    if flags is None:
        monkeypatch.delenv("XLA_FLAGS")
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    assert ek.environment_digest() == env
    # a traced constant that bench ab sets for a variant (its source default is in the
    # source digest; a saved program of the default must not be loaded for the variant)
    from mtp_jax.bench.ab_backends import set_constants
    from pallas_kernels.paged_attention import pallas as attention

    path = "pallas_kernels.paged_attention.pallas.LONG_TABLE_KEYS"
    old = set_constants({path: attention.LONG_TABLE_KEYS + 1})
    try:
        assert ek.environment_digest() != env
    finally:
        set_constants(old, restore=True)
    assert ek.environment_digest() == env and attention.LONG_TABLE_KEYS == old[path]
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(ek, "_package_root", lambda name: str(pkg) if name == "mtp_jax" else None)
    compute = ek.source_digest.__wrapped__  # uncached; the process's digest stays as it was
    first = compute()
    (pkg / "sub" / "a.py").write_text("x = 2\n")
    assert compute() != first
    (pkg / "sub" / "a.py").rename(pkg / "sub" / "b.py")
    assert compute() not in (first, ek.source_digest())
    a = jax.numpy.zeros((2, 3), jax.numpy.float32)
    assert ek.leaf_signature(a) != ek.leaf_signature(a.astype(jax.numpy.bfloat16))
    assert ek.leaf_signature(a) != ek.leaf_signature(a.reshape(3, 2))
    assert ek.static_description({"k": 1, "mtp": True}) == ek.static_description(
        {"mtp": True, "k": 1})
    assert ek.static_description({"k": 1}) != ek.static_description({"k": 2})


def test_corrupt_entries_warn_and_are_rebuilt(model, cold, tmp_path):
    folder = tmp_path / "xla"
    shutil.copytree(cold[0], folder)
    _use_cache(folder)
    sub = folder / xc.SUBFOLDER
    names = _files(folder)
    assert len(names) == 3  # those the warm-up loads (no other test adds to the shared folder)
    data = (sub / names[0]).read_bytes()
    (sub / names[0]).write_bytes(data[:len(data) // 2])  # truncated
    data = bytearray((sub / names[1]).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte altered
    (sub / names[1]).write_bytes(bytes(data))
    m = _fresh(model)
    eng = _engine(m)
    with pytest.warns(xc.ExecutableCacheWarning, match="unreadable") as rec:
        eng.warmup(sampled=False)
    assert len([r for r in rec if issubclass(r.category, xc.ExecutableCacheWarning)]) == 2
    t = _programs(m).executables
    assert (t.loads, t.traces, t.saves) == (1, 2, 2)
    assert _generate(eng) == cold[1]
    m = _fresh(model)  # the rebuilt entries load again
    with warnings.catch_warnings():
        warnings.simplefilter("error", xc.ExecutableCacheWarning)
        _engine(m).warmup(sampled=False)
    assert _programs(m).executables.loads == 3


def test_cache_off_writes_nothing(model, cold, tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "home"))
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    before = _files(cold[0])
    assert _use_cache("none") is None and xc.cache_dir() is None
    m = _fresh(model)
    eng = _engine(m)
    eng.warmup(sampled=False)
    t = _programs(m).executables
    assert (t.loads, t.traces, t.saves, len(t)) == (0, 3, 0, 3)
    assert _generate(eng) == cold[1]
    assert _files(cold[0]) == before and not (tmp_path / "home").exists()


def test_build_ahead_compiles_the_warmup_on_threads(model, cold, tmp_path):
    """A dry run of the warm-up records its programs without running any; they are built on
    two threads; the warm-up after it traces nothing and matches the jit path's tokens (those
    of the ``cold`` fixture: same engine settings and prompts, no executable table)."""
    from mtp_jax.engine.startup import build_warmup_programs

    _use_cache(tmp_path / "xla")
    m = _fresh(model)
    eng = _engine(m)
    before = [a.copy() for a in jax.tree_util.tree_leaves(eng.pools)]
    build_warmup_programs(eng, workers=2, sampled=False)
    t = _programs(m).executables
    assert (t.traces, t.compiles, t.saves, len(t)) == (3, 3, 3, 3)
    after = jax.tree_util.tree_leaves(eng.pools)  # the dry run donated and changed nothing
    assert all(not a.is_deleted() for a in after)
    assert all(bool((a == b).all()) for a, b in zip(after, before))
    with JaxTraces() as jt:
        eng.warmup(sampled=False)
    assert jt.count == 0 and _traces(m) == 3 and len(t) == 3
    assert _generate(eng) == cold[2]


def test_warmup_loads_saved_programs_on_threads(model, cold, tmp_path):
    """``Engine.warmup(workers=2)`` on a filled cache loads every program (on two threads),
    traces none, and the engine makes the tokens the cold build made."""
    folder = tmp_path / "xla"
    shutil.copytree(cold[0], folder)
    _use_cache(folder)
    m = _fresh(model)
    eng = _engine(m)
    eng.warmup(sampled=False, workers=2)
    t = _programs(m).executables
    assert (t.loads, t.traces, t.compiles) == (3, 0, 0) and _traces(m) == 0
    assert _generate(eng) == cold[1]


def _hold_rounds(monkeypatch, release: threading.Event, events: list, fail: list):
    """Make every round program's compile wait for ``release`` (30 s at most; ``events`` gets
    whether it was released), and the first ``len(fail)`` of them raise ``fail.pop()`` out of
    the compile worker (the table must still settle their programs)."""
    compile_one = xc.ExecutableTable._compile

    def held(self, store, c, dkey, lowered, rec, fut, *rest):
        if c.name == "round":
            events.append(("round released", release.wait(timeout=30)))
            if fail:
                raise fail.pop()  # as a failing compile would, out of the worker
        return compile_one(self, store, c, dkey, lowered, rec, fut, *rest)

    monkeypatch.setattr(xc.ExecutableTable, "_compile", held)


def test_background_warmup_waits_for_each_program_only(model, cold, tmp_path, monkeypatch):
    """``warmup(background=True)`` returns before its programs are built; the prefill runs
    while both round programs are still held back (a call waits for its own program only);
    each program is traced once and saved; the tokens are the jit path's."""
    _use_cache(tmp_path / "xla")
    m = _fresh(model)
    eng = _engine(m)
    release, events = threading.Event(), []
    _hold_rounds(monkeypatch, release, events, [])
    eng.warmup(sampled=False, background=True, workers=2)
    t = _programs(m).executables
    sched = eng.scheduler
    sched.device.prefill(padding_prefill_batch(1, 16, sched.book.max_pages_per_req, None),
                         sched.prefill_variant())
    jax.block_until_ready(sched.device.pools)
    events.append("prefill ran")
    assert t.building() == 2 and len(t) == 1
    release.set()
    assert _generate(eng) == cold[2]
    eng.wait_for_programs()
    assert events == ["prefill ran", ("round released", True), ("round released", True)]
    assert (t.traces, t.compiles, t.saves, len(t), _traces(m)) == (3, 3, 3, 3, 3)
    assert len(_files(tmp_path / "xla")) == 3


def test_failed_background_build_is_left_to_its_call(model, cold, tmp_path, monkeypatch):
    """Round programs whose background compile fails are dropped from the build (nothing is
    left in its hands, so no step waits on them); the call that needs one builds it itself
    and the engine makes the jit path's tokens."""
    _use_cache(tmp_path / "xla")
    m = _fresh(model)
    eng = _engine(m)
    release, events = threading.Event(), []
    _hold_rounds(monkeypatch, release, events, [RuntimeError("injected")] * 2)
    release.set()
    eng.warmup(sampled=False, background=True)
    t = _programs(m).executables
    t._threads[0].join()
    assert (len(t), t.building(), t.compiles) == (1, 0, 1)
    assert _generate(eng) == cold[2]
    assert t.compiles >= 2


def test_cancelled_background_build_drops_what_it_is_not_compiling(model, cold, tmp_path,
                                                                   monkeypatch):
    """``wait(cancel=True)`` arriving (once the prefill is in memory) while the first round
    program is lowered: that program and the next are dropped (out of the build's hands, not
    in memory), and the calls that need them build them then; tokens as the jit path's."""
    import time

    _use_cache(tmp_path / "xla")
    m = _fresh(model)
    eng = _engine(m)
    t = _programs(m).executables
    lower_one = xc.ExecutableTable._lower

    def lower(self, c, dkey):
        if c.name == "round":
            deadline = time.monotonic() + 60
            while len(self) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            self._cancel.set()  # as wait(cancel=True) does
        return lower_one(self, c, dkey)

    monkeypatch.setattr(xc.ExecutableTable, "_lower", lower)
    eng.warmup(sampled=False, background=True)
    t._threads[0].join()
    t._cancel.clear()
    assert (len(t), t.building(), t.traces, t.compiles) == (1, 0, 2, 1)
    assert _generate(eng) == cold[2]
    assert (len(t), t.traces) == (3, 4)


def test_call_takes_over_a_program_the_background_build_has_not_started(model, cold, tmp_path,
                                                                        monkeypatch):
    """While the background build is held lowering the prefill, a call of a round program it
    has queued builds that program itself instead of waiting behind the prefill (and saves it,
    although jax's cache is bypassed then); nothing is traced twice, and the tokens are the
    jit path's."""
    _use_cache(tmp_path / "xla")
    m = _fresh(model)
    eng = _engine(m)
    t = _programs(m).executables
    release, events = threading.Event(), []
    lower_one = xc.ExecutableTable._lower

    def lower(self, c, dkey):
        if c.name == "prefill":
            events.append(("prefill released", release.wait(timeout=30)))
        return lower_one(self, c, dkey)

    monkeypatch.setattr(xc.ExecutableTable, "_lower", lower)
    eng.warmup(sampled=False, background=True)
    sched = eng.scheduler
    variant = dataclasses.replace(round_variants(sched)[0], greedy_only=True, filtering=None)
    sched.device.round(padding_round_batch(1, variant.k, sched.book.max_pages_per_req), variant)
    jax.block_until_ready(sched.device.pools)
    events.append("round ran")
    release.set()
    assert _generate(eng) == cold[2]
    eng.wait_for_programs()
    assert events == ["round ran", ("prefill released", True)]
    assert (t.traces, len(t), t.building(), _traces(m)) == (3, 3, 0, 3)
    # the call's own build ran while the background one had jax's cache bypassed: still saved
    assert t.saves == 3 and len(_files(tmp_path / "xla")) == 3


def test_models_share_programs_unless_made_under_other_constants(model):
    """Two live models of one structure share their programs, except where a tool changed a
    traced constant for one of them (``python -m mtp_jax.bench ab``'s ``@module.ATTR``
    variants): that model gets programs of its own, traced with the constant."""
    from mtp_jax.bench.ab_backends import set_constants
    from pallas_kernels.paged_attention import pallas as attention

    a, b, c = (dataclasses.replace(model, derived={}) for _ in range(3))
    assert _programs(a) is _programs(b)
    old = set_constants({"pallas_kernels.paged_attention.pallas.LONG_TABLE_KEYS":
                         attention.LONG_TABLE_KEYS + 1})
    try:
        assert _programs(c) is not _programs(a)
    finally:
        set_constants(old, restore=True)
