"""The kernel backend switch: validation at config time and resolution of ``auto``."""

import pytest

from mtp_jax.config import ConfigError
from mtp_jax.kernels import AUTO_PALLAS_ON_GPU, KernelBackends


def test_auto_is_xla_on_cpu():
    assert KernelBackends.resolve(platform="cpu") == KernelBackends("xla", "xla", "xla")


def test_auto_on_gpu_takes_only_the_checked_kernels():
    got = KernelBackends.resolve(platform="gpu")
    for op in ("attention", "gdn", "moe"):
        assert getattr(got, op) == ("pallas" if op in AUTO_PALLAS_ON_GPU else "xla")


def test_explicit_choices_are_kept_on_gpu():
    got = KernelBackends.resolve("pallas", "xla", "pallas", platform="gpu")
    assert got == KernelBackends("pallas", "xla", "pallas")


@pytest.mark.parametrize("op", ["attention", "gdn", "moe"])
def test_unknown_backend_names_value_and_flag(op):
    with pytest.raises(ConfigError, match=rf"{op}_backend 'triton'.*--{op}-backend"):
        KernelBackends.resolve(**{op: "triton"}, platform="gpu")


def test_pallas_without_gpu_is_refused():
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*--gdn-backend xla"):
        KernelBackends.resolve(gdn="pallas", platform="cpu")


def test_cli_refuses_pallas_on_cpu_before_loading(capsys, monkeypatch):
    import jax

    from mtp_jax import generate
    from mtp_jax.models import loader

    if jax.default_backend() == "gpu":
        pytest.skip("the refusal is for machines without a GPU")
    opened = []
    monkeypatch.setattr(loader, "load_tensors", lambda *a, **k: opened.append(a))
    rc = generate.main(["--attention-backend", "pallas", "--prompt", "hi"])
    assert rc == 2 and not opened
    assert "attention_backend 'pallas' needs a CUDA GPU" in capsys.readouterr().err


def test_float32_keeps_sixteen_bit_kernels_on_xla():
    got = KernelBackends.resolve(platform="gpu", dtype="float32")
    assert got.attention == "xla" and got.moe == "xla"
    assert got.gdn == ("pallas" if "gdn" in AUTO_PALLAS_ON_GPU else "xla")  # float32 state
    with pytest.raises(ConfigError, match="moe_backend 'pallas' needs 16-bit.*--dtype bfloat16"):
        KernelBackends.resolve(moe="pallas", platform="gpu", dtype="float32")
    assert KernelBackends.resolve(moe="pallas", platform="gpu", dtype="bfloat16").moe == "pallas"
