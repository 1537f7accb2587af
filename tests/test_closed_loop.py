"""Closed-loop chains (CompressionConfig.closed_loop, the default): a save after a keyframe stores the residual
against the previous save's reconstruction; restores are bit-identical to that reconstruction, continue the chain
across a restart, keep the error from growing over restores, and survive retention; broken chains are named
errors."""

import dataclasses
import functools
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import inshrink_jax as ij
from inshrink_jax import cli, codec, config, quantize, records, restore, save, store


def manager(root, max_to_keep=None, **cfg):
    cfg = {"search": False, "quant": ij.QuantConfig(bins=8), **cfg}
    return ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(**cfg)),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


def walk(seed: int, n: int, step_size: float = 2e-3):
    """n states of a random walk of two weights (float32 and bfloat16) and a bias."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, size=(96, 64)).astype(np.float32) * 0.05
    v = rng.normal(size=(64, 32)).astype(np.float32) * 0.05
    for _ in range(n):
        w = w + rng.normal(size=w.shape).astype(np.float32) * step_size
        v = v + rng.normal(size=v.shape).astype(np.float32) * step_size
        yield {"w": jnp.asarray(w), "v": jnp.asarray(v, jnp.bfloat16), "b": jnp.asarray(w[0])}


def rms(a, b) -> float:
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def test_keyframe_then_residuals_bounded_by_keyframe_every(tmp_path):
    mngr = manager(tmp_path, keyframe_every=3)
    for step, s in enumerate(walk(0, 7)):
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
    kinds = [(mngr.item_metadata(s)["kind"], mngr.item_metadata(s)["chain_depth"]) for s in range(7)]
    assert kinds == [("keyframe", 0), ("delta", 1), ("delta", 2), ("keyframe", 0), ("delta", 1), ("delta", 2),
                     ("keyframe", 0)]
    reader = store.Reader(tmp_path / "5" / "default")
    assert reader.leaves["['w']"].coding == records.CLOSED_LOOP
    assert [o.id for o, _ in reader.links("['w']")] == ["3.0", "4.0", "5.0"]
    # The 1-D bias (64 elements) is in the chain too: exact at the keyframe, a residual after it.
    keyframe = store.Reader(tmp_path / "3" / "default")
    assert (keyframe.leaves["['b']"].kind, keyframe.leaves["['b']"].coding) == ("array", records.CLOSED_LOOP)
    assert (reader.leaves["['b']"].kind, reader.leaves["['b']"].coding) == ("quantized", records.CLOSED_LOOP)
    assert [o.id for o, _ in reader.links("['b']")] == ["3.0", "4.0", "5.0"]
    assert reader.own.commit["bases"] == ["4.0"]
    assert cli.main(["verify", str(tmp_path)]) == 0


def test_a_restart_continues_the_chain_bit_exactly(tmp_path):
    """A new process that restores step 3 and saves step 4 writes exactly what the process that saved 0..3
    would have: it holds the same reconstruction."""
    states = list(walk(1, 5))
    a = manager(tmp_path / "a")
    for step in range(4):
        a.save(step, args=ij.InshrinkSave(states[step]))
        a.wait_until_finished()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a.save(4, args=ij.InshrinkSave(states[4]))
    a.wait_until_finished()
    b = manager(tmp_path / "b")
    restored = b.restore(3, args=ij.InshrinkRestore(states[3]))
    assert restored["w"].dtype == jnp.float32 and restored["v"].dtype == jnp.bfloat16
    b.save(4, args=ij.InshrinkSave(states[4]))
    b.wait_until_finished()
    assert b.item_metadata(4)["kind"] == "delta"  # a residual against the restored reconstruction
    for name in ("a", "b"):
        assert store.Reader(tmp_path / name / "4" / "default").own.commit["bases"] == ["3.0"]
    out_a, out_b = manager(tmp_path / "a").restore(4), manager(tmp_path / "b").restore(4)
    for k in ("w", "v", "b"):
        np.testing.assert_array_equal(np.asarray(out_a[k]), np.asarray(out_b[k]))
    # the restore of step 3 is what the saver held as its reconstruction: step 4's residual was added to it
    assert rms(out_a["w"], states[4]["w"]) < rms(restored["w"], states[3]["w"])
    # the bias, exact at the keyframe, is off by a fraction of the residuals' quantization error since
    assert 0 < rms(out_a["b"], states[4]["b"]) < 0.3 * rms(states[4]["b"], states[3]["b"])


def test_small_parameters_join_the_chain_from_min_residual_size(tmp_path):
    """A 1-D float parameter of MIN_RESIDUAL_SIZE elements is a residual after the keyframe; one element fewer,
    or an integer leaf, is stored exactly at every save."""
    n = save.MIN_RESIDUAL_SIZE
    mngr = manager(tmp_path)
    for step, s in enumerate(walk(3, 3)):
        s = {**s, "c": s["w"][1, :n - 1], "i": jnp.arange(n, dtype=jnp.int32) + step}
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
    leaves = store.Reader(tmp_path / "2" / "default").leaves
    assert (leaves["['b']"].kind, leaves["['b']"].coding) == ("quantized", records.CLOSED_LOOP)
    for key in ("['c']", "['i']"):
        assert (leaves[key].kind, leaves[key].coding) == ("array", None), key
    out = mngr.restore(2)
    np.testing.assert_array_equal(np.asarray(out["c"]), np.asarray(s["c"]))
    np.testing.assert_array_equal(np.asarray(out["i"]), np.asarray(s["i"]))


def test_a_small_leafs_residual_stream_is_its_alphabet_and_its_ranks_without_a_zstd_frame(tmp_path):
    """A residual stream of a small leaf (a bias of 64 values) is written without a zstd frame or a value count:
    one header byte, its alphabet, then (format 15) its ranks in a prefix code whose model the stream states,
    fewer bytes than ceil(64 / codes a byte) packed ranks (format 14's "ranks"); the restore reads it."""
    mngr = manager(tmp_path)
    for step, s in enumerate(walk(5, 2)):
        s = {**s, "b": s["w"][0, :64]}
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
    reader = store.Reader(tmp_path / "1" / "default")
    (p, shard), = reader.shards["['b']"]
    seg = shard.segments["codes"]
    assert seg.prior is not None and seg.codec == codec.PREFIX
    blob = reader.object(reader.manifest.object).segment("['b']", p, seg, "codes")
    k = blob[0]
    assert 2 <= k <= 16
    codes = np.frombuffer(codec.decompress(blob, seg.codec, 64), np.uint8)
    assert seg.length < len(codec.compress(codes, codec.RANKS)) == 1 + k + -(-64 // codec._radix_digits(k))
    assert np.array_equal(np.unique(codes), np.frombuffer(blob[1:1 + k], np.uint8))
    out = np.asarray(ij.InshrinkCheckpointHandler().restore(tmp_path / "1" / "default", ij.InshrinkRestore())["b"])
    assert rms(out, s["b"]) < 1e-3  # the residual corrected the keyframe's 8 levels (values of RMS 0.06)


def test_error_does_not_grow_over_restores(tmp_path):
    """Ten save -> new process -> restore -> train on cycles, against the same updates applied without
    interruption. Open loop, each restore re-quantizes the weights on a grid at their own scale, and updates
    smaller than a level are lost at every restore; closed loop, a restore loses only the quantization error of
    the last interval's change. (Both lose the keyframe's error at the first restore: the uninterrupted run
    starts from the first restored state.)"""
    drift = {}
    for closed in (True, False):
        root = tmp_path / str(closed)
        rng = np.random.default_rng(2)
        state = truth = next(walk(2, 1))
        for step in range(10):
            mngr = manager(root, closed_loop=closed, keyframe_every=32)
            if step:
                state = mngr.restore(step - 1, args=ij.InshrinkRestore(state))
                truth = state if step == 1 else truth
            update = {k: rng.normal(size=x.shape) * 1e-3 for k, x in state.items()}
            state = {k: x + jnp.asarray(update[k], x.dtype) for k, x in state.items()}
            truth = {k: x + jnp.asarray(update[k], x.dtype) for k, x in truth.items()}
            mngr.save(step, args=ij.InshrinkSave(state))
            mngr.wait_until_finished()
            mngr.close()
        drift[closed] = rms(manager(root).restore(9)["w"], truth["w"])
    assert drift[True] < 0.3 * drift[False], drift


def test_retention_keeps_the_chain_and_collects_it_after_a_keyframe(tmp_path):
    mngr = manager(tmp_path, max_to_keep=1, keyframe_every=4)
    states = list(walk(3, 6))
    for step, s in enumerate(states[:4]):
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
    assert mngr.all_steps() == [3]
    objects = store.objects_dir(tmp_path, "default")
    assert sorted(p.name for p in objects.iterdir()) == ["0.0", "1.0", "2.0", "3.0"]
    r3 = manager(tmp_path).restore(3)
    assert rms(r3["w"], states[3]["w"]) < 0.01
    for step in (4, 5):  # step 4 is a keyframe: the old chain goes
        mngr.save(step, args=ij.InshrinkSave(states[step]))
        mngr.wait_until_finished()
    assert sorted(p.name for p in objects.iterdir()) == ["4.0", "5.0"]


def test_a_lossless_save_is_an_exact_root(tmp_path):
    """When the search stores the parameters losslessly, the chain goes on from their exact values."""
    states = list(walk(4, 3))
    harsh = {"on": True}
    ref = states[0]

    def quality(s):  # while harsh, any change of the weight costs more than epsilon
        return 1.0 + (float(jnp.sum(jnp.abs(s["w"] - ref["w"]))) if harsh["on"] else 0.0)

    mngr = manager(tmp_path, search=True, quant=ij.QuantConfig())
    with pytest.warns(UserWarning, match="no quantization configuration meets"):
        mngr.save(0, args=ij.InshrinkSave(states[0], eval_fn=quality))
        mngr.wait_until_finished()
    leaf = store.Reader(tmp_path / "0" / "default").leaves["['w']"]
    assert (leaf.kind, leaf.coding) == ("array", records.CLOSED_LOOP)
    harsh["on"] = False
    mngr.save(1, args=ij.InshrinkSave(states[1], eval_fn=quality))
    mngr.wait_until_finished()
    fig = mngr.item_metadata(1)
    assert fig["kind"] == "delta" and fig["search"]["coding"] == "residual" and fig["quant"] is not None
    links = store.Reader(tmp_path / "1" / "default").links("['w']")
    assert [o.id for o, _ in links] == ["0.0", "1.0"] and "data" in links[0][1][0][1].segments
    # the residual is one interval's change: small against the weights
    assert rms(mngr.restore(1)["w"], states[1]["w"]) < 0.05 * float(np.std(np.asarray(states[1]["w"])))


@pytest.mark.slow  # 19 s; .ci/run runs it
def test_sharded_save_restored_replicated_continues_the_chain(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    states = list(walk(5, 3))

    def split_up(tree):
        return {k: jax.device_put(x, split if x.ndim == 2 else whole) for k, x in tree.items()}

    mngr = manager(tmp_path)
    for step in (0, 1):
        mngr.save(step, args=ij.InshrinkSave(split_up(states[step])))
        mngr.wait_until_finished()
    fresh = manager(tmp_path)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole), states[1])
    restored = fresh.restore(1, args=ij.InshrinkRestore(target))
    assert restored["w"].sharding == whole
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(mngr.restore(1)["w"]))
    fresh.save(2, args=ij.InshrinkSave(jax.device_put(states[2], whole)))
    fresh.wait_until_finished()
    assert fresh.item_metadata(2)["kind"] == "delta"
    r2 = manager(tmp_path).restore(2, args=ij.InshrinkRestore(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), split_up(states[2]))))
    assert r2["w"].sharding == split and rms(r2["w"], states[2]["w"]) < rms(restored["w"], states[1]["w"])


@pytest.mark.parametrize("quant", [pytest.param(ij.QuantConfig(bins=8, protect_fraction=0.02),
                                                marks=pytest.mark.slow),  # 23 s; .ci/run runs it
                                   ij.QuantConfig(bins=14, embedding_bins=14, protect_fraction=0.02, rate=0.2)],
                         ids=["k-means levels", "entropy-constrained levels"])
def test_every_restore_of_a_chain_is_the_reconstruction_its_saver_held(tmp_path, monkeypatch, quant):
    """A restore of each link, whole, into shards and as NumPy, is bit for bit the reconstruction the saving process
    held (what its next residual was coded against): float32, bfloat16 and float16 leaves, with protected weights in
    the keyframe and the residuals, and a non-finite weight; the links' streams decompressed in threads (as for a
    large leaf: the sharded restores) or not (the others)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
    root = tmp_path / "run"
    handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False, quant=quant, keyframe_every=6))
    mngr = ocp.CheckpointManager(root, item_handlers=handler)
    held = []
    for step, s in enumerate(walk(7, 6)):
        s = {**s, "h": s["w"][:, :32].astype(jnp.float16)}
        if step == 2:
            s["w"] = s["w"].at[3, 3].set(jnp.inf)
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
        (_, committed), = handler._states.values()  # noqa: SLF001 (what the next save builds on)
        held.append({k: np.asarray(v) for k, v in committed.result().recon.items()})
    assert [mngr.item_metadata(s)["chain_depth"] for s in range(6)] == [0, 1, 2, 3, 4, 5]
    for step in range(6):
        fresh = manager(root)
        saved = fresh.item_metadata(step)["tree"]
        plain = fresh.restore(step)
        as_numpy = manager(root).restore(step, args=ij.InshrinkRestore(
            {k: np.zeros(v.shape, v.dtype) for k, v in saved.items()}))
        monkeypatch.setattr(restore, "_THREADED_SIZE", 0)
        sharded = manager(root).restore(step, args=ij.InshrinkRestore(
            {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=split if len(v.shape) == 2 else None)
             for k, v in saved.items()}))
        monkeypatch.undo()
        for name in ("w", "v", "h", "b"):
            expect = held[step][f"['{name}']"]
            for out in (plain, as_numpy, sharded):
                assert out[name].dtype == expect.dtype
                np.testing.assert_array_equal(np.asarray(out[name]).view(np.uint8), expect.view(np.uint8))
    assert np.isposinf(held[2]["['w']"][3, 3]) and np.isfinite(held[3]["['w']"][3, 3])


def test_large_closed_loop_leaves_restore_two_at_a_time_in_threads_to_the_same_values(tmp_path, monkeypatch):
    """Closed-loop leaves of `_THREADED_SIZE` elements or more (lowered here) are restored `LEAVES_AT_ONCE` at a
    time off the caller's thread, the others on it; the values are the serial restore's bit for bit."""
    mngr = manager(tmp_path)
    for step, s in enumerate(walk(3, 3)):
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
    serial = manager(tmp_path).restore(2)
    where, at_once, running = {}, [], set()
    original = restore.restore_leaf

    def recorded(reader, m, t):
        running.add(m.keystr)
        at_once.append(len(running))
        where[m.keystr] = threading.current_thread() is threading.main_thread()
        try:
            return original(reader, m, t)
        finally:
            running.discard(m.keystr)

    monkeypatch.setattr(restore, "restore_leaf", recorded)
    monkeypatch.setattr(restore, "_THREADED_SIZE", 64 * 32)  # w (96 x 64) and v (64 x 32), not b (64)
    threaded = manager(tmp_path).restore(2)
    assert where == {"['w']": False, "['v']": False, "['b']": True}
    assert max(at_once) <= restore.LEAVES_AT_ONCE
    for name in ("w", "v", "b"):
        np.testing.assert_array_equal(np.asarray(threaded[name]).view(np.uint8),
                                      np.asarray(serial[name]).view(np.uint8))


def test_a_missing_or_corrupt_link_is_a_named_error(tmp_path, monkeypatch):
    mngr = manager(tmp_path)
    for step, s in enumerate(walk(6, 3)):
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
    blob = store.objects_dir(tmp_path, "default") / "1.0" / store.blob_name(0)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ij.CheckpointCorruptError, match=r"step 2.*leaf \['(w|v)'\].*checksum"):
        manager(tmp_path).restore(2)
    with monkeypatch.context() as m:  # every leaf large: the leaves restored two at a time in threads
        m.setattr(restore, "_THREADED_SIZE", 0)
        with pytest.raises(ij.CheckpointCorruptError, match=r"step 2.*leaf \['(w|v)'\].*checksum"):
            manager(tmp_path).restore(2)
        assert manager(tmp_path).restore(0)["w"].shape == (96, 64)
    assert cli.main(["verify", str(tmp_path), "--step", "2"]) == 1
    shutil.rmtree(store.objects_dir(tmp_path, "default") / "1.0")
    with pytest.raises(ij.CheckpointCorruptError, match=r"step 2.*object 1\.0.*missing"):
        manager(tmp_path).restore(2)
    assert manager(tmp_path).restore(0)["w"].shape == (96, 64)  # the keyframe alone still restores


def test_eval_fn_outcomes_at_residual_saves_and_recovery_across_a_resume(tmp_path):
    """A NaN from eval_fn at a residual save: a warning, that save lossless (an exact root), and after a restart
    and a restore the next save is a compressed residual again; a non-numeric value is a TypeError."""
    states = list(walk(7, 4))
    value = {"v": 1.0}

    def quality(s):
        if isinstance(value["v"], str):
            return value["v"]
        return value["v"] + float(jnp.mean(jnp.abs(s["w"] - states[0]["w"])))

    mngr = manager(tmp_path, search=True, quant=ij.QuantConfig())
    mngr.save(0, args=ij.InshrinkSave(states[0], eval_fn=quality))
    mngr.save(1, args=ij.InshrinkSave(states[1], eval_fn=quality))
    mngr.wait_until_finished()
    assert mngr.item_metadata(1)["search"]["coding"] == "residual"
    value["v"] = float("nan")
    with pytest.warns(UserWarning, match="cannot be measured"):
        mngr.save(2, args=ij.InshrinkSave(states[2], eval_fn=quality))
        mngr.wait_until_finished()
    assert mngr.item_metadata(2)["quant"] is None
    value["v"] = "good"
    other = manager(tmp_path / "other", search=True)
    with pytest.raises(TypeError, match="eval_fn must return one real number"):
        other.save(0, args=ij.InshrinkSave(states[0], eval_fn=quality))
        other.wait_until_finished()  # the search runs in the background: its error surfaces here
    assert other.all_steps() == []
    value["v"] = 1.0
    resumed = manager(tmp_path, search=True, quant=ij.QuantConfig())
    restored = resumed.restore(2, args=ij.InshrinkRestore(states[2]))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(states[2]["w"]))  # lossless: exact
    resumed.save(3, args=ij.InshrinkSave(states[3], eval_fn=quality))
    resumed.wait_until_finished()
    fig = resumed.item_metadata(3)
    assert fig["search"]["coding"] == "residual" and fig["quant"] is not None and fig["kind"] == "delta"
    assert [o.id for o, _ in store.Reader(tmp_path / "3" / "default").links("['w']")] == ["2.0", "3.0"]


def test_residual_levels_fit_a_peaked_residual():
    """A residual that is 0 for most weights (inputs that are always 0 get no gradient) with long tails: its
    levels are weighted by count, so even 2 levels leave less error than storing no residual (the paper's
    |value| weighting put both levels in the tails: many times the residual's energy as error)."""
    rng = np.random.default_rng(8)
    base = jnp.asarray(rng.normal(size=(512, 128)).astype(np.float32) * 0.05)
    change = np.where(rng.random(base.shape) < 0.1, rng.standard_t(2, size=base.shape) * 0.01, 0.0)
    w = base + jnp.asarray(change.astype(np.float32))
    cfg = ij.CompressionConfig()
    for bins in (2, 3, 8):
        (dev,) = ij.quantize.encode_on_device([w], [None], ["dense"], ij.QuantConfig(bins=bins, protect_fraction=0.0),
                                              cfg, offsets=[base], sigma=ij.quantize.RESIDUAL_SIGMA)
        err = float(ij.search.proxy_degradation([w], [dev.dequantize(w.dtype)], [None], [base]))
        assert err < 1.0, (bins, err)
    assert err < 0.2  # 8 levels


@pytest.mark.parametrize("step", [1.0, 2.0, 4.0])
def test_uniform_residual_levels_are_cell_centres_and_the_outer_cells_means(step):
    """QuantConfig.step: five cells of width step * RMS centred on 0; a value takes its cell and decodes to the
    cell's centre (exactly -width, 0, width for the inner three), the outer two to the mean of their values."""
    rng = np.random.default_rng(3)
    base = jnp.asarray(rng.normal(size=(256, 96)).astype(np.float32) * 0.05)
    r = rng.standard_t(3, size=base.shape).astype(np.float32) * 1e-3
    w = base + jnp.asarray(r)
    q = ij.QuantConfig(bins=5, protect_fraction=0.0, step=step)
    (dev,) = ij.quantize.encode_on_device([w], [None], ["dense"], q, ij.CompressionConfig(), offsets=[base],
                                          sigma=ij.quantize.RESIDUAL_SIGMA)
    got = np.asarray(dev.dequantize(w.dtype), np.float64) - np.asarray(base, np.float64)
    resid = np.asarray(w, np.float64) - np.asarray(base, np.float64)  # the residual as float32 arithmetic makes it
    width = step * np.sqrt(np.mean(resid ** 2))
    levels = np.asarray(dev.centres, np.float32)[:5]
    # the inner levels: 0 and +-the encoder's width (its RMS comes from the sketch's buckets, within 1%)
    assert levels[2] == 0.0 and levels[1] == -levels[3] and abs(levels[3] / width - 1) < 0.01
    codes = np.asarray(dev.codes)
    assert codes.min() >= 1 and codes.max() <= 5
    # the outer levels: the mean of their cells' values (which hold everything beyond 1.5 cells)
    for code, level in ((1, levels[0]), (5, levels[4])):
        in_cell = resid[codes == code]
        assert abs(level - in_cell.mean()) < 0.02 * abs(in_cell.mean()), (code, level, in_cell.mean())
    inside = np.abs(resid) <= 1.5 * width  # the inner cells: value and level in the same cell (buckets: 1%)
    assert np.all(np.abs(got - resid)[inside] <= width * 0.51)
    # the zero cell: |r| <= width / 2
    assert abs(np.mean(np.abs(resid) <= width / 2) - np.mean(codes == 3)) < 0.005


def test_a_closed_loop_of_centred_cells_does_not_trail_a_steady_drift():
    """Weights drifting steadily (each by its own amount a save, peaked at 0, plus noise), coded closed loop by five
    cells of 1.5 RMS: the reconstruction's error along each weight's drift averages to about 0 (a fraction of a
    percent of its mean size), where levels at their cells' means (inside their centres) would leave every
    drifting weight behind by a part of a cell (quantize.uniform_levels)."""
    rng = np.random.default_rng(5)
    shape = (128, 96)
    drift = rng.laplace(size=shape).astype(np.float32) * 1e-3
    w = rng.normal(size=shape).astype(np.float32) * 0.05
    recon = jnp.asarray(w)
    q = ij.QuantConfig(bins=5, protect_fraction=0.0, step=1.5)
    along, size = [], []
    for t in range(30):
        w = w + drift + rng.normal(size=shape).astype(np.float32) * 2e-4
        x = jnp.asarray(w)
        (dev,) = ij.quantize.encode_on_device([x], [None], ["dense"], q, ij.CompressionConfig(), offsets=[recon],
                                              sigma=ij.quantize.RESIDUAL_SIGMA)
        recon = dev.dequantize(x.dtype)
        err = np.asarray(x, np.float64) - np.asarray(recon, np.float64)
        if t >= 10:
            along.append(np.mean(np.sign(drift) * err))
            size.append(np.mean(np.abs(err)))
    assert abs(np.mean(along)) < 0.05 * np.mean(size), (np.mean(along), np.mean(size))


def test_uniform_residual_error_and_bits_fall_monotonically_with_the_step():
    rng = np.random.default_rng(4)
    base = jnp.asarray(rng.normal(size=(256, 96)).astype(np.float32) * 0.05)
    w = base + jnp.asarray(rng.normal(size=base.shape).astype(np.float32) * 1e-3)
    errs, sizes = [], []
    for step in (1.0, 1.5, 2.0, 3.0, 4.0):
        (dev,) = ij.quantize.encode_on_device([w], [None], ["dense"], ij.QuantConfig(bins=5, protect_fraction=0.0,
                                                                                   step=step),
                                              ij.CompressionConfig(), offsets=[base], sigma=ij.quantize.RESIDUAL_SIGMA)
        errs.append(float(ij.search.proxy_degradation([w], [dev.dequantize(w.dtype)], [None], [base])))
        sizes.append(len(codec.compress_best(np.asarray(dev.codes), codec.CODE_CODECS, codec.CODE_LEVEL)[0]))
    assert errs == sorted(errs) and sizes == sorted(sizes, reverse=True), (errs, sizes)
    assert errs[0] < 0.1 and sizes[0] > 2.5 * sizes[-1]


def test_entropy_constrained_residuals_trade_error_for_bits_and_keep_weights_at_their_zero_level():
    """Entropy-constrained levels (QuantConfig.rate) of a heavy-tailed residual: error rises and bytes fall with the
    rate; a value at the zero level (code 0) keeps its previous weight exactly; at rate 0.2 both the error and the
    bytes are below those of 4 k-means levels (the default space's choice for such a residual)."""
    rng = np.random.default_rng(4)
    base = jnp.asarray(rng.normal(size=(256, 96)).astype(np.float32) * 0.05)
    w = base + jnp.asarray(rng.laplace(size=base.shape).astype(np.float32) * 1e-3)

    def code(q):
        (dev,) = ij.quantize.encode_on_device([w], [None], ["dense"], q, ij.CompressionConfig(), offsets=[base],
                                              sigma=ij.quantize.RESIDUAL_SIGMA)
        out = dev.dequantize(w.dtype)
        err = float(ij.search.proxy_degradation([w], [out], [None], [base]))
        return err, len(codec.compress_best(np.asarray(dev.codes), codec.CODE_CODECS, codec.CODE_LEVEL)[0]), dev, out

    errs, sizes = [], []
    for rate in (0.05, 0.1, 0.2, 0.4, 0.8):
        err, size, dev, out = code(ij.QuantConfig(bins=14, embedding_bins=14, protect_fraction=0.0, rate=rate))
        errs.append(err)
        sizes.append(size)
        zero = np.asarray(dev.codes) == 0
        assert 0.3 < zero.mean() < 1.0 and np.asarray(dev.codes).max() <= 14
        np.testing.assert_array_equal(np.asarray(out)[zero], np.asarray(base)[zero])
    assert errs == sorted(errs) and sizes == sorted(sizes, reverse=True), (errs, sizes)
    kmeans_err, kmeans_size, _, _ = code(ij.QuantConfig(bins=4, protect_fraction=0.0))
    assert errs[2] < kmeans_err and sizes[2] < kmeans_size, (errs[2], kmeans_err, sizes[2], kmeans_size)
    # Scale-free: a residual 1e18 times as large (its squares overflow float32) is coded as well.
    base, w = base * 1e18, w * 1e18
    err, size, _, _ = code(ij.QuantConfig(bins=14, embedding_bins=14, protect_fraction=0.0, rate=0.2))
    assert abs(err - errs[2]) < 0.1 * errs[2] and abs(size - sizes[2]) < 0.1 * sizes[2], (err, errs[2])


def test_entropy_constrained_configurations_are_checked():
    cube = ij.search.Cube.build(config.ENTROPY_RESIDUAL_SPACE, False, ij.QuantConfig())
    assert cube.names[-1] == "rate" and cube.config(cube.top, "magnitude").rate == 0.05  # least aggressive: 0.05
    for bad in ({"rate": -0.1}, {"rate": 0.2, "step": 1.0}, {"rate": 0.2, "bins": 5}, {"rate": float("inf")}):
        with pytest.raises(ValueError, match="rate"):
            ij.QuantConfig(**{"bins": 14, "embedding_bins": 14, **bad})
    with pytest.raises(ValueError, match="rates"):
        config.SearchSpace(rates=(0.0, 0.2))
    for space in ({"rates": (-0.1, 0.2)}, {"rates": (0.2,), "bins": (3, 4)}, {"rates": (0.2,), "steps": (1.0,)}):
        with pytest.raises(ValueError, match="rate"):
            config.SearchSpace(**space)


@pytest.mark.parametrize("space", ["RESIDUAL_SPACE", pytest.param("KMEANS_RESIDUAL_SPACE", marks=pytest.mark.slow),
                                   "ENTROPY_RESIDUAL_SPACE"])
def test_a_residual_save_that_meets_no_budget_takes_the_finest_levels(tmp_path, space):
    """residual_budget=0 (only an exact residual would meet it): every residual save takes the finest levels it
    may (mode "least aggressive"): four times those of its space's least aggressive configuration (63 cells of
    1 RMS -> 249 of 0.25 RMS; 8 k-means levels -> 32; entropy-constrained levels at 1/16 the rate), stays a
    compressed link of the chain, and restores within half of one interval's change."""
    space_name, space = space, getattr(config, space)
    states = list(walk(11, 3))
    mngr = manager(tmp_path, search=True, quant=ij.QuantConfig(), residual_budget=0.0, residual_space=space)
    for i, s in enumerate(states):
        mngr.save(i, args=ij.InshrinkSave(s))
    mngr.wait_until_finished()
    cube = ij.search.Cube.build(space, False, ij.QuantConfig())
    top = cube.config(cube.top, "magnitude")
    expected = {"RESIDUAL_SPACE": (249, 0.0, 0.25, 0.0), "KMEANS_RESIDUAL_SPACE": (32, 0.0, 0.0, 0.0),
                "ENTROPY_RESIDUAL_SPACE": (top.bins, 0.0, 0.0, top.rate / 16)}[space_name]
    for i in (1, 2):
        fig = mngr.item_metadata(i)
        assert fig["search"]["coding"] == "residual" and fig["search"]["mode"] == "least aggressive"
        q = fig["quant"]
        assert (q["bins"], q["prune_fraction"], q["step"], q["rate"]) == pytest.approx(expected)
        assert fig["kind"] == "delta"
    restored = mngr.restore(2, args=ij.InshrinkRestore(states[2]))
    assert rms(restored["w"], states[2]["w"]) < 0.5 * rms(states[2]["w"], states[1]["w"])


def test_a_tight_epsilon_gets_finer_residual_cells_than_the_space_holds(tmp_path):
    """epsilon 0.002 asks residual saves for 0.04 of the residual's squared error (`RESIDUAL_PER_EPSILON`), which
    the space's finest cells (1 RMS, about 0.08) do not give: the saves take 125 cells of 0.5 RMS (mode "finer"),
    record a proxy within that budget, and write more bytes than at epsilon 0.005 (budget 0.1, met by cells of
    1 RMS inside the space): the knob keeps steering past the space's end."""
    states = list(walk(13, 3))
    written, errors = {}, {}
    for eps in (0.002, 0.005):
        mngr = manager(tmp_path / str(eps), search=True, quant=ij.QuantConfig(), epsilon=eps)
        for i, s in enumerate(states):
            mngr.save(i, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
        recs = [mngr.item_metadata(i)["search"] for i in (1, 2)]
        quants = [mngr.item_metadata(i)["quant"] for i in (1, 2)]
        budget = 20 * eps
        assert all(r["coding"] == "residual" and r["budget"] == pytest.approx(budget) for r in recs)
        assert all(r["degradation"] <= budget for r in recs)
        if eps == 0.002:
            assert [r["mode"] for r in recs] == ["finer", "finer"]
            assert [(q["bins"], q["step"]) for q in quants] == [(125, 0.5), (125, 0.5)]
        else:
            assert all(r["mode"] != "finer" for r in recs) and all(q["step"] >= 1.0 for q in quants)
        written[eps] = sum(mngr.item_metadata(i)["stored_bytes"]["params"] for i in (1, 2))
        restored = mngr.restore(2, args=ij.InshrinkRestore(states[2]))
        errors[eps] = rms(restored["w"], states[2]["w"])
    assert written[0.002] > 1.3 * written[0.005] and errors[0.002] < 0.75 * errors[0.005]


@pytest.mark.parametrize("large", [True, False])
def test_a_residual_search_encodes_only_its_choice_and_records_what_it_restores_to(tmp_path, monkeypatch, large):
    """Without eval_fn a large state's residual candidates (uniform cells; `search.SCORED_WITHOUT_ENCODING`
    values or more, lowered here) are scored without encoding them (`quantize.uniform_residual_scores`): the
    weights are encoded once, for the chosen configuration; a small state's are encoded per candidate. Either
    way the recorded degradation is the data-free proxy of what step 1 restores to, against step 0's
    reconstruction."""
    if large:
        monkeypatch.setattr(ij.search, "SCORED_WITHOUT_ENCODING", 1000)
    states = list(walk(12, 2))
    mngr = manager(tmp_path, search=True, quant=ij.QuantConfig())
    mngr.save(0, args=ij.InshrinkSave(states[0]))
    mngr.wait_until_finished()
    encodes = []
    real = quantize.encode_on_device
    monkeypatch.setattr(quantize, "encode_on_device", lambda *a, **k: encodes.append(a[3]) or real(*a, **k))
    mngr.save(1, args=ij.InshrinkSave(states[1]))
    mngr.wait_until_finished()
    rec = mngr.item_metadata(1)["search"]
    assert rec["coding"] == "residual" and rec["candidates"] >= 3
    assert len(encodes) == (1 if large else rec["candidates"])
    assert rec["chosen"] in [dataclasses.asdict(q) for q in encodes]
    # A resumed job's next residual search starts from this choice; the keyframes' search starts afresh.
    resumed = save.state_of_restore(store.Reader(tmp_path / "1" / "default"), {})
    assert dataclasses.asdict(resumed.residual_quant) == rec["chosen"] and resumed.quant is None
    before, after = mngr.restore(0), mngr.restore(1)
    keys = ["w", "v", "b"]
    proxy = ij.search.proxy_degradation([jnp.asarray(states[1][k]) for k in keys], [after[k] for k in keys],
                                        [None] * len(keys), [before[k] for k in keys])
    assert rec["degradation"] == pytest.approx(float(proxy), rel=1e-5)


STRICT_FINER = 1.5  # an eval_fn scale at which 125 uniform cells of half the step meet epsilon, 63 do not


@pytest.mark.parametrize("space, strict, bins, meets", [
    pytest.param("KMEANS_RESIDUAL_SPACE", 1e4, 32, False, marks=pytest.mark.slow),
    pytest.param("KMEANS_RESIDUAL_SPACE", 2.0, 16, True, marks=pytest.mark.slow),
                                                       ("RESIDUAL_SPACE", 1e4, 249, False),
                                                       ("RESIDUAL_SPACE", STRICT_FINER, 125, True)])
def test_a_residual_save_over_epsilon_at_the_space_top_goes_finer(tmp_path, space, strict, bins, meets):
    """An eval_fn that no configuration of the residual space satisfies: the save measures finer levels beyond
    it (k-means: 16, then 32 levels; 63 uniform cells: 125 then 249 cells over the same range, embedding tables
    too) and takes the first within epsilon, else the best measured; the step restores to the reconstruction that
    was measured, and the next save searches the residual space again."""
    states = list(walk(8, 3))
    target = {"i": 0}

    def quality(s):  # relative error against the state being saved, scaled by `strict`
        w = states[target["i"]]["w"]
        return 1.0 + strict * float(jnp.mean(jnp.abs(s["w"] - w)) / jnp.mean(jnp.abs(w)))

    space = getattr(config, space)
    mngr = manager(tmp_path, search=True, quant=ij.QuantConfig(), residual_space=space)
    for i in range(2):
        target["i"] = i
        mngr.save(i, args=ij.InshrinkSave(states[i], eval_fn=quality))
        mngr.wait_until_finished()
    rec = mngr.item_metadata(1)["search"]
    assert rec["coding"] == "residual" and rec["mode"] == "guarded"
    assert (rec["chosen"]["bins"], rec["chosen"]["embedding_bins"]) == (bins, bins)
    assert (rec["degradation"] <= 0.01) == meets
    restored = mngr.restore(1, args=ij.InshrinkRestore(states[1]))
    assert quality(restored) - 1.0 == pytest.approx(rec["degradation"], rel=1e-5)
    target["i"] = 2
    mngr.save(2, args=ij.InshrinkSave(states[2]))  # no eval_fn: the residual space's own choice
    mngr.wait_until_finished()
    assert mngr.item_metadata(2)["search"]["chosen"]["bins"] <= max(space.bins)


@pytest.mark.slow  # 30 s a case; .ci/run runs them
@pytest.mark.parametrize("weighted", [False, True])
def test_layers_on_disjoint_device_sets_save_and_restore(tmp_path, weighted):
    """Pipeline-style placement: each layer, its Adam moments included, sharded over its own pair of devices.
    The encoders, the second moments' encoder and the weighting run one call per device set (a jitted call takes arrays of one device set: such a save failed); each reconstruction stays on
    its layer's devices, so both layers continue their chains (one placed elsewhere made its leaf a keyframe at
    every save); restores land on each layer's devices."""
    import optax

    stages = [jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[k:k + 2]), ("x",)),
                                         jax.sharding.PartitionSpec("x")) for k in (0, 2)]
    rng = np.random.default_rng(0)
    w = [rng.normal(size=(64, 48)).astype(np.float32) * 0.05 for _ in stages]
    mngr = manager(tmp_path, weighted_residuals=weighted, optimizer="quantize")
    for step in range(3):
        w = [x + rng.normal(size=x.shape).astype(np.float32) * 2e-3 for x in w]
        params = {f"l{k}": {"kernel": jax.device_put(jnp.asarray(x), s)} for k, (x, s) in enumerate(zip(w, stages))}
        opt = jax.tree.map(lambda a: a + 1e-4 if a.ndim else a, optax.adam(1e-3).init(params))
        mngr.save(step, args=ij.InshrinkSave({"params": params, "opt_state": opt}))
        mngr.wait_until_finished()
    reader = store.Reader(tmp_path / "2" / "default")
    for k in range(2):
        assert all(e.segments["codes"].prior is not None for _, e in reader.shards[f"['params']['l{k}']['kernel']"])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          {"params": params, "opt_state": opt})
    out = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler()).restore(
        2, args=ij.InshrinkRestore(target))
    for k, (x, s) in enumerate(zip(w, stages)):
        got = out["params"][f"l{k}"]["kernel"]
        assert got.sharding == s and rms(got, x) < 0.01


def test_the_search_proxy_sums_over_device_sets():
    """The residual search's proxy of tensors on disjoint device sets: per-set sums, combined on the host, equal to
    the proxy of the same tensors on one device."""
    rng = np.random.default_rng(0)
    xs, ds, refs = ([rng.normal(size=(16, 8)).astype(np.float32) for _ in range(2)] for _ in range(3))
    whole = float(ij.search.proxy_degradation(*(list(map(jnp.asarray, a)) for a in (xs, ds)), [None, None],
                                              list(map(jnp.asarray, refs))))
    sets = [jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[k:k + 2]), ("x",)),
                                       jax.sharding.PartitionSpec("x")) for k in (0, 2)]
    apart = [[jax.device_put(a, s) for a, s in zip(group, sets)] for group in (xs, ds, refs)]
    split = float(ij.search.proxy_degradation(apart[0], apart[1], [None, None], apart[2]))
    assert split == pytest.approx(whole, rel=1e-6) and 0 < whole


def test_a_shard_read_asked_for_by_two_threads_at_once_is_read_once_and_its_error_reaches_both():
    # The links of a large leaf are read in a pool while the chain is decoded: a shard's read is shared.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    calls, gate = [], threading.Event()

    def read(p, e):
        calls.append(p)
        gate.wait(10)
        if p < 0:
            raise store.CheckpointCorruptError("bad shard")
        return 2 * p

    good, bad = object(), object()
    for shard, p in ((good, 3), (bad, -1)):
        once = restore._once(read)  # noqa: SLF001
        calls.clear()
        gate.clear()
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(once, p, shard), pool.submit(once, p, shard)]
            while not calls:  # one read started; the other caller waits for it
                gate.wait(0.01)
            gate.set()
            if p > 0:
                assert [f.result() for f in futures] == [6, 6] and calls == [3]  # read once
            else:
                for f in futures:
                    with pytest.raises(store.CheckpointCorruptError, match="bad shard"):
                        f.result()
                assert calls == [-1, -1]  # a failed read is not kept: the other caller reads and fails too


def test_a_link_with_no_protected_values_but_a_protected_code_is_a_named_error():
    import types

    bins = 4
    codes = np.array([1, 2, bins + 1, 3], np.uint8)
    seg = records.Segment(file=store.CODES_FILE, offset=0, length=0, crc32=0, codec=codec.RAW, dtype="float32",
                          count=0)
    shard = types.SimpleNamespace(segments={"protected": seg})
    protected_of = restore._protected_reader(lambda p, e: codes, lambda *a: np.zeros(0, np.float32), bins,  # noqa: SLF001
                                             "leaf ['w']")
    with pytest.raises(store.CheckpointCorruptError, match=r"leaf \['w'\]: a protected code but no protected values"):
        protected_of(0, shard)
    clean = restore._protected_reader(lambda p, e: codes.clip(0, bins), lambda *a: np.zeros(0, np.float32), bins,  # noqa: SLF001
                                      "leaf ['w']")
    local, values = clean(0, shard)
    assert local.size == 0 and values.size == 0


@pytest.mark.parametrize("bins", [1, 2, 3, 4, 5, 6, 7, 15])
@pytest.mark.parametrize("packing", [codec.RANKS, codec.ZSTD_RADIX, codec.ZSTD_RANK])
def test_a_chain_of_packed_codes_decodes_bit_for_bit_as_its_codes(monkeypatch, bins, packing):
    """`decode_chain` given a residual's codes left packed (`quantize.PackedCodes`, as a restore reads a
    "ranks", "zstd-radix" or "zstd-rank" stream: 8, 5, 4, 3 or 2 codes a byte) gives the chain of the same codes spelled
    out, bit for bit, also where the tensor's size is not a multiple of the codes a byte and a link is weighted;
    packed codes of the wrong size are refused."""
    monkeypatch.setattr(quantize, "_PACKED_FROM", 1)  # a small tensor takes packed codes, as one of 8M+ values
    rng = np.random.default_rng(bins)
    shape = (37, 29)
    first = rng.normal(size=shape).astype(np.float32)
    links, packed_links = [(first, None)], [(first, None)]
    for k in range(5):
        codes = rng.integers(0, bins + 1, size=shape).astype(np.uint8)  # 0 (a zero residual) .. bins
        if k == 3:
            codes[:] = codes.max()  # one value: "zstd-rank" of a one-value alphabet does not pack
        centres = np.sort(rng.normal(size=bins)).astype(np.float32) * 1e-2
        enc = quantize.EncodedTensor(codes, centres, np.zeros(0, np.float32), "float32")
        links.append((enc, None))
        stream = codec.compress(codes, packing)
        got = codec.packed_values(stream, packing, codes.size, quantize.chain_size(codes.size))
        if got is None:
            assert packing == codec.ZSTD_RANK and np.unique(codes).size == 1
            packed_links.append((enc, None))
            continue
        assert got[1].shape == (256, {2: 8, 3: 5, 4: 4, 5: 3, 6: 3}.get(len(np.unique(codes)) if packing !=
                                                                         codec.ZSTD_RADIX else codes.max() + 1, 2)
                                if np.unique(codes).size > 1 or packing != codec.RANKS else 8)
        assert got[0].ctypes.data % 64 == 0
        packed = quantize.PackedCodes(got[0], got[1], shape)
        np.testing.assert_array_equal(packed.at(np.arange(codes.size)), codes.reshape(-1))
        packed_links.append((enc._replace(codes=packed), None))
    weightings = [None, [np.arange(37) % 3 - 1, np.zeros(29, np.int64)], None, None, None]
    expect = np.asarray(quantize.decode_chain(links, weightings=weightings))
    out = np.asarray(quantize.decode_chain(packed_links, weightings=weightings))
    np.testing.assert_array_equal(out.view(np.uint32), expect.view(np.uint32))
    enc = packed_links[1][0]
    short = enc._replace(codes=enc.codes._replace(packed=enc.codes.packed[:-1]))
    with pytest.raises(ValueError, match="packed codes of"):
        quantize.decode_chain([(first, None), (short, None)])


def test_a_large_chain_restores_from_packed_codes_as_its_saver_held(tmp_path, monkeypatch):
    """A restore reads a residual link without protected values from its packed stream (a large tensor's: every
    tensor here, with the threshold lowered), whole, into shards and as NumPy, bit for bit
    the reconstruction the saving process held, the same as read code by code; packed bytes said to hold a code
    past their link's levels are not used."""
    monkeypatch.setattr(quantize, "_PACKED_FROM", 1)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
    root = tmp_path / "run"
    handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False, keyframe_every=6, quant=ij.QuantConfig(
        bins=63, embedding_bins=63, protect_fraction=0.0, prune_fraction=0.0, step=1.5)))
    mngr = ocp.CheckpointManager(root, item_handlers=handler)
    held = []
    for step, s in enumerate(walk(9, 4)):
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
        (_, committed), = handler._states.values()  # noqa: SLF001
        held.append({k: np.asarray(v) for k, v in committed.result().recon.items()})
    packed = []
    real = store._Object.packed  # noqa: SLF001
    monkeypatch.setattr(store._Object, "packed", lambda self, *a: packed.append(real(self, *a)) or packed[-1])  # noqa: SLF001
    saved = manager(root).item_metadata(3)["tree"]
    outs = [manager(root).restore(3), manager(root).restore(3, args=ij.InshrinkRestore(
        {k: np.zeros(v.shape, v.dtype) for k, v in saved.items()})), manager(root).restore(3, args=ij.InshrinkRestore(
            {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=split if len(v.shape) == 2 else None)
             for k, v in saved.items()}))]
    assert sum(p is not None for p in packed) >= 2 * 3 * 3  # w, v and b's three residuals, in each whole restore
    monkeypatch.setattr(store._Object, "packed", lambda self, *a: None)  # noqa: SLF001
    outs.append(manager(root).restore(3))
    for out in outs:
        for name in ("w", "v", "b"):
            expect = held[3][f"['{name}']"]
            np.testing.assert_array_equal(np.asarray(out[name]).view(np.uint8), expect.view(np.uint8))
    # Packed bytes said to hold a code past the link's levels (a crafted alphabet) are not used: the link is read
    # code by code (`_encoded`, which checks each), here to the right values.
    monkeypatch.setattr(store._Object, "packed", lambda self, *a: (  # noqa: SLF001
        lambda got: None if got is None else (got[0], np.full_like(got[1], 200)))(real(self, *a)))
    out = manager(root).restore(3)
    for name in ("w", "v", "b"):
        np.testing.assert_array_equal(np.asarray(out[name]).view(np.uint8), held[3][f"['{name}']"].view(np.uint8))


def test_a_sampled_residual_search_keeps_its_measured_decode_as_the_reconstruction(tmp_path, monkeypatch):
    """A large state's residual save (searched on row samples, its choice measured whole: search._measured_whole)
    keeps the decode it measured as its reconstruction, not a second decode: the saver decodes the residuals once,
    and each step restores bit for bit to what it held."""
    monkeypatch.setattr(ij.search, "SCORED_WITHOUT_ENCODING", 1000)
    monkeypatch.setattr(ij.search, "SEARCH_SAMPLE", 512)
    handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(keyframe_every=4))
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=handler)
    decodes = []
    real = quantize.dequantize_all
    monkeypatch.setattr(quantize, "dequantize_all", lambda devs, *a: decodes.append(len(devs)) or real(devs, *a))
    held = []
    for step, s in enumerate(walk(13, 3)):
        decodes.clear()
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
        (_, committed), = handler._states.values()  # noqa: SLF001
        held.append({k: np.asarray(v) for k, v in committed.result().recon.items()})
        if step:
            assert "sampled" in mngr.item_metadata(step)["search"] and mngr.item_metadata(step)["kind"] == "delta"
            assert [n for n in decodes if n] == [3]  # the measured choice's w, v and b (a small parameter), once
    for step in range(3):
        out = manager(tmp_path).restore(step)
        for name in ("w", "v", "b"):
            np.testing.assert_array_equal(np.asarray(out[name]).view(np.uint8), held[step][f"['{name}']"].view(np.uint8))


@pytest.mark.slow  # 14 s; .ci/run runs it
def test_a_large_states_residual_saves_keep_their_choice_between_searches_and_across_a_resume(tmp_path,
                                                                                             monkeypatch):
    """A large state's residual saves (thresholds lowered) search on row samples, then keep the choice with one
    measurement on the whole state for at most `search.KEPT_AT_MOST` saves (mode "kept"), then search again; they
    store the same choices and bytes as saves that search every time, and restore bit for bit what the saver held.
    A new process that restores the latest step and saves on keeps the choice too: the hint travels in the
    step's search record."""
    monkeypatch.setattr(ij.search, "SCORED_WITHOUT_ENCODING", 1000)
    monkeypatch.setattr(ij.search, "SEARCH_SAMPLE", 512)
    states = list(walk(21, 9))

    def run(root, upto=len(states)):
        handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(keyframe_every=32))
        mngr = ocp.CheckpointManager(root, item_handlers=handler)
        held = []
        for step, s in enumerate(states[:upto]):
            mngr.save(step, args=ij.InshrinkSave(s))
            mngr.wait_until_finished()
            (_, committed), = handler._states.values()  # noqa: SLF001
            held.append({k: np.asarray(v) for k, v in committed.result().recon.items()})
        meta = [mngr.item_metadata(step) for step in range(upto)]
        return [m["search"]["mode"] for m in meta[1:]], [m["stored_bytes"]["params"] for m in meta], held

    modes, sizes, held = run(tmp_path / "kept")
    k = ij.search.KEPT_AT_MOST
    assert modes == ["exhaustive"] + (["kept"] * k + ["exhaustive"] + ["kept"] * k)[:len(modes) - 1], modes
    monkeypatch.setattr(ij.search, "KEPT_AT_MOST", 0)
    searched, searched_sizes, _ = run(tmp_path / "searched")
    assert "kept" not in searched and sizes == searched_sizes
    for step in (3, 8):
        out = manager(tmp_path / "kept").restore(step)
        for name in ("w", "v", "b"):
            np.testing.assert_array_equal(np.asarray(out[name]).view(np.uint8), held[step][f"['{name}']"].view(np.uint8))
    monkeypatch.setattr(ij.search, "KEPT_AT_MOST", k)
    # Saves 0-3, then a new handler restores step 3 (kept, two saves after a search) and saves step 4: kept.
    run(tmp_path / "resumed", 4)
    handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(keyframe_every=32))
    mngr = ocp.CheckpointManager(tmp_path / "resumed", item_handlers=handler)
    mngr.restore(3, args=ij.InshrinkRestore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                          states[3])))
    mngr.save(4, args=ij.InshrinkSave(states[4]))
    mngr.wait_until_finished()
    assert mngr.item_metadata(4)["search"]["mode"] == "kept" and mngr.item_metadata(4)["search"]["wider"]["saves"] == 3
    assert mngr.item_metadata(4)["stored_bytes"]["params"] == sizes[4]


@pytest.mark.parametrize("sharded", [False, True])
def test_a_residual_links_levels_that_no_code_takes_are_stored_as_zero(tmp_path, sharded):
    """A closed-loop residual whose values leave cells empty between its centre and an outlier: stored whole, every
    level no code of the link takes is 0 in its record (short records); split into shards (whose records must
    agree), the levels outside the range of the codes are 0 and those inside it kept. Either way the restore is
    the save's reconstruction (levels no code takes are never decoded)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    states = [w, w + 1e-3 * rng.standard_normal(w.shape).astype(np.float32)]
    states.append(states[1] + 1e-3 * rng.standard_normal(w.shape).astype(np.float32))
    states[2][0, 0] += 1.0  # an outlier: the outer cell, with empty cells between it and the others
    put = jnp.asarray
    if sharded:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
        put = functools.partial(jax.device_put, device=sh)
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig()))
    for step, s in enumerate(states):
        mngr.save(step, args=ij.InshrinkSave({"w": put(s)}))
        mngr.wait_until_finished()
    assert mngr.item_metadata(2)["kind"] == "delta"
    obj, shards = store.Reader(tmp_path / "2" / "default").links("['w']")[-1]
    assert len(shards) == (2 if sharded else 1)
    levels = shards[0][1].segments["codes"].table()
    codes = np.zeros(w.shape, np.uint8)
    for p, e in shards:
        (r0, r1), (c0, c1) = e.box
        codes[r0:r1, c0:c1] = obj.array("['w']", p, e.segments["codes"], "codes", np.uint8, store.box_shape(e.box))
    taken = np.isin(np.arange(1, levels.size + 1), codes.reshape(-1))
    lo, hi = np.flatnonzero(taken)[[0, -1]]
    assert not taken[lo:hi + 1].all()  # a gap inside the range
    assert np.all(levels[~taken][(np.flatnonzero(~taken) < lo) | (np.flatnonzero(~taken) > hi)] == 0)
    inside_gap = levels[lo:hi + 1][~taken[lo:hi + 1]]
    assert np.all(inside_gap != 0) if sharded else np.all(inside_gap == 0)
    assert codes.min() >= 1 and codes.max() <= levels.size  # every value quantized: none pruned or protected
    # step 2 restores to step 1's reconstruction plus its codes' levels, as the save computed it
    want = np.asarray(mngr.restore(1)["w"]) + levels[codes - 1]
    assert np.array_equal(np.asarray(mngr.restore(2)["w"]), want)


@pytest.mark.parametrize("wider, expect", [
    ({"ratio": 1.4, "saves": 2}, {"ratio": 1.4, "saves": 2}),
    ({"ratio": 2, "saves": 0}, {"ratio": 2.0, "saves": 0}),
    (None, None), ("1.4", None), ({"ratio": 1.4}, None), ({"ratio": "1.4", "saves": 1}, None),
    ({"ratio": float("nan"), "saves": 1}, None), ({"ratio": float("inf"), "saves": 1}, None),
    ({"ratio": 0.0, "saves": 1}, None), ({"ratio": -1.0, "saves": 1}, None), ({"ratio": 1.4, "saves": -1}, None),
    ({"ratio": 1.4, "saves": 1.0}, None), ({"ratio": 1.4, "saves": True}, None), ({"ratio": True, "saves": 1}, None),
])
def test_a_search_records_wider_is_a_hint_only_where_it_reads_as_one(wider, expect):
    """A step's search record travels into the next residual save's hint (`save._hint`) only as a positive finite
    ratio and a count of saves that is not negative; anything else (an older record, a record edited by hand) is
    no hint, and the next residual save searches."""
    assert save._hint(wider) == expect
