import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inshrink_jax import kmeans, sketch

SPEC = sketch.SketchSpec(0.01)


def optimal_kmeans_loss(x, w, k):
    """Exact optimum of weighted 1-D k-means by dynamic programming over sorted points (O(k m^2))."""
    order = np.argsort(x)
    x, w = x[order].astype(np.float64), w[order].astype(np.float64)
    m = x.size
    cw, cwx, cwx2 = (np.concatenate([[0.0], np.cumsum(v)]) for v in (w, w * x, w * x * x))

    def cost(i, j):  # points i..j-1 (vectorised over i)
        sw = cw[j] - cw[i]
        swx = cwx[j] - cwx[i]
        return np.where(sw > 0, (cwx2[j] - cwx2[i]) - swx * swx / np.where(sw > 0, sw, 1.0), 0.0)

    best = np.array([cost(0, j) for j in range(m + 1)])
    for _ in range(1, k):
        best = np.array([np.min(best[: j + 1] + cost(np.arange(j + 1), j)) for j in range(m + 1)])
    return best[m]


@pytest.mark.parametrize("k", [2, 3, 4, 6, 8])
def test_weighted_bucket_loss_near_optimal(k):
    ratios = []
    for seed in range(12):
        rng = np.random.default_rng(seed)
        x = (rng.standard_t(3, 300) * 0.1).astype(np.float32)
        counts = sketch.histogram(jnp.asarray(x), SPEC)
        values = jnp.asarray(SPEC.representatives())
        w = kmeans.bucket_weights(counts, values, 0.2)
        c = kmeans.histogram_kmeans(counts, SPEC, k, 0.2, jax.random.PRNGKey(seed), restarts=3)
        got = float(kmeans.loss(values, w, c))
        nz = np.asarray(w) > 0
        opt = optimal_kmeans_loss(np.asarray(values)[nz], np.asarray(w)[nz], k)
        ratios.append(got / opt if opt > 0 else 1.0)
    assert np.mean(ratios) <= 1.1, ratios


@pytest.mark.parametrize("k", [2, 4, 8])
def test_raw_data_loss_near_optimal_with_count_weights(k):
    # sigma = 1 weighs buckets by count only: the plain k-means objective, solved on the sketch.
    ratios = []
    for seed in range(12):
        x = (np.random.default_rng(100 + seed).standard_t(3, 250) * 0.1).astype(np.float32)
        c = np.asarray(kmeans.histogram_kmeans(sketch.histogram(jnp.asarray(x), SPEC), SPEC, k, 1.0,
                                               jax.random.PRNGKey(seed), restarts=3))
        got = float(np.sum((x - c[np.asarray(kmeans.assign(jnp.asarray(x), jnp.asarray(c)))]) ** 2))
        ratios.append(got / optimal_kmeans_loss(x, np.ones_like(x), k))
    assert np.mean(ratios) <= 1.1, ratios


@pytest.mark.parametrize("k", [2, 3, 5, 7, 12, 32])
def test_centres_sorted_finite_any_k(k):
    x = jnp.asarray(np.random.default_rng(k).normal(size=5000).astype(np.float32))
    c = np.asarray(kmeans.histogram_kmeans(sketch.histogram(x, SPEC), SPEC, k, 0.2, jax.random.PRNGKey(0)))
    assert c.shape == (k,) and np.all(np.isfinite(c)) and np.all(np.diff(c) >= 0)
    assert np.unique(c).size == k  # 5000 distinct values: no centre wasted


def test_fewer_distinct_values_than_k():
    x = jnp.asarray([0.5, 0.5, -1.0, 2.0] * 10, jnp.float32)
    c = np.asarray(kmeans.histogram_kmeans(sketch.histogram(x, SPEC), SPEC, 8, 0.2, jax.random.PRNGKey(0)))
    assert np.all(np.isfinite(c)) and np.all(np.diff(c) >= 0)
    reps = SPEC.representatives()[np.asarray(sketch.bucket_index(x, SPEC))]
    assert set(np.unique(reps)) <= set(c)  # each distinct value has its own centre


def test_empty_data_gives_zero_centres():
    c = kmeans.histogram_kmeans(jnp.zeros(SPEC.num_buckets, jnp.int32), SPEC, 4, 0.2, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(c), np.zeros(4))


def test_deterministic_given_key():
    x = jnp.asarray(np.random.default_rng(5).normal(size=3000).astype(np.float32))
    h = sketch.histogram(x, SPEC)
    a = kmeans.histogram_kmeans(h, SPEC, 6, 0.2, jax.random.PRNGKey(7))
    b = kmeans.histogram_kmeans(h, SPEC, 6, 0.2, jax.random.PRNGKey(7))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_range_sums_keep_a_tiny_range_after_large_sums():
    """The prefix sums Lloyd's iterations take range sums from: a range of small weights far along a vector of
    large ones keeps float32's relative precision of its own sum (a plain float32 cumsum's difference does not)."""
    rng = np.random.default_rng(0)
    x = (rng.random(SPEC.num_buckets) ** 8).astype(np.float32)
    x[rng.random(x.size) < 0.7] = 0
    x[5000:5010] = 1e-5
    x[12000:12003] = -3e-4  # signed, as the weighted sums of negative values are
    exact = np.concatenate([[0.0], np.cumsum(x.astype(np.float64))])
    ends = np.array([5000, 5010, 12000, 12003, x.size])
    want = np.diff(np.concatenate([[0.0], exact[ends]]))
    got = np.asarray(kmeans.range_sums(kmeans.prefix_sums(jnp.asarray(x)), jnp.asarray(ends, jnp.int32)))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain = np.concatenate([[0.0], np.cumsum(x)]).astype(np.float32)
    assert abs((plain[5010] - plain[5000]) - want[1]) > 1e-3 * want[1]  # what the pairs guard against


@pytest.mark.parametrize("seed", range(6))
def test_lloyd_iterations_match_a_float64_reference(seed):
    """Lloyd's iterations from the same start, against NumPy in float64 with the same assignment (a point on a
    midpoint goes to the lower centre) and the same stopping rule (here: a fixed number of iterations)."""
    rng = np.random.default_rng(seed)
    points = np.sort(rng.standard_t(3, 2000)).astype(np.float32)
    weights = np.where(rng.random(2000) < 0.3, 0.0, rng.random(2000) ** 2).astype(np.float32)
    start = np.concatenate([np.sort(rng.choice(points, 5, replace=False)), np.full(3, np.inf)]).astype(np.float32)
    c = start.astype(np.float64)
    for _ in range(7):
        mids = 0.5 * (c[1:] + c[:-1])
        a = np.searchsorted(mids, points, side="left")
        wsum = np.bincount(a, weights, minlength=c.size)
        vsum = np.bincount(a, weights * points.astype(np.float64), minlength=c.size)
        c = np.sort(np.where(wsum > 0, vsum / np.where(wsum > 0, wsum, 1.0), c))
    got = np.asarray(kmeans.lloyd(jnp.asarray(points), jnp.asarray(weights), jnp.asarray(start), 7, 0.0))
    assert np.all(np.isinf(got[5:])) and np.all(np.isfinite(got[:5]))
    np.testing.assert_allclose(got[:5], c[:5], rtol=1e-5, atol=1e-6)


def test_entropy_constrained_levels_fit_their_shares_and_widen_the_zero_level_with_the_rate():
    rng = np.random.default_rng(0)
    x = np.sort(rng.laplace(size=20000).astype(np.float32))
    points, weights = jnp.asarray(x), jnp.ones(x.size, jnp.float32)
    zero_share = []
    for lam in (0.0, 0.5, 2.0):
        levels, lengths = kmeans.entropy_constrained(points, weights, 8, lam, float(np.sqrt(np.mean(x * x))))
        levels, lengths = np.asarray(levels), np.asarray(lengths)
        assert levels[0] == 0.0 and np.all(np.diff(levels[1:]) >= 0)
        idx = np.asarray(kmeans.penalised_assign(points, jnp.asarray(levels), jnp.asarray(lengths), lam))
        share = np.bincount(idx, minlength=9) / x.size
        used = np.isfinite(lengths)
        # each used level's code length is that of its share of the points (one more assignment pass moves few)
        np.testing.assert_allclose(2.0 ** -lengths[used], share[used], atol=0.01)
        assert np.all(share[~used] == 0)
        zero_share.append(share[0])
    assert zero_share == sorted(zero_share) and zero_share[-1] > 0.5 > zero_share[0]
    # lam 0: each point takes its nearest level
    levels = jnp.asarray([0.0, -1.0, 1.0])
    got = np.asarray(kmeans.penalised_assign(jnp.asarray([-0.6, -0.4, 0.4, 0.6, 3.0]), levels,
                                             jnp.asarray([5.0, 1.0, 1.0]), 0.0))
    assert got.tolist() == [1, 0, 0, 2, 2]


def test_compact_keeps_the_points_of_weight_when_they_fit_and_merges_them_in_order_when_not():
    rng = np.random.default_rng(0)
    points = jnp.asarray(np.sort(rng.normal(size=5000)).astype(np.float32))
    weights = np.where(rng.random(5000) < 0.3, rng.random(5000), 0.0).astype(np.float32)
    n = int((weights > 0).sum())
    p, w = kmeans.compact(points, jnp.asarray(weights), slots=n + 10)
    np.testing.assert_array_equal(np.asarray(p)[:n], np.asarray(points)[weights > 0])  # bit-identical
    np.testing.assert_array_equal(np.asarray(w)[:n], weights[weights > 0])
    assert not np.asarray(w)[n:].any() and np.all(np.diff(np.asarray(p)) >= 0)
    p, w = kmeans.compact(points, jnp.asarray(weights), slots=64)  # n > 64: 64 groups of consecutive points
    p, w = np.asarray(p, np.float64), np.asarray(w, np.float64)
    assert np.all(w > 0) and np.all(np.diff(p) >= 0)
    np.testing.assert_allclose(w.sum(), weights.sum(), rtol=1e-5)
    np.testing.assert_allclose((w * p).sum(), (weights * np.asarray(points)).sum(), rtol=1e-4, atol=1e-4)


def test_kmeans_of_a_histogram_is_that_of_its_filled_buckets():
    """k-means on a full histogram (17,607 buckets, compacted to `COMPACT_SLOTS`) gives the centres it gives on
    the filled buckets alone: the buckets of weight 0 take no part."""
    x = jnp.asarray((np.random.default_rng(1).standard_t(3, 20_000) * 0.05).astype(np.float32))
    counts = sketch.histogram(x, SPEC)
    values = jnp.asarray(SPEC.representatives())
    w = kmeans.bucket_weights(counts, values, 0.2)
    assert values.shape[0] > kmeans.COMPACT_SLOTS
    filled = np.asarray(w) > 0
    for k in (3, 8, 16):
        full = kmeans.weighted_kmeans(values, w, k, jax.random.PRNGKey(k), restarts=3)
        alone = kmeans.weighted_kmeans(values[filled], w[filled], k, jax.random.PRNGKey(k), restarts=3)
        np.testing.assert_allclose(np.asarray(full), np.asarray(alone), rtol=1e-6)
