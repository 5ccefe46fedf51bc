"""Resumable train state (mtp_jax.train.checkpoint): save and restore equal, the newest kept,
and a resume with other run settings refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtp_jax.config import ConfigError
from mtp_jax.train import checkpoint as ck

RUN = {"model": "/models/q", "k": 3, "seq_len": 64, "layers": [0, 1]}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    step: jax.Array
    params: dict
    opt_state: object


def make_state(seed: int) -> State:
    rng = np.random.default_rng(seed)
    params = {"mtp.fc.weight": jnp.asarray(rng.standard_normal((4, 8)), jnp.float32),
              "mtp.norm.weight": jnp.asarray(rng.standard_normal(4), jnp.bfloat16)}
    tx = optax.adamw(1e-3)
    opt = tx.init(params)
    _, opt = tx.update(params, opt, params)  # moments that differ from their init
    return State(jnp.int32(seed), params, opt)


def assert_same(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_save_restore_latest_and_max_to_keep(tmp_path):
    d = str(tmp_path / "ck")
    assert ck.latest(d) is None
    states = {s: make_state(s) for s in (1, 2, 3)}
    for s, st in states.items():
        ck.save(d, s, st, {"data": {"epoch": s, "position": 2}, "run": RUN}, max_to_keep=2)
    assert ck.latest(d) == 3
    state, meta = ck.restore(d, make_state(0), run=dict(RUN, layers=(0, 1)))  # tuple == list
    assert_same(state, states[3])
    assert meta == {"data": {"epoch": 3, "position": 2}, "run": RUN}
    state, meta = ck.restore(d, make_state(0), step=2)
    assert_same(state, states[2]) and meta["data"]["epoch"] == 2
    with pytest.raises(ConfigError, match=r"step 1 is not saved .*\[2, 3\]"):
        ck.restore(d, make_state(0), step=1)  # max_to_keep=2 removed it
    ck.save(d, 3, states[1], {"run": RUN}, max_to_keep=2)  # a saved step is replaced
    assert_same(ck.restore(d, make_state(0))[0], states[1])


def test_resume_with_other_settings_is_refused(tmp_path):
    d = str(tmp_path / "ck")
    ck.save(d, 5, make_state(5), {"run": RUN})
    other = dict(RUN, k=2, lr=1e-4)
    with pytest.raises(ConfigError, match=r"k: saved 3, now 2; lr: saved None, now 0\.0001"):
        ck.restore(d, make_state(0), run=other)
    ck.check_run(RUN, dict(RUN))


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint to resume from"):
        ck.restore(str(tmp_path / "none"), make_state(0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no checkpoint to resume from"):
        ck.restore(str(tmp_path / "empty"), make_state(0))
    with pytest.raises(ConfigError, match="JSON-able"):
        ck.save(str(tmp_path / "ck"), 1, make_state(1), {"x": object()})
