"""Gated DeltaNet (``linear_attention`` layers) of the Qwen3.5 family.

    qkv = conv_silu(in_proj_qkv x)            # causal depthwise conv, kernel K, over the raw rows
    q, k = l2norm(q), l2norm(k); q *= Dk**-0.5; q, k heads repeated (interleaved) to Hv
    beta = sigmoid(in_proj_b x);  g = -exp(A_log) * softplus(in_proj_a x + dt_bias)
    o = gated_delta_rule(q, k, v, g, beta)    # pallas_kernels.gdn.reference
    out = out_proj(norm(o) * w * silu(in_proj_z x))

Four uses: ``prefill`` (chunked form, writes the state), ``verify`` (step form, leaves the live
state untouched and returns the per-row inputs), ``commit`` (replays the accepted rows
of a verify onto the live state with the step form, so the result equals decoding them one by
one) and ``decode`` (one row per request, speculation off: the step form's output and new
state from one read of the state, equal to a one-row verify plus commit).

``verify``, ``decode`` and ``commit`` take either a batch view of the states (``[B, ...]``) or,
with ``slots [B]``, the whole pool (``[S, ...]``), which they read and write at those slots.
With the ``pallas`` GDN backend the step form runs as the fused slot-addressed kernels of
:mod:`pallas_kernels.gdn.fused` (conv, norms, gates and recurrence; no gather or scatter of the
states; on a ring conv state a decode is one kernel, :mod:`pallas_kernels.gdn.fused_decode`,
a verify one, :mod:`pallas_kernels.gdn.fused_verify`, and its commit one; with the merged
in-projection the decode and verify kernels also do the gated output norm) and a verify
returns :class:`GDNConvRows`; the ``xla`` backend gathers the slots' states, runs the XLA code
below and scatters them back.

The conv state is a ring of K raw inputs keyed by position (the Qwen3.5 family's pools; every
call then takes ``start [B]``, the position of each request's row 0) or a shift register of the
last K-1 (qwen4_exp); see :mod:`mtp_jax.models.layers.conv_state`.
Source: HF transformers ``qwen3_5`` (``Qwen3_5GatedDeltaNet``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.rows import set_rows
from mtp_jax.config import ModelConfig
from mtp_jax.kernels import kernels_of
from mtp_jax.models.layers.basic import (Linear, as_data, merge_linears, mergeable, project,
                                         rms_normalize)
from mtp_jax.models.layers.conv_state import (advance, advance_at, conv_window, is_ring,
                                              window_before)
from pallas_kernels.gdn.api import gdn_commit, gdn_decode, gdn_verify
from pallas_kernels.gdn.fused import gdn_conv_rows, gdn_step
from pallas_kernels.gdn.fused_decode import OutputNorm, gdn_decode_ring
from pallas_kernels.gdn.fused_verify import gdn_verify_ring
from pallas_kernels.gdn.reference import gdn_chunked_reference, gdn_chunked_states


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNRows:
    """Per-row recurrence inputs of a verify window, kept for the commit.

    q, k: ``[B, T, Hv, Dk]`` f32; v: ``[B, T, Hv, Dv]`` f32; g, beta: ``[B, T, Hv]`` f32;
    qkv: ``[B, T, conv_dim]`` raw conv inputs (model dtype); start: ``[B]`` int32 position of
    row 0 (``None`` with a shift-register conv state, which does not need it).
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    qkv: jax.Array
    start: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GDNConvRows:
    """Per-row inputs of a verify window on the fused Pallas path, kept for the commit.

    conv: ``[B, T, C]`` conv + SiLU outputs (model dtype); valid: ``[B, T]`` bool. a, b, qkv:
    the raw ``in_proj_a`` / ``in_proj_b`` outputs ``[B, T, Hv]`` and conv inputs ``[B, T, C]``
    (model dtype); after ``merge_projections`` all three are the merged in-projection's whole
    output ``[B, T, N]``, which the kernels read at the layer's columns
    (:meth:`GatedDeltaNet._gate_cols`). start: ``[B]`` int32 position of row 0 (``None`` with a
    shift-register conv state).
    """

    conv: jax.Array
    a: jax.Array
    b: jax.Array
    valid: jax.Array
    qkv: jax.Array
    start: jax.Array | None = None


def gather_states(pool: tuple[jax.Array, jax.Array], slots: jax.Array):
    """``(recurrent, conv)`` pools ``[S, ...]`` -> the batch view ``[B, ...]`` of ``slots``."""
    return tuple(a[slots] for a in pool)


def scatter_states(pool: tuple[jax.Array, jax.Array], slots: jax.Array, view):
    """Write the batch view ``view`` back into the pools at ``slots`` (rows on the trash slot 0
    write nothing: :func:`mtp_jax.cache.rows.set_rows`)."""
    return tuple(set_rows(a, slots, v) for a, v in zip(pool, view))


def commit(state: tuple[jax.Array, jax.Array], rows: GDNRows, length: jax.Array,
           backend: str = "xla"):
    """Apply the first ``length [B]`` rows of a verify window to ``(recurrent, conv)``.

    Rows at or past ``length`` get ``g = 0, beta = 0`` and so leave the state unchanged exactly.
    ``backend``: ``"xla"`` or ``"pallas"`` (:func:`pallas_kernels.gdn.api.gdn_commit`); use the
    verify's backend so that the commit repeats the verify's arithmetic.
    """
    recurrent, conv = state
    keep = jnp.arange(rows.g.shape[1])[None, :] < length[:, None]
    g = jnp.where(keep[..., None], rows.g, 0.0)
    beta = jnp.where(keep[..., None], rows.beta, 0.0)
    recurrent = gdn_commit(rows.q, rows.k, rows.v, g, beta, recurrent, backend=backend)
    if rows.start is None:  # a shift register: verify sets ``start`` for a ring only
        return recurrent, conv_window(conv, rows.qkv, length)
    return recurrent, advance(conv, conv.shape[-1], rows.qkv, length, rows.start)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        h = cfg.hidden_size
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel, self.eps = cfg.linear_conv_kernel_dim, cfg.rms_norm_eps
        self.backend = kernels_of(cfg).gdn
        conv_dim = cfg.linear_conv_dim
        self.in_proj_qkv = Linear(h, conv_dim, dtype)
        self.in_proj_z = Linear(h, self.hv * self.dv, dtype)
        self.in_proj_b = Linear(h, self.hv, dtype)
        self.in_proj_a = Linear(h, self.hv, dtype)
        self.conv1d = _Conv(conv_dim, self.kernel, dtype)
        self.A_log = nnx.Param(jnp.zeros((self.hv,), jnp.float32))
        self.dt_bias = nnx.Param(jnp.zeros((self.hv,), jnp.float32))
        self.norm = _GatedNormWeight(self.dv, dtype)
        self.out_proj = Linear(self.hv * self.dv, h, dtype)
        self.in_proj = None  # MergedLinear of (qkv, z, b, a) after merge_projections()

    def merge_projections(self) -> None:
        """Merge ``in_proj_qkv, in_proj_z, in_proj_b, in_proj_a`` into one ``in_proj``
        (:class:`mtp_jax.models.layers.basic.MergedLinear`; the four are removed)."""
        parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
        if self.in_proj is None and mergeable(parts):
            self.in_proj = as_data(merge_linears(parts))
            self.in_proj_qkv = self.in_proj_z = self.in_proj_b = self.in_proj_a = None

    def _project(self, x: jax.Array):
        """``x [B, T, H]`` -> ``(qkv [B,T,C], z [B,T,Hv*Dv], b [B,T,Hv], a [B,T,Hv])``."""
        return project(x, self.in_proj,
                       (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))

    def _rows(self, proj, conv_state: jax.Array, valid: jax.Array) -> GDNRows:
        qkv, _, b_proj, a_proj = proj
        b, t, _ = qkv.shape
        w = self.conv1d.weight[...][:, 0, :].astype(jnp.float32)  # [C, K]
        ext = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(jnp.float32),
                               qkv.astype(jnp.float32)], axis=1)  # [B, K-1+T, C]
        conv = sum(ext[:, j:j + t] * w[:, j] for j in range(self.kernel))
        conv = jax.nn.silu(conv).astype(qkv.dtype).astype(jnp.float32)
        kd = self.hk * self.dk
        q = conv[..., :kd].reshape(b, t, self.hk, self.dk)
        k = conv[..., kd:2 * kd].reshape(b, t, self.hk, self.dk)
        v = conv[..., 2 * kd:].reshape(b, t, self.hv, self.dv)
        l2 = lambda a: a * jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + 1e-6)
        rep = self.hv // self.hk
        q = jnp.repeat(l2(q), rep, axis=2) * (self.dk ** -0.5)
        k = jnp.repeat(l2(k), rep, axis=2)
        beta = jax.nn.sigmoid(b_proj.astype(jnp.float32))
        a = a_proj.astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a + self.dt_bias[...].astype(jnp.float32))
        g = jnp.where(valid[..., None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
        return GDNRows(q=q, k=k, v=v, g=g, beta=beta, qkv=qkv)

    def _output(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """``out_proj(norm(o) * w * silu(z))``: ``o [B, T, Hv, Dv]``, ``z [B, T, Hv*Dv]``."""
        b, t, _ = z.shape
        dtype = z.dtype
        z = z.reshape(b, t, self.hv, self.dv).astype(jnp.float32)
        y = rms_normalize(o, self.eps).astype(dtype) * self.norm.weight[...]
        y = (y.astype(jnp.float32) * self._output_gate(z)).astype(dtype)
        return self.out_proj(y.reshape(b, t, self.hv * self.dv))

    # The output gate's activation (``"silu"`` in the Qwen3.5 family, ``"sigmoid"`` possible).
    output_gate = "silu"

    def _output_gate(self, z: jax.Array) -> jax.Array:
        """The output gate's activation of ``z`` (float32)."""
        return jax.nn.sigmoid(z) if self.output_gate == "sigmoid" else jax.nn.silu(z)

    def _start(self, conv: jax.Array, start, batch: int):
        """``start`` as ``[B]`` int32 for a ring conv state, ``None`` for a shift register
        (:mod:`mtp_jax.models.layers.conv_state`). Raises ValueError for a ring without it or
        with another shape."""
        if not is_ring(conv, self.kernel):
            return None
        if start is None or jnp.shape(start) != (batch,):
            got = None if start is None else jnp.shape(start)
            raise ValueError(f"GatedDeltaNet: the conv state is a ring (K columns, keyed by "
                             f"position); pass `start [B={batch}]`, the position of each "
                             f"request's row 0 (got {got}).")
        return jnp.asarray(start, jnp.int32)

    def prefill(self, x, state, valid, start=None, at=None):
        """Chunked form over ``x [B, T, H]``; rows where ``valid [B, T]`` is False (a padded
        tail) change nothing. ``state = (recurrent [B,Hv,Dk,Dv], conv)``, conv a ring
        ``[B,C,K]`` (then ``start [B]``, the position of row 0, is needed) or a shift register
        ``[B,C,K-1]``. Returns ``(out [B, T, H], new state)``; with ``at [B, S]`` int32 (row
        counts, ``0..T``) also the states after the first ``at[b, s]`` rows,
        ``(recurrent [B, S, Hv, Dk, Dv] f32, conv [B, S, C, columns])``
        (:func:`~pallas_kernels.gdn.reference.gdn_chunked_states`,
        :func:`~mtp_jax.models.layers.conv_state.advance_at`): ``(out, new state, states at)``.
        """
        recurrent, conv = state
        start = self._start(conv, start, x.shape[0])
        proj = self._project(x)
        rows = self._rows(proj, window_before(conv, self.kernel, start), valid)
        length = jnp.sum(valid, axis=1).astype(jnp.int32)
        new_conv = advance(conv, self.kernel, rows.qkv, length, start)
        if at is None:
            o, new_rec = gdn_chunked_reference(rows.q, rows.k, rows.v, rows.g, rows.beta,
                                               recurrent)
            return self._output(o, proj[1]), (new_rec, new_conv)
        o, new_rec, rec_at = gdn_chunked_states(rows.q, rows.k, rows.v, rows.g, rows.beta,
                                                recurrent, at)
        conv_at = advance_at(conv, self.kernel, rows.qkv, at, start)
        return self._output(o, proj[1]), (new_rec, new_conv), (rec_at, conv_at)

    def verify(self, x, state, valid, slots=None, start=None):
        """Step form over the rows of a verify window from the live state, which it does not
        change. ``state``: the batch view, or the pools when ``slots [B]`` is given, optionally
        with a third element ``sync [B, Hv]`` int32 zeros, as :meth:`decode` (the scratch of
        the one-kernel verify's folded output norm, left zero); ``start [B]``: as
        :meth:`prefill`. Returns ``(out [B, T, H], rows)``, ``rows`` the ``GDNRows |
        GDNConvRows`` for :meth:`commit`, or ``(out, (rows, sync))`` when ``state`` carried
        ``sync``."""
        sync = state[2] if len(state) == 3 else None
        state = tuple(state[:2])
        start = self._start(state[1], start, x.shape[0])
        if self.backend == "pallas":
            out, rows, sync = self._verify_fused(x, state, valid, _slots_of(slots, x), start,
                                                 sync)
        else:
            out, rows = self._verify_xla(x, state, valid, slots, start)
        return out, rows if sync is None else (rows, sync)

    def _verify_xla(self, x, state, valid, slots, start):
        recurrent, conv = state if slots is None else gather_states(state, slots)
        proj = self._project(x)
        rows = self._rows(proj, window_before(conv, self.kernel, start), valid)
        o = gdn_verify(rows.q, rows.k, rows.v, rows.g, rows.beta, recurrent,
                       backend=self.backend)
        return self._output(o, proj[1]), dataclasses.replace(rows, start=start)

    def decode(self, x, state, valid, slots=None, start=None):
        """One decode row per request (``x [B, 1, H]``): the step form's output and new state
        from one read of the state (:func:`pallas_kernels.gdn.api.gdn_decode`, or the fused
        kernels with the ``pallas`` backend), equal to :meth:`verify` followed by
        :meth:`commit` of that row. A request whose row is not ``valid [B, 1]`` (a padding row)
        keeps its recurrent state (its ``g = beta = 0``) and its conv window (length 0).
        ``state``: the batch view, or the pools when ``slots [B]`` is given; ``start [B]``: as
        :meth:`prefill`. ``state`` may carry a third element, ``sync [B, Hv]`` int32 zeros: the
        scratch of the one-kernel decode's folded output norm, which it leaves zero, so the
        model passes one buffer from layer to layer instead of zeroing one per layer (without
        it the layer makes its own). Returns ``(out [B, 1, H], new (recurrent, conv[, sync]))``
        in the form ``state`` came in. Raises ValueError when ``T != 1`` (a window needs verify
        + commit)."""
        if x.shape[1] != 1:
            raise ValueError(f"GatedDeltaNet.decode: T={x.shape[1]} rows; decode takes one row "
                             "per request (use verify + commit for a window).")
        sync = state[2] if len(state) == 3 else None
        state = tuple(state[:2])
        start = self._start(state[1], start, x.shape[0])
        if self.backend == "pallas":
            out, new, sync = self._decode_fused(x, state, valid, _slots_of(slots, x), start, sync)
        else:
            out, new = self._decode_xla(x, state, valid, slots, start)
        return out, new if sync is None else (*new, sync)

    def _decode_xla(self, x, state, valid, slots, start):
        recurrent, conv = state if slots is None else gather_states(state, slots)
        proj = self._project(x)
        rows = self._rows(proj, window_before(conv, self.kernel, start), valid)
        o, recurrent = gdn_decode(rows.q, rows.k, rows.v, rows.g, rows.beta, recurrent,
                                  backend=self.backend)
        length = jnp.sum(valid, axis=1).astype(jnp.int32)
        new = (recurrent, advance(conv, self.kernel, rows.qkv, length, start))
        return self._output(o, proj[1]), new if slots is None else scatter_states(state, slots, new)

    def commit(self, state, rows, length: jax.Array, slots=None):
        """Apply the first ``length [B]`` rows of a verify window (its ``GDNRows`` or
        ``GDNConvRows``, which carry the rows' start position for a ring) to ``state``: the
        batch view, or the pools when ``slots [B]`` is given. Returns the new
        ``(recurrent, conv)`` in the form ``state`` came in."""
        if isinstance(rows, GDNConvRows):
            return self._commit_fused(state, rows, length, _slots_of(slots, rows.qkv))
        view = state if slots is None else gather_states(state, slots)
        new = commit(view, rows, length, self.backend)
        return new if slots is None else scatter_states(state, slots, new)

    # The fused Pallas path (pallas_kernels.gdn.fused): states addressed by slot in place.

    def _conv_weight(self):
        return self.conv1d.weight[...][:, 0, :]

    def _fused_inputs(self, x):
        """``x [B, T, H]`` -> ``(qkv, z, b, a)`` for the fused kernels. Merged: ``qkv``, ``b``
        and ``a`` are the in-projection's whole output ``[B, T, N]``, read in place at
        :meth:`_gate_cols` (a slice passed to a kernel would be copied first), and ``z`` is
        its slice; unmerged: the four projections."""
        if self.in_proj is None:
            return self._project(x)
        y = self.in_proj.stacked(x)
        off = self.in_proj.offsets
        return y, y[..., off[1]:off[2]], y, y

    def _gate_cols(self) -> dict:
        """The columns of ``b`` and ``a`` in :meth:`_fused_inputs`' arrays (``gdn_step``'s
        ``b_col`` / ``a_col``)."""
        if self.in_proj is None:
            return {"b_col": 0, "a_col": 0}
        off = self.in_proj.offsets
        return {"b_col": off[2], "a_col": off[3]}

    def _verify_fused(self, x, state, valid, slots, start, sync):
        """Returns ``(out, GDNConvRows, sync)``; ``sync`` passes through unless the one-kernel
        verify folds the output norm in (a ring and merged in-projections)."""
        recurrent, window = state
        qkv, z, b, a = self._fused_inputs(x)
        rows = functools.partial(GDNConvRows, a=a, b=b, valid=valid, qkv=qkv, start=start)
        if start is None:  # a shift register: conv, then gates and recurrence
            conv = gdn_conv_rows(qkv, self._conv_weight(), window, slots)
            o = gdn_step(conv, a, b, self.A_log[...], self.dt_bias[...], valid, recurrent,
                         slots, num_k_heads=self.hk, mode="verify", **self._gate_cols())
            return self._output(o, z), rows(conv=conv), sync
        args = (qkv, self._conv_weight(), window, a, b, self.A_log[...], self.dt_bias[...],
                valid, recurrent, slots, start)
        if self.in_proj is None:  # z is its own array: the norm stays outside
            o, conv = gdn_verify_ring(*args, num_k_heads=self.hk, **self._gate_cols())
            return self._output(o, z), rows(conv=conv), sync
        y, conv, new_sync = gdn_verify_ring(*args, num_k_heads=self.hk,
                                            **self._folded_norm(x.shape[0], sync),
                                            **self._gate_cols())
        return self.out_proj(y), rows(conv=conv), None if sync is None else new_sync

    def _decode_fused(self, x, state, valid, slots, start, sync):
        """Returns ``(out, (recurrent, conv), sync)``; ``sync`` passes through unless the
        one-kernel decode folds the output norm in (a ring and merged in-projections)."""
        recurrent, window = state
        qkv, z, b, a = self._fused_inputs(x)
        if start is None:  # a shift register: conv, then gates and recurrence
            length = jnp.sum(valid, axis=1).astype(jnp.int32)
            conv, window = gdn_conv_rows(qkv, self._conv_weight(), window, slots, length)
            o, recurrent = gdn_step(conv, a, b, self.A_log[...], self.dt_bias[...], valid,
                                    recurrent, slots, num_k_heads=self.hk, mode="decode",
                                    **self._gate_cols())
            return self._output(o, z), (recurrent, window), sync
        args = (qkv, self._conv_weight(), window, a, b, self.A_log[...], self.dt_bias[...],
                valid, recurrent, slots, start)
        if self.in_proj is None:  # z is its own array: the norm stays outside
            o, recurrent, window = gdn_decode_ring(*args, num_k_heads=self.hk,
                                                   **self._gate_cols())
            return self._output(o, z), (recurrent, window), sync
        y, recurrent, window, new_sync = gdn_decode_ring(
            *args, num_k_heads=self.hk, **self._folded_norm(x.shape[0], sync),
            **self._gate_cols())
        return self.out_proj(y), (recurrent, window), None if sync is None else new_sync

    def _folded_norm(self, batch: int, sync) -> dict:
        """The ring kernels' arguments that fold the output norm in (merged in-projections:
        ``z`` read in place at its column): ``sync``, or zeros ``[B, Hv]`` int32 of its own
        when the caller passed none."""
        if sync is None:
            sync = jnp.zeros((batch, self.hv), jnp.int32)
        return {"output_norm": OutputNorm(z_col=self.in_proj.offsets[1], eps=self.eps,
                                          act=self.output_gate),
                "norm_weight": self.norm.weight[...], "sync": sync}

    def _commit_fused(self, state, rows: GDNConvRows, length, slots):
        recurrent, window = state
        keep = rows.valid & (jnp.arange(rows.valid.shape[1])[None, :] < length[:, None])
        step = functools.partial(gdn_step, rows.conv, rows.a, rows.b, self.A_log[...],
                                 self.dt_bias[...], keep, recurrent, slots,
                                 num_k_heads=self.hk, mode="commit", **self._gate_cols())
        if rows.start is not None:  # a ring: the window's new columns in the same kernel
            return step(ring=(rows.qkv, window, rows.start, length))
        _, window = gdn_conv_rows(rows.qkv, self._conv_weight(), window, slots, length)
        return step(), window


def _slots_of(slots, x):
    """``slots``, or ``arange(B)`` for a batch view (row b is state b)."""
    return jnp.arange(x.shape[0], dtype=jnp.int32) if slots is None else slots


class _Conv(nnx.Module):
    def __init__(self, channels: int, kernel: int, dtype):
        self.weight = nnx.Param(jnp.zeros((channels, 1, kernel), dtype))


class _GatedNormWeight(nnx.Module):
    """The GDN output norm's plain (not zero-centred) weight ``[Dv]``."""

    def __init__(self, dim: int, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
