import os

import pytest

def pytest_collection_modifyitems(config, items):
    import jax

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    import tempfile

    import jax

    # LLM() turns on the persistent compilation cache; keep the suite's out of the user's home
    # (one folder per session, so later tests reuse programs that earlier ones compiled), and
    # one subfolder per pytest-xdist worker, so that no worker reads an entry the other is
    # writing (reuse across workers is small: --dist loadfile keeps a file in one worker).
    # The workers inherit the session's root from the controller.
    if "MTP_JAX_COMPILATION_CACHE" not in os.environ or "MTP_JAX_TEST_XLA_ROOT" in os.environ:
        root = os.environ.setdefault("MTP_JAX_TEST_XLA_ROOT",
                                     tempfile.mkdtemp(prefix="mtp_jax_xla_"))
        folder = os.path.join(root, os.environ.get("PYTEST_XDIST_WORKER", "main"))
        os.makedirs(folder, exist_ok=True)
        os.environ["MTP_JAX_COMPILATION_CACHE"] = folder

    # The executable store (mtp_jax.engine.executable_cache) off, but in the tests of it, which
    # turn it on (fixture ``executable_store``): jax's own persistent cache, which stays on,
    # already keeps the suite's programs between modules. (Workers that died inside the store's
    # serialize_executable had run out of memory mappings: _free_executables_after_module.)
    os.environ.setdefault("MTP_JAX_EXECUTABLE_CACHE", "0")

    # CPU runs (CI): the suite's time is mostly XLA compiling tiny programs; LLVM at -O0 cuts
    # about a fifth of it and changes no float result (no fast-math either way), and compiling
    # each module whole rather than split into parallel parts (pointless on CI's 2 cores, both
    # busy with a worker each) 3-10% more (two file sets, 2-core machine, session 64). Read
    # when the backend starts, which nothing has done yet.
    flags = os.environ.get("XLA_FLAGS", "")
    if os.environ.get("JAX_PLATFORMS") == "cpu" and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0"
                                   " --xla_cpu_parallel_codegen_split_count=1").strip()

    # Golden comparisons are float32 at 1e-4: keep GPUs from using TF32 for float32 matmuls.
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _free_executables_after_module():
    """Drop jax's in-memory executables after each test module.

    Every XLA:CPU executable keeps its JIT code in its own memory mappings, and a worker that
    runs half the suite piles up tens of thousands of them: once a process reaches the kernel's
    ``vm.max_map_count`` (65,530 by default) the next compile dies of a segmentation fault in
    ``backend_compile_and_load`` (what CI and local full runs hit; reproduced by running two
    files under ``sysctl vm.max_map_count=8000``, docs/design.md). Clearing jax's caches when a
    module ends frees them (about 3,000 mappings stay); later modules get their programs from
    the persistent compilation cache instead of from memory."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def vocab_cache(tmp_path_factory) -> str:
    """A pytest tmp cache holding the converted tokenizer.json: the one slow step (~6 s) of
    building a tokenizer or the default model; converted once per session (test_tokenizer.py
    tests the conversion and the cache file)."""
    from mtp_jax.tools import qwen_vocab

    cache = str(tmp_path_factory.mktemp("qwen_vocab_cache"))
    qwen_vocab.converted_tokenizer_json(cache)
    return cache


@pytest.fixture
def executable_store(monkeypatch):
    """The executable store on for one test (the suite turns it off: see pytest_configure)."""
    monkeypatch.delenv("MTP_JAX_EXECUTABLE_CACHE", raising=False)


@pytest.fixture(scope="module")
def restore_jax_cache_config():
    """Put back jax's compilation-cache settings (folder, thresholds) after a module whose tests
    switch the persistent cache on, and reset jax's open cache."""
    import jax

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {k: getattr(jax.config, k) for k in keys}
    yield
    from jax._src import compilation_cache as cc

    cc.reset_cache()
    for k, v in saved.items():
        jax.config.update(k, v)
