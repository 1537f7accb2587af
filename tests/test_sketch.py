import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from inshrink_jax import sketch

SPEC = sketch.SketchSpec(0.01)
QS = np.array([0.0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0])
TOL = SPEC.alpha + 1e-6  # alpha, plus float32 rounding of the representative itself


def heavy_tailed(rng, n, zero_frac=0.1):
    x = rng.standard_t(2.5, size=n).astype(np.float32) * np.float32(10.0 ** rng.uniform(-4, 2))
    x[rng.random(n) < zero_frac] = 0.0
    return x


def quantile(counts, q):
    """The order statistic of rank floor(q (n - 1)) read off a histogram: its bucket's representative."""
    cum = np.cumsum(np.asarray(counts, dtype=np.int64))
    rank = np.floor(np.asarray(q, np.float64) * (cum[-1] - 1)).astype(np.int64)
    return SPEC.representatives()[np.searchsorted(cum, rank, side="right")]


def assert_quantiles_within_alpha(x):
    """The histogram counts every value in the bucket whose representative is within alpha of it."""
    est = quantile(jax.jit(sketch.histogram, static_argnums=1)(jnp.asarray(x), SPEC), QS)
    exact = np.quantile(x.astype(np.float64), QS, method="lower")
    err = np.abs(est.astype(np.float64) - exact)
    assert np.all(err <= TOL * np.abs(exact)), (est, exact)


@given(st.integers(1, 3000), st.integers(0, 2**31 - 1))
def test_quantiles_within_alpha(n, seed):
    assert_quantiles_within_alpha(heavy_tailed(np.random.default_rng(seed), n))


@pytest.mark.parametrize("n", [1, 2, 10, 1000, 100_000, 10_000_000])
def test_quantiles_within_alpha_sizes(n):
    assert_quantiles_within_alpha(heavy_tailed(np.random.default_rng(n), n))


def test_bucket_boundaries_are_exact():
    # Just below gamma^k lies in bucket k, just above in bucket k + 1. (Within ~1e-7 of a boundary float32
    # rounding may put a value in the neighbour, costing < 1e-6 of relative error: see TOL.)
    ks = np.arange(-4300, 4400, 97)
    bounds = np.exp(ks * math.log(SPEC.gamma))
    for k, side, v in [(k, s, np.float32(b * (1 + s * 1e-5))) for k, b in zip(ks, bounds) for s in (-1, 1)]:
        key = k if side < 0 else k + 1
        assert int(sketch.bucket_index(jnp.float32(v), SPEC)) == SPEC.zero_index + 1 + key - SPEC.min_key
        assert int(sketch.bucket_index(jnp.float32(-v), SPEC)) == SPEC.zero_index - 1 - (key - SPEC.min_key)


def test_representative_within_alpha_of_every_value():
    rng = np.random.default_rng(1)
    x = (np.exp(rng.uniform(-80, 80, size=200_000)) * rng.choice([-1, 1], size=200_000)).astype(np.float32)
    rep = SPEC.representatives()[np.asarray(sketch.bucket_index(jnp.asarray(x), SPEC))]
    assert np.all(np.abs(rep.astype(np.float64) - x) <= TOL * np.abs(x.astype(np.float64)))


def test_merge_equals_histogram_of_concatenation():
    rng = np.random.default_rng(2)
    parts = [heavy_tailed(rng, n) for n in (1, 17, 1000, 54321)]
    merged = sum(sketch.histogram(jnp.asarray(p), SPEC) for p in parts)
    whole = sketch.histogram(jnp.asarray(np.concatenate(parts)), SPEC)
    np.testing.assert_array_equal(np.asarray(merged), np.asarray(whole))
    assert int(whole.sum()) == sum(p.size for p in parts)


def test_non_finite_and_masked_values_are_not_counted():
    x = jnp.asarray([1.0, np.nan, np.inf, -np.inf, 0.0, -2.0], jnp.float32)
    h = sketch.histogram(x, SPEC)
    assert int(h.sum()) == 3
    assert int(h[SPEC.zero_index]) == 1
    h = sketch.histogram(x, SPEC, mask=jnp.asarray([True, True, True, True, False, False]))
    assert int(h.sum()) == 1


def test_sample_stride():
    """Large single-device tensors are histogrammed from a sample of at least HISTOGRAM_SAMPLES elements taken at
    a prime stride that divides no axis (so it walks through every column); small or multi-device ones whole."""
    assert sketch.sample_stride((4096, 4096), True) == 13  # 16 -> 13: the largest prime, and no axis is 13k
    assert sketch.sample_stride((6250, 4096), True) == 23  # 24 -> 23
    assert sketch.sample_stride((4096, 4096), False) == 1  # spread over devices: each counts its own shard
    assert sketch.sample_stride((1000, 1000), True) == 1  # below SAMPLE_MIN_SIZE
    assert sketch.sample_stride((3 * 2**20,), True) == 1  # the only candidate, 3, divides the axis
    assert sketch.sample_stride((7, 7, 3 * 2**20), True) == 139  # 147 -> 139 (not 7 x 21 or 3 x 49)


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=3))
def test_sample_strides_are_primes_dividing_no_axis(shape):
    stride = sketch.sample_stride(tuple(shape), True)
    size = math.prod(shape)
    if stride == 1:
        return
    assert all(stride % d for d in range(2, stride)) and all(n % stride for n in shape)
    assert size >= sketch.SAMPLE_MIN_SIZE and -(-size // stride) >= sketch.HISTOGRAM_SAMPLES


def test_strided_histogram_counts_the_sample():
    rng = np.random.default_rng(5)
    x = heavy_tailed(rng, 96 * 70).reshape(96, 70)
    mask = rng.random(x.shape) < 0.8
    f = jax.jit(sketch.histogram, static_argnums=(1, 3))
    sampled = np.asarray(f(jnp.asarray(x), SPEC, jnp.asarray(mask), 11))
    expect = np.asarray(f(jnp.asarray(x.reshape(-1)[::11]), SPEC, jnp.asarray(mask.reshape(-1)[::11]), 1))
    np.testing.assert_array_equal(sampled, expect)
    assert sampled.sum() == mask.reshape(-1)[::11].sum()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_inputs(dtype):
    x = heavy_tailed(np.random.default_rng(3), 5000).astype(dtype)
    assert_quantiles_within_alpha(np.asarray(x).astype(np.float32))


def test_sharded_histogram_equals_single_device_without_gathering():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    x = heavy_tailed(np.random.default_rng(4), 4 * 4096).reshape(64, 256)
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None)))
    f = jax.jit(sketch.histogram, static_argnums=1)
    np.testing.assert_array_equal(np.asarray(f(sharded, SPEC)), np.asarray(f(jnp.asarray(x), SPEC)))
    hlo = f.lower(sharded, SPEC).compile().as_text()
    assert "all-gather" not in hlo  # one all-reduce of the counts, the tensor itself stays in place


@pytest.mark.parametrize("alpha", [0.001, 0.01, 0.05, 0.2])
def test_keys_match_a_float64_reference_on_every_exponent(alpha):
    """The key ceil(log_gamma |x|), computed in float32 from the exponent and mantissa without table lookups,
    equals the float64 one for random bit patterns over every float32 exponent, except for values within 1e-6 of
    a bucket boundary (relative), where float32 rounding may put them on either side."""
    spec = sketch.SketchSpec(alpha)
    bits = np.random.default_rng(7).integers(0, 2**32, size=2_000_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) >= np.float32(2.0**-126))]
    idx = np.asarray(jax.jit(lambda v: sketch.bucket_index(v, spec))(jnp.asarray(x)))
    scaled = np.log(np.abs(x.astype(np.float64))) / math.log(spec.gamma)
    key = np.clip(np.ceil(scaled).astype(np.int64) - spec.min_key, 0, spec.num_keys - 1) + 1
    want = np.where(x > 0, spec.zero_index + key, spec.zero_index - key)
    near = np.abs(scaled - np.round(scaled)) < 1e-6 / math.log(spec.gamma)  # |x| within 1e-6 of a boundary
    assert x.size > 1_500_000 and near.mean() < 2e-3
    np.testing.assert_array_equal(idx[~near], want[~near])
