"""Orbax's v1 API: `ij.Compressed` through `ocp.v1.training.Checkpointer`, with restarts and retention."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint import v1 as ocp1
from orbax.checkpoint.experimental.v1._src.training import preservation_policies

import inshrink_jax as ij
from inshrink_jax import cli, store


def state_at(step: int) -> dict:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 48)).astype(np.float32)
    drift = np.random.default_rng(step).normal(size=w.shape).astype(np.float32)
    return {"params": {"w": jnp.asarray(w + 0.01 * step * drift), "b": jnp.arange(4.0) + step},
            "opt": {"mu": jnp.asarray(w * 0.1), "nu": jnp.asarray(w * w)}, "step": step}


def test_twelve_saves_keep_three_with_restarts_and_load_as_the_v0_handler_restores(tmp_path):
    """12 steps, a new Checkpointer for every save (LatestN(3) retention), then every kept step loaded through
    v1 equals the v0 handler's restore of the same directory bit for bit; the saves form a delta chain, retention
    keeps what the kept steps need, and verify passes."""
    root = tmp_path / "ckpt"
    cfg = ij.CompressionConfig(search=False)
    for step in range(12):
        ckptr = ocp1.training.Checkpointer(root, preservation_policy=preservation_policies.LatestN(3))
        ckptr.save_checkpointables(step, {"state": ij.Compressed(state_at(step), config=cfg)})
        ckptr.close()
    ckptr = ocp1.training.Checkpointer(root)
    assert [c.step for c in ckptr.checkpoints] == [9, 10, 11]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x,
                            state_at(0))
    for step in (9, 10, 11):
        loaded = ckptr.load_checkpointables(step, {"state": ij.Compressed(abstract)})["state"].state
        v0 = ij.InshrinkCheckpointHandler().restore(root / str(step) / "state", ij.InshrinkRestore(abstract))
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(v0)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert loaded["step"] == step
        np.testing.assert_array_equal(np.asarray(loaded["params"]["b"]), np.arange(4.0) + step)
        assert np.max(np.abs(np.asarray(loaded["params"]["w"]) - np.asarray(state_at(step)["params"]["w"]))) < 0.1
        assert store.Reader(root / str(step) / "state").figures()["kind"] != "keyframe"
    ckptr.close()
    assert cli.main(["verify", str(root)]) == 0


def test_a_new_process_continues_the_chain_after_a_load(tmp_path):
    """A load in a fresh process (another handler) continues the chain: the next save is a delta whose restore
    is close to what was saved."""
    import subprocess
    import sys

    root = tmp_path / "ckpt"
    code = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from orbax.checkpoint import v1 as ocp1
import inshrink_jax as ij
from test_v1 import state_at
cfg = ij.CompressionConfig(search=False)
ckptr = ocp1.training.Checkpointer({str(root)!r})
step = int(sys.argv[1])
if step:
    ckptr.load_checkpointables(step - 1, {{"state": ij.Compressed(None, config=cfg)}})
ckptr.save_checkpointables(step, {{"state": ij.Compressed(state_at(step), config=cfg)}})
ckptr.close()
"""
    for step in (0, 1):
        done = subprocess.run([sys.executable, "-c", code, str(step)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    assert store.Reader(root / "1" / "state").figures()["kind"] == "delta"
    restored = ij.InshrinkCheckpointHandler().restore(root / "1" / "state", ij.InshrinkRestore())
    assert np.max(np.abs(restored["params"]["w"] - np.asarray(state_at(1)["params"]["w"]))) < 0.1


def test_more_than_one_process_is_refused_with_the_way_out(monkeypatch, tmp_path):
    import types

    from inshrink_jax import v1

    monkeypatch.setattr(v1, "jax", types.SimpleNamespace(process_count=lambda: 2))  # only inshrink_jax's view
    ckptr = ocp1.training.Checkpointer(tmp_path / "ckpt")
    with pytest.raises(Exception, match="use InshrinkCheckpointHandler with a CheckpointManager"):
        ckptr.save_checkpointables(0, {"state": ij.Compressed(state_at(0))})


def test_plain_pytree_saves_through_v1_registry_are_compressed_chained_and_load_back(tmp_path):
    """`ckptr.save(step, pytree)` and `ckptr.load(step, abstract)` keep their call sites: in a Context whose
    registry is `ij.v1_registry(cfg)`, the pytree goes through inshrink_jax (our manifest, a delta chain), and a
    load without a target gives the saved tree back."""
    root = tmp_path / "ckpt"
    ctx = ocp1.Context()
    ctx.checkpointables.registry = ij.v1_registry(ij.CompressionConfig(search=False))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x,
                            state_at(0))
    with ctx:
        ckptr = ocp1.training.Checkpointer(root)
        for step in range(3):
            ckptr.save(step, state_at(step))
        loaded = ckptr.load(2, abstract)
        bare = ckptr.load_checkpointables(2)["state"]
        meta = ckptr.checkpointables_metadata(2).metadata["state"]
        ckptr.close()
    directory = root / "2" / "state"
    assert (directory / store.MANIFEST).exists() and store.Reader(directory).figures()["kind"] == "delta"
    assert store.Reader(directory).figures()["ratio"]["params"] > 3
    assert np.max(np.abs(np.asarray(loaded["params"]["w"]) - np.asarray(state_at(2)["params"]["w"]))) < 0.1
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(bare)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert meta["params"]["w"].shape == (64, 48) and meta["params"]["w"].dtype == np.float32
    assert cli.main(["verify", str(root)]) == 0
