"""Weighted closed-loop residuals (weighting.py): the factors of a second moment, the exact power-of-two
multipliers, where the error of a weighted residual goes, bit-exact restores of weighted links, and damaged
weighting named as such."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings, strategies as st

import inshrink_jax as ij
from inshrink_jax import records, store, weighting
from test_fuzz import _resign


def separable(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """nu = 2^-(rows_i + cols_j): -log2(nu) is exactly rows_i + cols_j."""
    return np.exp2(-(rows[:, None] + cols[None, :])).astype(np.float32)


def test_factors_of_a_separable_second_moment_are_its_centred_main_effects():
    rows = np.array([0, 4, 8, 12, 16, 20], np.float64)
    cols = np.array([2, 6, 10, 14], np.float64)
    (fr, fc), = weighting.factors([jnp.asarray(separable(rows, cols))])
    np.testing.assert_array_equal(np.asarray(fr), rows - rows.mean())
    np.testing.assert_array_equal(np.asarray(fc), cols - cols.mean())
    # K = floor((f_i + f_j + 2) / 4): a quarter of the octaves of nu, so M = 2^K is about nu^(-1/4).
    k = np.asarray(weighting.exponents([fr, fc]))
    np.testing.assert_array_equal(k, np.floor((rows[:, None] - 10 + cols[None, :] - 8 + 2) / 4))


def test_factors_ignore_what_is_not_a_gradient_statistic():
    nu = separable(np.array([0.0, 4, 8, 12]), np.array([0.0, 4]))
    nu[1, 1] = np.nan
    nu[2, 0] = 0.0  # never had a gradient: counts as 2^-48 of the largest, not as -log2(0)
    fr, fc = weighting.factors([jnp.asarray(nu)])[0]
    assert np.all(np.abs(np.asarray(fr)) <= 48) and np.all(np.abs(np.asarray(fc)) <= 48)
    zero = weighting.factors([jnp.zeros((3, 5))])[0]  # no gradient anywhere: unweighted
    assert all(not np.any(np.asarray(f)) for f in zero)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(-weighting.FACTOR_LIMIT, weighting.FACTOR_LIMIT), min_size=1, max_size=5),
                min_size=1, max_size=4))
def test_exponents_agree_on_host_and_device_and_stay_clipped(fs):
    host = weighting.exponents_host([np.asarray(f) for f in fs])
    device = np.asarray(jax.jit(weighting.exponents)([jnp.asarray(f, jnp.int32) for f in fs]))
    np.testing.assert_array_equal(host, device)
    assert host.shape == tuple(len(f) for f in fs)
    assert np.abs(host).max() <= weighting.OCTAVES


def test_multipliers_are_exact_powers_of_two():
    k = jnp.arange(-weighting.OCTAVES, weighting.OCTAVES + 1)
    np.testing.assert_array_equal(np.asarray(weighting.pow2(k)), np.exp2(np.arange(-8, 9)).astype(np.float32))
    r = jnp.asarray(np.random.default_rng(0).normal(size=(17, 2000)).astype(np.float32) * 1e-3)
    there = weighting.times_multiplier(r, -k[:, None])
    back = weighting.times_multiplier(there, k[:, None])
    np.testing.assert_array_equal(np.asarray(back), np.asarray(r))  # u = r / M and u * M round trip exactly


def adam_state(params: dict, nu: dict, step: int) -> dict:
    return {"params": params, "opt_state": (optax.ScaleByAdamState(
        jnp.int32(step), jax.tree.map(jnp.zeros_like, nu), nu),)}


def walk(n: int, seed: int = 0):
    """n states of a random walk of a 2-D kernel whose second moment's rows span 2^24 (so M spans 2^6), a
    3-D kernel whose second moment varies along its middle axis, and a bias."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(64, 48)).astype(np.float32) * 0.05
    c = rng.normal(size=(8, 6, 40)).astype(np.float32) * 0.05
    nu_w = separable(np.repeat([0.0, 24.0], 32), np.zeros(48))
    nu_c = np.broadcast_to(np.exp2(-np.arange(6.0) * 4)[None, :, None], c.shape).astype(np.float32)
    for step in range(n):
        w = w + rng.normal(size=w.shape).astype(np.float32) * 2e-3
        c = c + rng.normal(size=c.shape).astype(np.float32) * 2e-3
        params = {"w": jnp.asarray(w), "c": jnp.asarray(c), "b": jnp.asarray(w[0])}
        yield adam_state(params, {"w": jnp.asarray(nu_w), "c": jnp.asarray(nu_c), "b": jnp.ones(48)}, step)


def manager(root, **cfg):
    cfg = {"search": False, "quant": ij.QuantConfig(bins=4, protect_fraction=0.0), "weighted_residuals": True, **cfg}
    handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(**cfg))
    return ocp.CheckpointManager(root, item_handlers=handler), handler


def weightings(directory) -> dict:
    reader = store.Reader(directory)
    return {k: e.segments["codes"].weighting for k, shards in reader.shards.items() for _, e in shards
            if "codes" in e.segments and e.segments["codes"].weighting is not None}


@pytest.mark.slow  # (weighted_residuals is not the default; -m slow runs it)
def test_a_weighted_residual_puts_its_error_where_the_second_moment_is_small(tmp_path):
    """The 2-D kernel's first 32 rows have 2^24 times the second moment of the others (M 2^6 smaller): weighted,
    at the same 4 levels, the others take about the level nearest 0 and their error is far above these rows',
    which keep what unweighted coding gives them, and the code stream shrinks; unweighted, the two halves'
    errors are alike."""
    ratio, sensitive, stored = {}, {}, {}
    for weighted in (True, False):
        mngr, _ = manager(tmp_path / str(weighted), weighted_residuals=weighted)
        for step, s in enumerate(walk(3)):
            mngr.save(step, args=ij.InshrinkSave(s))
            mngr.wait_until_finished()
        got = np.asarray(mngr.restore(2)["params"]["w"], np.float64)
        err = (got - np.asarray(s["params"]["w"], np.float64)) ** 2
        ratio[weighted] = np.sqrt(err[32:].mean() / err[:32].mean())
        sensitive[weighted] = np.sqrt(err[:32].mean())
        reader = store.Reader(tmp_path / str(weighted) / "2" / "default")
        stored[weighted] = sum(e.segments["codes"].length for _, e in reader.shards["['params']['w']"])
    w = weightings(tmp_path / "True" / "2" / "default")
    assert sorted(w) == ["['params']['c']", "['params']['w']"]  # the bias (1-D) is not weighted
    np.testing.assert_array_equal(w["['params']['w']"][0], [-12] * 32 + [12] * 32)
    np.testing.assert_array_equal(w["['params']['c']"][1], [-10, -6, -2, 2, 6, 10])
    assert ratio[True] > 8 and 0.5 < ratio[False] < 2, ratio
    assert sensitive[True] < 1.15 * sensitive[False], sensitive
    assert stored[True] < 0.8 * stored[False], stored


def test_unweighted_when_switched_off_or_without_a_second_moment(tmp_path):
    mngr, _ = manager(tmp_path / "off", weighted_residuals=False)
    for step, s in enumerate(walk(2)):
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
    assert weightings(tmp_path / "off" / "1" / "default") == {}
    mngr, _ = manager(tmp_path / "plain")
    for step, s in enumerate(walk(2)):
        mngr.save(step, args=ij.InshrinkSave(s["params"]))
        mngr.wait_until_finished()
    assert weightings(tmp_path / "plain" / "1" / "default") == {}
    assert not ij.CompressionConfig().weighted_residuals  # not the default (docs/results.md)
    mngr, _ = manager(tmp_path / "default", weighted_residuals=ij.CompressionConfig().weighted_residuals)
    for step, s in enumerate(walk(2)):
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
    assert weightings(tmp_path / "default" / "1" / "default") == {}
    with pytest.raises(TypeError, match="weighted_residuals must be a bool"):
        ij.CompressionConfig(weighted_residuals=1)


@pytest.mark.slow  # (weighted_residuals is not the default; -m slow runs it)
def test_every_restore_of_a_weighted_chain_is_the_reconstruction_its_saver_held(tmp_path):
    """Whole and into shards (the weighting assembled from the shards' parts); saved from shards too; with a
    non-finite weight in a weighted link. (NumPy targets decode through the same chain kernel:
    test_closed_loop.py.)"""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
    mngr, handler = manager(tmp_path, keyframe_every=4)
    held, saved = [], []
    for step, s in enumerate(walk(4, seed=3)):
        if step == 2:
            s["params"]["w"] = s["params"]["w"].at[3, 3].set(jnp.inf)
        s = jax.tree.map(lambda x: jax.device_put(x, split) if x.ndim == 2 else x, s)
        saved.append(s)
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
        (_, committed), = handler._states.values()  # noqa: SLF001 (what the next save builds on)
        held.append({k: np.asarray(v) for k, v in committed.result().recon.items()})
    assert "['params']['w']" in weightings(tmp_path / "3" / "default")
    for step in range(4):
        fresh, _ = manager(tmp_path)
        outs = [fresh.restore(step)]
        for make in (lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=split if len(m.shape) == 2 else None),):
            outs.append(manager(tmp_path)[0].restore(step, args=ij.InshrinkRestore(jax.tree.map(make, saved[step]))))
        for name in ("w", "c"):  # (the bias, of fewer than MIN_RESIDUAL_SIZE elements, is stored exactly)
            expect = held[step][f"['params']['{name}']"]
            for out in outs:
                got = np.asarray(out["params"][name])
                assert got.dtype == expect.dtype
                np.testing.assert_array_equal(got.view(np.uint8), expect.view(np.uint8))
    assert np.isposinf(held[2]["['params']['w']"][3, 3]) and np.isfinite(held[3]["['params']['w']"][3, 3])


def rewrite_weighting(root, step: str, leaf: str, change) -> None:
    """Apply `change` to the weighting of every shard of `leaf` in the step's offset tables, and sign the
    records again (as a crafted checkpoint would be)."""
    step_dir = root / step / "default"
    obj = root / store.OBJECTS / "default" / store.Reader(step_dir).object_id
    for path in obj.glob("index.*.json"):
        body, _ = store.read_json(path, "index", step_dir)
        for shard in body["entries"]:
            if shard["leaf"] == leaf and "weighting" in shard["segments"]["codes"]:
                change(shard["segments"]["codes"])
        store.write_json(path, body)
    _resign(root, step)


@pytest.mark.parametrize("change, message", [
    (lambda seg: seg["weighting"][0].pop(), "weighting has lengths"),
    (lambda seg: seg.pop("weighting"), None),
    (lambda seg: seg["weighting"][1].__setitem__(0, weighting.FACTOR_LIMIT + 1), "weighting"),
    (lambda seg: seg["weighting"][1].__setitem__(0, True), "weighting"),
])
def test_damaged_weighting_is_a_named_error(tmp_path, change, message):
    mngr, _ = manager(tmp_path)
    for step, s in enumerate(walk(2)):
        mngr.save(step, args=ij.InshrinkSave(s))
        mngr.wait_until_finished()
    rewrite_weighting(tmp_path, "1", "['params']['w']", change)
    fresh, _ = manager(tmp_path)
    if message is None:  # an unweighted link then decodes as such: a different, but well-formed, checkpoint
        assert np.all(np.isfinite(np.asarray(fresh.restore(1)["params"]["w"])))
        return
    with pytest.raises(ij.CheckpointCorruptError, match=message):
        fresh.restore(1)


def test_segment_weighting_must_be_lists_of_small_ints():
    ok = {"file": records.CODES_FILE, "offset": 0, "length": 1, "crc32": 0, "codec": "zstd"}
    assert records.Segment.from_json({**ok, "weighting": [[1, -2], [0]]}).weighting == [[1, -2], [0]]
    for bad in ([[1.5]], [1, 2], "x", [[weighting.FACTOR_LIMIT + 1]], [[False]]):
        with pytest.raises(records.RecordError, match="weighting"):
            records.Segment.from_json({**ok, "weighting": bad})
    json.dumps(records.Segment.from_json({**ok, "weighting": [[3]]}).to_json())
