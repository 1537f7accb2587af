"""Bad or unusual input at save: each leaf either round-trips as documented or is refused before anything is
written."""

import subprocess
import time
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
    ({1.5: jnp.ones(3)}, r"\['x'\]\[1.5\]: dict key 1.5 of type float cannot be stored; use str or int"),
    ({("a", "b"): jnp.ones(3)}, r"\['x'\]\[\('a', 'b'\)\]: dict key \('a', 'b'\) of type tuple"),
    ({"a": jnp.ones(3), 1: jnp.ones(3)}, r"\['x'\]: a dict whose keys mix types \['int', 'str'\]"),
])
def test_unsupported_leaves_are_refused_before_writing(tmp_path, leaf, message):
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler())
    with pytest.raises((TypeError, ValueError), match=message):
        mngr.save(0, args=ij.InshrinkSave({"params": {"w": jnp.ones((64, 64))}, "x": leaf}))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [] and not (tmp_path / "inshrink_objects").exists()
    assert not [p.name for p in tmp_path.iterdir() if "tmp" in p.name]  # no temporary step directory left behind


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
    reader = ij.store.Reader(tmp_path / "0" / "default")
    meta = reader.manifest.leaves[0]
    assert meta.coding == ij.records.CLOSED_LOOP and meta.stored is None  # a keyframe: the levels of its link
    [(_, shard)] = reader.shards[meta.keystr]
    on_grid = np.isin(out, shard.segments["codes"].table())
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


def test_64_bit_numpy_leaves_and_numpy_scalars_come_back_exactly(tmp_path):
    """With the documented recipe (`ocp.utils.to_shape_dtype_struct`), a concrete target and no target: NumPy
    int64 / float64 values are not narrowed, NumPy scalars stay NumPy scalars, a typed PRNG key stays a key."""
    tree = {"a": np.array([2**33 + 5]), "b": np.int64(2**33), "c": np.float64(np.pi), "f": np.float32(1.5),
            "low": np.int64(-2**63), "key": jax.random.key(1)}
    _, mngr = save_restore(tmp_path, tree)
    for target in (jax.tree.map(ocp.utils.to_shape_dtype_struct, tree), tree, None):
        r = mngr.restore(0, args=ij.InshrinkRestore(target))
        for k in ("a", "b", "c", "f", "low"):
            assert type(r[k]) is type(tree[k]) and r[k].dtype == tree[k].dtype, (k, target)
            np.testing.assert_array_equal(r[k], tree[k])
        np.testing.assert_array_equal(jax.random.key_data(r["key"]), jax.random.key_data(tree["key"]))


@pytest.mark.parametrize("saved, target, message", [
    (1.5, jax.ShapeDtypeStruct((3,), jnp.float32), "saved a Python float, the target is an array"),
    (jnp.ones(5), 2.0, r"saved shape \(5,\), target \(\)"),
    (jax.random.key(0), jax.ShapeDtypeStruct((), jax.random.key(0, impl="rbg").dtype), "threefry2x32 key"),
])
def test_a_target_that_does_not_fit_is_an_error(tmp_path, saved, target, message):
    _, mngr = save_restore(tmp_path, {"x": saved})
    with pytest.raises(ValueError, match=message):
        mngr.restore(0, args=ij.InshrinkRestore({"x": target}))


def test_empty_containers_survive_a_restore_without_target(tmp_path):
    import optax

    import flax.struct

    @flax.struct.dataclass
    class NoFields:
        pass

    tree = {"a": {}, "b": [], "d": (), "opt": optax.sgd(0.1).init({"w": jnp.ones(3)}), "x": 1, "n": NoFields()}
    r, _ = save_restore(tmp_path / "a", tree)
    # sgd: a chain of two EmptyState(), NamedTuples: as Orbax restores them, dicts (a NamedTuple's fields are
    # attribute keys), so an empty one is {}
    assert r == {"a": {}, "b": [], "d": [], "opt": [{}, {}], "x": 1, "n": {}}
    r, _ = save_restore(tmp_path / "b", {})
    assert r == {}


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(epsilon="0.1"), TypeError, "epsilon must be a real number"),
    (dict(epsilon=float("nan")), ValueError, "epsilon is NaN"),
    (dict(proxy_budget=float("nan")), ValueError, "proxy_budget is NaN"),
    (dict(min_compress_size=-5), ValueError, "min_compress_size must be an int in"),
    (dict(policy_rules=(("(", "drop"),)), ValueError, r"policy_rules: '\(' is not a regular expression"),
    (dict(keyframe_every=2.0), TypeError, "keyframe_every must be an int"),
    (dict(search=1), TypeError, "search must be a bool"),
    (dict(residual_width_power=1.5), ValueError, r"residual_width_power must be in \[0.0, 1.0\], got 1.5"),
    (dict(residual_width_power=True), TypeError, "residual_width_power must be a real number"),
])
def test_bad_configuration_values_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        ij.CompressionConfig(**kwargs)


def test_codes_above_the_levels_of_a_leaf_are_an_error(tmp_path):
    """A code stream whose checksum is valid but holds codes beyond K + 1 (a crafted file, or an encoder bug)
    is refused by restore and by verify, never decoded to 0."""
    from inshrink_jax import cli, codec, store

    tree = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32)}
    save_restore(tmp_path, tree)
    reader = store.Reader(tmp_path / "0" / "default")
    (p, shard), = reader.shards["['w']"]
    codes = reader.codes("['w']", shard.box)[0].copy()
    codes[0, 0] = reader.leaves["['w']"].bins + 2
    # re-sign the crafted stream and every record above it, so only the range check can catch it
    blob = codec.compress(codes, codec.ZSTD)
    obj = reader.own.path
    data = (obj / "blob.0").read_bytes()
    seg = shard.segments["codes"]
    new = data[:seg.offset] + blob + data[seg.offset + seg.length:]
    (obj / "blob.0").write_bytes(new)
    index, _ = store.read_json(obj / "index.0.json", "index", obj)
    entry = index["entries"][[e["leaf"] for e in index["entries"]].index("['w']")]
    entry["segments"]["codes"].update(length=len(blob), crc32=store.crc32(blob), codec=codec.ZSTD)
    for other in index["entries"]:
        for s in other["segments"].values():
            if s["file"] == "blob" and s["offset"] > seg.offset:
                s["offset"] += len(blob) - seg.length
    index["blob_bytes"] = len(new)
    raw = store.write_json(obj / "index.0.json", index)
    commit, _ = store.read_json(obj / "commit.json", "commit", obj)
    commit["processes"][0].update(index_crc32=store.crc32(raw), blob_bytes=len(new))
    raw = store.write_json(obj / "commit.json", commit)
    step_commit, _ = store.read_json(tmp_path / "0" / "default" / "commit.json", "commit", obj)
    step_commit["objects"][step_commit["object"]] = store.crc32(raw)
    store.write_json(tmp_path / "0" / "default" / "commit.json", step_commit)
    with pytest.raises(ij.CheckpointCorruptError, match="holds code .*above"):
        ij.InshrinkCheckpointHandler().restore(tmp_path / "0" / "default", ij.InshrinkRestore())
    assert cli.main(["verify", str(tmp_path)]) == 1


def test_large_records_are_zstd_coded_and_a_forged_one_is_a_named_error(tmp_path):
    """A manifest over JSON_ZSTD_OVER bytes is stored as one zstandard frame of its JSON and reads back; a frame
    that claims more than its ratio bound, or does not decode, is CheckpointCorruptError naming the step."""
    from inshrink_jax import store

    tree = {f"w{i}": jnp.full((64, 32), i, jnp.int32) for i in range(40)}  # lossless: compared exactly
    r, _ = save_restore(tmp_path, tree)
    step = tmp_path / "0" / "default"
    raw = (step / store.MANIFEST).read_bytes()
    assert raw[:4] == b"\x28\xb5\x2f\xfd"
    body, _ = store.read_json(step / store.MANIFEST, "manifest", step)
    assert len(store._canonical(body)) > 4 * len(raw)  # the repeated key paths and shardings code small
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, r), jax.tree.map(np.asarray, tree))
    import zstandard
    bomb = zstandard.ZstdCompressor().compress(b"{" + b" " * (store.JSON_ZSTD_RATIO * 200) + b"}")
    for forged in (bomb, raw[:-7]):
        (step / store.MANIFEST).write_bytes(forged)
        with pytest.raises(ij.CheckpointCorruptError, match=r"step 0.*manifest.*corrupted"):
            ij.InshrinkCheckpointHandler().restore(step, ij.InshrinkRestore())


def test_a_refused_save_leaves_nothing_even_when_orbax_writes_its_step_metadata_late(tmp_path, monkeypatch):
    """Orbax writes a step's `_CHECKPOINT_METADATA` on a thread of its own after it makes the temporary directory;
    a refused save's cleanup waits for that write, so the manager closes without an error and nothing is left."""
    from orbax.checkpoint._src.metadata import checkpoint as step_metadata
    write = step_metadata._MetadataStoreImpl.write

    def late(self, file_path, metadata):
        time.sleep(0.5)
        return write(self, file_path, metadata)

    monkeypatch.setattr(step_metadata._MetadataStoreImpl, "write", late)
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler())
    with pytest.raises(TypeError, match="unsupported type object"):
        mngr.save(0, args=ij.InshrinkSave({"params": {"w": jnp.ones((64, 64))}, "x": object()}))
    mngr.close()
    assert mngr.all_steps() == [] and not [p.name for p in tmp_path.iterdir() if "tmp" in p.name]
