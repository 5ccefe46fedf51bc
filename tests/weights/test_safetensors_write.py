"""mtp_jax's safetensors writer leaves files with the mode a plain ``open(path, "w")`` gives
(0666 less the umask), not the owner-only 0600 of ``safetensors.numpy.save_file``, and the
file reads back with the safetensors library."""

import os
import stat

import numpy as np
from safetensors.numpy import load_file

from mtp_jax.weights.safetensors_write import save_file


def test_written_file_has_the_umask_mode_and_reads_back(tmp_path):
    old = os.umask(0o022)
    try:
        path = str(tmp_path / "w.safetensors")
        save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, path, {"format": "pt"})
        plain = str(tmp_path / "plain.txt")
        open(plain, "w").close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(plain).st_mode) == 0o644
    np.testing.assert_array_equal(load_file(path)["a"], np.arange(6).reshape(2, 3))
