import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from inshrink_jax import threshold


def expected_top(scores, k):
    """Reference: the k largest, ties at the cut included only if all of them fit."""
    if k == 0:
        return np.zeros(scores.shape, bool)
    t = np.sort(scores)[::-1][min(k, scores.size) - 1]
    ge = scores >= t
    return ge if ge.sum() <= k else scores > t


# A few sizes (each size is one compilation of the kernel), with every k from 0 to n.
@given(st.sampled_from([1, 2, 3, 17, 256, 2000]), st.integers(0, 2**31 - 1), st.booleans(), st.floats(0, 1))
def test_kth_largest_matches_sort(n, seed, with_ties, frac):
    rng = np.random.default_rng(seed)
    if with_ties:
        s = rng.integers(0, 20, n).astype(np.float32) * np.float32(0.37)
    else:
        s = np.abs(rng.standard_t(2, n)).astype(np.float32) * np.float32(10.0 ** rng.uniform(-30, 30))
    k = int(round(frac * n))
    t = threshold.kth_largest([jnp.asarray(s)], [jnp.ones(n, bool)], k)
    got = np.asarray(t.select(jnp.asarray(s)))
    np.testing.assert_array_equal(got, expected_top(s, k))
    if not with_ties:
        assert got.sum() == k


def test_kth_largest_over_several_masked_tensors_equals_concatenation():
    rng = np.random.default_rng(0)
    parts = [np.abs(rng.normal(size=shape)).astype(np.float32) for shape in [(7,), (30, 40), (5, 6, 7)]]
    masks = [rng.random(p.shape) < 0.8 for p in parts]
    k = 321
    t = threshold.kth_largest([jnp.asarray(p) for p in parts], [jnp.asarray(m) for m in masks], k)
    flat = np.concatenate([p[m] for p, m in zip(parts, masks)])
    ref = np.sort(flat)[::-1][k - 1]
    assert float(t.value) == ref
    assert sum(int((np.asarray(t.select(jnp.asarray(p))) & m).sum()) for p, m in zip(parts, masks)) == k


def test_kth_smallest_complement_prunes_exactly_k_or_fewer_at_ties():
    rng = np.random.default_rng(1)
    s = np.abs(rng.normal(size=10_000)).astype(np.float32)
    keep, n = threshold.kth_smallest_complement([jnp.asarray(s)], [jnp.ones(s.shape, bool)], 2500)
    pruned = ~np.asarray(keep.select(jnp.asarray(s)))
    assert int(n) == 10_000 and pruned.sum() == 2500
    assert s[pruned].max() < s[~pruned].min()
    # All-equal scores (e.g. zero gradients): pruning any of them would exceed k, so none is pruned.
    z = jnp.zeros(1000)
    keep, _ = threshold.kth_smallest_complement([z], [jnp.ones(1000, bool)], 100)
    assert int((~keep.select(z)).sum()) == 0
    # Prune everything.
    keep, _ = threshold.kth_smallest_complement([jnp.asarray(s)], [jnp.ones(s.shape, bool)], 10_000)
    assert int((~keep.select(jnp.asarray(s))).sum()) == 10_000


def test_k_zero_selects_nothing_and_k_past_count_selects_all():
    s = jnp.asarray([0.0, 1.0, 2.0, 3.0])
    m = jnp.ones(4, bool)
    assert int(threshold.kth_largest([s], [m], 0).select(s).sum()) == 0
    assert int(threshold.kth_largest([s], [m], 99).select(s).sum()) == 4


@pytest.mark.parametrize("digits", [threshold.DIGITS, threshold.SMALL_DIGITS, (16, 15), (8, 8, 8, 7)])
@pytest.mark.parametrize("with_ties", [False, True])
def test_every_split_of_the_bits_finds_the_same_threshold(digits, with_ties, monkeypatch):
    """The histograms may read the 31 bits in any split (the default one for large scores, three of 11, 10 and
    10 bits for small ones): each finds the k-th largest exactly."""
    monkeypatch.setattr(threshold, "DIGITS", digits)
    monkeypatch.setattr(threshold, "SMALL", 0)
    rng = np.random.default_rng(len(digits))
    n = 3000
    s = (rng.integers(0, 20, n).astype(np.float32) * np.float32(0.37) if with_ties else
         np.abs(rng.standard_t(2, n)).astype(np.float32) * np.float32(10.0 ** rng.uniform(-30, 30)))
    for k in (0, 1, 7, 1500, 2999, 3000, 5000):
        got = np.asarray(threshold.kth_largest([jnp.asarray(s)], [jnp.ones(n, bool)], k).select(jnp.asarray(s)))
        np.testing.assert_array_equal(got, expected_top(s, k))


def test_a_fraction_selects_that_fraction_of_the_masked_elements_rounded_half_up():
    """`fraction` counts the masked elements off the first histogram pass: 50% of 1001 masked scores is 501 (500.5
    rounds up), out of 2000; the complement prunes the same count; giving both k and fraction is an error."""
    rng = np.random.default_rng(5)
    s = np.abs(rng.normal(size=2000)).astype(np.float32)
    m = np.zeros(2000, bool)
    m[rng.permutation(2000)[:1001]] = True
    t = threshold.kth_largest([jnp.asarray(s)], [jnp.asarray(m)], fraction=0.5)
    chosen = np.asarray(t.select(jnp.asarray(s))) & m
    assert chosen.sum() == 501 and s[chosen].min() > s[m & ~chosen].max()
    keep, n = threshold.kth_smallest_complement([jnp.asarray(s)], [jnp.asarray(m)], fraction=0.25)
    assert int(n) == 1001 and (m & ~np.asarray(keep.select(jnp.asarray(s)))).sum() == 250  # round(250.25)
    for fraction, want in ((0.0, 0), (1.0, 1001)):
        sel = np.asarray(threshold.kth_largest([jnp.asarray(s)], [jnp.asarray(m)], fraction=fraction).select(
            jnp.asarray(s))) & m
        assert sel.sum() == want
    with pytest.raises(TypeError, match="either k or fraction"):
        threshold.kth_largest([jnp.asarray(s)], [jnp.asarray(m)], 3, fraction=0.5)


def test_stacked_tensors_counted_one_at_a_time_find_the_same_threshold(monkeypatch):
    """`stacked`: tensors of MAP_MIN_SIZE elements or more on a leading axis are counted one by one (lax.map) and
    their counts added; the threshold is the one over all of them at once, negative zeros counted as 0."""
    rng = np.random.default_rng(6)
    s = np.abs(rng.standard_t(2, size=(3, 40, 50))).astype(np.float32)
    s[0, 0, :5] = -0.0
    m = rng.random(s.shape) < 0.9
    whole = threshold.kth_smallest_complement([jnp.asarray(s)], [jnp.asarray(m)], fraction=0.3)
    monkeypatch.setattr(threshold, "MAP_MIN_SIZE", 40 * 50)
    mapped = threshold.kth_smallest_complement([jnp.asarray(s)], [jnp.asarray(m)], fraction=0.3, stacked=True)
    assert float(whole[0].value) == float(mapped[0].value) and int(whole[1]) == int(mapped[1]) == m.sum()
    pruned = m & ~np.asarray(mapped[0].select(jnp.asarray(s)))
    assert pruned.sum() == round(0.3 * m.sum()) and pruned[0, 0, :5].sum() == m[0, 0, :5].sum()
