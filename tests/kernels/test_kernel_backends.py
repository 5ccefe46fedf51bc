"""The kernel backend switch: validation at config time and resolution of ``auto``."""

import pytest

from mtp_jax.config import ConfigError
from mtp_jax.kernels import AUTO_ON_GPU, AUTO_PALLAS_ON_GPU, KernelBackends
from tests.helpers.paths import CONFIGS


def test_auto_is_xla_on_cpu():
    assert KernelBackends.resolve(platform="cpu") == KernelBackends("xla", "xla", "xla", "xla",
                                                                    "xla")


def test_auto_on_gpu_takes_only_the_checked_kernels():
    got = KernelBackends.resolve(platform="gpu")
    for op in ("attention", "gdn", "moe", "gemv"):
        want = "pallas" if op in AUTO_PALLAS_ON_GPU else AUTO_ON_GPU.get(op, "xla")
        assert getattr(got, op) == want
    assert got.attention == "pallas"  # faster on 2B and 27B, neutral on 35B-A3B
    assert got.norm == "xla"  # no hidden size given: the norm kernel is not assumed
    assert got.gemv == "reduce"  # XLA's multiply-reduce form of one-row projections
    assert KernelBackends.resolve(platform="gpu", dtype="float32").attention == "xla"


@pytest.mark.parametrize("hidden, want", [(2048, "pallas"), (1024, "pallas"), (5120, "xla"),
                                          (3072, "xla"), (None, "xla")])
def test_auto_norm_by_hidden_size(hidden, want):
    """Measured faster at 2048 (2B, 35B-A3B) and slower at 5120 (27B): auto takes the norm
    kernel up to 2048 on a GPU, never on the CPU."""
    assert KernelBackends.resolve(platform="gpu", hidden_size=hidden).norm == want
    assert KernelBackends.resolve(platform="cpu", hidden_size=hidden).norm == "xla"


def test_fused_gemv_without_gpu_is_refused():
    with pytest.raises(ConfigError, match="gemv_backend 'fused' needs a CUDA GPU.*"
                                          "--gemv-backend xla, reduce or auto"):
        KernelBackends.resolve(gemv="fused", platform="cpu")
    assert KernelBackends.resolve(gemv="fused", platform="gpu").gemv == "fused"


def test_fused_gemv_needs_dense_merged_mlps(monkeypatch):
    """``fused`` works on a dense MLP's merged gate/up: a MoE model or unmerged projections
    are refused before any weight is read, not silently run as ``reduce`` (a GPU is faked:
    on the CPU ``fused`` is refused first for that)."""
    import jax

    import mtp_jax
    from tests.helpers.paths import fixture_path
    from mtp_jax.models.qwen3_5 import loader

    with pytest.raises(ConfigError, match="mixture-of-experts; use --gemv-backend reduce"):
        KernelBackends.resolve(platform="gpu", gemv="fused", dense_mlp=False)
    assert KernelBackends.resolve(platform="gpu", gemv="fused", dense_mlp=True).gemv == "fused"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    opened = []
    monkeypatch.setattr(loader, "load_tensors", lambda *a, **k: opened.append(a))
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        mtp_jax.load_model(fixture_path("tiny_moe_fused"), "float32", gemv_backend="fused")
    with pytest.raises(ConfigError, match="merge_projections is False"):
        mtp_jax.load_model(fixture_path("tiny_dense"), "float32", gemv_backend="fused",
                           merge_projections=False)
    assert not opened


def test_reduce_is_a_gemv_choice_only():
    assert KernelBackends.resolve(platform="cpu", gemv="reduce").gemv == "reduce"  # XLA: any
    with pytest.raises(ConfigError, match=r"norm_backend 'reduce'.*auto, xla, pallas "
                                          r"\(--norm-backend\)"):
        KernelBackends.resolve(platform="gpu", norm="reduce")


def test_explicit_choices_are_kept_on_gpu():
    got = KernelBackends.resolve("pallas", "xla", "pallas", platform="gpu", norm="pallas",
                                 gemv="pallas")
    assert got == KernelBackends("pallas", "xla", "pallas", "pallas", "pallas")


@pytest.mark.parametrize("op", ["attention", "gdn", "moe", "norm", "gemv"])
def test_unknown_backend_names_value_and_flag(op):
    with pytest.raises(ConfigError, match=rf"{op}_backend 'triton'.*--{op}-backend"):
        KernelBackends.resolve(**{op: "triton"}, platform="gpu")


def test_gdn_sizes_the_fused_kernels_cannot_take():
    """Released shapes fit; a value head of 24 or a key head of 96 does not: ``auto`` takes
    XLA for GDN, an explicit ``pallas`` is refused naming the size."""
    assert KernelBackends.resolve(platform="gpu", gdn_dims=(128, 128, 10240)).gdn == "pallas"
    for dims, name in (((128, 24, 4480), "linear_value_head_dim 24"),
                       ((96, 128, 8192), "linear_key_head_dim 96")):
        assert KernelBackends.resolve(platform="gpu", gdn_dims=dims).gdn == "xla"
        with pytest.raises(ConfigError, match=f"{name}.*--gdn-backend xla"):
            KernelBackends.resolve(gdn="pallas", platform="gpu", gdn_dims=dims)


def test_every_released_qwen3_5_shape_fits_the_gdn_kernels():
    import glob
    import os

    from mtp_jax.bench.floor import load_config
    from mtp_jax.kernels import gdn_dims_of

    root = CONFIGS
    checked = 0
    for path in sorted(glob.glob(os.path.join(root, "Qwen3.[56]-*.json"))):
        dims = gdn_dims_of(load_config(path))
        assert dims is not None, path
        assert KernelBackends.resolve(platform="gpu", gdn_dims=dims).gdn == "pallas", path
        checked += 1
    assert checked >= 8


def test_norm_kernel_refuses_hidden_sizes_it_cannot_split():
    """Released hidden sizes (2048 to 5120) fit; 3000 has no power-of-two piece."""
    for h in (2048, 4096, 5120):
        assert KernelBackends.resolve(platform="gpu", norm="pallas", hidden_size=h).norm == "pallas"
    with pytest.raises(ConfigError, match="hidden_size 3000.*--norm-backend xla"):
        KernelBackends.resolve(platform="gpu", norm="pallas", hidden_size=3000)
    assert KernelBackends.resolve(platform="gpu", hidden_size=3000).norm == "xla"


def test_pallas_without_gpu_is_refused():
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*--gdn-backend xla or auto"):
        KernelBackends.resolve(gdn="pallas", platform="cpu")
    with pytest.raises(ConfigError, match="--gemv-backend xla, reduce or auto"):
        KernelBackends.resolve(gemv="pallas", platform="cpu")


def test_cli_refuses_pallas_on_cpu_before_loading(capsys, monkeypatch):
    import jax

    from mtp_jax import generate
    from mtp_jax.models.qwen3_5 import loader

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


def test_backend_help_names_what_auto_picks():
    from mtp_jax.kernels import backend_help

    assert "auto = pallas on a GPU, else xla" in backend_help("gdn")
    assert "auto = pallas on a GPU in 16-bit dtypes" in backend_help("moe")
    assert "auto = pallas on a GPU in 16-bit dtypes" in backend_help("attention")
    assert "auto = pallas on a GPU for hidden sizes up to 2048" in backend_help("norm")
    assert "auto = reduce on a GPU, else xla" in backend_help("gemv")
    assert "pallas" in backend_help("gemv") and "experimental" in backend_help("gemv")
    assert "fused (a GPU kernel)" in backend_help("gemv")


def test_attention_kernel_needs_a_power_of_two_head_dim():
    """auto falls back to XLA for a head_dim the Triton kernel cannot tile; asking for the
    kernel there is refused at config time."""
    assert KernelBackends.resolve(platform="gpu", head_dim=256).attention == "pallas"
    assert KernelBackends.resolve(platform="gpu", head_dim=96).attention == "xla"
    with pytest.raises(ConfigError, match="attention_backend 'pallas' cannot run this model: "
                                          "head_dim 96 is not a power of two"):
        KernelBackends.resolve("pallas", platform="gpu", head_dim=96)
