"""``python -m mtp_jax.serve`` in a process of its own, as a user starts it, for the tests that
drive it with the official ``openai`` client."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import httpx

from tests.helpers.paths import REPO


@contextlib.contextmanager
def serve_process(args: list[str], env: dict | None = None, timeout: float = 600):
    """Start the server with ``args`` (``--port`` among them) on the CPU, with ``env`` added to
    the environment; yield its base URL once ``/health`` answers 200; stop it on exit. Fails
    the test when the process exits first or ``/health`` does not answer within ``timeout``
    seconds (with the process's output)."""
    import pytest

    port = args[args.index("--port") + 1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "mtp_jax.serve", *args], cwd=str(REPO),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}):\n{proc.stdout.read()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the server did not answer /health within {timeout:.0f} s:\n"
                            f"{proc.stdout.read()}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
