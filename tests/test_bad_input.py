"""Bad or unusual input at save: each leaf either round-trips as documented or is refused before anything is
written."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import inshrink_jax as ij


def save_restore(tmp_path, tree, **cfg):
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler(
        ij.CompressionConfig(search=False, **cfg)))
    mngr.save(0, args=ij.InshrinkSave(tree))
    mngr.wait_until_finished()
    return mngr.restore(0), mngr


def test_unusual_arrays_round_trip_as_documented(tmp_path):
    rng = np.random.default_rng(0)
    special = rng.normal(size=(64, 64)).astype(np.float32)
    special[0, :4] = [np.nan, np.inf, -np.inf, 3e38]
    tree = {"params": {
        "empty": jnp.zeros((0, 64)), "empty_np": np.zeros((3, 0), np.int8),
        "zeros": jnp.zeros((64, 64)), "constant": jnp.full((64, 64), 0.125),
        "special": jnp.asarray(special), "f64_np": rng.normal(size=(40, 40)),
        "scalar_array": jnp.float32(2.5)}}
    r, _ = save_restore(tmp_path, tree)
    p = r["params"]
    assert p["empty"].shape == (0, 64) and p["empty_np"].shape == (3, 0) and p["empty_np"].dtype == np.int8
    np.testing.assert_array_equal(np.asarray(p["zeros"]), 0.0)  # zeros are exact
    np.testing.assert_allclose(np.asarray(p["constant"]), 0.125, rtol=0.01)  # within the sketch's alpha
    s = np.asarray(p["special"])  # non-finite values are protected: they come back as they were
    assert np.isnan(s[0, 0]) and s[0, 1] == np.inf and s[0, 2] == -np.inf and np.isfinite(s[0, 3])
    assert np.abs(s[0, 3] - 3e38) / 3e38 < 2**-7  # bfloat16-protected, never turned into Inf
    np.testing.assert_array_equal(p["f64_np"], tree["params"]["f64_np"])  # float64 is never quantized
    assert float(p["scalar_array"]) == 2.5


def test_float64_with_x64_is_stored_bit_exact(tmp_path):
    code = f"""
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
import inshrink_jax as ij
x = jnp.asarray(np.random.default_rng(0).normal(size=(128, 64)))
assert x.dtype == jnp.float64
mngr = ocp.CheckpointManager({str(tmp_path)!r}, item_handlers=ij.InshrinkCheckpointHandler())
mngr.save(0, args=ij.InshrinkSave({{"params": {{"w": x}}, "n": jnp.int64(2**40)}}))
mngr.wait_until_finished()
r = mngr.restore(0)
assert r["params"]["w"].dtype == jnp.float64 and int(r["n"]) == 2**40
np.testing.assert_array_equal(np.asarray(r["params"]["w"]), np.asarray(x))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("leaf, message", [
    (object(), "unsupported type object"),
    (b"bytes", "unsupported type bytes"),
    (2**70, "does not fit in 64 bits"),
    ({1.5: jnp.ones(3)}, "cannot be stored; use str or int"),
])
def test_unsupported_leaves_are_refused_before_writing(tmp_path, leaf, message):
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler())
    with pytest.raises((TypeError, ValueError), match=message):
        mngr.save(0, args=ij.InshrinkSave({"params": {"w": jnp.ones((64, 64))}, "x": leaf}))
    assert mngr.all_steps() == [] and not (tmp_path / "inshrink_objects").exists()


def test_a_sharding_that_does_not_fit_is_a_clear_error(tmp_path):
    _, mngr = save_restore(tmp_path, {"params": {"w": jnp.ones((63, 64))}})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(4), ("x",))
    target = {"params": {"w": jax.ShapeDtypeStruct((63, 64), jnp.float32, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("x", None)))}}
    with pytest.raises(ValueError, match=r"step 0.*\['params'\]\['w'\]: the target sharding does not fit shape \(63, 64\)"):
        mngr.restore(0, args=ij.InshrinkRestore(target))


def test_a_huge_single_leaf_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    w = (rng.standard_t(3, size=(8192, 4096)) * 0.02).astype(np.float32)  # 2^25 weights, one tensor
    r, mngr = save_restore(tmp_path, {"params": {"w": jnp.asarray(w)}}, quant=ij.QuantConfig(bins=16))
    out = np.asarray(r["params"]["w"])
    assert out.shape == w.shape
    meta = ij.store.Reader(tmp_path / "0" / "default").manifest.leaves[0]
    on_grid = np.isin(out, np.asarray(meta.centres, np.float32))
    near = np.abs(out - w) <= 2.0**-8 * np.abs(w)  # protected: bfloat16 of the weight
    assert np.all(on_grid | near)  # every weight is on one of the 16 centres or its protected value
    assert near.mean() >= 0.005  # the protected 0.5% (the largest weights) come back near-exact
    assert mngr.item_metadata(0)["ratio"]["params"] > 4


def test_a_shard_too_large_to_address_is_refused_before_writing(tmp_path, monkeypatch):
    from inshrink_jax import save

    monkeypatch.setattr(save, "MAX_SHARD_ELEMENTS", 4095)
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler())
    with pytest.raises(ValueError, match=r"leaf \['params'\]\['w'\]: a shard of 4,096 elements"):
        mngr.save(0, args=ij.InshrinkSave({"params": {"w": jnp.ones((64, 64))}}))
    assert mngr.all_steps() == []
