"""Delta chains: the cyclic rearranged delta, keyframes, restarts, failed saves, missing bases, retention."""

import os
import shutil

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint import checkpoint_managers as cm

import inshrink_jax as ij
from inshrink_jax import delta, store


# --------------------------------------------------------------------------------------------- the delta
@hypothesis.given(st.integers(2, 254), st.integers(2, 254), st.integers(1, 3000), st.integers(0, 2**31 - 1),
                  st.booleans())
def test_delta_round_trip_any_bins(k_prev, k_new, n, seed, rearrange):
    rng = np.random.default_rng(seed)
    prev = rng.integers(0, k_prev + 2, n).astype(np.uint8)
    new = rng.integers(0, k_new + 2, n).astype(np.uint8)
    b = delta.modulus(k_prev, k_new)
    d = delta.encode(prev, new, b, rearrange)
    assert d.dtype == np.uint8 and d.max(initial=0) < b
    order = np.argsort(prev, kind="stable") if rearrange else np.arange(n)  # the definition, in wide integers
    np.testing.assert_array_equal(d, (new[order].astype(np.int64) - prev[order]) % b)
    np.testing.assert_array_equal(delta.decode(prev, d, b, rearrange), new)


def test_rearranged_stream_is_grouped_by_previous_code():
    prev = np.array([2, 0, 2, 1, 0, 1], np.uint8)
    new = np.array([3, 0, 2, 1, 5, 1], np.uint8)
    plain = delta.encode(prev, new, 6, rearrange=False)
    np.testing.assert_array_equal(plain, [1, 0, 0, 0, 5, 0])
    # stable order of prev: positions 1, 4 (code 0), 3, 5 (code 1), 0, 2 (code 2)
    np.testing.assert_array_equal(delta.encode(prev, new, 6), [0, 5, 0, 0, 1, 0])


@pytest.mark.parametrize("rearrange", [True, False])
def test_a_delta_or_previous_code_past_the_modulus_is_refused(rearrange):
    """A stream from disk is untrusted: a value the modulus cannot hold is an error, never an out-of-range code."""
    prev = np.array([2, 0, 1, 0], np.uint8)
    with pytest.raises(ValueError, match="code 6 is not below the delta modulus 6"):
        delta.decode(prev, np.array([0, 6, 0, 0], np.uint8), 6, rearrange)
    with pytest.raises(ValueError, match="code 7 is not below the delta modulus 6"):
        delta.decode(np.array([7, 0, 1, 0], np.uint8), np.zeros(4, np.uint8), 6, rearrange)


# ----------------------------------------------------------------------------------------------- helpers
def make_manager(root, keyframe_every=10, **opts):
    # A fixed configuration: these tests are about chains (test_search.py saves chains with the search on);
    # the optimizer state is lossless so that its "trace" tells bit-exactly which step came back. Open loop: the
    # level-index deltas (test_closed_loop.py has the closed-loop chains).
    h = ij.InshrinkCheckpointHandler(ij.CompressionConfig(keyframe_every=keyframe_every, search=False,
                                                          optimizer="lossless", closed_loop=False))
    return ocp.CheckpointManager(root, item_handlers=h, options=ocp.CheckpointManagerOptions(**opts))


def train_like(seed, steps):
    """A parameter tree that drifts slowly, as weights do between checkpoints."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(3, size=(96, 64)).astype(np.float32) * 0.05
    c = rng.standard_t(3, size=(3, 3, 8, 16)).astype(np.float32) * 0.1
    for i in range(steps):
        yield {"params": {"dense": {"kernel": jnp.asarray(w)}, "conv": {"kernel": jnp.asarray(c)},
                          "bias": jnp.asarray(w[0])},
               "opt_state": optax.TraceState(trace=jnp.asarray(w * 0.1)), "step": jnp.int32(i)}
        w = w + rng.normal(size=w.shape).astype(np.float32) * 2e-3
        c = c + rng.normal(size=c.shape).astype(np.float32) * 2e-3


def as_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(x), tree)


def assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, as_numpy(a), as_numpy(b))


def figures(mngr, step):
    return mngr.item_metadata(step)


# ------------------------------------------------------------------------------------------------ chains
def test_saves_after_the_first_are_deltas_and_keyframes_bound_the_chain(tmp_path):
    mngr = make_manager(tmp_path, keyframe_every=3)
    first = {}
    for step, state in enumerate(train_like(0, 7)):
        mngr.save(step, args=ij.InshrinkSave(state))
        mngr.wait_until_finished()
        first[step] = as_numpy(mngr.restore(step))
    kinds = [(figures(mngr, s)["kind"], figures(mngr, s)["chain_depth"]) for s in range(7)]
    assert kinds == [("keyframe", 0), ("delta", 1), ("delta", 2), ("keyframe", 0), ("delta", 1), ("delta", 2),
                     ("keyframe", 0)]
    assert figures(mngr, 1)["stored_bytes"]["params"] < figures(mngr, 0)["stored_bytes"]["params"]
    for s in range(7):  # a fresh manager (no cached state) restores every step to the same bits
        assert_same(make_manager(tmp_path).restore(s), first[s])


def test_a_leaf_new_at_every_save_is_stored_on_its_own_and_ends_its_chain(tmp_path):
    """Codes that change little take a delta; codes that are new at every save (as Adam's first moment is after
    an interval of steps) code smaller on their own, which the writer picks, and restores stay bit-exact."""
    mngr = make_manager(tmp_path)
    rng = np.random.default_rng(3)
    first = {}
    for step, state in enumerate(train_like(2, 3)):
        state["params"]["fresh"] = jnp.asarray(rng.standard_t(3, size=(96, 64)).astype(np.float32))
        mngr.save(step, args=ij.InshrinkSave(state))
        mngr.wait_until_finished()
        first[step] = as_numpy(mngr.restore(step))
    reader = store.Reader(tmp_path / "2" / "default")
    [(_, fresh)], [(_, drifting)] = reader.shards["['params']['fresh']"], reader.shards["['params']['dense']['kernel']"]
    assert fresh.segments["codes"].base is None and drifting.segments["codes"].base is not None
    assert figures(mngr, 2)["kind"] == "mixed"
    for s in range(3):
        assert_same(make_manager(tmp_path).restore(s), first[s])


def test_restart_starts_a_keyframe_and_restore_continues_the_chain(tmp_path):
    states = list(train_like(1, 4))
    mngr = make_manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(states[0]))
    mngr.save(1, args=ij.InshrinkSave(states[1]))
    mngr.wait_until_finished()
    assert figures(mngr, 1)["kind"] == "delta"
    # a new process: new manager, new handler, no cached codes
    mngr = make_manager(tmp_path)
    mngr.save(2, args=ij.InshrinkSave(states[2]))
    mngr.wait_until_finished()
    assert figures(mngr, 2)["kind"] == "keyframe"
    # another new process that resumes from step 1 first: it holds step 1's codes and continues that chain.
    mngr = make_manager(tmp_path)
    r1 = mngr.restore(1, args=ij.InshrinkRestore(states[1]))  # the target keeps the optax state's type
    # The resumed weights sit on step 1's grid: saving them again is an almost empty delta.
    mngr.save(3, args=ij.InshrinkSave(r1 | {"step": jnp.int32(3)}))
    mngr.wait_until_finished()
    f3 = figures(mngr, 3)
    assert (f3["kind"], f3["chain_depth"]) == ("delta", 2)
    assert f3["ratio"]["params"] > 3 * figures(mngr, 1)["ratio"]["params"]
    mngr.save(4, args=ij.InshrinkSave(states[3]))
    mngr.wait_until_finished()
    assert (figures(mngr, 4)["kind"], figures(mngr, 4)["chain_depth"]) == ("delta", 3)
    assert_same(make_manager(tmp_path).restore(1, args=ij.InshrinkRestore(states[1])), r1)


@pytest.mark.parametrize("where", ["commit", "finalize"])
def test_failed_save_leaves_the_chain_on_the_last_committed_save(tmp_path, monkeypatch, where):
    states = list(train_like(2, 3))
    mngr = make_manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(states[0]))
    mngr.wait_until_finished()
    r0 = as_numpy(mngr.restore(0))

    def broken(*args, **kwargs):
        raise OSError("disk full (simulated)")

    with monkeypatch.context() as m:
        m.setattr(store.BlobWriter, "close", broken) if where == "commit" else m.setattr(store, "finalize", broken)
        mngr.save(1, args=ij.InshrinkSave(states[1]))
        with pytest.raises(Exception, match="disk full"):
            mngr.wait_until_finished()
    assert mngr.all_steps() == [0]
    mngr.save(2, args=ij.InshrinkSave(states[2]))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [0, 2]
    # never a delta on the failed save's codes: a delta on step 0's (depth 1)
    f2 = figures(mngr, 2)
    assert (f2["kind"], f2["chain_depth"]) == ("delta", 1)
    base = {s.base for _, e in store.Reader(tmp_path / "2" / "default").own.entries.values()
            for s in e.segments.values() if s.base is not None}
    assert base == {store.Reader(tmp_path / "0" / "default").object_id}
    assert_same(make_manager(tmp_path).restore(0), r0)
    fresh = make_manager(tmp_path).restore(2)
    np.testing.assert_array_equal(np.asarray(fresh["opt_state"]["trace"]), np.asarray(states[2]["opt_state"].trace))


def test_missing_base_is_a_clear_error(tmp_path):
    states = list(train_like(3, 2))
    mngr = make_manager(tmp_path)
    for step, state in enumerate(states):
        mngr.save(step, args=ij.InshrinkSave(state))
    mngr.wait_until_finished()
    base = store.Reader(tmp_path / "0" / "default").object_id
    shutil.rmtree(tmp_path / store.OBJECTS / "default" / base)
    with pytest.raises(ij.CheckpointCorruptError, match=f"step 1, item 'default'.*needs object {base}.*missing"):
        make_manager(tmp_path).restore(1)


def test_step_saved_again_after_delete_gets_a_new_object(tmp_path):
    states = list(train_like(4, 4))
    mngr = make_manager(tmp_path)
    for step in (0, 1, 2):
        mngr.save(step, args=ij.InshrinkSave(states[step]))
    mngr.wait_until_finished()
    r0 = as_numpy(mngr.restore(0))
    mngr.delete(2)
    mngr.delete(1)
    mngr.save(1, args=ij.InshrinkSave(states[3]))  # same step number, other weights
    mngr.wait_until_finished()
    assert store.Reader(tmp_path / "1" / "default").object_id == "1.1"
    assert sorted(os.listdir(tmp_path / store.OBJECTS / "default")) == ["0.0", "1.1"]  # 1.0 and 2.0 collected
    assert_same(make_manager(tmp_path).restore(0), r0)
    np.testing.assert_array_equal(np.asarray(make_manager(tmp_path).restore(1)["opt_state"]["trace"]),
                                  np.asarray(states[3]["opt_state"].trace))


def test_objects_of_deleted_steps_are_collected(tmp_path):
    mngr = make_manager(tmp_path, keyframe_every=2, max_to_keep=1)
    for step, state in enumerate(train_like(5, 5)):
        mngr.save(step, args=ij.InshrinkSave(state))
        mngr.wait_until_finished()
    assert mngr.all_steps() == [4]
    # step 4 is a keyframe (chains of 2); the next save collects what step 3 and older used
    mngr.save(5, args=ij.InshrinkSave(next(train_like(6, 1))))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [5]
    left = sorted(os.listdir(tmp_path / store.OBJECTS / "default"))
    assert left == ["4.0", "5.0"], left  # 5 is a delta on 4: both kept, nothing else


def test_a_base_whose_step_is_gone_keeps_only_its_code_streams(tmp_path):
    mngr = make_manager(tmp_path, keyframe_every=10, max_to_keep=1)
    states = list(train_like(7, 5))
    for step, state in enumerate(states):
        mngr.save(step, args=ij.InshrinkSave(state))
        mngr.wait_until_finished()
    mngr.save(5, args=ij.InshrinkSave(states[-1]))  # collects what the deletion of step 4 left
    mngr.wait_until_finished()
    objects = tmp_path / store.OBJECTS / "default"
    files = {o: sorted(os.listdir(objects / o)) for o in sorted(os.listdir(objects))}
    assert sorted(files) == ["0.0", "1.0", "2.0", "3.0", "4.0", "5.0"]  # one chain: every object is a base
    for o, names in files.items():  # step 4 is dropped after step 5 commits: its data goes at the next save
        assert "blob.0" in names and (("data.0" in names) == (o in ("4.0", "5.0"))), (o, names)
    restored = mngr.restore(5)
    np.testing.assert_array_equal(np.asarray(restored["opt_state"]["trace"]), np.asarray(states[-1]["opt_state"].trace))
    # The lossless leaves of the dropped steps are gone: the chain keeps code streams only.
    data_bytes = os.path.getsize(objects / "5.0" / "data.0")
    chain_bytes = sum(os.path.getsize(objects / o / "blob.0") for o in files if o != "5.0")
    assert chain_bytes < data_bytes


# ----------------------------------------------------------------------------------------------- retention
POLICIES = {
    "max_to_keep=2": dict(max_to_keep=2),
    "max_to_keep=1": dict(max_to_keep=1),
    "keep_period=3": dict(max_to_keep=1, keep_period=3),
    "best_fn": dict(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min"),
    "LatestN|EveryNSteps": dict(preservation_policy=cm.AnyPreservationPolicy([cm.LatestN(2), cm.EveryNSteps(4)])),
    "BestN": dict(preservation_policy=cm.BestN(get_metric_fn=lambda m: m["loss"], n=2)),
    "keep all": dict(),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(data=st.data())
def test_every_listed_step_restores_as_first_restored(tmp_path_factory, policy, data):
    """Random programs of saves, restores, deletes (by the manager and by hand) and restarts under one
    retention policy: after every operation, every step Orbax lists restores bit-identically to its first
    restore, right after it was saved."""
    root = tmp_path_factory.mktemp("retention")
    keyframe_every = data.draw(st.sampled_from([2, 3, 10]), "keyframe_every")
    opts = POLICIES[policy]
    mngr = make_manager(root, keyframe_every, **opts)
    states = train_like(data.draw(st.integers(0, 1000), "seed"), 10**6)
    first: dict[int, object] = {}
    step = 0
    ops = data.draw(st.lists(st.sampled_from(["save", "save", "save", "restore", "delete", "rm", "restart"]),
                             min_size=4, max_size=12), "ops")
    for op in ops:
        listed = mngr.all_steps()
        hypothesis.event(f"{op} with {len(listed)} listed")
        if op == "save":
            step += data.draw(st.integers(1, 3), "step gap")
            mngr.save(step, args=ij.InshrinkSave(next(states)),
                      metrics={"loss": data.draw(st.floats(0, 1), "loss")})
            mngr.wait_until_finished()
            if step in mngr.all_steps():  # a best-N policy may drop the new step at once
                first[step] = as_numpy(mngr.restore(step))
        elif op == "restore" and listed:
            mngr.restore(data.draw(st.sampled_from(listed), "restore step"))  # adopts that step's codes
        elif op == "delete" and listed:
            mngr.delete(data.draw(st.sampled_from(listed), "delete step"))
        elif op in ("rm", "restart"):  # the job stops; maybe someone deletes a step by hand; a new job starts
            mngr.close()
            if op == "rm" and listed:
                shutil.rmtree(root / str(data.draw(st.sampled_from(listed), "rm step")))
            mngr = make_manager(root, keyframe_every, **opts)
        for s in mngr.all_steps():
            assert_same(make_manager(root).restore(s), first[s])
    mngr.close()


def test_a_chain_restores_alike_with_its_codes_decoded_in_threads_or_in_turn(tmp_path, monkeypatch):
    # restore.decode_codes decodes shards of at least _THREADED_SIZE elements in a thread pool and smaller ones one
    # after the other: either way a step at the end of a delta chain comes back bit for bit the same.
    from inshrink_jax import restore

    mngr = make_manager(tmp_path, keyframe_every=8)
    for i, state in enumerate(train_like(3, 4)):
        mngr.save(i, args=ij.InshrinkSave(state))
    mngr.wait_until_finished()
    reader = store.Reader(tmp_path / "3" / "default")
    assert max(reader.codes(k, e.box)[1] for k, sh in reader.shards.items() for _, e in sh
               if reader.leaves[k].kind == "quantized") == 3  # the deepest chain holds 3 deltas
    in_turn = restore.restore(reader, None, threads=2)
    monkeypatch.setattr(restore, "_THREADED_SIZE", 0)
    pools = []
    real_pool = restore.concurrent.futures.ThreadPoolExecutor
    monkeypatch.setattr(restore.concurrent.futures, "ThreadPoolExecutor",
                        lambda *a, **k: pools.append(a) or real_pool(*a, **k))
    threaded = restore.restore(store.Reader(tmp_path / "3" / "default"), None, threads=2)
    monkeypatch.undo()
    assert pools  # the shards' codes went through the pool
    assert_same(threaded, in_turn)
    assert_same(in_turn, mngr.restore(3))
