"""Optimizer-state policies: the moment quantizer's guarantees, and lossless / quantize / drop through the handler."""

import os
import sys

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import inshrink_jax as ij
from inshrink_jax import moments, policy, quantize, save
from inshrink_jax.save import MIN_MOMENT_SIZE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import digits  # noqa: E402


# ------------------------------------------------------------------------------------------- the quantizer
def decoded(m, **cfg):
    """(quantize-dequantize on device, what a restore decodes from the host copy) of one second moment."""
    dev, = moments.encode_on_device([jnp.asarray(m)], ij.CompressionConfig(**cfg))
    enc = quantize.to_host(dev.codes, dev.centres, dev.protected_in_place, dev.bins, np.asarray(m).dtype)
    return np.asarray(dev.dequantize(np.asarray(m).dtype)), np.asarray(quantize.decode(enc)), enc


def first_decoded(mu, nu=None, weight_codes=None, **cfg):
    """(quantize-dequantize on device, what a restore decodes from the host copy, encoded) of one first moment
    coded relative to `nu` (as given: the second moment as a restore gives it), or on its own."""
    scale = None if nu is None else jnp.asarray(nu)
    dev, = moments.encode_first_on_device([jnp.asarray(mu)], [scale], [weight_codes], ij.CompressionConfig(**cfg))
    enc = quantize.to_host(dev.codes, dev.centres, dev.protected_in_place, dev.bins, np.asarray(mu).dtype)
    return np.asarray(dev.dequantize(np.asarray(mu).dtype)), np.asarray(quantize.decode(enc, scale=scale)), enc


def update_error(restored, mu, nu=None) -> float:
    """||u' - u||^2 / ||u||^2 of u = mu / sqrt(nu) over the values where sqrt(nu) > 0 (nu None: 1)."""
    s = np.ones(np.shape(mu)) if nu is None else np.sqrt(np.asarray(nu, np.float64))
    ok = s > 0
    u = np.asarray(mu, np.float64)[ok] / s[ok]
    return float(((np.asarray(restored, np.float64)[ok] / s[ok] - u) ** 2).sum() / max((u ** 2).sum(), 1e-300))


@pytest.mark.slow  # 25 s; .ci/run runs it
@hypothesis.settings(deadline=None, max_examples=25)
@hypothesis.given(st.integers(0, 2**31 - 1), st.sampled_from([2, 4, 16, 127]), st.floats(0.0, 0.9),
                  st.sampled_from(["float32", "bfloat16", "float16"]), st.booleans())
def test_zeros_signs_and_nearest_log_level(seed, bins, zeros, dtype, second):
    rng = np.random.default_rng(seed)
    decades = rng.uniform(-30 if dtype != "float16" else -6, 0, size=(64, 48))
    m = rng.standard_normal((64, 48)) * 10.0 ** decades
    m = (m**2 if second else m) * (rng.uniform(size=m.shape) >= zeros)
    m = np.asarray(jnp.asarray(m, dtype)).astype(np.float64)  # exactly representable in `dtype`
    on_device, restored, enc = decoded(np.asarray(m, dtype), moment_bins=bins)
    np.testing.assert_array_equal(on_device, restored)  # what the search sees is what a restore gives
    r = restored.astype(np.float64)
    # exact zeros stay exact zeros, and nothing else becomes 0; the sign is kept (so nu >= 0)
    np.testing.assert_array_equal(r == 0, m == 0)
    np.testing.assert_array_equal(np.sign(r), np.sign(m))
    # each value is on the nearest of its sign's levels in log|m| (up to the dtype's rounding of the level)
    nz = m != 0
    levels = np.unique(np.abs(enc.centres.astype(np.float64)))
    assert levels.size <= bins and enc.codes.max() <= 2 * bins
    gap = np.abs(np.log(np.abs(m[nz]))[:, None] - np.log(levels)[None, :]).min(axis=1)
    err = np.abs(np.log(np.abs(r[nz]) / np.abs(m[nz])))
    tol = {"float32": 1e-5, "bfloat16": 2.0**-7, "float16": 2.0**-9}[dtype]
    assert np.all(err <= gap + 2 * tol + 1e-6)


def test_non_finite_moments_come_back_exactly():
    m = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
    m[0, :3] = [np.nan, np.inf, -np.inf]
    _, r, _ = decoded(m)
    assert np.isnan(r[0, 0]) and r[0, 1] == np.inf and r[0, 2] == -np.inf
    assert np.all(np.isfinite(r[1:]))


def test_first_moment_of_a_pruned_weight_is_pruned_with_it():
    rng = np.random.default_rng(0)
    mu = rng.standard_normal((64, 32)).astype(np.float32)
    codes = jnp.asarray(rng.integers(0, 5, size=mu.shape).astype(np.uint8))  # 0 = pruned weight
    _, r, _ = first_decoded(mu, weight_codes=codes)
    np.testing.assert_array_equal(r == 0, np.asarray(codes) == 0)


def test_a_residuals_codes_do_not_prune_a_first_moment():
    """A closed-loop residual's codes are passed with prunes=False (so a residual save runs the kernel a keyframe
    compiled): the moment is coded exactly as without codes, bit for bit."""
    rng = np.random.default_rng(1)
    mu = rng.standard_normal((64, 32)).astype(np.float32)
    nu = jnp.asarray(rng.uniform(0.5, 2.0, size=mu.shape).astype(np.float32))
    codes = jnp.asarray(rng.integers(0, 5, size=mu.shape).astype(np.uint8))
    cfg = ij.CompressionConfig()
    with_codes, = moments.encode_first_on_device([jnp.asarray(mu)], [nu], [codes], cfg, [False])
    without, = moments.encode_first_on_device([jnp.asarray(mu)], [nu], [None], cfg)
    for a, b in ((with_codes.codes, without.codes), (with_codes.centres, without.centres),
                 (with_codes.bins, without.bins)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(codes) == 0) and not np.any(np.asarray(with_codes.codes) == 0)
    with pytest.raises(ValueError, match="one prunes flag and one budget factor per moment"):
        moments.encode_first_on_device([jnp.asarray(mu)], [nu], [codes], cfg, [False, True])
    with pytest.raises(ValueError, match="one prunes flag and one budget factor per moment"):
        moments.encode_first_on_device([jnp.asarray(mu)], [nu], [codes], cfg, [False], [1.0, 0.1])


@hypothesis.settings(deadline=None, max_examples=20)
@hypothesis.given(st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.02, 0.1, 0.3, 1.0]), st.floats(0.0, 0.5),
                  st.sampled_from(["float32", "bfloat16", "float16"]), st.booleans())
def test_first_moment_update_error_is_within_the_budget(seed, budget, zeros, dtype, relative):
    rng = np.random.default_rng(seed)
    lo = -12 if dtype == "float16" else -30
    nu = (rng.standard_normal((96, 40)) * 10.0 ** rng.uniform(lo / 2, 0, size=(96, 40))) ** 2
    # Adam's |mu| is up to about sqrt(nu); a rare input's moments are both tiny, where a coding of mu on its own
    # blows the update up
    mu = rng.standard_t(3, size=nu.shape) * np.sqrt(nu) * 0.3 * (rng.uniform(size=nu.shape) >= zeros)
    mu, nu = np.asarray(mu, dtype), np.asarray(nu, dtype)
    on_device, restored, enc = first_decoded(mu, nu if relative else None, moment_budget=budget)
    np.testing.assert_array_equal(on_device, restored)  # the save's decode is the restore's, bit for bit
    assert np.all(restored[mu == 0] == 0)
    assert enc.bins % 2 == 1 and enc.bins <= moments.FIRST_CAPACITY
    # the levels' squared error is within the budget on the histogram (buckets of 5% relative width: a value is
    # within 5% of its bucket's), and the decoded value's rounding to the dtype adds its own
    tol = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype]
    finite = np.isfinite(nu.astype(np.float64)) & (nu.astype(np.float64) > 0) if relative else np.ones(mu.shape, bool)
    stored = enc.codes == quantize.protected_code(enc.bins)
    np.testing.assert_array_equal(stored, (mu != 0) & ~finite)  # only where sqrt(nu) cannot scale is mu stored
    err = update_error(restored[finite], mu[finite], nu[finite] if relative else None)
    assert budget == 0 or np.sqrt(err) <= np.sqrt(budget) + 0.05 + 2 * tol
    # a looser budget never takes finer cells
    _, _, looser = first_decoded(mu, nu if relative else None, moment_budget=min(1.0, budget * 2 + 0.05))
    assert looser.bins <= enc.bins


def test_first_moments_where_the_second_moment_cannot_scale_are_stored_exactly():
    mu = np.linspace(-1e-3, 1e-3, 64 * 32, dtype=np.float32).reshape(64, 32)
    nu = np.full(mu.shape, 1e-6, np.float32)
    mu[0, :3] = [np.nan, np.inf, -np.inf]
    nu[1, :4] = [0.0, np.inf, np.nan, 0.0]
    mu[1, 3] = 0.0  # 0 stays an exact zero, whatever nu is
    on_device, r, enc = first_decoded(mu, nu)
    np.testing.assert_array_equal(on_device, r)
    assert np.isnan(r[0, 0]) and r[0, 1] == np.inf and r[0, 2] == -np.inf
    np.testing.assert_array_equal(r[1, :4], mu[1, :4])
    assert np.all(np.isfinite(r[2:]))
    assert int((enc.codes == quantize.protected_code(enc.bins)).sum()) == 6


@pytest.mark.slow  # 22 s; .ci/run runs it
def test_lions_first_moment_is_coded_within_the_normalized_budget(tmp_path, trained):
    """A Lion state saved with the default configuration: its `mu` comes back within `policy.NORMALIZED_BUDGET` of the
    first-moment budget (squared error against its own), where the full budget would not hold it so close."""
    state, grads, _ = trained
    lion = state.replace(tx=optax.lion(1e-4), opt_state=optax.lion(1e-4).init(state.params))
    for _ in range(20):  # a mu of some history: the gradients of the digits' last step, decayed and renewed
        lion = lion.apply_gradients(grads=jax.tree.map(lambda g: g * (1 + 0.1 * jnp.sign(g)), grads))
    r, _ = save_restore(tmp_path, lion, grads)
    cfg = ij.CompressionConfig()
    errors = []
    for a, b in zip(jax.tree.leaves(r.opt_state[0].mu), jax.tree.leaves(lion.opt_state[0].mu)):
        if a.size >= cfg.min_compress_size:
            errors.append(update_error(np.asarray(a), np.asarray(b)))
    assert errors and max(errors) <= (np.sqrt(policy.NORMALIZED_BUDGET * cfg.effective_moment_budget) + 0.05) ** 2
    # and the full budget, as Adam's mu takes it, codes the same moments more coarsely
    full = [update_error(np.asarray(first_decoded(np.asarray(b))[1]), np.asarray(b))
            for b in jax.tree.leaves(lion.opt_state[0].mu) if b.size >= cfg.min_compress_size]
    assert min(full) > max(errors)


def test_a_tiny_first_moment_beside_a_tiny_second_moment_keeps_its_update():
    # a rare input: its weights' mu and nu are both many decades below the others'. Coded on its own (format
    # <= 8), mu took a level of the busy weights' size and its update came back orders of magnitude too large.
    rng = np.random.default_rng(3)
    nu = rng.uniform(0.5, 2.0, size=(128, 64)).astype(np.float32) * 1e-4
    nu[:4] *= 1e-12
    mu = (rng.standard_normal(nu.shape) * np.sqrt(nu) * 0.3).astype(np.float32)
    budget = ij.CompressionConfig().effective_moment_budget
    _, r, enc = first_decoded(mu, nu)
    rows = np.sqrt(((r[:4] - mu[:4]) ** 2).sum() / (mu[:4] ** 2).sum())
    # the tiny rows' relative error is of the order of the budget's (sqrt(b) in norm), not orders of magnitude
    assert rows < 1.6 * np.sqrt(budget) and update_error(r, mu, nu) <= budget * 1.1


# --------------------------------------------------------------------------------------- through the handler
def save_restore(path, state, grads=None, **cfg):
    h = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False, **cfg))
    mngr = ocp.CheckpointManager(path, item_handlers=h)
    mngr.save(int(state.step), args=ij.InshrinkSave(state, grads=grads))
    mngr.wait_until_finished()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, state)
    return mngr.restore(int(state.step), args=ij.InshrinkRestore(abstract)), mngr.item_metadata(int(state.step))


def adam(state):
    return state.opt_state[0]


def test_lossless_policy_is_bit_exact(tmp_path, trained):
    state, grads, _ = trained
    r, fig = save_restore(tmp_path, state, grads, optimizer="lossless")
    for a, b in zip(jax.tree.leaves(r.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert fig["ratio"]["optimizer"] > 1.0  # byte planes + zstd: never larger than the raw bytes


def test_quantize_policy_keeps_zeros_signs_and_prunes_first_moments(tmp_path, trained):
    state, grads, _ = trained
    # a weight whose gradient is exactly 0 has mu = nu = 0: they must come back exactly 0
    kernel = ("Dense_1", "kernel")
    mu, nu = adam(state).mu, adam(state).nu
    zero = np.zeros(mu[kernel[0]][kernel[1]].shape, bool)
    zero[::7] = True
    set_zero = lambda t: {**t, kernel[0]: {**t[kernel[0]], kernel[1]: jnp.where(zero, 0.0, t[kernel[0]][kernel[1]])}}
    state = state.replace(opt_state=(adam(state)._replace(mu=set_zero(mu), nu=set_zero(nu)),
                                     *state.opt_state[1:]))
    quant = ij.QuantConfig(bins=8, prune_fraction=0.3)
    r, fig = save_restore(tmp_path, state, grads, quant=quant, optimizer="quantize")
    weights = jax.tree_util.tree_flatten_with_path(r.params)[0]
    pairs = zip(jax.tree.leaves(adam(r).mu), jax.tree.leaves(adam(state).mu), jax.tree.leaves(adam(r).nu),
                jax.tree.leaves(adam(state).nu), weights)
    n_quantized = 0
    for mu_r, mu_s, nu_r, nu_s, (path, w) in pairs:
        mu_r, mu_s, nu_r, nu_s, w = map(np.asarray, (mu_r, mu_s, nu_r, nu_s, w))
        assert np.all(nu_r >= 0)
        np.testing.assert_array_equal(nu_r == 0, nu_s == 0)  # nu is never 0 where it was not, nor > 0 where it was
        assert np.all(mu_r[mu_s == 0] == 0)
        if mu_s.size >= MIN_MOMENT_SIZE:  # coded relative to sqrt(nu) as restored, within moment_budget where
            kept = (w != 0) | (w.ndim < 2) | (w.size < 1024)  # the weight was not pruned
            assert update_error(mu_r[kept], mu_s[kept], nu_r[kept]) <= (np.sqrt(ij.CompressionConfig().effective_moment_budget) + 0.05) ** 2
        if w.ndim >= 2 and w.size >= 1024:  # quantized: mu pruned exactly where its weight was
            n_quantized += 1
            np.testing.assert_array_equal(mu_r == 0, (mu_s == 0) | (w == 0))
            assert np.all(nu_r[(w == 0) & (nu_s != 0)] > 0)
        elif mu_s.size >= MIN_MOMENT_SIZE:  # the moments of a weight stored exactly are quantized all the same
            np.testing.assert_array_equal(mu_r == 0, mu_s == 0)
            assert np.all(nu_r[nu_s != 0] > 0)
        else:
            np.testing.assert_array_equal(mu_r, mu_s)
    assert n_quantized == 3
    assert np.all(np.asarray(r.opt_state[0].nu[kernel[0]][kernel[1]])[zero] == 0)
    assert int(adam(r).count) == int(adam(state).count)
    assert fig["ratio"]["optimizer"] > 4 and fig["ratio"]["total"] > fig["ratio"]["optimizer"] / 2


def test_first_and_second_moments_take_their_own_level_counts(tmp_path, trained):
    state, grads, _ = trained
    cells = {}
    for budget in (0.0, 1.0):
        r, _ = save_restore(tmp_path / str(budget), state, grads, optimizer="quantize", moment_budget=budget,
                            moment_bins=5)
        leaves = ij.store.Reader(tmp_path / str(budget) / str(int(state.step)) / "default").leaves
        cells[budget] = [m.bins for m in leaves.values() if m.method == "moments" and m.scale_leaf is not None]
        seconds = {m.bins for m in leaves.values() if m.method == "moments" and m.scale_leaf is None}
        assert seconds == {moments.table_size(5)} and all(c % 2 == 1 for c in cells[budget])  # odd: one cell at 0
    # the loosest budget takes the widest cells: fewer of them, for every first moment
    assert all(loose < tight for loose, tight in zip(cells[1.0], cells[0.0])), cells
    for m in leaves.values():  # every quantized mu is coded relative to its own nu
        if m.scale_leaf is not None:
            assert m.scale_leaf == m.keystr.replace(".mu", ".nu") and leaves[m.scale_leaf].method == "moments"
    mus = jax.tree_util.tree_flatten_with_path(adam(r).mu)[0]
    for (path, mu_r), nu_r in zip(mus, jax.tree.leaves(adam(r).nu)):
        meta = next((m for k, m in leaves.items() if k.endswith(".mu" + jax.tree_util.keystr(path))), None)
        if meta is not None and meta.kind == "quantized":  # each value is a level times sqrt(nu) as restored
            mu_r, nu_r = np.asarray(mu_r, np.float64), np.asarray(nu_r, np.float64)
            assert np.unique(nu_r[nu_r != 0]).size <= 5
            ratios = mu_r[mu_r != 0] / np.sqrt(nu_r[mu_r != 0])
            gap = np.min(np.abs(ratios[:, None] - meta.table()[None, :]), axis=1)
            assert np.all(gap <= 1e-6 * np.abs(ratios))


def test_a_first_moment_restores_without_its_second_moment_in_the_target(tmp_path, trained):
    state, grads, _ = trained
    full, _ = save_restore(tmp_path, state, grads, optimizer="quantize")
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler())
    # only the first moments: nu (what they decode relative to), the parameters and the counters are not asked for
    target = state.replace(step=None, params=None, opt_state=(adam(state)._replace(count=None, nu=None),) + tuple(
        None for _ in state.opt_state[1:]))
    part = mngr.restore(int(state.step), args=ij.InshrinkRestore(target, partial_restore=True))
    assert part.params is None and adam(part).nu is None
    for a, b in zip(jax.tree.leaves(adam(part).mu), jax.tree.leaves(adam(full).mu)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_full_restore_decodes_each_second_moment_once(tmp_path, trained, monkeypatch):
    state, grads, _ = trained
    save_restore(tmp_path, state, grads, optimizer="quantize")
    decoded = []
    quantized = ij.restore._RESTORERS["quantized"]
    monkeypatch.setitem(ij.restore._RESTORERS, "quantized",
                        lambda reader, meta, *a: decoded.append(meta.keystr) or quantized(reader, meta, *a))
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler())
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    mngr.restore(int(state.step), args=ij.InshrinkRestore(abstract))
    scaled = {m.scale_leaf for m in ij.store.Reader(tmp_path / str(int(state.step)) / "default").leaves.values()
              if m.scale_leaf is not None}
    assert len(scaled) == 6 and scaled <= set(decoded)  # every quantized second moment scales its first moment
    assert sorted(decoded) == sorted(set(decoded))  # each leaf decoded once: its first moment reuses it


def test_a_first_moment_whose_second_moment_is_missing_is_a_named_error(tmp_path, trained):
    state, grads, _ = trained
    save_restore(tmp_path, state, grads, optimizer="quantize")
    directory = tmp_path / str(int(state.step)) / "default"
    body, _ = ij.store.read_json(directory / ij.store.MANIFEST, "manifest", directory)
    leaf = next(m for m in body["leaves"] if m.get("scale_leaf"))
    leaf["scale_leaf"] = leaf["scale_leaf"].replace("kernel", "nothing")
    raw = ij.store.write_json(directory / ij.store.MANIFEST, body)
    commit, _ = ij.store.read_json(directory / ij.store.COMMIT, "commit", directory)  # re-bound to the manifest
    ij.store.write_json(directory / ij.store.COMMIT, {**commit, "manifest_crc32": ij.store.crc32(raw)})
    with pytest.raises(ij.CheckpointCorruptError, match=r"coded relative to the leaf .*nothing"):
        ij.InshrinkCheckpointHandler().restore(directory, ij.InshrinkRestore())


def train(state, stream, steps):
    losses = []
    for _ in range(steps):
        state, loss, _ = digits.train_step(state, *next(stream))
        losses.append(float(loss))
    return state, losses


def test_drop_policy_restores_a_fresh_adam_state_that_trains(tmp_path, trained):
    state, grads, (tx, ty, vx, vy) = trained
    r, fig = save_restore(tmp_path, state, grads, optimizer="drop")
    for leaf in jax.tree.leaves((adam(r).mu, adam(r).nu)):
        assert not np.any(np.asarray(leaf))
    assert int(adam(r).count) == 0 and int(r.step) == int(state.step)  # adam restarts; the train step does not
    assert fig["stored_bytes"]["optimizer"] == 0 and fig["ratio"]["total"] > fig["ratio"]["params"]
    # the first update after the restore is Adam's first: at most the learning rate (1e-3) per weight
    stream = digits.batches(tx, ty, 64, 1)
    after, losses = train(r, stream, 60)
    step1 = jax.tree.map(lambda a, b: np.max(np.abs(np.asarray(a) - np.asarray(b))),
                         train(r, digits.batches(tx, ty, 64, 1), 1)[0].params, r.params)
    assert max(jax.tree.leaves(step1)) <= 1e-3 * 1.001
    assert all(np.isfinite(losses)) and np.mean(losses[-10:]) < np.mean(losses[:10])
    assert digits.accuracy(after.params, after.apply_fn, vx, vy) >= digits.accuracy(r.params, r.apply_fn, vx, vy)


def test_policy_rules_override_by_path(tmp_path, trained):
    state, grads, _ = trained
    # mu dropped, nu quantized, count kept: Adam's bias correction goes on; a kernel kept lossless
    rules = ((r"\.mu\b", "drop"), (r"Dense_1", "lossless"))
    r, _ = save_restore(tmp_path, state, grads, optimizer="quantize", policy_rules=rules)
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(adam(r).mu))
    assert int(adam(r).count) == int(adam(state).count)
    np.testing.assert_array_equal(np.asarray(r.params["Dense_1"]["kernel"]),
                                  np.asarray(state.params["Dense_1"]["kernel"]))
    np.testing.assert_array_equal(np.asarray(adam(r).nu["Dense_1"]["kernel"]),  # the rule matches nu's path too
                                  np.asarray(adam(state).nu["Dense_1"]["kernel"]))
    assert not np.array_equal(np.asarray(adam(r).nu["Dense_0"]["kernel"]), np.asarray(adam(state).nu["Dense_0"]["kernel"]))


@pytest.mark.parametrize("rules, message", [
    (((r"\.nu\b", "drop"), (r"\.count\b", "lossless")), r"second moment \S+\.nu\S+ is dropped but its step counter"),
    (((r"\.nu\b", "drop"),), r"second moment \S+\.nu\S+ is dropped, so its step counter is reset with it, but the first moment"),
    (((r"\.count\b", "drop"),), "the step counter is dropped .reset to 0. but the first moment"),
    (((r"step", "drop"),), "policy_rules apply to array leaves only"),
    (((r"key", "drop"),), "PRNG key"),
])
def test_unsafe_or_impossible_policies_are_refused(tmp_path, trained, rules, message):
    state, _, _ = trained
    tree = {"state": state.replace(step=3), "key": jax.random.key(0)}
    h = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False, optimizer="quantize", policy_rules=rules))
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=h)
    with pytest.raises(ValueError, match=message):
        mngr.save(0, args=ij.InshrinkSave(tree))
    assert mngr.all_steps() == []


def test_config_rejects_unknown_policies():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        ij.CompressionConfig(optimizer="prune")
    with pytest.raises(ValueError, match="policy_rules entries"):
        ij.CompressionConfig(policy_rules=(("mu", "zero"),))
    with pytest.raises(ValueError, match="moment_bins"):
        ij.CompressionConfig(moment_bins=128)


@pytest.mark.slow  # 19 s; .ci/run runs it
def test_moment_deltas_and_nnx_paths(tmp_path):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(64, 64, rngs=rngs)
            self.b = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (32, 64))
    y = jnp.arange(32) % 10

    @nnx.jit
    def step(model, opt):
        loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        opt.update(model, nnx.grad(loss)(model))

    h = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False, optimizer="quantize"))
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=h)
    for s in range(2):
        for _ in range(3):
            step(model, opt)
        mngr.save(s, args=ij.InshrinkSave({"model": nnx.state(model), "opt": nnx.state(opt)}))
        mngr.wait_until_finished()
    fig = mngr.item_metadata(1)
    leaves = ij.store.Reader(tmp_path / "1" / "default").leaves
    assert leaves["['opt']['opt_state'][0]['nu']['a']['kernel'].value"].method == "moments"
    assert leaves["['model']['a']['kernel'].value"].method == "weights"
    assert fig["kind"] in ("delta", "mixed") and fig["ratio"]["optimizer"] > 4  # mixed: a 1-D mu takes its own codes
    restored = mngr.restore(1)
    nu = restored["opt"]["opt_state"][0]["nu"]["a"]["kernel"]["value"]
    assert np.all(np.asarray(nu) > 0)


def test_drop_resets_only_the_counter_of_the_dropped_moments():
    params = {"dense": {"kernel": jnp.ones((64, 32)), "bias": jnp.ones((32,))}}
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-3, 0.0, 100))
    state = {"params": params, "opt_state": tx.init(params)}
    kinds = {m.keystr: m.kind for m in save.plan(state, None, None, ij.CompressionConfig(optimizer="drop")).records}
    counts = {k: v for k, v in kinds.items() if k.endswith("count")}
    # adam's own counter restarts with its moments; the schedule's (inject_hyperparams) goes on
    assert counts == {"['opt_state'].count": "array", "['opt_state'].inner_state[0].count": "dropped",
                      "['opt_state'].hyperparams_states['learning_rate'].count": "array"}
    assert {v for k, v in kinds.items() if ".mu" in k or ".nu" in k} == {"dropped"}
    assert kinds["['opt_state'].hyperparams['learning_rate']"] == "array"
    assert {kinds["['params']['dense']['kernel']"], kinds["['params']['dense']['bias']"]} == {"quantized", "array"}
