"""Fine-tunes stored as residuals against a base checkpoint in another directory
(InshrinkCheckpointHandler(base=)): the fine-tune is kept, leaf matching, restore is what the search scored,
chains and retention, a base that is itself a fine-tune, sharding, and a missing or changed base."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def fine_tuned(start, step, classes=100, seed=1):
    """A fine-tune's train state: `start`'s weights (the restored base) moved a little, the dense kernel more at
    every step (along one direction, as training drifts: consecutive saves' codes differ little, so they are
    stored as deltas), the conv kernel left as it is; a head of `classes`; Adam-like state."""
    rng = np.random.default_rng(seed)
    p = {"conv": {"kernel": start["params"]["conv"]["kernel"]},
         "dense": {"kernel": start["params"]["dense"]["kernel"]
                   + jnp.asarray(rng.normal(size=(128, 64)).astype(np.float32)) * 1e-3 * (step + 1)},
         "head": {"kernel": jnp.asarray(rng.normal(size=(64, classes)).astype(np.float32) * 0.05),
                  "bias": jnp.zeros(classes)}}
    # Under another key path than the base's ['params']: leaves are matched by the tail of their paths.
    return {"step": jnp.int32(step), "model": {"params": p}, "opt_state": optax.TraceState(trace=jax.tree.map(lambda x: x * 0.1, p))}


def save_base(root, variables=None):
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(CFG)) as m:
        m.save(0, args=ij.InshrinkSave(variables or pretrained()))
        m.wait_until_finished()
    return os.path.join(root, "0")


def manager(root, base=None, **opts):
    handler = ij.InshrinkCheckpointHandler(CFG, base=base)
    return ocp.CheckpointManager(root, item_handlers=handler, options=ocp.CheckpointManagerOptions(**opts)), handler


def restore(root, step, like=None):
    """Restore a step into the layout of `like` (NumPy leaves restore as NumPy), or as saved if None."""
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(CFG)) as m:
        return m.restore(step, args=ij.InshrinkRestore(None if like is None else jax.tree.map(
            lambda x: x if isinstance(x, np.ndarray) else ocp.utils.to_shape_dtype_struct(x), like)))


def save_fine_tune(tmp_path, base, state):
    """Save `state` as step 0 of tmp_path/ft by a handler against `base`: (the open manager, the save's figures)."""
    m, h = manager(str(tmp_path / "ft"), base=base)
    m.save(0, args=ij.InshrinkSave(state))
    m.wait_until_finished()
    return m, m.item_metadata(0)


def restored_base(root):
    return restore(root, 0, pretrained())


def rms(a, b):
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def assert_keeps_the_fine_tune(restored, state, start, alone=None):
    """The fine-tune is kept: the unchanged conv kernel restores to the base's values bit-exactly; the dense
    kernel's error is at most a fifth of the change fine-tuning made (16 levels on a Gaussian change: about a
    tenth), and a tenth of the error of the state saved without a base (`alone`), which quantizes the
    fine-tuned weight itself."""
    got, want = restored["model"]["params"], state["model"]["params"]
    np.testing.assert_array_equal(np.asarray(got["conv"]["kernel"]), np.asarray(start["params"]["conv"]["kernel"]))
    err = rms(got["dense"]["kernel"], want["dense"]["kernel"])
    assert err < 0.2 * rms(want["dense"]["kernel"], start["params"]["dense"]["kernel"])
    if alone is not None:
        assert err < 0.1 * rms(alone["model"]["params"]["dense"]["kernel"], want["dense"]["kernel"])
    np.testing.assert_array_equal(np.asarray(got["head"]["bias"]), np.asarray(want["head"]["bias"]))


def leaves_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fine_tune_residual_round_trip_keeps_the_fine_tune(tmp_path):
    base_dir = save_base(str(tmp_path / "base"))
    start = restored_base(str(tmp_path / "base"))
    state = fine_tuned(start, 0, classes=20)
    m, figures = save_fine_tune(tmp_path, base_dir, state)
    with_base = restore(str(tmp_path / "ft"), 0, state)
    m2, h2 = manager(str(tmp_path / "alone"))
    m2.save(0, args=ij.InshrinkSave(state))
    m2.wait_until_finished()
    assert_keeps_the_fine_tune(with_base, state, start, alone=restore(str(tmp_path / "alone"), 0, state))
    # conv and dense are residuals against the base's weights; the 20-class head has no base weight of its shape.
    reader = store.Reader(str(tmp_path / "ft" / "0" / "default"))
    residual = {m.keystr: m.base_leaf for m in reader.manifest.leaves if m.kind == "quantized"}
    assert residual == {"['model']['params']['conv']['kernel']": "['params']['conv']['kernel']",
                        "['model']['params']['dense']['kernel']": "['params']['dense']['kernel']",
                        "['model']['params']['head']['kernel']": None}
    # Restoring without a target (nested dicts, NumPy-free default device) gives the same values.
    leaves_equal(restore(str(tmp_path / "ft"), 0)["model"], with_base["model"])
    commit, _ = store.read_json(str(tmp_path / "ft" / "0" / "default" / store.COMMIT), "commit", "")
    assert commit["objects"][str(tmp_path / "base" / store.OBJECTS / "default" / "0.0")] == \
        reader.manifest.base["commit_crc32"]
    assert figures["kind"] == "keyframe" and figures["chain_depth"] == 0
    assert figures["stored_bytes"]["params"] < m2.item_metadata(0)["stored_bytes"]["params"]
    assert reader.manifest.base["directory"] == os.path.join(base_dir, "default")
    m.close(), m2.close()


def test_restore_is_what_the_search_scored(tmp_path):
    """With the search, a candidate is scored as base + decoded residual: the restored state's eval_fn gives
    exactly the degradation the search recorded."""
    base_dir = save_base(str(tmp_path / "base"))
    state = fine_tuned(restored_base(str(tmp_path / "base")), 0)
    target = state["model"]["params"]["dense"]["kernel"]

    def eval_fn(s):
        return 1.0 + jnp.mean((s["model"]["params"]["dense"]["kernel"] - target) ** 2) * 1e4

    cfg = ij.CompressionConfig(epsilon=0.05, optimizer="lossless")
    handler = ij.InshrinkCheckpointHandler(cfg, base=base_dir)
    with ocp.CheckpointManager(str(tmp_path / "ft"), item_handlers=handler) as m:
        m.save(0, args=ij.InshrinkSave(state, eval_fn=eval_fn))
        m.wait_until_finished()
        record = m.item_metadata(0)["search"]
    assert record["chosen"] != "lossless" and 0 < record["degradation"] <= 0.05
    got = float(eval_fn(restore(str(tmp_path / "ft"), 0, state)))
    assert (got - record["baseline"]) / record["baseline"] == pytest.approx(record["degradation"], rel=1e-6)


def test_non_finite_weights_of_the_base_and_of_the_fine_tune(tmp_path):
    """A base weight that is Inf or NaN cannot be added to: the fine-tune's value is stored as it is."""
    variables = pretrained()
    kernel = np.asarray(variables["params"]["dense"]["kernel"]).copy()
    kernel[0, :3] = [np.inf, np.nan, -np.inf]
    variables["params"]["dense"]["kernel"] = jnp.asarray(kernel)
    base_dir = save_base(str(tmp_path / "base"), variables)
    start = restore(str(tmp_path / "base"), 0, variables)
    np.testing.assert_array_equal(np.asarray(start["params"]["dense"]["kernel"])[0, :3], kernel[0, :3])
    state = fine_tuned(start, 0)
    tuned = np.asarray(state["model"]["params"]["dense"]["kernel"]).copy()
    tuned[0, :4] = [0.5, np.nan, np.inf, -0.25]  # Inf -> finite, NaN stays, -Inf -> Inf, finite -> finite
    state["model"]["params"]["dense"]["kernel"] = jnp.asarray(tuned)
    save_fine_tune(tmp_path, base_dir, state)[0].close()
    got = np.asarray(restore(str(tmp_path / "ft"), 0, state)["model"]["params"]["dense"]["kernel"])
    # All four are protected (the largest residuals): the first three exact, the last the base's value plus
    # a bfloat16 residual.
    np.testing.assert_array_equal(got[0, :3], tuned[0, :3])
    change = tuned[0, 3] - np.asarray(start["params"]["dense"]["kernel"])[0, 3]
    assert abs(got[0, 3] - tuned[0, 3]) <= abs(change) * 2.0**-8
    assert np.isfinite(got[1:]).all() and rms(got[1:], tuned[1:]) < 0.2 * rms(tuned[1:], kernel[1:])


def test_chain_of_fine_tune_saves_with_retention(tmp_path, capsys):
    base_dir = save_base(str(tmp_path / "base"))
    start = restored_base(str(tmp_path / "base"))
    m, h = manager(str(tmp_path / "ft"), base=base_dir, max_to_keep=2)
    depths, states = [], {}
    for step in range(7):  # keyframe_every=4: the residuals' codes go 0 (keyframe), 1, 2, 3, 0, 1, 2
        states[step] = fine_tuned(start, step)
        m.save(step, args=ij.InshrinkSave(states[step]))
        m.wait_until_finished()
        depths.append(m.item_metadata(step)["chain_depth"])
    m.close()
    assert depths == [0, 1, 2, 3, 0, 1, 2]
    # Steps 5 and 6 are kept; their chain starts at step 4's keyframe.
    assert sorted(os.listdir(tmp_path / "ft" / store.OBJECTS / "default")) == ["4.0", "5.0", "6.0"]
    # Retention and garbage collection in the fine-tune's root never touch the base: it still restores.
    assert cli.main(["verify", str(tmp_path / "base")]) == 0
    assert cli.main(["verify", str(tmp_path / "ft")]) == 0
    assert cli.main(["inspect", str(tmp_path / "ft"), "--step", "6"]) == 0
    out = capsys.readouterr().out
    assert f"residuals against the base checkpoint {os.path.join(base_dir, 'default')}" in out
    assert "(weights, residual, 16 levels)" in out
    restored = restore(str(tmp_path / "ft"), 6, states[6])
    assert_keeps_the_fine_tune(restored, states[6], start)
    leaves_equal(restore(str(tmp_path / "base"), 0, pretrained()), start)
    # A plain Orbax export of the fine-tune needs no base to read.
    assert cli.main(["export", str(tmp_path / "ft"), "--step", "6", str(tmp_path / "plain")]) == 0
    leaves_equal(ocp.StandardCheckpointer().restore((tmp_path / "plain").resolve())["model"], restored["model"])


def test_base_that_is_itself_a_delta_and_a_fine_tune(tmp_path):
    """The base step is a delta in its own root, and a fine-tune of another base: the residuals add up."""
    first = save_base(str(tmp_path / "first"))
    start = restored_base(str(tmp_path / "first"))
    root = str(tmp_path / "base")
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(CFG, base=first)) as m:
        for step in range(2):
            m.save(step, args=ij.InshrinkSave(fine_tuned(start, step)["model"]))
            m.wait_until_finished()
        assert m.item_metadata(1)["chain_depth"] == 1  # its drifting kernel is a delta
        middle = m.restore(1, args=ij.InshrinkRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                                   fine_tuned(start, 1)["model"])))
    state = fine_tuned(middle, 3)
    save_fine_tune(tmp_path, os.path.join(root, "1"), state)[0].close()
    assert_keeps_the_fine_tune(restore(str(tmp_path / "ft"), 0, state), state, middle)
    # The base's own restore (residuals against the first base) is untouched by the fine-tune's.
    assert_keeps_the_fine_tune({"model": middle}, fine_tuned(start, 1), start)


def test_sharded_fine_tune_against_unsharded_base(tmp_path):
    base_dir = save_base(str(tmp_path / "base"))
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    state = fine_tuned(restored_base(str(tmp_path / "base")), 0)
    shard = NamedSharding(mesh, PartitionSpec(None, "x"))
    state["model"]["params"]["dense"]["kernel"] = jax.device_put(state["model"]["params"]["dense"]["kernel"], shard)
    save_fine_tune(tmp_path, base_dir, state)[0].close()
    reader = store.Reader(str(tmp_path / "ft" / "0" / "default"))
    assert len(reader.shards["['model']['params']['dense']['kernel']"]) == 4
    sharded = restore(str(tmp_path / "ft"), 0, state)
    assert sharded["model"]["params"]["dense"]["kernel"].sharding == shard
    unsharded = restore(str(tmp_path / "ft"), 0, jax.tree.map(np.asarray, state))
    leaves_equal(sharded, unsharded)
    assert isinstance(unsharded["model"]["params"]["dense"]["kernel"], np.ndarray)


def test_missing_base_is_a_clear_error(tmp_path):
    base_dir = save_base(str(tmp_path / "base"))
    state = fine_tuned(restored_base(str(tmp_path / "base")), 0)
    save_fine_tune(tmp_path, base_dir, state)[0].close()
    # The base's step directory is deleted (its root's retention), its object not yet.
    shutil.rmtree(os.path.join(base_dir))
    with pytest.raises(store.CheckpointCorruptError, match=r"step 0.*stored against the base checkpoint .*cannot "
                                                           r"be read.*Put the base checkpoint back"):
        restore(str(tmp_path / "ft"), 0, state)
    assert cli.main(["verify", str(tmp_path / "ft")]) == 1
    shutil.rmtree(tmp_path / "base")
    with pytest.raises(store.CheckpointCorruptError, match=r"step 0.*stored against a base checkpoint.*missing"):
        restore(str(tmp_path / "ft"), 0, state)
    assert cli.main(["verify", str(tmp_path / "ft")]) == 1


def test_base_saved_again_in_place_is_a_clear_error(tmp_path):
    base_dir = save_base(str(tmp_path / "base"))
    start = restored_base(str(tmp_path / "base"))
    state = fine_tuned(start, 0)
    m, _ = save_fine_tune(tmp_path, base_dir, state)
    # Another checkpoint is saved where the base was: same path, same object name, other contents.
    shutil.rmtree(tmp_path / "base")
    save_base(str(tmp_path / "base"), pretrained(seed=7))
    with pytest.raises(store.CheckpointCorruptError, match=r"base checkpoint object .* has changed"):
        restore(str(tmp_path / "ft"), 0, state)
    # The handler that opened the old base refuses to save against the new one.
    with pytest.raises(Exception, match=r"was deleted or saved again since this handler opened it"):
        m.save(1, args=ij.InshrinkSave(fine_tuned(start, 1)))
        m.wait_until_finished()
    m.close()
    assert not os.path.exists(tmp_path / "ft" / "1")


def test_base_that_is_not_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no inshrink_jax checkpoint there"):
        ij.InshrinkCheckpointHandler(CFG, base=str(tmp_path))
    base_dir = save_base(str(tmp_path / "base"))
    assert ij.InshrinkCheckpointHandler(CFG, base=os.path.join(base_dir, "default")).base.directory == \
        ij.InshrinkCheckpointHandler(CFG, base=base_dir).base.directory
