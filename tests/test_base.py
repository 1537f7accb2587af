"""Fine-tunes stored as deltas against a base checkpoint in another directory (InshrinkCheckpointHandler(base=)):
round trip, leaf matching, finer sharding than the base, retention, and a missing or changed base."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import inshrink_jax as ij
from inshrink_jax import cli, store

CFG = ij.CompressionConfig(search=False, optimizer="lossless", keyframe_every=4)


def pretrained(seed=0):
    """A 'pretrained' variables dict: two weights and a classifier head, and batch-norm-like statistics."""
    rng = np.random.default_rng(seed)
    return {"params": {"conv": {"kernel": jnp.asarray(rng.standard_t(3, (3, 3, 16, 32)).astype(np.float32) * 0.1)},
                       "dense": {"kernel": jnp.asarray(rng.standard_t(3, (128, 64)).astype(np.float32) * 0.05)},
                       "head": {"kernel": jnp.asarray(rng.normal(size=(64, 100)).astype(np.float32) * 0.05),
                                "bias": jnp.zeros(100)}},
            "batch_stats": {"mean": jnp.asarray(rng.normal(size=32).astype(np.float32))}}


def fine_tuned(base, step, classes=100, seed=1):
    """A fine-tune's train state: the base's weights moved a little, a head of `classes`, and Adam-like state."""
    rng = np.random.default_rng(seed + step)
    p = jax.tree.map(lambda x: x + jnp.asarray(rng.normal(size=x.shape).astype(np.float32)) * 1e-3 * (step + 1),
                     base["params"])
    p["head"] = {"kernel": jnp.asarray(rng.normal(size=(64, classes)).astype(np.float32) * 0.05),
                 "bias": jnp.zeros(classes)}
    # Under another key path than the base's ['params']: leaves are matched by the tail of their paths.
    return {"step": jnp.int32(step), "model": {"params": p}, "opt_state": {"mu": jax.tree.map(lambda x: x * 0.1, p)}}


def save_base(root, variables=None):
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(CFG)) as m:
        m.save(0, args=ij.InshrinkSave(variables or pretrained()))
        m.wait_until_finished()
    return os.path.join(root, "0")


def manager(root, base=None, **opts):
    handler = ij.InshrinkCheckpointHandler(CFG, base=base)
    return ocp.CheckpointManager(root, item_handlers=handler, options=ocp.CheckpointManagerOptions(**opts)), handler


def restore(root, step, like=None):
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(CFG)) as m:
        return m.restore(step, args=ij.InshrinkRestore(
            None if like is None else jax.tree.map(ocp.utils.to_shape_dtype_struct, like)))


def save_fine_tune(tmp_path, base, state):
    """Save `state` as step 0 of tmp_path/ft by a handler against `base`: (the open manager, the save's figures)."""
    m, h = manager(str(tmp_path / "ft"), base=base)
    m.save(0, args=ij.InshrinkSave(state))
    m.wait_until_finished()
    return m, h.last_figures


def assert_restores_as_saved_alone(tmp_path, step, state):
    """Step `step` of the fine-tune root (tmp_path/ft) restores to exactly what the same state restores to when
    saved without a base (a keyframe)."""
    alone, _ = manager(str(tmp_path / "alone"))
    alone.save(step, args=ij.InshrinkSave(state))
    alone.wait_until_finished()
    alone.close()
    leaves_equal(restore(str(tmp_path / "ft"), step, state), restore(str(tmp_path / "alone"), step, state))


def leaves_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fine_tune_delta_round_trip_is_bit_exact_and_small(tmp_path):
    base_dir = save_base(str(tmp_path / "base"))
    state = fine_tuned(pretrained(), 0, classes=20)
    m, figures = save_fine_tune(tmp_path, base_dir, state)
    with_base = restore(str(tmp_path / "ft"), 0, state)
    # The same state saved without a base (a keyframe) restores to exactly the same values.
    m2, h2 = manager(str(tmp_path / "alone"))
    m2.save(0, args=ij.InshrinkSave(state))
    m2.wait_until_finished()
    leaves_equal(with_base, restore(str(tmp_path / "alone"), 0, state))
    # conv and dense are deltas against the base; the 20-class head has no base weight of its shape: keyframe.
    reader = store.Reader(str(tmp_path / "ft" / "0" / "default"))
    kinds = {leaf: ("base" in shards[0][1]["segments"]["codes"]) for leaf, shards in reader.shards.items()
             if "codes" in shards[0][1]["segments"]}
    assert kinds == {"['model']['params']['conv']['kernel']": True, "['model']['params']['dense']['kernel']": True,
                     "['model']['params']['head']['kernel']": False}
    seg = reader.shards["['model']['params']['dense']['kernel']"][0][1]["segments"]["codes"]
    assert seg["base_leaf"] == "['params']['dense']['kernel']"
    assert os.path.isabs(seg["base"]) and seg["base"].startswith(str(tmp_path / "base"))
    assert figures["kind"] == "mixed" and figures["chain_depth"] == 1
    assert figures["stored_bytes"]["params"] < h2.last_figures["stored_bytes"]["params"]
    assert reader.manifest["base"]["directory"] == os.path.join(base_dir, "default")
    m.close(), m2.close()


def test_chain_of_fine_tune_saves_uses_the_base_as_keyframe(tmp_path, capsys):
    base_dir = save_base(str(tmp_path / "base"))
    m, h = manager(str(tmp_path / "ft"), base=base_dir, max_to_keep=2)
    depths, states = [], {}
    for step in range(6):  # keyframe_every=4: depths 1, 2, 3 then back to the base: 1, 2, 3
        states[step] = fine_tuned(pretrained(), step)
        m.save(step, args=ij.InshrinkSave(states[step]))
        m.wait_until_finished()
        depths.append(h.last_figures["chain_depth"])
        assert h.last_figures["kind"] == "delta"
    m.close()
    assert depths == [1, 2, 3, 1, 2, 3]
    assert sorted(os.listdir(tmp_path / "ft" / store.OBJECTS / "default")) == ["3.0", "4.0", "5.0"]
    # Retention and garbage collection in the fine-tune's root never touch the base: it still restores.
    leaves_equal(restore(str(tmp_path / "base"), 0), restore(str(tmp_path / "base"), 0))
    assert cli.main(["verify", str(tmp_path / "base")]) == 0
    assert cli.main(["verify", str(tmp_path / "ft")]) == 0
    assert cli.main(["inspect", str(tmp_path / "ft"), "--step", "5"]) == 0
    assert f"deltas against the base checkpoint {os.path.join(base_dir, 'default')}" in capsys.readouterr().out
    assert_restores_as_saved_alone(tmp_path, 5, states[5])


def test_base_that_is_itself_a_delta(tmp_path):
    """The base step is a delta in its own root: the fine-tune's chain continues into the base's chain, whose
    references are relative to the base's store."""
    root = str(tmp_path / "base")
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(CFG)) as m:
        for step in range(2):
            m.save(step, args=ij.InshrinkSave(pretrained() if step == 0 else fine_tuned(pretrained(), 5)["model"]))
            m.wait_until_finished()
        assert m.item_metadata(1)["kind"] == "delta"
    state = fine_tuned(pretrained(), 0)
    m, figures = save_fine_tune(tmp_path, os.path.join(root, "1"), state)
    m.close()
    assert figures["chain_depth"] == 2
    commit, _ = store.read_json(str(tmp_path / "ft" / "0" / "default" / store.COMMIT), "commit", "")
    assert sorted(k for k in commit["objects"] if os.path.isabs(k)) == [
        os.path.join(root, store.OBJECTS, "default", "0.0"), os.path.join(root, store.OBJECTS, "default", "1.0")]
    assert_restores_as_saved_alone(tmp_path, 0, state)


def test_sharded_fine_tune_against_unsharded_base(tmp_path):
    base_dir = save_base(str(tmp_path / "base"))
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    state = fine_tuned(pretrained(), 0)
    shard = NamedSharding(mesh, PartitionSpec(None, "x"))
    state["model"]["params"]["dense"]["kernel"] = jax.device_put(state["model"]["params"]["dense"]["kernel"], shard)
    save_fine_tune(tmp_path, base_dir, state)[0].close()
    reader = store.Reader(str(tmp_path / "ft" / "0" / "default"))
    shards = reader.shards["['model']['params']['dense']['kernel']"]
    assert len(shards) == 4
    assert all(e["segments"]["codes"]["base_box"] == [[0, 128], [0, 64]] for _, e in shards)
    assert_restores_as_saved_alone(tmp_path, 0, state)


def test_missing_base_is_a_clear_error(tmp_path):
    base_dir = save_base(str(tmp_path / "base"))
    state = fine_tuned(pretrained(), 0)
    save_fine_tune(tmp_path, base_dir, state)[0].close()
    shutil.rmtree(tmp_path / "base")
    with pytest.raises(store.CheckpointCorruptError, match=r"step 0.*delta against a base checkpoint.*missing"):
        restore(str(tmp_path / "ft"), 0, state)
    assert cli.main(["verify", str(tmp_path / "ft")]) == 1


def test_base_saved_again_in_place_is_a_clear_error(tmp_path):
    base_dir = save_base(str(tmp_path / "base"))
    state = fine_tuned(pretrained(), 0)
    m, _ = save_fine_tune(tmp_path, base_dir, state)
    # Another checkpoint is saved where the base was: same path, same object name, other contents.
    shutil.rmtree(tmp_path / "base")
    save_base(str(tmp_path / "base"), pretrained(seed=7))
    with pytest.raises(store.CheckpointCorruptError, match=r"base checkpoint object .* has changed"):
        restore(str(tmp_path / "ft"), 0, state)
    # The handler that opened the old base refuses to save against the new one.
    with pytest.raises(Exception, match=r"was deleted or saved again since this handler opened it"):
        m.save(1, args=ij.InshrinkSave(fine_tuned(pretrained(), 1)))
        m.wait_until_finished()
    m.close()
    assert not os.path.exists(tmp_path / "ft" / "1")


def test_base_that_is_not_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no inshrink_jax checkpoint there"):
        ij.InshrinkCheckpointHandler(CFG, base=str(tmp_path))
    base_dir = save_base(str(tmp_path / "base"))
    assert ij.InshrinkCheckpointHandler(CFG, base=os.path.join(base_dir, "default")).base.directory == \
        ij.InshrinkCheckpointHandler(CFG, base=base_dir).base.directory
