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
from inshrink_jax import moments, quantize, save
from inshrink_jax.save import MIN_MOMENT_SIZE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import digits  # noqa: E402


# ------------------------------------------------------------------------------------------- the quantizer
def decoded(m, weight_codes=None, **cfg):
    """(quantize-dequantize on device, what a restore decodes from the host copy) of one moment."""
    dev, = moments.encode_on_device([jnp.asarray(m)], [weight_codes], ij.CompressionConfig(**cfg))
    enc = quantize.to_host(dev.codes, dev.centres, dev.protected_in_place, dev.bins, np.asarray(m).dtype)
    return np.asarray(dev.dequantize(np.asarray(m).dtype)), np.asarray(quantize.decode(enc)), enc


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
    _, r, _ = decoded(mu, codes)
    np.testing.assert_array_equal(r == 0, np.asarray(codes) == 0)


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
        assert np.all((np.sign(mu_r) == np.sign(mu_s)) | (mu_r == 0))
        assert np.all(mu_r[mu_s == 0] == 0)
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
    r, _ = save_restore(tmp_path, state, grads, optimizer="quantize", first_moment_bins=3, moment_bins=5)
    quantized = 0
    for mu_r, nu_r, w in zip(jax.tree.leaves(adam(r).mu), jax.tree.leaves(adam(r).nu), jax.tree.leaves(r.params)):
        if w.ndim >= 2 and w.size >= 1024:
            quantized += 1
            mu_r, nu_r = np.asarray(mu_r), np.asarray(nu_r)
            assert np.unique(np.abs(mu_r[mu_r != 0])).size == 3  # levels per sign, shared by both signs
            assert np.unique(nu_r[nu_r != 0]).size == 5
    assert quantized == 3


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
