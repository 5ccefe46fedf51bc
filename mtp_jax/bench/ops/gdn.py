"""``python -m mtp_jax.bench gdn``: the gated delta rule's step form, the XLA reference against
the Pallas (Triton) kernels, at the Qwen3.5 shapes (Dk = Dv = ``--head-dim`` 128; value heads
``--heads`` 16 (2B), 32 (35B-A3B), 48 (27B); q and k at ``--key-heads`` heads, repeated).

Parts (``--parts``):

* ``step``: a verify window's ``verify`` (outputs, state read) and ``commit`` (new state) over
  ``--rows`` rows (T); variants ``xla`` (the reference with the row loop unrolled), ``xla_rolled``
  (a rolled scan; T > 1 only) and ``pallas`` (``gdn_verify_pallas`` / ``gdn_commit_pallas``);
* ``decode``: one row per request, the fused ``gdn_decode`` (one state read, output and new
  state) against the ``verify+commit`` pair it replaces (``g, beta`` masked by a run-time length
  as ``mtp_jax.models.layers.gdn.commit`` does, so XLA cannot merge the two), for the ``xla``
  and ``pallas`` backends; notes ``vs_vc`` (the pair's time over this one) and ``bitwise``
  (decode's state equals the same backend's commit bit for bit).

Each timed call runs the op on R independent copies (like R layers; R = 128 MB / state, at most
8), states donated and fed back; ``l2`` in the case marks copies that fit in the 50 MB L2
(optimistic times). Time: ``--iters`` calls back to back, waited for at the end, median over
``--reps`` (warm-up excluded), per copy. Bytes per copy: verify = state read + inputs + o;
commit = state read and written + inputs; decode = state read and written + inputs + o;
verify+commit = state read twice, written once + inputs twice + o. Error: the largest
|difference| from the XLA reference (outputs and state). ``--quick``: Hv 48, batch 1 and 32,
T 4. ``--sweep`` (GPU): the kernel over block_v x num_warps (Hv 48, T 4). Without a GPU only
the XLA variants run; asking for ``pallas`` there is refused.
"""

from __future__ import annotations

import argparse
import itertools
import math
import warnings

import jax
import jax.numpy as jnp

from mtp_jax.bench.report import op_row
from mtp_jax.bench.subcommand import (Refused, Results, int_list, name_list, parser, pick_variants,
                                      positive, require_gpu, run)
from mtp_jax.bench.timing import wall_seconds
from pallas_kernels.gdn import api
from pallas_kernels.common import next_pow2
from pallas_kernels.gdn.pallas import (default_tiling, gdn_commit_pallas, gdn_verify_pallas,
                                       pad_rows)
from pallas_kernels.gdn.reference import gdn_recurrent_reference

SUMMARY = ("the GDN step form (verify, commit, fused decode): XLA reference against the Pallas "
           "kernels")
PARTS = ("step", "decode")
VARIANTS = ("xla", "xla_rolled", "pallas")
L2_BYTES = 50e6


def build_parser() -> argparse.ArgumentParser:
    """The ``gdn`` flags."""
    p = parser("gdn", __doc__)
    p.add_argument("--parts", type=name_list(PARTS), default=list(PARTS),
                   help="step, decode (default both)")
    p.add_argument("--heads", type=int_list, default=[16, 32, 48],
                   help="value heads Hv (default 16,32,48)")
    p.add_argument("--key-heads", type=positive(int), default=16,
                   help="q / k heads, repeated to Hv (default 16; at most Hv, dividing it)")
    p.add_argument("--batch", type=int_list, default=[1, 8, 32], help="default 1,8,32")
    p.add_argument("--rows", type=int_list, default=[1, 4], help="step: rows T (default 1,4)")
    p.add_argument("--head-dim", type=positive(int), default=128, help="Dk = Dv (default 128)")
    p.add_argument("--iters", type=positive(int), default=20,
                   help="back-to-back calls per timed repeat (default 20)")
    p.add_argument("--reps", type=positive(int), default=5, help="timed repeats (default 5)")
    p.add_argument("--variants", type=name_list(VARIANTS), default=None,
                   help="xla, xla_rolled, pallas (default all; the xla ones without a GPU)")
    p.add_argument("--quick", action="store_true", help="Hv 48, batch 1 and 32, T 4 only")
    p.add_argument("--sweep", action="store_true",
                   help="GPU: also the kernel over block_v x num_warps (Hv 48, T 4)")
    return p


def inputs(key, b: int, t: int, h: int, hk: int, d: int, length: bool = False):
    """One copy: q, k (L2-normalised, at ``hk`` heads repeated to ``h``; q scaled),
    v ``[B, T, H, D]``, g, beta ``[B, T, H]``, (``length``: ``[B]`` ones), state
    ``[B, H, D, D]``, float32."""
    ks = jax.random.split(key, 6)
    l2 = lambda a: a * jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + 1e-6)
    rep = lambda a: jnp.repeat(a, h // hk, axis=2)
    out = (rep(l2(jax.random.normal(ks[0], (b, t, hk, d)))) * d ** -0.5,
           rep(l2(jax.random.normal(ks[1], (b, t, hk, d)))),
           jax.random.normal(ks[2], (b, t, h, d)),
           -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h))),
           jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))))
    out += (jnp.ones((b,), jnp.int32),) if length else ()
    return out + (jax.random.normal(ks[5], (b, h, d, d)) * 0.3,)


def time_copies(fn, copies, a, new_state=None):
    """Seconds per call of ``fn(*inputs, state)`` over all copies in one jit, and copy 0's
    first output. ``new_state(out)``: the state to feed back (donated); ``None``: the state is
    only read."""
    with warnings.catch_warnings():  # a CPU cannot donate; the timing holds all the same
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        if new_state is None:
            step = jax.jit(lambda cs: [fn(*c) for c in cs])
            first = jax.block_until_ready(step(copies))[0]
            return wall_seconds(lambda: step(copies), reps=a.reps, calls=a.iters), first
        step = jax.jit(lambda xs, ss: [fn(*x, s) for x, s in zip(xs, ss)], donate_argnums=1)
        xs = [c[:-1] for c in copies]
        first = jax.block_until_ready(step(xs, [jnp.copy(c[-1]) for c in copies]))[0]
        states = [[jnp.copy(c[-1]) for c in copies]]

        def call():
            out = step(xs, states[0])
            states[0] = [new_state(o) for o in out]
            return out

        return wall_seconds(call, reps=a.reps, calls=a.iters), first


def copies_of(b: int, h: int, d: int, seed: int, make) -> tuple[list, int, str]:
    """``(copies, R, "l2" | "hbm")``: R = 128 MB / state copies (1..8) made by ``make(key)``."""
    state_bytes = b * h * d * d * 4
    r = max(1, min(8, math.ceil(128e6 / state_bytes)))
    copies = [make(k) for k in jax.random.split(jax.random.key(seed), r)]
    return copies, r, "l2" if r * state_bytes < L2_BYTES else "hbm"


def pallas_step(op: str, tiling: dict):
    """The Pallas ``verify`` or ``commit`` kernel with ``tiling``, T padded to a power of two
    with ``g = beta = 0`` rows (no-op rows; the kernels need a power of two), as ``api`` does."""
    kernel = gdn_verify_pallas if op == "verify" else gdn_commit_pallas

    def fn(q, k, v, g, beta, state):
        t = q.shape[1]
        q, k, v, g, beta = (pad_rows(x, next_pow2(t)) for x in (q, k, v, g, beta))
        out = kernel(q, k, v, g, beta, state, **tiling)
        return out[:, :t] if op == "verify" else out
    return fn


def step_case(results: Results, a, b: int, h: int, t: int, impls, tiling=None) -> None:
    """``verify`` and ``commit`` rows of one (B, Hv, T) for each of ``impls``."""
    d = a.head_dim
    copies, r, where = copies_of(b, h, d, b * 1000 + h * 10 + t,
                                 lambda k: inputs(k, b, t, h, min(a.key_heads, h), d))
    ref = jax.jit(gdn_recurrent_reference)(*copies[0])
    bv, nw = tiling or default_tiling(b, h, d)
    pallas = {"block_v": bv, "num_warps": nw}
    ins = 4 * b * t * h * (3 * d + 2)
    state = b * h * d * d * 4
    for i, op in enumerate(("verify", "commit")):
        nbytes = 2 * state + ins if op == "commit" else state + ins + 4 * b * t * h * d
        for name in impls:
            if name == "xla_rolled" and t == 1:
                continue  # one row: the same program as xla
            fn = {"xla": lambda *x: gdn_recurrent_reference(*x, unroll=True)[i],
                  "xla_rolled": lambda *x: gdn_recurrent_reference(*x, unroll=1)[i],
                  "pallas": pallas_step(op, pallas)}[name]
            sec, out = time_copies(fn, copies, a, (lambda s: s) if op == "commit" else None)
            notes = {"block_v": bv, "num_warps": nw} if name == "pallas" else {}
            results.add(op_row("gdn", f"{op} B={b} Hv={h} T={t} R={r} {where}", name, sec / r,
                               nbytes, hbm_tbps=a.hbm_tbps, reference="xla",
                               error=float(jnp.max(jnp.abs(out - ref[i]))), **notes))


def _verify_commit(backend: str):
    """``(o, state)`` of a one-row verify, then the commit of that row masked by ``length``
    (``g, beta`` zeroed where it is 0, as the model's commit does), with ``backend``."""
    def fn(q, k, v, g, beta, length, state):
        o = api.gdn_verify(q, k, v, g, beta, state, backend=backend)
        keep = (length > 0)[:, None, None]
        s = api.gdn_commit(q, k, v, jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0), state,
                           backend=backend)
        return o, s
    return fn


def _decode(backend: str):
    """``(o, state)`` of the fused decode step with ``backend`` (``length`` unused)."""
    def fn(q, k, v, g, beta, length, state):
        return api.gdn_decode(q, k, v, g, beta, state, backend=backend)
    return fn


def decode_case(results: Results, a, b: int, h: int, backends) -> None:
    """``verify+commit`` and ``decode`` rows of one (B, Hv) for each of ``backends``."""
    d, hk = a.head_dim, min(a.key_heads, h)
    copies, r, where = copies_of(b, h, d, b * 1000 + h,
                                 lambda k: inputs(k, b, 1, h, hk, d, length=True))
    ref = jax.jit(_verify_commit("xla"))(*copies[0])
    state, ins, o = b * h * d * d * 4, 4 * b * h * (3 * d + 2), 4 * b * h * d
    for backend in backends:
        vc_sec, vc_out = time_copies(_verify_commit(backend), copies, a, lambda out: out[1])
        d_sec, d_out = time_copies(_decode(backend), copies, a, lambda out: out[1])
        bitwise = bool(jnp.array_equal(d_out[1], vc_out[1]))
        for name, sec, out, nbytes in (
                ("verify+commit", vc_sec, vc_out, 3 * state + 2 * ins + o),
                ("decode", d_sec, d_out, 2 * state + ins + o)):
            err = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(out, ref))
            notes = {"vs_vc": vc_sec / sec, **({"bitwise": bitwise} if name == "decode" else {})}
            results.add(op_row("gdn", f"decode B={b} Hv={h} Hk={hk} R={r} {where}",
                               f"{backend} {name}", sec / r, nbytes, hbm_tbps=a.hbm_tbps,
                               error=err, reference="xla verify+commit", **notes))


def bench(a, results: Results) -> None:
    """Every case of the flags (see the module docstring)."""
    bad = [h for h in a.heads if h % min(a.key_heads, h)]
    if bad:
        raise Refused(f"--key-heads {a.key_heads} must divide every --heads value; {bad} "
                      "do not (pick --key-heads 16 or a divisor of each).")
    if a.sweep:
        require_gpu("gdn --sweep", "leave --sweep out to time the XLA variants only")
    impls = pick_variants("gdn", a.variants, list(VARIANTS), ("pallas",))
    heads, batches, rows = ([48], [1, 32], [4]) if a.quick else (a.heads, a.batch, a.rows)
    if "step" in a.parts:
        for h, b, t in itertools.product(heads, batches, rows):
            step_case(results, a, b, h, t, impls)
    if "decode" in a.parts:
        backends = [v for v in impls if v in ("xla", "pallas")]
        for h, b in itertools.product(heads, batches):
            decode_case(results, a, b, h, backends)
    if a.sweep:
        for b, bv, nw in itertools.product(batches, (16, 32, 64), (2, 4, 8)):
            step_case(results, a, b, 48, 4, ["pallas"], tiling=(bv, nw))


def main(argv=None) -> int:
    """``python -m mtp_jax.bench gdn``; 0, or 2 for refused flags."""
    return run("gdn", build_parser(), bench, argv)
