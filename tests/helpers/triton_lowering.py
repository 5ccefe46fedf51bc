"""Lower a jitted function for CUDA on a machine without a GPU.

The Pallas Triton lowering only asks the GPU for its compute capability; giving it an H200's
(90, an int as jax's own GPU info gives it: float8 casts compare it with 89) lets CPU-only CI
check that a kernel is expressible in Triton (power-of-two blocks, supported primitives)
before anyone spends GPU time on it. It does not compile the Triton
module to PTX, so it cannot catch register or shared-memory limits.
"""

from __future__ import annotations

import contextlib
import types

import jax


@contextlib.contextmanager
def fake_h200():
    from jax._src.pallas.triton import pallas_call_registration as reg

    saved = reg.gpu_info_lib
    reg.gpu_info_lib = types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    try:
        yield
    finally:
        reg.gpu_info_lib = saved


def lower_for_cuda(fn, *args, **kwargs) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for CUDA; raises if a kernel cannot lower."""
    with fake_h200():
        return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()
