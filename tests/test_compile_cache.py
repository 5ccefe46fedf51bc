"""The persistent compilation cache (``mtp_jax.compile_cache``): folder resolution, switching
folders, and refusals of unusable folders (also through the CLI and the bench).

Every cache folder here is under pytest's tmp_path; the jax cache settings are restored after
the module, so nothing is written to the user's home."""

import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from mtp_jax import compile_cache
from mtp_jax.config import ConfigError
from tests.helpers.paths import CONFIGS


@pytest.fixture(scope="module", autouse=True)
def _restore_jax_cache(restore_jax_cache_config):
    yield


def test_cache_same_dir_is_noop_other_dir_warns(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert compile_cache.enable_compilation_cache(a) == a
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    jax.jit(lambda x: x * 3 + 2)(jnp.ones(5)).block_until_ready()  # jax opens the cache
    assert os.listdir(a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_cache.enable_compilation_cache(a) == a  # same folder: nothing happens
    with pytest.warns(compile_cache.CompilationCacheWarning, match="moves from .* to "):
        assert compile_cache.enable_compilation_cache(b) == b
    jax.jit(lambda x: x * 5 - 1)(jnp.ones(5)).block_until_ready()
    assert os.listdir(b)
    with pytest.warns(compile_cache.CompilationCacheWarning, match="off"):
        assert compile_cache.enable_compilation_cache("OFF") is None
    assert compile_cache.active_cache_dir() is None


def test_cache_folder_resolution(tmp_path, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_cache.enable_compilation_cache("none")
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "root"))
    assert compile_cache.resolve_cache_dir(None) == (str(tmp_path / "root" / "xla"), False)
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.resolve_cache_dir(None) == (str(tmp_path / "env"), True)
    assert compile_cache.resolve_cache_dir("none") == (None, True)
    assert compile_cache.resolve_cache_dir(str(tmp_path / "x")) == (str(tmp_path / "x"), True)


def test_unwritable_cache_folder_errors(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = str(blocker / "xla")  # a folder under a file: cannot be created, even by root
    with pytest.raises(ConfigError, match="--compilation-cache-dir") as e:
        compile_cache.enable_compilation_cache(bad)
    assert bad in str(e.value)
    monkeypatch.setenv(compile_cache.ENV, bad)
    with pytest.raises(ConfigError, match="not writable"):
        compile_cache.enable_compilation_cache()
    # the default folder unusable: a warning, the cache stays off, the engine still starts
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("MTP_JAX_CACHE", str(blocker))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_cache.enable_compilation_cache("none")
    with pytest.warns(compile_cache.CompilationCacheWarning, match="stays off"):
        assert compile_cache.enable_compilation_cache() is None
    from mtp_jax import generate
    from mtp_jax.bench import main

    assert generate.main(["--compilation-cache-dir", bad]) == 2
    config = os.path.join(CONFIGS, "Qwen3.5-2B.json")
    assert main(["--config", config, "--compilation-cache-dir", bad]) == 2
    err = capsys.readouterr().err
    assert err.count(bad) == 2 and err.count("--compilation-cache-dir") == 2


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_read_only_cache_folder_errors(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="not writable.*--compilation-cache-dir"):
            compile_cache.enable_compilation_cache(str(ro))
    finally:
        ro.chmod(0o700)
