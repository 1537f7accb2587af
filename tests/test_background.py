"""Saves whose search and encoders run after save() returns (InshrinkCheckpointHandler(background=...))."""

import gc
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import inshrink_jax as ij
from inshrink_jax import save

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import digits  # noqa: E402


def manager(path, background, cfg=ij.CompressionConfig()):
    return ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(cfg, background=background),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=None))


def arrays(tree):
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


@pytest.mark.slow  # 30 s; .ci/run runs it
def test_a_background_save_stores_what_a_save_on_the_callers_thread_stores(tmp_path, trained):
    """Three saves (a keyframe, then closed-loop residuals) with the search and an eval_fn, once on the caller's
    thread and once in the background, where every array passed to save() is deleted as soon as save() returns
    (what a training loop that donates its state does): the same configurations, bytes and restored values."""
    state, grads, (tx, ty, vx, vy) = trained
    eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, vx[:256], vy[:256]))
    stream = digits.batches(tx, ty, 64, 1)
    states = [state]
    for _ in range(2):
        for _ in range(5):
            state, _, _ = digits.train_step(state, *next(stream))
        states.append(state)
    figures, restored = {}, {}
    for background in (False, True):
        # A small keyframe space: the search and its eval_fn calls still run, alike in both modes, in less time.
        space = ij.SearchSpace(bins=(4, 8, 16), prune_fractions=(0.0, 0.2), protect_fractions=(0.005,))
        mngr = manager(tmp_path / str(background), background, ij.CompressionConfig(epsilon=0.1, search_space=space))
        for step, s in enumerate(states):
            passed, g = jax.tree.map(jnp.copy, (s, grads))
            mngr.save(step, args=ij.InshrinkSave(passed, grads=g, eval_fn=eval_fn))
            if background:
                for x in arrays((passed, g)):
                    x.delete()
        mngr.wait_until_finished()
        figures[background] = [mngr.item_metadata(step) for step in range(3)]
        restored[background] = [mngr.restore(step, args=ij.InshrinkRestore(states[0])) for step in range(3)]
        mngr.close()
    for sync, bg in zip(figures[False], figures[True]):
        assert sync["stored_bytes"] == bg["stored_bytes"] and sync["quant"] == bg["quant"]
        assert sync["search"]["chosen"] == bg["search"]["chosen"] and sync["kind"] == bg["kind"]
    assert [f["search"].get("coding") for f in figures[True]] == ["keyframe", "residual", "residual"]
    for a, b in zip(restored[False], restored[True]):
        for x, y in zip(arrays(a), arrays(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_the_default_runs_in_the_background_only_for_a_single_device_state(tmp_path):
    """background=None: a single-device state in one process goes to the background; a state sharded over
    devices stays on the caller's thread (its encoders run collectives); background=True refuses it, and
    the refused save leaves nothing."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    local = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}
    sharded = {"w": jax.device_put(local["w"], NamedSharding(mesh, P("d"))), "b": local["b"]}
    cfg = ij.CompressionConfig()
    auto = ij.InshrinkCheckpointHandler(cfg)
    assert auto._in_background(save.plan(local, None, None, cfg))
    assert not auto._in_background(save.plan(sharded, None, None, cfg))
    assert not ij.InshrinkCheckpointHandler(cfg, background=False)._in_background(save.plan(local, None, None, cfg))
    mngr = manager(tmp_path, True)
    with pytest.raises(ValueError, match=r"background=True\) needs a single-process job"):
        mngr.save(0, args=ij.InshrinkSave(sharded))
    assert mngr.all_steps() == []
    mngr.save(1, args=ij.InshrinkSave(local))  # the sharded one is saved on the caller's thread by default
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1]
    with pytest.raises(TypeError, match="background must be None, True or False"):
        ij.InshrinkCheckpointHandler(cfg, background="yes")


def test_a_failed_background_save_is_not_committed_and_the_next_save_goes_on(tmp_path):
    """An eval_fn error in the background surfaces at wait_until_finished(); the step is not committed, and
    the next save (a keyframe again: nothing after step 0 was committed) restores."""
    w = {"w": jax.random.normal(jax.random.PRNGKey(0), (128, 64))}
    quality = jax.jit(lambda s: jnp.mean(s["w"] ** 2))
    mngr = manager(tmp_path, None)
    mngr.save(0, args=ij.InshrinkSave(w, eval_fn=quality))
    mngr.wait_until_finished()
    with pytest.raises(TypeError, match="eval_fn must return one real number"):
        mngr.save(1, args=ij.InshrinkSave(w, eval_fn=lambda s: "good"))
        mngr.wait_until_finished()
    assert mngr.all_steps() == [0]
    assert gc.isenabled()  # the failed save's pause of the collector ended with it
    w2 = {"w": w["w"] * 1.01}
    mngr.save(2, args=ij.InshrinkSave(w2, eval_fn=quality))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0, 2]
    out = mngr.restore(2)
    rec = mngr.item_metadata(2)["search"]
    q0, q = float(quality(w2)), float(quality(out))
    assert (q - q0) / abs(q0) == pytest.approx(rec["degradation"], abs=1e-6)
    assert abs(rec["degradation"]) <= ij.CompressionConfig().epsilon


def test_saves_and_restores_run_without_the_collector_and_leave_it_on(tmp_path, monkeypatch):
    """A save's encode (in the background) and a restore's decode run with Python's cyclic collector paused, the
    encode also with a short thread switch interval, and both are as before once each is over."""
    from inshrink_jax.handler import _COLLECTOR_PAUSED, _SHORT_SWITCHES, SWITCH_INTERVAL_S
    deadline = time.monotonic() + 120  # a save an earlier test left running in this process holds them until done
    while (_COLLECTOR_PAUSED._open or _SHORT_SWITCHES._open) and time.monotonic() < deadline:
        time.sleep(0.1)
    seen, interval = [], sys.getswitchinterval()
    assert interval > SWITCH_INTERVAL_S and gc.isenabled()

    def watched(module, name):
        original = getattr(module, name)

        def call(*a, **k):
            seen.append((name, gc.isenabled(), sys.getswitchinterval()))
            return original(*a, **k)
        monkeypatch.setattr(module, name, call)
    from inshrink_jax import restore
    watched(save, "_encode_shard")
    watched(restore, "restore")
    w = {"w": jax.random.normal(jax.random.PRNGKey(0), (128, 64))}
    mngr = manager(tmp_path, True)
    for step in range(2):
        mngr.save(step, args=ij.InshrinkSave(jax.tree.map(lambda x: x * (1 + step / 100), w)))
        mngr.wait_until_finished()
        assert gc.isenabled() and sys.getswitchinterval() == interval
    out = mngr.restore(1)
    assert gc.isenabled() and sys.getswitchinterval() == interval
    error = np.asarray(out["w"]) - np.asarray(w["w"]) * 1.01
    assert np.sqrt(np.mean(error ** 2)) <= 0.1  # the weights' RMS is 1
    assert {name for name, _, _ in seen} == {"_encode_shard", "restore"}
    assert not any(on for _, on, _ in seen)
    assert all(s == SWITCH_INTERVAL_S for name, _, s in seen if name == "_encode_shard")
    assert all(s == interval for name, _, s in seen if name == "restore")
