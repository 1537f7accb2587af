"""The configuration search: its logic on synthetic monotone quality functions, and through the handler on a
real model (digits CNN) with a real eval_fn."""

import dataclasses
import itertools
import math
import warnings
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, strategies as st

import inshrink_jax as ij
from inshrink_jax import codec, config, quantize, search, weighting
from inshrink_jax.config import QuantConfig, SearchSpace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import digits  # noqa: E402

EPS = 0.05
CUBE = search.Cube.build(SearchSpace(), False, QuantConfig())
POINTS = list(itertools.product(*[range(len(v)) for v in CUBE.values]))
SIZES, BITS = {"dense": 100_000, "conv": 20_000}, {"dense": 32, "conv": 32}


def estimate(p):
    return search.estimated_ratio(CUBE.config(p, "magnitude"), SIZES, BITS)


def linear_quality(weights, threshold, offsets=None):
    """A monotone synthetic degradation: feasible (0) when the weighted index sum reaches the threshold
    (per-metric offsets shift it), else 1. Records every evaluated configuration."""
    calls = []

    def evaluate(quants):
        calls.append(list(quants))
        out = []
        for q in quants:
            s = sum(w * i for w, i in zip(weights, CUBE.point(q))) + (offsets or {}).get(q.prune_metric, 0.0)
            out.append((0.0 if s >= threshold else 1.0, q))
        return out

    return evaluate, calls


def brute_force_best(evaluate, metric="magnitude"):
    feasible = [p for p in POINTS if evaluate([CUBE.config(p, metric)])[0][0] <= EPS]
    return max((estimate(p) for p in feasible), default=None)


def test_estimated_ratio_decreases_with_more_bins_and_more_protection():
    for p in POINTS:
        for axis in (0, 2):
            if p[axis] < CUBE.top[axis]:
                q = tuple(i + (j == axis) for j, i in enumerate(p))
                assert estimate(q) < estimate(p)


@given(st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3), st.floats(0.0, 1.0), st.sampled_from([1, 2, 4]))
def test_exhaustive_search_finds_the_best_feasible_configuration(weights, frac, batch):
    threshold = frac * sum(w * (len(v) - 1) for w, v in zip(weights, CUBE.values))
    evaluate, calls = linear_quality(weights, threshold)
    out = search.search(evaluate, CUBE, ["magnitude"], EPS, batch, estimate, None)
    assert out.mode == "exhaustive"
    check, _ = linear_quality(weights, threshold)
    best = brute_force_best(check)
    if best is None:
        assert out.quant is None
    else:
        assert out.quant is not None and out.degradation <= EPS
        assert estimate(CUBE.point(out.quant)) == pytest.approx(best)
        assert out.payload == out.quant  # the chosen candidate's payload comes back with it
    evaluated = [q for c in calls for q in c]
    assert len(evaluated) == len(set(evaluated)) == out.evaluations  # nothing evaluated twice
    assert out.evaluations < len(POINTS) // 2
    assert all(len(c) <= batch for c in calls) and out.rounds == len(calls)


STEP_CUBE = search.Cube.build(config.RESIDUAL_SPACE, False, QuantConfig(), residual=True)
STEP_AXIS = STEP_CUBE.names.index("step")
STEPS = len(STEP_CUBE.values[STEP_AXIS])


def step_search(start, edge, batch):
    """(outcome, calls) of a search over the default residual space's steps whose feasible steps are the `edge`
    + 1 least aggressive (-1: none), started from step index `start` (None: a fresh search)."""
    calls = []

    def evaluate(quants):
        calls.append(list(quants))
        return [(0.0 if STEP_CUBE.point(q)[STEP_AXIS] >= STEPS - 1 - edge else 1.0, q) for q in quants]

    def est(p):
        return search.estimated_ratio(STEP_CUBE.config(p, "magnitude"), {"dense": 1000}, {"dense": 32})

    begin = None if start is None else STEP_CUBE.config(
        tuple(start if a == STEP_AXIS else t for a, t in enumerate(STEP_CUBE.top)), "magnitude")
    return search.search(evaluate, STEP_CUBE, ["magnitude"], EPS, batch, est, None, start=begin), calls


@given(st.integers(0, STEPS - 1), st.integers(-1, STEPS), st.sampled_from([1, 3, 4]))
def test_a_search_started_from_the_previous_residual_choice_ends_where_a_fresh_one_does(start, edge, batch):
    """`search(..., start=)` (a residual save starts from the previous one's choice): the same outcome as the
    search without it, over the default residual space's steps, wherever the feasible steps end; nothing
    evaluated twice."""
    fresh, _ = step_search(None, edge, batch)
    warm, calls = step_search(start, edge, batch)
    assert warm.quant == fresh.quant and warm.mode == fresh.mode == "exhaustive"
    evaluated = [q for c in calls for q in c]
    assert len(evaluated) == len(set(evaluated)) == warm.evaluations


def test_a_search_started_from_its_answer_takes_one_round():
    """Started from the step that is the answer (its coarser neighbour infeasible), one round of three settles
    the search wherever the answer lies; a fresh search takes more rounds for most of them."""
    fresh_rounds = []
    for edge in range(STEPS):
        warm, _ = step_search(STEPS - 1 - edge, edge, 4)
        assert warm.rounds == 1 and STEP_CUBE.point(warm.quant)[STEP_AXIS] == STEPS - 1 - edge
        fresh_rounds.append(step_search(None, edge, 4)[0].rounds)
    assert sum(r > 1 for r in fresh_rounds) > STEPS // 2


def test_exhaustive_search_runs_once_per_prune_metric_and_keeps_the_better():
    # The sensitivity metric reaches feasibility two index steps earlier: it must win.
    evaluate, calls = linear_quality((1.0, 1.0, 1.0), 8.0, offsets={"sensitivity": 2.0})
    out = search.search(evaluate, CUBE, ["magnitude", "sensitivity"], EPS, 4, estimate, None)
    assert {q.prune_metric for c in calls for q in c} == {"magnitude", "sensitivity"}
    assert out.quant.prune_metric == "sensitivity"
    check, _ = linear_quality((1.0, 1.0, 1.0), 6.0)
    assert estimate(CUBE.point(out.quant)) == pytest.approx(brute_force_best(check))


@given(st.sampled_from(POINTS), st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3), st.floats(0.0, 1.0))
def test_later_saves_never_become_more_aggressive(prev, weights, frac):
    threshold = frac * sum(w * (len(v) - 1) for w, v in zip(weights, CUBE.values))
    evaluate, calls = linear_quality(weights, threshold)
    out = search.search(evaluate, CUBE, ["magnitude"], EPS, 4, estimate, CUBE.config(prev, "magnitude"))
    assert out.mode in ("neighbourhood", "fallback")
    if out.quant is not None:
        assert all(a >= b for a, b in zip(CUBE.point(out.quant), prev))
        assert out.degradation <= EPS
    evaluated = [CUBE.point(q) for c in calls for q in c]
    assert all(all(a >= b for a, b in zip(p, prev)) for p in evaluated)
    if out.mode == "neighbourhood":
        assert out.evaluations <= 1 + len(prev)


def test_previous_configuration_that_still_holds_is_kept_with_one_round():
    evaluate, calls = linear_quality((1.0, 1.0, 1.0), 3.0)
    prev = CUBE.config((1, 1, 1), "magnitude")
    out = search.search(evaluate, CUBE, ["magnitude", "sensitivity"], EPS, 4, estimate, prev)
    assert (out.quant, out.mode, out.evaluations, out.rounds) == (prev, "neighbourhood", 2, 1)


def test_previous_configuration_switches_metric_when_the_other_is_clearly_better():
    def evaluate(quants):
        return [(0.04 if q.prune_metric == "magnitude" else 0.0, None) for q in quants]

    prev = CUBE.config((2, 2, 1), "magnitude")
    out = search.search(evaluate, CUBE, ["magnitude", "sensitivity"], EPS, 4, estimate, prev, switch_margin=0.2)
    assert out.quant == dataclasses.replace(prev, prune_metric="sensitivity")
    out = search.search(evaluate, CUBE, ["magnitude", "sensitivity"], EPS, 4, estimate, prev, switch_margin=0.9)
    assert out.quant == prev  # 0.04 is not lower by more than 0.9 * epsilon: keep the metric


def test_one_step_neighbour_when_the_previous_no_longer_holds():
    evaluate, _ = linear_quality((1.0, 0.0, 0.0), 3.0)  # needs bins index >= 3
    out = search.search(evaluate, CUBE, ["magnitude"], EPS, 4, estimate, CUBE.config((2, 4, 0), "magnitude"))
    assert out.mode == "neighbourhood"
    assert CUBE.point(out.quant) == (3, 4, 0)


def test_fallback_to_exhaustive_search_when_no_neighbour_is_feasible():
    evaluate, calls = linear_quality((1.0, 0.0, 0.0), 4.0)  # needs bins index >= 4: two steps away
    out = search.search(evaluate, CUBE, ["magnitude"], EPS, 4, estimate, CUBE.config((2, 1, 1), "magnitude"))
    assert out.mode == "fallback"
    assert CUBE.point(out.quant) == (4, 1, 1)  # the best that is not more aggressive than the previous


def test_nothing_feasible_is_lossless_until_the_least_aggressive_configuration_holds_again():
    evaluate, _ = linear_quality((1.0, 1.0, 1.0), 100.0)
    out = search.search(evaluate, CUBE, ["magnitude"], EPS, 4, estimate, None)
    assert out.quant is None and out.mode == "exhaustive"
    out = search.search(evaluate, CUBE, ["magnitude"], EPS, 4, estimate, search.LOSSLESS)
    assert (out.quant, out.mode, out.evaluations, out.rounds) == (None, "lossless", 1, 1)  # one probe: the top
    evaluate, _ = linear_quality((1.0, 0.0, 0.0), 2.0)  # quality is back: bins index >= 2 holds
    out = search.search(evaluate, CUBE, ["magnitude"], EPS, 4, estimate, search.LOSSLESS)
    assert out.mode == "recovered" and CUBE.point(out.quant)[0] == 2


def test_cube_maps_a_configuration_outside_the_space_to_one_not_more_aggressive():
    assert CUBE.point(QuantConfig(bins=10, prune_fraction=0.25, protect_fraction=0.002)) == (3, 3, 1)
    assert CUBE.point(QuantConfig(bins=64, prune_fraction=0.0, protect_fraction=0.5)) == CUBE.top


def test_dequantize_on_device_is_what_a_restore_decodes():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((96, 80)).astype(np.float32) * 0.05)
    x = x.at[3, 4].set(jnp.nan)
    cfg = ij.CompressionConfig()
    for q in (QuantConfig(bins=4, prune_fraction=0.3), QuantConfig(bins=32, protect_fraction=0.01)):
        (dev,) = quantize.encode_on_device([x], [None], ["dense"], q, cfg)
        on_device = np.asarray(dev.dequantize(x.dtype))
        decoded = np.asarray(quantize.decode(quantize.to_host(dev.codes, dev.centres, dev.protected_in_place,
                                                              dev.bins, x.dtype)))
        np.testing.assert_array_equal(on_device, decoded)


def test_proxy_is_zero_for_exact_values_and_weights_by_gradient():
    x = [jnp.ones((4, 4)), jnp.full((4, 4), 2.0)]
    assert float(search.proxy_degradation(x, x, [None, None])) == 0.0
    d = [jnp.zeros((4, 4)), x[1]]
    assert float(search.proxy_degradation(x, d, [None, None])) == pytest.approx(16 / (16 + 64))
    assert float(search.proxy_degradation(x, d, [jnp.zeros((4, 4)), jnp.ones((4, 4))])) == 0.0


@pytest.mark.parametrize("weighted, power", [(False, 1.0), (True, 1.0), (False, 0.5), (True, 0.0)])
def test_residual_candidates_are_scored_without_encoding_as_their_encoding_scores(weighted, power):
    """`quantize.uniform_residual_scores` (the residual search's scores: the histograms once, one pass per
    candidate, no codes) equals `proxy_degradation` of each candidate's encode + dequantize, up to the order of the
    float32 sums: several layer types and shapes, an embedding table with its own bins, a non-finite weight, a
    bfloat16 tensor, a tensor sharded over two devices, a weighted residual (factors from a second moment whose
    rows and columns differ by orders of magnitude), cells of each tensor's own RMS (power 1) or of the whole
    state's width reference (`quantize.residual_reference`, both given it)."""
    rng = np.random.default_rng(0)
    shapes = [(64, 32), (64, 32), (100,), (300, 20), (96, 40), (128, 16)]
    lts = ["dense", "dense", "other", "embedding", "dense", "dense"]
    xs = [jnp.asarray(rng.standard_t(3, s).astype(np.float32) * 0.02) for s in shapes[:5]]
    xs.append(jnp.asarray(rng.standard_normal(shapes[5]) * 0.02, jnp.bfloat16))
    offs = [x + jnp.asarray(rng.standard_normal(x.shape) * 1e-3, x.dtype) for x in xs]
    xs[0] = xs[0].at[3, 4].set(jnp.inf)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    xs[4], offs[4] = jax.device_put(xs[4], sh), jax.device_put(offs[4], sh)
    factors = None
    if weighted:
        nus = [jnp.asarray(10.0 ** rng.uniform(-9, -3, (s[0], 1)) * 10.0 ** rng.uniform(-2, 2, (1, s[1])),
                           jnp.float32) for s in (shapes[0], shapes[1], shapes[3])]
        fs = weighting.factors(nus)
        factors = [tuple(fs[0]), tuple(fs[1]), None, tuple(fs[2]), None, None]
    quants = [QuantConfig(bins=63, embedding_bins=63, protect_fraction=0.0, prune_fraction=0.0, step=s)
              for s in (1.0, 1.5, 4.0)] + [QuantConfig(bins=31, embedding_bins=125, protect_fraction=0.0,
                                                       prune_fraction=0.0, step=0.5)]
    cfg = ij.CompressionConfig()
    reference = quantize.residual_reference(xs, offs, factors, power)
    assert (reference is None) == (power == 1)
    fast = np.asarray(quantize.uniform_residual_scores(xs, offs, factors, lts, quants, cfg, reference))
    weights = [None] * len(xs) if factors is None else \
        quantize.map_by_device_set(weighting.inverse_multipliers, factors)
    seen = set()
    for q, f in zip(quants, fast):
        devs = quantize.encode_on_device(xs, [None] * len(xs), lts, q, cfg, offsets=offs,
                                         sigma=quantize.RESIDUAL_SIGMA, factors=factors, reference=reference)
        slow = float(search.proxy_degradation(xs, quantize.dequantize_all(devs, [x.dtype for x in xs]), weights,
                                              offs))
        assert 0 < slow < 2 and float(f) == pytest.approx(slow, rel=1e-5)
        seen.add(round(slow, 6))
    assert len(seen) == len(quants)  # the candidates differ
    with pytest.raises(ValueError, match="nothing protected or pruned"):
        quantize.uniform_residual_scores(xs, offs, factors, lts, [QuantConfig(step=1.0, protect_fraction=0.01)], cfg)


# ------------------------------------------------------------------------------------- through the handler
@pytest.fixture(scope="module")
def run():
    tx, ty, vx, vy = digits.load()
    state = digits.create_state(0)
    return state, digits.batches(tx, ty, 64, 0), (jnp.asarray(vx), jnp.asarray(vy))


def eval_loss(val):
    vx, vy = val
    return jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, vx, vy))


def manager(path, **cfg):
    # The paper's open-loop saves: every save searches the weights' space (test_closed_loop.py has the
    # residual saves' search).
    return ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(
        ij.CompressionConfig(**{"closed_loop": False, **cfg})))


def axes(q):
    return (q["bins"], -q["prune_fraction"], q["protect_fraction"])


@pytest.mark.slow  # 34 s; .ci/run runs it
def test_search_meets_epsilon_tightens_monotonically_and_resumes_after_a_restart(tmp_path, run):
    state, stream, val = run
    eval_fn = eval_loss(val)
    mngr = manager(tmp_path)
    records = []
    for step in range(4):
        for _ in range(15):
            state, _, grads = digits.train_step(state, *next(stream))
        mngr.save(step, args=ij.InshrinkSave(state, grads=grads, eval_fn=eval_fn))
        mngr.wait_until_finished()
        records.append(mngr.item_metadata(step)["search"])
    assert records[0]["mode"] == "exhaustive"
    assert all(r["mode"] in ("neighbourhood", "fallback") for r in records[1:])
    for r in records:
        assert r["degradation"] <= 0.05 and r["eval_fn_calls"] == r["candidates"] + 1
        assert r["quality"].startswith("eval_fn") and r["prune_metrics"] == ["magnitude", "sensitivity"]
    for a, b in zip(records, records[1:]):
        assert all(y >= x for x, y in zip(axes(a["chosen"]), axes(b["chosen"])))
    # The recorded degradation is what the restored parameters give.
    restored = mngr.restore(3, args=ij.InshrinkRestore(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        state)))
    q0, q = float(eval_fn(state)), float(eval_fn(restored))
    assert (q - q0) / abs(q0) == pytest.approx(records[3]["degradation"], abs=1e-6)
    # A restarted job (new handler) that restores goes on from the checkpoint's configuration.
    mngr2 = manager(tmp_path)
    mngr2.restore(3)
    mngr2.save(4, args=ij.InshrinkSave(state, grads=grads, eval_fn=eval_fn))
    mngr2.wait_until_finished()
    r = mngr2.item_metadata(4)["search"]
    assert r["mode"] in ("neighbourhood", "fallback")
    assert all(y >= x for x, y in zip(axes(records[3]["chosen"]), axes(r["chosen"])))


def test_without_eval_fn_or_grads_the_fallbacks_are_reported(tmp_path, run):
    state = run[0]
    mngr = manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(state))
    mngr.wait_until_finished()
    fig = mngr.item_metadata(0)
    assert fig["search"]["quality"].startswith("data-free proxy")
    assert fig["search"]["degradation"] <= ij.CompressionConfig().effective_proxy_budget
    assert fig["search"]["eval_fn_calls"] == 0 and fig["search"]["prune_metrics"] == ["magnitude"]
    assert fig["sensitivity"] == "magnitude (no grads given)"


def test_epsilon_zero_never_accepts_a_degradation(tmp_path, run):
    state = run[0]
    ref = jax.tree.map(np.asarray, state.params)

    def distance(s):  # any change of any parameter is a degradation
        return 1.0 + sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(s.params), jax.tree.leaves(ref)))

    mngr = manager(tmp_path, epsilon=0.0)
    with pytest.warns(UserWarning, match="no quantization configuration meets epsilon=0.0"):
        mngr.save(0, args=ij.InshrinkSave(state, eval_fn=distance))
        mngr.wait_until_finished()
    for step in (0, 1):
        if step:
            mngr.save(step, args=ij.InshrinkSave(state, eval_fn=distance))
        mngr.wait_until_finished()
        fig = mngr.item_metadata(step)
        assert fig["search"]["chosen"] == "lossless" and fig["quant"] is None
    # a later save probes only the least aggressive configuration (one prune metric without grads) and the two
    # fine uniform quantizers of the fallback: the baseline and three candidates
    assert fig["search"]["mode"] == "lossless" and fig["search"]["eval_fn_calls"] == 4
    restored = mngr.restore(1)
    for a, b in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_eval_fn_with_the_search_off_is_an_error(tmp_path):
    mngr = manager(tmp_path, search=False)
    with pytest.raises(ValueError, match="search=False"):
        mngr.save(0, args=ij.InshrinkSave({"params": {"w": jnp.ones((64, 32))}}, eval_fn=lambda s: 0.0))


@pytest.mark.parametrize("value", [jnp.ones(3), "0.5", None, {"loss": 0.5}, True, jnp.bool_(True)])
def test_eval_fn_must_return_a_real_number(tmp_path, value):
    mngr = manager(tmp_path)
    with pytest.raises(TypeError, match="eval_fn must return one real number"):
        mngr.save(0, args=ij.InshrinkSave({"params": {"w": jnp.ones((64, 32))}}, eval_fn=lambda s: value))
        mngr.wait_until_finished()  # the search runs in the background: its error surfaces here
    assert mngr.all_steps() == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_eval_fn_makes_only_that_save_lossless(tmp_path, run, bad):
    state, _, val = run
    grads = None
    eval_fn = eval_loss(val)
    answers = iter([bad])  # the uncompressed state of the first save only
    mngr = manager(tmp_path)
    with pytest.warns(UserWarning, match=f"eval_fn returned {bad} for the uncompressed state"):
        mngr.save(0, args=ij.InshrinkSave(state, grads=grads,
                                          eval_fn=lambda s: next(answers, None) or eval_fn(s)))
        mngr.wait_until_finished()
    fig = mngr.item_metadata(0)
    assert fig["search"]["mode"] == "unmeasured" and fig["quant"] is None and fig["search"]["eval_fn_calls"] == 1
    mngr.save(1, args=ij.InshrinkSave(state, grads=grads, eval_fn=eval_fn))
    mngr.wait_until_finished()
    fig = mngr.item_metadata(1)
    assert fig["search"]["mode"] == "exhaustive" and fig["quant"] is not None


def test_a_constant_eval_fn_or_an_inverted_direction_is_warned_about(tmp_path, run):
    state, _, val = run
    grads = None
    with pytest.warns(UserWarning, match="does not seem to depend on the state"):
        m = manager(tmp_path / "a")
        m.save(0, args=ij.InshrinkSave(state, grads=grads, eval_fn=lambda s: 0.25))
        m.wait_until_finished()
    reference = jax.tree.map(np.asarray, state.params)

    def negated_distance(s):  # a "loss" that falls as the state moves away: the direction is inverted
        return -1.0 - sum(jnp.sum(jnp.abs(a - b)) for a, b in zip(jax.tree.leaves(s.params),
                                                                   jax.tree.leaves(reference)))

    with pytest.warns(UserWarning, match="Is the direction right"):
        m = manager(tmp_path / "b")
        m.save(0, args=ij.InshrinkSave(state, grads=grads, eval_fn=negated_distance))
        m.wait_until_finished()


def test_a_fallback_recovers_across_a_resume(tmp_path, run):
    """A save where nothing meets the budget is lossless; after a restart and a restore, the next save whose
    quality allows compression compresses again."""
    state, _, val = run
    grads = None
    eval_fn = eval_loss(val)
    reference = jax.tree.map(np.asarray, state.params)
    harsh = {"on": True}

    def quality(s):  # while harsh: any change of a parameter costs more than epsilon
        if harsh["on"]:
            return 1.0 + sum(float(jnp.sum(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(s.params),
                                                                         jax.tree.leaves(reference)))
        return eval_fn(s)

    mngr = manager(tmp_path)
    with pytest.warns(UserWarning, match="no quantization configuration meets"):
        mngr.save(0, args=ij.InshrinkSave(state, grads=grads, eval_fn=quality))
        mngr.wait_until_finished()
    assert mngr.item_metadata(0)["quant"] is None
    harsh["on"] = False
    resumed = manager(tmp_path)  # a new process: restores step 0 (lossless), then saves
    restored = resumed.restore(0, args=ij.InshrinkRestore(state))
    resumed.save(1, args=ij.InshrinkSave(restored, grads=grads, eval_fn=quality))
    resumed.wait_until_finished()
    fig = resumed.item_metadata(1)
    assert fig["search"]["mode"] == "recovered" and fig["quant"] is not None and fig["ratio"]["params"] > 4


def test_embedding_bins_are_their_own_axis_only_when_there_are_embeddings():
    with_emb = search.Cube.build(SearchSpace(), True, QuantConfig())
    assert with_emb.names == ("bins", "prune_fraction", "protect_fraction", "embedding_bins")
    assert {with_emb.config(p, "magnitude").embedding_bins for p in [(0, 0, 0, 0), (0, 0, 0, 1)]} == {16, 32}
    assert "embedding_bins" not in CUBE.names and CUBE.base.embedding_bins == 32
    sizes, bits = {"dense": 1000, "embedding": 5000}, {"dense": 32, "embedding": 32}
    est = lambda p: search.estimated_ratio(with_emb.config(p, "magnitude"), sizes, bits)  # noqa: E731
    evaluate = lambda qs: [(0.0 if q.embedding_bins == 32 else 1.0, None) for q in qs]  # noqa: E731
    out = search.search(evaluate, with_emb, ["magnitude"], EPS, 4, est, None)
    points = itertools.product(*[range(len(v)) for v in with_emb.values])
    best = max(est(p) for p in points if with_emb.config(p, "magnitude").embedding_bins == 32)
    assert out.quant.embedding_bins == 32 and est(with_emb.point(out.quant)) == pytest.approx(best)


def test_a_negative_eval_fn_is_measured_relative_to_its_magnitude(tmp_path, run):
    """A loss below 0 (e.g. a shifted log-likelihood): degradation is (q - q0) / |q0|, so a worse (higher) value
    is a positive degradation and the budget holds; the recorded figure is what the restored state gives."""
    state, _, val = run
    base = eval_loss(val)
    eval_fn = jax.jit(lambda s: base(s) - 5.0)
    mngr = manager(tmp_path)
    mngr.save(0, args=ij.InshrinkSave(state, eval_fn=eval_fn))
    mngr.wait_until_finished()
    rec = mngr.item_metadata(0)["search"]
    assert rec["baseline"] < 0 and 0 <= rec["degradation"] <= ij.CompressionConfig().epsilon
    restored = mngr.restore(0, args=ij.InshrinkRestore(state))
    q0, q = float(eval_fn(state)), float(eval_fn(restored))
    assert (q - q0) / abs(q0) == pytest.approx(rec["degradation"], abs=1e-6)


def _weights_and_error():
    """A two-tensor state and its relative squared error function (what the data-free proxy is without
    gradients)."""
    rng = np.random.default_rng(1)
    state = {"params": {"w": jnp.asarray(rng.standard_t(4, (256, 128)), jnp.float32),
                        "v": jnp.asarray(rng.standard_normal((128, 96)), jnp.float32)}}
    ref = jax.tree.map(np.asarray, state)
    energy = sum(float(np.sum(b.astype(np.float64) ** 2)) for b in jax.tree.leaves(ref))
    return state, lambda s: sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(ref))) / energy


def _first_save(path, state, eval_fn, **cfg):
    """(the restored state's relative error, the search record) of one save with `eval_fn`."""
    mngr = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(**cfg)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 'measured much better' warning of _check_eval_fn
        mngr.save(0, args=ij.InshrinkSave(state, eval_fn=eval_fn))
    mngr.wait_until_finished()
    return mngr.restore(0), mngr.item_metadata(0)["search"]


def test_a_reading_far_better_than_the_uncompressed_state_must_also_meet_the_data_free_bound(tmp_path):
    """The paper's saves (open loop) with an eval_fn that a perturbation of the weights improves (1 - 10x the
    weights' relative squared error): every candidate reads better than the uncompressed state, the coarsest
    most. A reading better by more than epsilon is taken only where the data-free proxy (the relative error, no
    gradients given) is within `effective_proxy_budget` too, so the choice's error is within epsilon; a milder
    eval_fn (1 - 0.2x the error) reads better by less than epsilon everywhere and keeps the most aggressive
    choice."""
    state, error = _weights_and_error()
    chosen = {}
    for gain in (10.0, 0.2):
        restored, rec = _first_save(tmp_path / str(gain), state, lambda s, gain=gain: 1.0 - gain * error(s),
                                    closed_loop=False)
        e = float(error(restored))
        assert rec["degradation"] == pytest.approx(-gain * e, rel=1e-4, abs=1e-7)  # the eval_fn's own reading
        chosen[gain] = (e, rec["chosen"]["bins"])
    epsilon = ij.CompressionConfig().epsilon
    assert chosen[10.0][0] <= epsilon  # a 4-level candidate (about 0.1) read 'better' by 100% and was refused
    assert chosen[0.2][0] > epsilon and chosen[0.2][1] < chosen[10.0][1]


def test_a_closed_loop_keyframe_meets_the_data_free_bound_whatever_the_eval_fn_allows(tmp_path):
    """An eval_fn that hardly sees the weights (1 + 1e-6 x their relative squared error) allows every candidate.
    The paper's saves (open loop) then take the most aggressive; a closed-loop chain's keyframe is held to the
    data-free bound as well (relative error within `effective_proxy_budget`, epsilon by default), and its
    recorded degradation is still the eval_fn's reading."""
    state, error = _weights_and_error()
    eval_fn = lambda s: 1.0 + 1e-6 * float(error(s))  # noqa: E731  (a Python float: 1 + 1e-8 is exact enough)
    open_, rec_open = _first_save(tmp_path / "open", state, eval_fn, closed_loop=False)
    closed, rec = _first_save(tmp_path / "closed", state, eval_fn)
    assert rec["coding"] == "keyframe" and rec["quality"] == ("eval_fn, lower is better, within the data-free "
                                                              "bound 0.01 (a closed-loop keyframe)")
    assert float(error(open_)) > 0.05  # the coarsest candidates
    e = float(error(closed))
    assert 0 < e <= ij.CompressionConfig().effective_proxy_budget
    assert rec["degradation"] == pytest.approx(1e-6 * e, rel=1e-3)
    loose, _ = _first_save(tmp_path / "loose", state, eval_fn, epsilon=0.05)  # the bound follows the knob
    assert ij.CompressionConfig().effective_proxy_budget < float(error(loose)) <= 0.05


@pytest.mark.parametrize("misleading", [False, True])
def test_a_large_states_first_search_runs_on_row_samples_and_measures_its_choice_whole(tmp_path, monkeypatch,
                                                                                      misleading):
    """A first keyframe without eval_fn over a large state (constants lowered here) searches on row samples of
    its large tensors: only the chosen configuration is encoded whole, and the recorded degradation is the
    proxy of what the step restores to, within the budget. A sample that misleads (here: all zeros, which any
    configuration quantizes exactly) leads to the exact search, started from the sample's choice."""
    monkeypatch.setattr(search, "SCORED_WITHOUT_ENCODING", 1000)
    monkeypatch.setattr(search, "SEARCH_SAMPLE", 20_000)
    if misleading:
        monkeypatch.setattr(search, "_row_sample", lambda x: None if x is None else jnp.zeros_like(x[:100]))
    w = jnp.asarray(np.random.default_rng(3).standard_t(3, (3000, 64)).astype(np.float32) * 0.02)
    state = {"w": w, "b": jnp.zeros(64)}
    shapes = []
    real = quantize.encode_on_device
    monkeypatch.setattr(quantize, "encode_on_device",
                        lambda xs, *a, **k: shapes.append(tuple(xs[0].shape)) or real(xs, *a, **k))
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig()))
    mngr.save(0, args=ij.InshrinkSave(state))
    mngr.wait_until_finished()
    rec = mngr.item_metadata(0)["search"]
    assert "row samples" in rec["sampled"] and rec["mode"] == "exhaustive"
    whole = [s for s in shapes if s == w.shape]
    assert len(whole) > 1 if misleading else len(whole) == 1  # misleading: the exact search ran
    assert len(whole) < len(shapes)  # the other candidates were encoded on the samples
    restored = mngr.restore(0)["w"]
    proxy = float(search.proxy_degradation([w], [restored], [None]))
    assert rec["degradation"] == pytest.approx(proxy, rel=1e-5)
    assert proxy <= ij.CompressionConfig().effective_proxy_budget


def test_a_keyframe_that_no_configuration_of_the_space_holds_takes_a_fine_uniform_quantizer(tmp_path):
    """Nothing in the paper's space (32 levels at most) meets the budget, the fine uniform quantizer does: the
    keyframe is stored at 254 cells of 1/20 of each tensor's RMS (the 1/8 cells measured over budget), not
    losslessly, and the recorded degradation is what its restore gives."""
    rng = np.random.default_rng(0)
    state = {"params": {"w": jnp.asarray(rng.standard_normal((256, 128)), jnp.float32),
                        "v": jnp.asarray(rng.standard_t(4, (128, 96)), jnp.float32)}}
    ref = jax.tree.map(np.asarray, state)

    def relative_error(s):  # 1 + squared error relative to the weights' energy
        err = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(ref)))
        return 1.0 + err / sum(float(np.sum(b.astype(np.float64) ** 2)) for b in jax.tree.leaves(ref))

    epsilon = 5e-4  # 1/8-RMS cells: about 0.125^2 / 12 = 1.3e-3; 1/20: about 2e-4
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler(
        ij.CompressionConfig(epsilon=epsilon)))
    mngr.save(0, args=ij.InshrinkSave(state, eval_fn=relative_error))
    mngr.wait_until_finished()
    fig = mngr.item_metadata(0)
    chosen = fig["search"]["chosen"]
    assert fig["search"]["mode"] == "fine" and (chosen["bins"], chosen["step"]) == (254, 0.05)
    assert fig["search"]["eval_fn_calls"] == fig["search"]["candidates"] + 1
    assert 0 < fig["search"]["degradation"] <= epsilon
    restored = mngr.restore(0)
    assert float(relative_error(restored)) - 1.0 == pytest.approx(fig["search"]["degradation"], rel=1e-4)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(ref)):
        # well inside the cells' range (+-6 RMS of the quantized values, the protected 1% left out): a value's
        # level is the centre of its cell, at most half a cell away; the cells are at most 1/20 of the whole RMS
        rms = np.sqrt(np.mean(b.astype(np.float64) ** 2))
        inside = np.abs(b) < 4 * rms
        err = np.abs(np.asarray(a) - b)
        assert np.max(err[inside]) <= 0.05 * rms and np.mean(err[inside]) <= 0.25 * 0.05 * rms * 1.2
    assert fig["ratio"]["params"] > 3  # lossless float32 would be about 1.1x


@pytest.mark.slow  # 30 s; .ci/run runs it
def test_epsilon_is_the_knob_of_a_saves_bytes(tmp_path, run):
    """One save of a trained digits CNN (a keyframe) at the tightest (0.001), the default (0.01) and the loosest
    (0.05) epsilon: bytes fall as epsilon loosens, the loosest writes less than 0.7x the tightest's, and each
    save's degradation, measured on its restore, is the recorded one and within its epsilon."""
    state, stream, val = run
    eval_fn = eval_loss(val)
    sens = ij.GradientEMA(every=50)
    ema = sens.init(state.params)
    for _ in range(150):
        state, _, grads = digits.train_step(state, *next(stream))
        ema = sens.update(ema, grads)
    q0 = float(eval_fn(state))
    written = {}
    for eps in (0.001, 0.01, 0.05):
        root = tmp_path / str(eps)
        mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(epsilon=eps)))
        mngr.save(0, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
        mngr.wait_until_finished()
        fig = mngr.item_metadata(0)["search"]
        restored = mngr.restore(0, args=ij.InshrinkRestore(state))
        measured = (float(eval_fn(restored)) - q0) / abs(q0)
        assert measured == pytest.approx(fig["degradation"], abs=1e-6) and measured <= eps
        written[eps] = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert written[0.001] > written[0.01] > written[0.05]
    assert written[0.05] < 0.7 * written[0.001]


RESIDUAL_CUBE = search.Cube.build(config.KMEANS_RESIDUAL_SPACE, True, QuantConfig(), residual=True)
RESIDUAL_POINTS = list(itertools.product(*[range(len(v)) for v in RESIDUAL_CUBE.values]))


def test_the_residual_width_power_splits_the_error_between_tensors():
    """A closed-loop residual save of two tensors whose residuals differ 10x in RMS, the default residual space
    and budget (0.2 of the state's residual energy): at power 1 each tensor keeps about the same share of its own
    residual's energy as error; at power 0 one width serves both, so the tensor that moved little is hardly coded
    (nearly all its codes the zero cell: its residual is the error the next save carries) and the one that moved
    a lot takes cells finer than its own RMS gives; 0.5 lies between. The total within the budget every time, the
    codes' order-0 entropy falling with the power, and the search's measurement is its encoding's."""
    rng = np.random.default_rng(4)
    offs = [jnp.asarray(rng.standard_normal((128, 64)).astype(np.float32) * 0.05) for _ in range(2)]
    xs = [o + jnp.asarray(rng.standard_normal(o.shape).astype(np.float32) * a) for o, a in zip(offs, (1e-2, 1e-1))]
    shares, bits = {}, {}
    for power in (1.0, 0.5, 0.0):
        cfg = ij.CompressionConfig(residual_width_power=power)
        outcome, _ = search.choose(list(xs), None, [0, 1], [None] * 2, ["dense", "dense"], cfg, None, None,
                                   offsets=offs, residual=True)
        assert (outcome.reference is None) == (power == 1)
        decoded = quantize.dequantize_all(outcome.payload, [x.dtype for x in xs])
        shares[power] = [float(jnp.sum((x - d) ** 2) / jnp.sum((x - o) ** 2)) for x, d, o in zip(xs, decoded, offs)]
        total = float(search.proxy_degradation(xs, decoded, [None] * 2, offs))
        assert outcome.degradation == pytest.approx(total, rel=1e-5) and total <= cfg.effective_residual_budget
        codes = [np.asarray(dev.codes) for dev in outcome.payload]
        bits[power] = [8 * codec.order0_entropy_bytes(c) for c in codes]
        if power == 0:
            assert bits[0.0][0] < 0.01 * 8192
    small, large = zip(*(shares[p] for p in (1.0, 0.5, 0.0)))
    assert 0.05 < small[0] < 0.25 and 0.05 < large[0] < 0.25 and max(shares[1.0]) / min(shares[1.0]) < 1.2
    assert small[0] < small[1] < small[2] and small[2] > 0.95
    assert large[0] > large[1] >= large[2]
    assert sum(bits[1.0]) > sum(bits[0.5]) > sum(bits[0.0])


@given(st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3), st.floats(0.02, 0.6), st.sampled_from([1, 2, 4]))
def test_the_residual_search_does_not_take_pruning_to_cost_quality(noise, budget, batch):
    """A closed-loop residual's error falls with more levels but not always with less pruning (a pruned residual
    is a level at 0): the search infers along the levels only, and finds the best configuration within the budget
    whatever the pruning does."""
    # Error: falling with the levels, times a factor per prune fraction in any order.
    error = {p: 0.6 / RESIDUAL_CUBE.values[0][p[0]] * (0.3 + 2 * noise[p[1]]) for p in RESIDUAL_POINTS}
    calls = []

    def evaluate(quants):
        calls.append(list(quants))
        return [(error[RESIDUAL_CUBE.point(q)], q) for q in quants]

    def est(p):
        return search.estimated_ratio(RESIDUAL_CUBE.config(p, "magnitude"), {"dense": 1000}, {"dense": 32})

    out = search.search(evaluate, RESIDUAL_CUBE, ["magnitude"], budget, batch, est, None)
    feasible = [p for p in RESIDUAL_POINTS if error[p] <= budget]
    if not feasible:
        assert out.quant is None
    else:
        assert RESIDUAL_CUBE.point(out.quant) == max(feasible, key=lambda p: (est(p), -error[p]))
    evaluated = [q for c in calls for q in c]
    assert len(evaluated) == len(set(evaluated)) == out.evaluations <= len(RESIDUAL_POINTS)


def test_the_residual_cube_orders_quality_along_the_levels_only():
    top = RESIDUAL_CUBE.top
    names = RESIDUAL_CUBE.names
    assert dict(zip(names, RESIDUAL_CUBE.ordered)) == {"bins": True, "prune_fraction": False,
                                                       "protect_fraction": True, "embedding_bins": True}
    assert all(search.Cube.build(SearchSpace(), True, QuantConfig()).ordered)
    assert RESIDUAL_CUBE.below((0, 1, 0, 0), top[:1] + (1, 0, 0)) and not RESIDUAL_CUBE.below((0, 1, 0, 0), top)


@pytest.mark.parametrize("per_round", [1, 2, 4])
@pytest.mark.parametrize("n", range(0, 13))
def test_the_ladder_search_finds_the_most_aggressive_rung_within_the_budget(n, per_round):
    """`search._first_within` over a ladder of n rungs whose quality rises along it, for every boundary (the
    first rung within the budget; n: none), measuring `per_round` rungs a round: it returns that rung after at
    most ceil(log_(per_round + 1)(n + 1)) rounds of at most `per_round` rungs each (per_round 1: bisection), or
    where none is within, the measured one of least degradation (the rung below the ladder included), keeping
    the payload of the returned one only."""
    for boundary in range(n + 1):
        calls = []

        def measure(qs):
            assert 1 <= len(qs) <= per_round and list(qs) == sorted(set(qs))
            calls.extend(qs)
            return [((0.5 if q >= boundary else 2.0 + q * 0.1 if q % 2 else 2.0 - q * 0.01), f"payload {q}")
                    for q in qs]

        below = (3.0, "payload below")
        k, within, measured, rounds = search._first_within(measure, list(range(n)), 1.0, below=below,
                                                           per_round=per_round)
        assert within == (boundary < n) and measured[-1][0] == 3.0
        assert k == (boundary if boundary < n else min(measured, key=lambda i: measured[i][0]))
        bound = 0 if n == 0 else math.ceil(math.log(n + 1, per_round + 1) - 1e-9)
        assert len(calls) == len(set(calls)) == len(measured) - 1 and rounds <= bound
        assert {i for i, (_, p) in measured.items() if p is not None} == {k}  # only the chosen payload kept
        if within:
            assert measured[k] == (0.5, f"payload {k}")
            assert k == 0 or k - 1 in measured  # its more aggressive neighbour measured over the budget
        assert search._first_within(measure, [], 1.0, below=below, per_round=per_round)[:2] == (-1, False)


@pytest.mark.parametrize("passes_from, expected", [(2.0, 2.0), (3.0, 3.0), (1.0, 1.0), (0.5, 0.5), (0.1, 0.25)])
def test_the_guard_takes_the_most_aggressive_residual_cells_the_eval_fn_accepts(passes_from, expected):
    """A residual save's choice (cells of 4 RMS) that the eval_fn reads over epsilon: the guard takes the widest
    cells it reads within epsilon, the space's (3 to 1 RMS) or finer ones beyond it (0.5, 0.25), not the
    space's least aggressive configuration; where nothing is within, the best measured (here the finest)."""
    cube = search.Cube.build(config.RESIDUAL_SPACE, False, QuantConfig(), residual=True)
    choice = cube.config((0,) * len(cube.names), "magnitude")
    assert choice.step == 4.0
    seen = []

    def checker(qs):
        [q] = qs
        seen.append(q.step)
        return [((0.005 if q.step <= passes_from else 0.02 + q.step / 100), q.step)]

    out = search._guard(checker, search.Outcome(choice, 0.001, "neighbourhood", 3, 1), cube, "magnitude", 0.01,
                        config.CompressionConfig().bins_capacity)
    assert out.quant.step == expected and out.payload == expected and out.mode == "guarded"
    assert out.evaluations == 3 + len(seen) and len(seen) <= 1 + math.ceil(math.log2(10))
    if expected != 0.25 or passes_from >= 0.25:
        assert out.degradation == 0.005


def _large_residual_state(monkeypatch, seed: int) -> tuple[list, list, list]:
    """(shapes, offsets, states) of a closed-loop residual save that counts as a large state (the search's
    `SCORED_WITHOUT_ENCODING` and `SEARCH_SAMPLE` lowered): Student-t weights moved by a small Gaussian step."""
    monkeypatch.setattr(search, "SCORED_WITHOUT_ENCODING", 1 << 12)
    monkeypatch.setattr(search, "SEARCH_SAMPLE", 1 << 10)
    rng = np.random.default_rng(seed)
    shapes = [(256, 64), (128, 96), (64,)]
    offs = [jnp.asarray(rng.standard_t(3, s).astype(np.float32) * 0.02) for s in shapes]
    xs = [o + jnp.asarray(rng.standard_normal(s).astype(np.float32) * 1e-3) for o, s in zip(offs, shapes)]
    return shapes, offs, xs


@pytest.mark.parametrize("misled", [False, True])
def test_a_large_residual_save_is_searched_on_row_samples_and_its_choice_measured_whole(monkeypatch, misled):
    """A closed-loop residual save of a large state (`SCORED_WITHOUT_ENCODING`, `SEARCH_SAMPLE`: lowered here)
    searches its candidates on row samples, then encodes the choice and measures it on the whole state: the
    outcome carries that encoding, and its degradation is exactly the whole state's proxy of it; the same choice
    as the exact search. `misled`: the samples are of another state, whose heavy-tailed residual takes cells of 4
    RMS; on the whole state (Gaussian residuals) they exceed the budget, and the first of the less aggressive
    cells within the budget on the whole state is taken (mode "ladder": cells of 1.5 RMS, the exact search's
    choice)."""
    shapes, offs, xs = _large_residual_state(monkeypatch, 0)
    rng = np.random.default_rng(10)
    if misled:
        heavy = [o + jnp.asarray(rng.standard_normal(s).astype(np.float32) * 1e-3 *
                                 np.where(rng.random(s) < 0.05, 30.0, 1.0)) for o, s in zip(offs, shapes)]
        sampled = search._sampled_evaluator
        monkeypatch.setattr(search, "_sampled_evaluator",
                            lambda small, t, q, *a: sampled(search._row_samples(heavy, q, None)[0], t, q, *a))
    lts = ["dense", "dense", "other"]
    cfg = ij.CompressionConfig()

    def run():
        return search.choose(list(xs), None, [0, 1, 2], [None] * 3, lts, cfg, None, None, offsets=offs,
                             residual=True)

    outcome, record = run()
    assert "sampled" in record
    if misled:  # the ladder's choice, scored without encoding (encoded when saved)
        assert outcome.mode == "ladder" and outcome.payload is None and outcome.decoded is None
        assert outcome.degradation <= cfg.effective_residual_budget
    else:
        decoded = quantize.dequantize_all(outcome.payload, [x.dtype for x in xs])
        whole = float(search.proxy_degradation(xs, decoded, [None] * 3, offs))
        assert outcome.degradation == pytest.approx(whole, rel=1e-6) and whole <= cfg.effective_residual_budget
        # Its decoded leaves come with it (the save keeps them as its reconstruction), bit for bit a decode's.
        for kept, again in zip(outcome.decoded, decoded):
            np.testing.assert_array_equal(np.asarray(kept).view(np.uint32), np.asarray(again).view(np.uint32))
    monkeypatch.setattr(search, "SCORED_WITHOUT_ENCODING", 1 << 30)  # the exact search
    exact, exact_record = run()
    assert "sampled" not in exact_record and outcome.quant == exact.quant and exact.quant.step == 1.5
    # The sampled search's five candidates in two rounds, its choice measured whole, then (misled) the ladder of
    # cells of 3, 2.5, 2, 1.75, 1.5, 1.25 and 1 RMS, then 0.5 and 0.25, four rungs a round: 2.5, 1.75, 1.25 and
    # 0.5 (1.75 over the budget, 1.25 within), then 1.5.
    assert (record["candidates"], record["rounds"]) == ((11, 5) if misled else (6, 3))


def test_a_large_residual_save_goes_finer_on_row_samples_then_measures_the_choice_whole(monkeypatch):
    """A large state's residual save whose space has nothing within the budget (epsilon 0.002: a budget of 0.04
    of the residual's squared error, which cells of 1 RMS do not meet) looks for finer cells on the row samples
    too (`_finer_residual` on the sampled evaluator, both rungs of its ladder in one round), then encodes that
    choice once on the whole state: no candidate is scored on the whole state, and the choice is the exact
    search's (the same save without sampling)."""
    shapes, offs, xs = _large_residual_state(monkeypatch, 1)
    whole_size = sum(int(np.prod(s)) for s in shapes)
    scored = []
    scores = quantize.uniform_residual_scores

    def spy(xs_, *a, **k):
        scored.append(sum(int(np.prod(x.shape)) for x in xs_))
        return scores(xs_, *a, **k)

    monkeypatch.setattr(quantize, "uniform_residual_scores", spy)
    cfg = ij.CompressionConfig(epsilon=0.002)

    def run():
        return search.choose(list(xs), None, [0, 1, 2], [None] * 3, ["dense", "dense", "other"], cfg, None, None,
                             offsets=offs, residual=True)

    outcome, record = run()
    assert "sampled" in record and outcome.mode == "finer" and outcome.quant.step < 1.0
    assert scored and all(n < whole_size for n in scored)  # every scoring on the samples
    assert outcome.payload is not None and outcome.degradation <= cfg.effective_residual_budget
    decoded = quantize.dequantize_all(outcome.payload, [x.dtype for x in xs])
    assert outcome.degradation == pytest.approx(float(search.proxy_degradation(xs, decoded, [None] * 3, offs)),
                                                rel=1e-6)
    monkeypatch.setattr(search, "SCORED_WITHOUT_ENCODING", 1 << 30)  # the exact search
    exact, exact_record = run()
    assert "sampled" not in exact_record and exact.mode == "finer" and exact.quant == outcome.quant


def test_a_sampled_choice_that_fails_on_the_whole_state_ends_at_the_least_error_measured(monkeypatch):
    """Samples of an easy residual (Gaussian: cells of 0.5 RMS meet epsilon 0.002's budget there) and a whole
    state that nothing can meet (a few values 10^4 times the others, beyond every cell's range): the sampled
    choice fails on the whole state, its ladder (the 249 cells of 0.25 RMS) fails too, and the save takes the one
    of least error measured on the whole state (mode "least aggressive"), over the budget, never lossless; where
    that is the sampled choice, its encoding and decode come with it."""
    monkeypatch.setattr(search, "SCORED_WITHOUT_ENCODING", 1 << 12)
    monkeypatch.setattr(search, "SEARCH_SAMPLE", 1 << 10)
    rng = np.random.default_rng(2)
    shapes = [(256, 64), (128, 96)]
    offs = [jnp.asarray(rng.standard_t(3, s).astype(np.float32) * 0.02) for s in shapes]
    easy = [o + jnp.asarray(rng.standard_normal(s).astype(np.float32) * 1e-3) for o, s in zip(offs, shapes)]
    xs = [o + jnp.asarray(rng.standard_normal(s).astype(np.float32) * 1e-3 * np.where(rng.random(s) < 1e-3, 1e4, 1.0))
          for o, s in zip(offs, shapes)]
    sampled = search._sampled_evaluator
    monkeypatch.setattr(search, "_sampled_evaluator",
                        lambda small, t, q, *a: sampled(search._row_samples(easy, q, None)[0], t, q, *a))
    # Each tensor's cells relative to its own residual: the whole state's outliers would otherwise widen the
    # samples' cells too (the width reference is the whole state's), which is not what this test is about.
    cfg = ij.CompressionConfig(epsilon=0.002, residual_width_power=1.0)
    outcome, record = search.choose(list(xs), None, [0, 1], [None] * 2, ["dense", "dense"], cfg, None, None,
                                    offsets=offs, residual=True)
    assert outcome.mode == "least aggressive" and outcome.degradation > cfg.effective_residual_budget
    assert (outcome.quant.bins, outcome.quant.step) in ((125, 0.5), (249, 0.25))
    # On the samples: the space's four candidates in one round, then the finer cells' two in one; the sampled
    # choice (125 cells) measured whole; then its ladder's one rung (249 cells) in one round.
    assert (record["candidates"], record["rounds"]) == (8, 4)
    scores = [float(quantize.uniform_residual_scores(xs, offs, None, ["dense", "dense"], [q] * 4, cfg)[0])
              for q in (dataclasses.replace(outcome.quant, bins=125, embedding_bins=125, step=0.5),
                        dataclasses.replace(outcome.quant, bins=249, embedding_bins=249, step=0.25))]
    assert outcome.degradation == pytest.approx(min(scores), rel=1e-5)
    assert (outcome.payload is not None and outcome.decoded is not None) == (outcome.quant.step == 0.5)


def test_a_large_residual_save_keeps_its_previous_choice_after_one_whole_measurement(monkeypatch):
    """A large state's residual save searched on row samples records how many times its choice's error the next
    wider cells' was there ("wider"); the next save, given it back as `hint`, measures its previous choice on the
    whole state once and keeps it (mode "kept": one candidate, one round, no scoring on the samples, its encoding
    and decode kept) where that error times the ratio is over the budget by `KEPT_MARGIN`: the exact search's
    choice, measured exactly as a decode of its encoding scores. The search runs again where the hint is
    `KEPT_AT_MOST` saves old, where the prediction leaves the wider cells within reach, or without a hint; a
    previous choice it measured and then chose is not measured twice."""
    shapes, offs, xs = _large_residual_state(monkeypatch, 0)
    scored = []
    scores = quantize.uniform_residual_scores
    monkeypatch.setattr(quantize, "uniform_residual_scores", lambda *a, **k: scored.append(1) or scores(*a, **k))
    lts = ["dense", "dense", "other"]
    cfg = ij.CompressionConfig()
    budget = cfg.effective_residual_budget

    def run(previous=None, hint=None):
        return search.choose(list(xs), None, [0, 1, 2], [None] * 3, lts, cfg, None, previous, offsets=offs,
                             residual=True, hint=hint)

    first, record = run()
    assert first.quant.step == 1.5 and record["wider"]["saves"] == 0
    wider = dataclasses.replace(first.quant, step=1.75)
    # the samples scored as the search scored them: with its width reference (the samples' residual RMS)
    assert first.reference is not None
    small, small_offs = search._row_samples(list(xs), [0, 1, 2], offs)
    sampled = search._sampled_evaluator(small, None, [0, 1, 2], [None] * 3, lts, cfg, small_offs, False, True,
                                        first.reference)
    expect = sampled([wider])[0][0] / sampled([first.quant])[0][0]
    assert record["wider"]["ratio"] == pytest.approx(expect, rel=1e-6) and expect > 1
    scored.clear()
    kept, kept_record = run(first.quant, record["wider"])
    assert (kept.mode, kept.quant, kept.evaluations, kept.rounds) == ("kept", first.quant, 1, 1) and not scored
    assert kept.degradation * record["wider"]["ratio"] > budget * search.KEPT_MARGIN
    assert kept_record["wider"] == {"ratio": record["wider"]["ratio"], "saves": 1} and "kept" in kept_record["sampled"]
    decoded = quantize.dequantize_all(kept.payload, [x.dtype for x in xs])
    assert kept.degradation == pytest.approx(float(search.proxy_degradation(xs, decoded, [None] * 3, offs)), rel=1e-6)
    for a, b in zip(kept.decoded, decoded):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    for hint in ({"ratio": record["wider"]["ratio"], "saves": search.KEPT_AT_MOST},  # too old
                 # wider cells within reach (just: at the boundary itself float rounding decides)
                 {"ratio": 0.999 * budget * search.KEPT_MARGIN / kept.degradation, "saves": 0},
                 None):
        scored.clear()
        again, again_record = run(first.quant, hint)
        assert again.mode != "kept" and again.quant == first.quant and scored
        assert again_record["wider"]["saves"] == 0
        # the sampled search's three candidates in one round, the choice measured whole once (by the kept check
        # where it made one)
        assert (again.evaluations, again.rounds) == (4, 2)
    monkeypatch.setattr(search, "SCORED_WITHOUT_ENCODING", 1 << 30)  # the exact search: the same choice
    exact, exact_record = run(first.quant, record["wider"])
    assert exact.quant == first.quant and exact.mode != "kept" and "wider" not in exact_record
