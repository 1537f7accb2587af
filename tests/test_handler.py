import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import inshrink_jax as ij
from inshrink_jax import moments

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import digits  # noqa: E402


def manager(path, config=ij.CompressionConfig(), **opts):
    return ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(config),
                                 options=ocp.CheckpointManagerOptions(**opts))


QUANTIZED_MOMENTS = ij.CompressionConfig(optimizer="quantize")


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def assert_on_grid(restored, original, meta):
    """A quantized leaf decodes to 0, a centre, or (protected) its value within bfloat16 rounding; closed loop
    (a sum of links, not on one grid), its RMS error is at most a quarter of the weights' RMS (what each save's
    budget bounds is checked by `closed_loop_error` across leaves)."""
    r, o = np.asarray(restored, np.float64), np.asarray(original, np.float64)
    if meta.coding == ij.records.CLOSED_LOOP:
        assert np.sqrt(np.mean((r - o) ** 2)) <= 0.25 * np.sqrt(np.mean(o ** 2))
        return
    centres = meta.table().astype(np.float64)
    on_grid = (r == 0) | np.isin(r, centres)
    near = np.abs(r - o) <= 2.0**-8 * np.abs(o)
    assert np.all(on_grid | near)


def assert_moment_on_table(restored, original, meta, scale=None):
    """A quantized moment decodes to an entry of its value table, times the square root of `scale` (the second
    moment as restored) for a first moment coded relative to it; 0 where it was 0. A second moment keeps its
    sign."""
    r, o = np.asarray(restored, np.float64), np.asarray(original, np.float64)
    table = meta.table().astype(np.float64)
    s = np.ones_like(r) if scale is None else np.sqrt(np.asarray(scale, np.float64))
    nz = r != 0
    ratio = r[nz] / s[nz]
    assert np.all(np.min(np.abs(ratio[:, None] - table[None, :]), axis=1) <= 1e-6 * np.abs(ratio))
    assert np.all(r[o == 0] == 0)
    assert (meta.scale_leaf is None) == (scale is None)
    if meta.bins == 2 * ij.CompressionConfig().effective_moment_bins:  # a second moment's table: signs kept
        assert np.all((np.sign(r) == np.sign(o)) | (r == 0))


def closed_loop_error(restored, original, leaves) -> float:
    """Squared error of the closed-loop parameters of a restored state, summed."""
    total = 0.0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(restored.params)[0], jax.tree.leaves(original.params)):
        meta = leaves["." + "params" + jax.tree_util.keystr(path)]
        if meta.kind == "quantized" and meta.coding == ij.records.CLOSED_LOOP:
            total += float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return total


@pytest.mark.slow  # 34 s; .ci/run runs it
def test_train_state_round_trip_through_async_manager(tmp_path, trained):
    state, grads, (_, _, vx, vy) = trained
    mngr = manager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3):
        mngr.save(step, args=ij.InshrinkSave(state.replace(step=step), grads=grads))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 3]
    r = mngr.restore(3, args=ij.InshrinkRestore(abstract(state)))
    assert int(r.step) == 3
    reader = ij.store.Reader(tmp_path / "3" / "default")
    leaves = reader.leaves
    kinds = []
    by_key = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_flatten_with_path(r)[0]}
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(r)[0], jax.tree.leaves(state.replace(step=3))):
        key = jax.tree_util.keystr(path)
        kinds.append(leaves[key].kind)
        if kinds[-1] == "quantized" and leaves[key].method == "weights":
            assert_on_grid(a, b, leaves[key])
        elif leaves[key].method == "moments":  # the default optimizer policy: nu in log levels, mu relative to it
            assert ".mu" in key or ".nu" in key
            assert_moment_on_table(a, b, leaves[key], by_key[key.replace(".mu", ".nu")] if ".mu" in key else None)
        else:  # biases, small kernels, the train step: bit-exact
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Conv_1, Dense_0 and Dense_1 kernels and the mu and nu of each; the mu and nu of the weights stored exactly
    # with >= 64 elements (save.MIN_MOMENT_SIZE): Conv_0's kernel, Conv_1's and Dense_0's biases; and, step 3 being
    # a closed-loop residual, those three weights themselves (>= save.MIN_RESIDUAL_SIZE elements)
    assert (kinds.count("quantized"), kinds.count("dropped")) == (18, 0)
    # Step 3 saved the same weights as step 2: its residual is step 2's error, which it may leave at most
    # residual_budget of (summed over the closed-loop leaves, as the search measures it).
    assert mngr.item_metadata(3)["search"]["mode"] == "exhaustive"
    before = closed_loop_error(mngr.restore(2, args=ij.InshrinkRestore(abstract(state))), state, leaves)
    after = closed_loop_error(r, state, leaves)
    assert 0 < after <= ij.CompressionConfig().effective_residual_budget * before * (1 + 1e-5)
    fig = mngr.item_metadata(3)
    assert fig["sensitivity"] == "gradient EMA on 6 of 6 quantized leaves"
    assert fig["ratio"]["params"] > 4 and fig["ratio"]["optimizer"] > 4
    assert abs(digits.accuracy(r.params, state.apply_fn, vx, vy) - digits.accuracy(state.params, state.apply_fn,
                                                                                   vx, vy)) <= 0.02


def test_composite_with_json_item(tmp_path, trained):
    state, grads, _ = trained
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    h = ij.InshrinkCheckpointHandler()
    reg.add("state", ij.InshrinkSave, h)
    reg.add("state", ij.InshrinkRestore, h)
    reg.add("meta", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
    reg.add("meta", ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
    mngr = ocp.CheckpointManager(tmp_path, handler_registry=reg)
    mngr.save(5, args=ocp.args.Composite(state=ij.InshrinkSave(state.params), meta=ocp.args.JsonSave({"lr": 1e-3})))
    mngr.wait_until_finished()
    out = mngr.restore(5, args=ocp.args.Composite(state=ij.InshrinkRestore(abstract(state.params)),
                                                  meta=ocp.args.JsonRestore()))
    assert out.meta == {"lr": 1e-3}
    assert jax.tree.structure(out.state) == jax.tree.structure(state.params)


def test_every_leaf_kind_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    tree = {
        "params": {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.bfloat16),
                   "w16": jnp.asarray(rng.normal(size=(64, 32)), jnp.float16),
                   "b": jnp.arange(5, dtype=jnp.float32)},
        "ints": jnp.arange(7, dtype=jnp.int8), "mask": jnp.asarray([True, False]),
        "key": jax.random.key(3), "raw_key": jax.random.PRNGKey(4),
        "np": rng.normal(size=(3, 2)), "scalar": 1.5, "count": 7, "flag": True, "name": "run-1", "nothing": None,
        "list": [jnp.zeros((2,)), 3],
    }
    mngr = manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(tree))
    mngr.wait_until_finished()
    target = dict(tree, params=abstract(tree["params"]))
    r = mngr.restore(0, args=ij.InshrinkRestore(target))
    for k in ("ints", "mask", "raw_key", "np", "scalar", "count", "flag", "name", "nothing"):
        np.testing.assert_array_equal(np.asarray(r[k]) if r[k] is not None else r[k], np.asarray(tree[k])
                                      if tree[k] is not None else None)
    assert isinstance(r["np"], np.ndarray) and r["count"] == 7 and isinstance(r["count"], int)
    np.testing.assert_array_equal(jax.random.key_data(r["key"]), jax.random.key_data(tree["key"]))
    np.testing.assert_array_equal(np.asarray(r["params"]["b"]), np.asarray(tree["params"]["b"]))
    assert r["params"]["w"].dtype == jnp.bfloat16 and r["params"]["w16"].dtype == jnp.float16
    plain = mngr.restore(0, args=ij.InshrinkRestore())
    assert plain["list"][1] == 3 and plain["name"] == "run-1" and plain["nothing"] is None


def test_sharded_save_restores_into_another_layout(tmp_path):
    devs = np.array(jax.devices()[:4])
    mesh_a = jax.sharding.Mesh(devs.reshape(4, 1), ("x", "y"))
    mesh_b = jax.sharding.Mesh(devs.reshape(2, 2), ("x", "y"))
    P = jax.sharding.PartitionSpec
    rng = np.random.default_rng(1)
    nu = (rng.normal(size=(128, 64)) * 10.0 ** rng.uniform(-6, 0, size=(128, 64))).astype(np.float32) ** 2
    tree = {"params": {"w": rng.normal(size=(128, 64)).astype(np.float32)},
            "opt": optax.TraceState(trace=rng.normal(size=(128, 64)).astype(np.float32)),
            "adam": optax.ScaleByAdamState(count=np.int32(3), mu=(rng.normal(size=nu.shape) * np.sqrt(nu)).astype(
                np.float32), nu=nu)}
    sharded = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh_a, P("x", None)))
                           if x.ndim else x, tree)
    mngr = manager(tmp_path, QUANTIZED_MOMENTS)
    mngr.save(0, args=ij.InshrinkSave(sharded))
    mngr.wait_until_finished()
    single = mngr.restore(0, args=ij.InshrinkRestore(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(devs[0])), tree)))
    target_sharding = jax.sharding.NamedSharding(mesh_b, P("y", "x"))
    other = mngr.restore(0, args=ij.InshrinkRestore(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target_sharding) if x.ndim else x, tree)))
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(other)):
        assert not np.ndim(b) or b.sharding == target_sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    reader = ij.store.Reader(tmp_path / "0" / "default")
    assert_moment_on_table(other["opt"].trace, tree["opt"].trace, reader.leaves["['opt'].trace"])
    # mu decodes relative to nu as restored in the target's layout, the same bits as in one device's
    assert_moment_on_table(other["adam"].mu, tree["adam"].mu, reader.leaves["['adam'].mu"], other["adam"].nu)
    # four saved shards of w and of the moment, one per device
    assert len(reader.shards["['params']['w']"]) == len(reader.shards["['opt'].trace"]) == 4


def test_overwriting_state_after_save_does_not_change_checkpoint(tmp_path):
    x = jnp.asarray(np.random.default_rng(2).normal(size=(256, 64)).astype(np.float32))
    tree = {"params": {"w": x}, "opt": optax.TraceState(trace=x + 1)}
    expected = jax.tree.map(np.array, tree)
    mngr = manager(tmp_path, QUANTIZED_MOMENTS)
    mngr.save(0, args=ij.InshrinkSave(tree))
    # donate the buffers right after save() returns, as a training step would
    step = jax.jit(lambda t: jax.tree.map(lambda v: v * 0 - 7, t), donate_argnums=0)
    tree = step(tree)
    mngr.wait_until_finished()
    r = mngr.restore(0)
    # the donated buffers hold -7: a moment read from them would be -7 everywhere. The values are a monotone
    # quantization of the saved ones (a momentum without a second moment: cells of its own values)
    mu = np.asarray(r["opt"]["trace"])
    saved = expected["opt"].trace
    assert 2 <= np.unique(mu).size <= moments.FIRST_CAPACITY
    assert np.all(np.diff(mu.reshape(-1)[np.argsort(saved, axis=None)]) >= 0)
    assert ((mu - saved) ** 2).sum() <= ij.CompressionConfig().effective_moment_budget * 1.1 * (saved ** 2).sum()
    assert np.max(np.abs(np.asarray(r["params"]["w"]) - expected["params"]["w"])) < 1.0


def test_restore_target_mismatch_names_leaves(tmp_path):
    tree = {"params": {"w": jnp.ones((64, 32)), "b": jnp.ones((3,))}}
    mngr = manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(tree))
    mngr.wait_until_finished()
    with pytest.raises(ValueError, match=r"\['params'\]\['b'\].*saved shape \(3,\), target \(4,\)"):
        mngr.restore(0, args=ij.InshrinkRestore({"params": {"w": jnp.ones((64, 32)), "b": jnp.ones((4,))}}))
    with pytest.raises(ValueError, match=r"not saved: \[\"\['params'\]\['c'\]\"\]"):
        mngr.restore(0, args=ij.InshrinkRestore({"params": {"w": jnp.ones((64, 32)), "b": jnp.ones((3,)),
                                                            "c": jnp.ones(1)}}))
    keys = jax.random.split(jax.random.key(0), 3)
    with pytest.raises(ValueError, match=r"\['params'\]\['b'\]: saved dtype float32, target key<fry>, which it cannot"):
        mngr.restore(0, args=ij.InshrinkRestore({"params": {"w": jnp.ones((64, 32)), "b": keys}}))


def test_unsupported_leaf_is_refused_before_writing(tmp_path):
    mngr = manager(tmp_path)
    with pytest.raises(TypeError, match=r"leaf \['bad'\] has unsupported type object"):
        mngr.save(0, args=ij.InshrinkSave({"bad": object()}))
        mngr.wait_until_finished()
    assert mngr.all_steps() == []


def object_dir(root, step, item="default"):
    """The object directory holding a step's own data."""
    return root / ij.store.OBJECTS / item / ij.store.Reader(root / str(step) / item).object_id


@pytest.mark.parametrize("whole", [True, False], ids=["blob read whole", "blob read by segment"])
@pytest.mark.parametrize("victim", ["object/blob.0", "object/index.0.json", "object/commit.json",
                                    "step/manifest.json", "step/commit.json"])
def test_corruption_is_a_clear_error(tmp_path, victim, whole, monkeypatch):
    if not whole:  # every blob over the size read whole: each segment read on its own, as for large blobs
        monkeypatch.setattr(ij.store, "WHOLE_READ_BYTES", 0)
    tree = {"params": {"w": jnp.asarray(np.random.default_rng(3).normal(size=(128, 64)), jnp.float32)},
            "opt": {"mu": jnp.ones((300,))}}
    mngr = manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(tree))
    mngr.wait_until_finished()
    where, name = victim.split("/")
    path = (object_dir(tmp_path, 0) if where == "object" else tmp_path / "0" / "default") / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises((ij.CheckpointCorruptError, ValueError), match="step 0, item 'default'"):
        mngr.restore(0)
    path.write_bytes(bytes(data[: len(data) // 3]))  # truncated
    with pytest.raises((ij.CheckpointCorruptError, ValueError), match="step 0, item 'default'"):
        mngr.restore(0)
    path.unlink()  # missing: the error names the file
    with pytest.raises(ij.CheckpointCorruptError, match=re.escape(name)):
        mngr.restore(0)


def test_blobs_read_whole_or_by_segment_restore_the_same_bits(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    w = rng.normal(size=(256, 64)).astype(np.float32)
    mngr = manager(tmp_path)
    for step in range(3):  # a closed-loop chain of three links, and the moments' chains
        w = w + 0.01 * rng.normal(size=w.shape).astype(np.float32)
        tree = {"params": {"w": jnp.asarray(w), "b": jnp.asarray(w[0, :32])}, "opt": {"mu": jnp.asarray(w * 0.1)}}
        mngr.save(step, args=ij.InshrinkSave(tree))
        mngr.wait_until_finished()
    whole = mngr.restore(2)
    monkeypatch.setattr(ij.store, "WHOLE_READ_BYTES", 0)
    by_segment = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler()).restore(2)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(by_segment)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    np.testing.assert_array_equal(np.asarray(whole["params"]["b"]), w[0, :32])  # stored exactly: a check of the read


def test_nnx_model_and_optimizer_round_trip(tmp_path):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(64, 128, rngs=rngs)
            self.out = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x)))

    tx, ty, vx, vy = digits.load()
    tx, vx = tx.reshape(len(tx), -1), vx.reshape(len(vx), -1)
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        grads = nnx.grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(model)
        opt.update(model, grads)

    for (x, y), _ in zip(digits.batches(tx, ty, 64, 0), range(60)):
        step(model, opt, x, y)
    accuracy = lambda m: float(jnp.mean(jnp.argmax(m(vx), -1) == vy))  # noqa: E731
    before = accuracy(model)
    state = nnx.state((model, opt))
    saved = jax.tree.map(np.array, state)
    mngr = manager(tmp_path, ij.CompressionConfig(optimizer="lossless"), max_to_keep=2)
    for s in (1, 2, 3):
        mngr.save(s, args=ij.InshrinkSave(state))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 3]
    restored = mngr.restore(3, args=ij.InshrinkRestore(abstract(state)))
    fresh_model = MLP(nnx.Rngs(1))
    fresh_opt = nnx.Optimizer(fresh_model, optax.adam(1e-2), wrt=nnx.Param)
    nnx.update((fresh_model, fresh_opt), restored)
    leaves = ij.store.Reader(tmp_path / "3" / "default").leaves
    kinds = set()
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(saved)):
        meta = leaves[jax.tree_util.keystr(path)]
        kinds.add(meta.kind)
        if meta.kind == "quantized":
            assert_on_grid(a, b, meta)
        else:  # Adam moments (lossless policy), count, biases: bit-exact
            np.testing.assert_array_equal(np.asarray(a), b)
    assert kinds == {"quantized", "array"}
    assert int(fresh_opt.step[...]) == 60
    assert abs(accuracy(fresh_model) - before) <= 0.03


def test_one_handler_serves_two_items_each_with_its_own_chain(tmp_path):
    """params and an EMA of them through one handler instance (same tree structure, close values): each item's
    deltas build on its own previous codes, and every step restores as saved."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(256, 64)).astype(np.float32)
    h = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False, closed_loop=False))
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in ("params", "ema"):
        reg.add(item, ij.InshrinkSave, h)
        reg.add(item, ij.InshrinkRestore, h)
    mngr = ocp.CheckpointManager(tmp_path, handler_registry=reg)
    saved = {}
    for step in range(4):
        w = w + 0.05 * rng.normal(size=w.shape).astype(np.float32)
        trees = {"params": {"w": jnp.asarray(w)}, "ema": {"w": jnp.asarray(0.5 * w + 0.3)}}
        mngr.save(step, args=ocp.args.Composite(**{k: ij.InshrinkSave(v) for k, v in trees.items()}))
        mngr.wait_until_finished()
        saved[step] = trees
    fresh = ocp.CheckpointManager(tmp_path, handler_registry=reg)
    for step, trees in saved.items():
        out = fresh.restore(step, args=ocp.args.Composite(params=ij.InshrinkRestore(), ema=ij.InshrinkRestore()))
        for item in ("params", "ema"):
            reader = ij.store.Reader(tmp_path / str(step) / item)
            if step:  # a delta against the same item's previous save
                assert reader.own.commit["bases"] == [f"{step - 1}.0"], (step, item)
            # exactly what the same tree saved alone (a keyframe of a fresh handler) restores to
            alone = manager(tmp_path / f"alone-{item}-{step}", ij.CompressionConfig(search=False, closed_loop=False))
            alone.save(0, args=ij.InshrinkSave(trees[item]))
            alone.wait_until_finished()
            np.testing.assert_array_equal(np.asarray(out[item]["w"]), np.asarray(alone.restore(0)["w"]))
    from inshrink_jax import cli
    for item in ("params", "ema"):
        assert cli.main(["verify", str(tmp_path), "--item", item]) == 0


def test_prng_key_restores_into_the_target_sharding(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tree = {"key": jax.random.key(7), "keys": jax.random.split(jax.random.key(8), 4)}
    mngr = manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(tree))
    mngr.wait_until_finished()
    target = jax.tree.map(lambda k: jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=replicated), tree)
    r = mngr.restore(0, args=ij.InshrinkRestore(target))
    for name in ("key", "keys"):
        assert r[name].sharding.is_equivalent_to(replicated, r[name].ndim)
        assert len(r[name].addressable_shards) == 4
        np.testing.assert_array_equal(jax.random.key_data(r[name]), jax.random.key_data(tree[name]))


@pytest.mark.parametrize("opts", [dict(primary_host=None), dict(active_processes={0})])
def test_multiprocessing_options_every_host_primary_and_active_processes(tmp_path, opts):
    """Orbax's `primary_host=None` (every host primary) and `active_processes` are honoured (one process here;
    tests/test_multiprocess.py runs two with the default options)."""
    from orbax.checkpoint import options as options_lib

    mp = options_lib.MultiprocessingOptions(**opts)
    h = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False), multiprocessing_options=mp)
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=h, options=ocp.CheckpointManagerOptions(
        multiprocessing_options=mp, create=False))
    tree = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32), "s": jnp.int32(3)}
    for step in (0, 1):
        mngr.save(step, args=ij.InshrinkSave(tree))
    mngr.wait_until_finished()
    assert mngr.item_metadata(1)["kind"] == "delta"
    r = mngr.restore(1, args=ij.InshrinkRestore(abstract(tree)))
    assert int(r["s"]) == 3 and np.corrcoef(np.ravel(r["w"]), np.ravel(tree["w"]))[0, 1] > 0.99


def test_a_target_of_another_dtype_is_cast_as_orbax_casts(tmp_path):
    """float32 saved into bfloat16 / float16 targets, int64 NumPy into an int32 target, a NumPy float32 target for
    a saved bfloat16 array: cast on restore; a key stays an error. The closed-loop chain goes on from the exact
    reconstruction, not the cast one: the next save after a cast restore is a delta whose restore equals an
    uncast restore's chain."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 64)).astype(np.float32)
    tree = {"params": {"w": jnp.asarray(w), "b": jnp.arange(3.0)}, "i": np.array([7, -2]),
            "z": jnp.ones((4,), jnp.bfloat16), "k": jax.random.key(0)}
    mngr = manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(tree))
    mngr.wait_until_finished()
    exact = mngr.restore(0)
    target = {"params": {"w": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), "b": jnp.zeros(3, jnp.float16)},
              "i": jax.ShapeDtypeStruct((2,), jnp.int32), "z": np.zeros(4, np.float32), "k": jax.random.key(1)}
    fresh = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False))
    r = fresh.restore(tmp_path / "0" / "default", ij.InshrinkRestore(target))
    assert r["params"]["w"].dtype == jnp.bfloat16 and r["params"]["b"].dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(r["params"]["w"]), np.asarray(exact["params"]["w"]).astype(jnp.bfloat16))
    assert r["i"].dtype == np.int32 and r["i"].tolist() == [7, -2]
    assert isinstance(r["z"], np.ndarray) and r["z"].dtype == np.float32 and r["z"].tolist() == [1.0] * 4
    with pytest.raises(ValueError, match=r"\['k'\]: saved a threefry2x32 key array"):
        fresh.restore(tmp_path / "0" / "default", ij.InshrinkRestore(dict(target, k=jnp.zeros((), jnp.float32))))
    # the chain continues from the float32 reconstruction
    with ocp.CheckpointManager(tmp_path, item_handlers=fresh) as m2:
        m2.save(1, args=ij.InshrinkSave(dict(tree, params={"w": jnp.asarray(w + 0.01), "b": jnp.arange(3.0)})))
    assert m2.item_metadata(1)["kind"] != "keyframe"
    again = ij.InshrinkCheckpointHandler().restore(tmp_path / "1" / "default", ij.InshrinkRestore())
    assert np.max(np.abs(np.asarray(again["params"]["w"]) - (w + 0.01))) < 0.05


def test_partial_restore_reads_only_the_leaves_the_target_names(tmp_path):
    """A dict target that leaves keys out, and a TrainState target whose opt_state is None: restored with
    partial_restore=True, refused without it with a message that names the option."""
    import optax
    from flax.training import train_state

    params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32)}
    state = train_state.TrainState.create(apply_fn=lambda *a: None, params=params, tx=optax.adam(1e-3))
    mngr = manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(state))
    mngr.wait_until_finished()
    full = mngr.restore(0, args=ij.InshrinkRestore(state))
    with pytest.raises(ValueError, match="partial_restore=True"):
        mngr.restore(0, args=ij.InshrinkRestore(state.replace(opt_state=None)))
    r = mngr.restore(0, args=ij.InshrinkRestore(state.replace(opt_state=None), partial_restore=True))
    assert r.opt_state is None and int(r.step) == 0
    np.testing.assert_array_equal(np.asarray(r.params["w"]), np.asarray(full.params["w"]))
    d = tmp_path / "dict"
    mngr = manager(d)
    mngr.save(0, args=ij.InshrinkSave({"params": params, "opt": {"mu": params["w"] * 0.1}, "step": 3}))
    mngr.wait_until_finished()
    r = mngr.restore(0, args=ij.InshrinkRestore({"params": params}, partial_restore=True))
    assert list(r) == ["params"] and r["params"]["w"].shape == (64, 64)


def test_a_live_nnx_module_as_target_says_to_pass_its_state(tmp_path):
    from flax import nnx

    model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    mngr = manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(nnx.state(model)))
    mngr.wait_until_finished()
    with pytest.raises(ValueError, match=r"pass nnx.state\(model\)"):
        mngr.restore(0, args=ij.InshrinkRestore(model))
    restored = mngr.restore(0, args=ij.InshrinkRestore(nnx.state(model)))
    nnx.update(model, restored)
    assert model.kernel[...].shape == (64, 32)
    for other in (nnx.Linear(64, 16, rngs=nnx.Rngs(0)), nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0)))):
        with pytest.raises(ValueError, match=r"For Flax NNX: the target is nnx.state\(...\) of a model"):
            mngr.restore(0, args=ij.InshrinkRestore(nnx.state(other)))  # another graph: says what to pass


def test_restore_latest_falls_back_past_a_corrupted_latest_step(tmp_path):
    mngr = manager(tmp_path, ij.CompressionConfig(search=False))
    for step in range(3):
        mngr.save(step, args=ij.InshrinkSave({"params": {"w": jnp.full((64, 64), float(step))}, "step": step}))
        mngr.wait_until_finished()
    assert ij.restore_latest(mngr)[0] == 2
    blob = object_dir(tmp_path, 2) / "blob.0"
    raw = blob.read_bytes()
    blob.write_bytes(bytes([raw[0] ^ 0xFF]) + raw[1:])  # its first segment no longer matches its CRC
    with pytest.warns(UserWarning, match=r"skipping step 2, which cannot be restored: step 2, item 'default'"):
        step, restored = ij.restore_latest(mngr)
    assert step == 1 and restored["step"] == 1
    for s in (0, 1):
        (object_dir(tmp_path, s) / "blob.0").write_bytes(b"")
    with pytest.raises(ij.CheckpointCorruptError, match="no step restores. step 2: .* step 1: .* step 0: "):
        with pytest.warns(UserWarning):
            ij.restore_latest(mngr)


@pytest.mark.parametrize("checkpointer", [ocp.Checkpointer, ocp.AsyncCheckpointer])
def test_a_plain_checkpointer_keeps_everything_under_its_path(tmp_path, checkpointer):
    """`ocp.Checkpointer(handler).save(path)` writes nothing outside `path` (its objects live inside it), so a
    moved or deleted checkpoint takes all its data along; each save is a keyframe; verify and inspect read it."""
    from inshrink_jax import cli

    rng = np.random.default_rng(0)
    trees = [{"params": {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)}, "step": i} for i in range(2)]
    ckptr = checkpointer(ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False)))
    for i, tree in enumerate(trees):
        ckptr.save(tmp_path / "runs" / f"ck{i}", args=ij.InshrinkSave(tree))
        if hasattr(ckptr, "wait_until_finished"):
            ckptr.wait_until_finished()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["ck0", "ck1"]
    want = ij.InshrinkCheckpointHandler().restore(tmp_path / "runs" / "ck1", ij.InshrinkRestore())
    (tmp_path / "runs" / "ck1").rename(tmp_path / "moved")
    got = ocp.Checkpointer(ij.InshrinkCheckpointHandler()).restore(tmp_path / "moved")
    assert got["step"] == 1 and ij.store.Reader(tmp_path / "moved").figures()["kind"] == "keyframe"
    np.testing.assert_array_equal(np.asarray(got["params"]["w"]), np.asarray(want["params"]["w"]))
    assert cli.main(["verify", str(tmp_path / "moved")]) == 0 and cli.main(["inspect", str(tmp_path / "moved")]) == 0
    with pytest.raises(TypeError, match="unsupported type object"):  # a refused save leaves nothing either
        ckptr.save(tmp_path / "runs" / "bad", args=ij.InshrinkSave({"x": object()}))
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["ck0"]


@pytest.mark.slow  # 21 s; .ci/run runs it
def test_orbax_standard_args_through_handler_registry(tmp_path, trained):
    """Code written for Orbax's standard handler keeps its call sites: StandardSave / StandardRestore (and the
    PyTree ones) through `ij.handler_registry` are compressed saves and restores of the same format, with a delta
    chain, a restart, and the same restore as InshrinkRestore; what they cannot mean is refused by name."""
    state, grads, _ = trained
    like = abstract(state)

    def mngr():
        return ocp.CheckpointManager(tmp_path, handler_registry=ij.handler_registry(
            ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False, optimizer="lossless"))))  # the routing

    with mngr() as m:
        for step in (1, 2, 3):
            m.save(step, args=ocp.args.StandardSave(state.replace(step=step)))
        m.save(4, args=ij.InshrinkSave(state.replace(step=4), grads=grads))  # both kinds of args, one chain
        m.wait_until_finished()
        assert [m.item_metadata(s)["kind"] for s in (1, 2, 3, 4)] == ["keyframe", "delta", "delta", "delta"]
        standard = m.restore(3, args=ocp.args.StandardRestore(like))
    with mngr() as m:  # a new process
        ours = m.restore(3, args=ij.InshrinkRestore(like))
        tree = m.restore(3, args=ocp.args.PyTreeRestore(like.replace(opt_state=None), partial_restore=True))
        with pytest.raises(ValueError, match="save_args=.*not supported"):
            m.save(5, args=ocp.args.StandardSave(state, save_args=jax.tree.map(lambda _: ocp.SaveArgs(), state)))
        with pytest.raises(ValueError, match="transforms=.*not supported"):
            m.restore(3, args=ocp.args.PyTreeRestore(like, transforms={}))
        with_args = m.restore(3, args=ocp.args.PyTreeRestore(restore_args=ocp.checkpoint_utils.construct_restore_args(
            like)))  # Orbax's restore_args alone: the saved tree, each leaf where they say
    for a, b in zip(jax.tree.leaves(with_args["params"]), jax.tree.leaves(ours.params)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(standard), jax.tree.leaves(ours)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(standard.step) == 3 and tree.opt_state is None
    for a, b in zip(jax.tree.leaves(tree.params), jax.tree.leaves(ours.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert ij.store.Reader(tmp_path / "1" / "default").figures()["ratio"]["params"] > 3  # compressed


def test_explicit_mesh_saves_and_restores_without_target_in_the_saved_sharding(tmp_path):
    """Arrays on a `jax.make_mesh` mesh (Explicit axes) save; a restore without a target puts each leaf back in
    the sharding it was saved with (mesh, axis types, spec), the values of a restore into that target, and the
    chain goes on from it in a new handler; a process without those devices gets the default device and a
    warning naming the leaf."""
    import subprocess

    mesh = jax.make_mesh((2, 2), ("data", "model"))
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    P = jax.sharding.PartitionSpec
    rng = np.random.default_rng(2)

    def put(x, *spec):
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, P(*spec)))

    state = {"w": put(rng.normal(size=(256, 128)).astype(np.float32), "data", "model"),
             "v": put(rng.normal(size=(128, 64)).astype(np.float32), ("data", "model"), None),
             "b": put(np.zeros(128, np.float32), "model"), "host": np.arange(6), "step": 3}
    with manager(tmp_path) as m:
        m.save(0, args=ij.InshrinkSave(state))
        m.wait_until_finished()
    with manager(tmp_path) as m:
        bare = m.restore(0)
        targeted = m.restore(0, args=ij.InshrinkRestore(abstract(state)))
        for k in ("w", "v", "b"):
            assert bare[k].sharding == state[k].sharding, k
            np.testing.assert_array_equal(np.asarray(bare[k]), np.asarray(targeted[k]))
        assert isinstance(bare["host"], np.ndarray) and bare["step"] == 3
        tree = m.item_metadata(0)["tree"]  # Orbax users build a target from the metadata tree
        assert tree["w"] == jax.ShapeDtypeStruct((256, 128), jnp.float32, sharding=state["w"].sharding)
        assert tree["host"] == jax.ShapeDtypeStruct((6,), np.arange(6).dtype) and tree["step"] == 3
        from_tree = m.restore(0, args=ij.InshrinkRestore(tree))
        assert jax.tree.structure(from_tree) == jax.tree.structure(bare)
        for a, b in zip(jax.tree.leaves(from_tree), jax.tree.leaves(bare)):
            assert type(a) is type(b) and getattr(a, "sharding", None) == getattr(b, "sharding", None)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        m.save(1, args=ij.InshrinkSave({**state, "w": state["w"] + 0.01}))
        m.wait_until_finished()
        assert m.item_metadata(1)["kind"] == "delta"
    code = (f"import warnings, jax, numpy as np, orbax.checkpoint as ocp, inshrink_jax as ij\n"
            f"with warnings.catch_warnings(record=True) as w:\n"
            f"    warnings.simplefilter('always')\n"
            f"    r = ocp.CheckpointManager({str(tmp_path)!r}, item_handlers=ij.InshrinkCheckpointHandler()).restore(0)\n"
            f"print(len(jax.devices()), r['w'].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0]), "
            f"sum('3 leaves ([' in str(x.message) and 'saved sharded' in str(x.message) for x in w))\n")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[-2] == "1 True 1", out.stderr[-2000:]  # one warning for the three leaves


@pytest.mark.slow  # 22 s; .ci/run runs it
def test_steps_orbax_wrote_in_the_root_restore_and_the_run_goes_on(tmp_path, trained, capsys):
    """A run moved over to inshrink_jax: the steps Orbax's standard handler wrote restore through our handler
    (into a target, and without one), our saves go on in the same root (a keyframe first) with retention
    deleting Orbax's steps as usual, and the tools name what such a step is."""
    state, grads, _ = trained
    with ocp.CheckpointManager(tmp_path) as m:
        for step in (0, 1):
            m.save(step, args=ocp.args.StandardSave(state.replace(step=step)))
    with manager(tmp_path, ij.CompressionConfig(search=False, optimizer="lossless"), max_to_keep=3) as m:
        assert m.latest_step() == 1
        restored = m.restore(1, args=ij.InshrinkRestore(abstract(state)))
        assert int(restored.step) == 1 and type(restored) is type(state)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state.replace(step=1))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        bare = m.restore(0)
        np.testing.assert_array_equal(np.asarray(bare["params"]["Dense_0"]["kernel"]),
                                      np.asarray(state.params["Dense_0"]["kernel"]))
        for step in (2, 3):
            m.save(step, args=ij.InshrinkSave(restored.replace(step=step), grads=grads))
            m.wait_until_finished()
        assert m.all_steps() == [1, 2, 3] and m.item_metadata(2)["kind"] == "keyframe"
        assert int(m.restore(3, args=ij.InshrinkRestore(abstract(state))).step) == 3
        assert int(m.restore(1, args=ij.InshrinkRestore(abstract(state))).step) == 1
    with pytest.raises(ij.CheckpointCorruptError, match="written by Orbax's own handler"):
        ij.store.Reader(tmp_path / "1" / "default")
    from inshrink_jax import cli
    assert cli.main(["inspect", str(tmp_path)]) == 0 and cli.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ +1 +orbax +written by Orbax's own handler", out, re.M) and \
        "NOTE step(s) 1: written by Orbax" in out
