"""Exact partition thresholds: the k-th largest score over one or several tensors (jit).

The partition of ALGORITHM.md step 2 needs "the top f by magnitude", "the f least important of a layer type".
The paper reads these thresholds off its sketch (relative error alpha in value, which can be percents in rank
where weights are dense). We find the exact order statistic instead, with the same number of histogram passes
as sketch + refinement: non-negative float32 scores order like their int32 bit patterns, so one histogram of
the high 15 bits finds the bucket holding the k-th largest, and one histogram of the low 16 bits of the elements
in that bucket finds the value. Every histogram merges by addition, so scores may be sharded or spread over all
tensors of a layer type. Scores of few elements in all (`SMALL`) take three histograms of 11, 10 and 10 bits
instead: one more pass over their elements, but 4,096 buckets instead of 98,304 to clear and sum, which for a
tensor of a few thousand weights are more than ten times its elements.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

# Bits of the int32 pattern of a non-negative float32 (31) read per histogram, most significant first.
DIGITS = (15, 16)
SMALL = 1 << 17
SMALL_DIGITS = (11, 10, 10)


class Threshold(NamedTuple):
    """Selects the k largest scores: `score > value`, or `score >= value` when `inclusive`.

    `inclusive` is False when ties at `value` would push the selection past k, so a selection holds exactly k
    elements when scores are distinct and never more than k otherwise (k = 0 selects nothing).
    """

    value: jax.Array
    inclusive: jax.Array

    def select(self, score: jax.Array) -> jax.Array:
        return jnp.where(self.inclusive, score >= self.value, score > self.value)


def _bits(score: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(score.astype(jnp.float32), jnp.int32)


def _last_bucket_with_at_least(counts: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Largest index b with sum(counts[b:]) >= k, and sum(counts[b+1:])."""
    at_or_above = jnp.cumsum(counts[::-1])[::-1]
    b = jnp.maximum(jnp.sum(at_or_above >= k) - 1, 0)
    return b, at_or_above[b] - counts[b]


def round_count(fraction: jax.Array, n: jax.Array) -> jax.Array:
    """round(fraction * n), halves up: the number of elements a fraction selects."""
    return jnp.floor(fraction * n.astype(jnp.float32) + 0.5).astype(jnp.int32)


def kth_largest(scores: Sequence[jax.Array], masks: Sequence[jax.Array], k: jax.Array | None = None, *,
                fraction: jax.Array | None = None, stacked: bool = False) -> Threshold:
    """Threshold selecting the `k` largest of the finite, non-negative `scores` where `masks` is True.

    Args:
      scores: arrays of any shapes (and shardings), all non-negative where masked in.
      masks: boolean arrays of the same shapes; elements outside are ignored. Must exclude NaN/Inf.
      k: how many to select (int32, may be traced); 0 selects none, >= the count selects all.
      fraction: instead of `k`, the fraction of the masked elements to select (`round_count`); their number
        is read off the first histogram pass, so no pass over the masks counts them.
      stacked: each score array holds tensors stacked on its leading axis (an encoder's bucket): tensors of
        `MAP_MIN_SIZE` elements or more are counted one at a time (`lax.map`) and their counts added, which
        XLA's CPU backend runs faster than one scatter over all of them (its index arrays stay in cache).

    Returns:
      The `Threshold` (value, inclusive).
    """
    return _kth_largest(scores, masks, lambda n: _count(k, fraction, n), stacked)[0]


def _count(k, fraction, n: jax.Array) -> jax.Array:
    """`k`, or `fraction` of `n` (exactly one is given), as int32 in [0, n]."""
    if (k is None) == (fraction is None):
        raise TypeError("give either k or fraction")
    k = round_count(fraction, n) if k is None else jnp.asarray(k, jnp.int32)
    return jnp.clip(k, 0, n)


def _kth_largest(scores, masks, count_of, stacked: bool) -> tuple[Threshold, jax.Array]:
    """(`kth_largest`'s threshold for the `count_of(n)` largest, n), n the number of masked elements."""
    # A masked-out element gets the bit pattern -1, which no digit prefix matches (prefixes are >= 0): each
    # histogram pass then scatters only the elements it counts, out-of-range indices dropped, instead of
    # adding an int32 mask (0 or 1) for every element.
    bits = [jnp.where(m, _bits(s) & 0x7FFFFFFF, -1) for s, m in zip(scores, masks)]  # -0.0 counts as 0
    digits = SMALL_DIGITS if sum(s.size for s in scores) <= SMALL else DIGITS
    prefix = jnp.zeros((), jnp.int32)  # the bits of the k-th largest found so far
    above = jnp.zeros((), jnp.int32)  # elements known to be larger
    shift = 31
    for j, width in enumerate(digits):
        shift -= width
        hist = sum(_digit_counts(b, shift, width, prefix, stacked) for b in bits)
        if j == 0:  # every masked element is in the first pass's histogram
            n = jnp.sum(hist)
            k = count_of(n)
        d, more = _last_bucket_with_at_least(hist, k - above)
        prefix, above = (prefix << width) | d, above + more
    value = jax.lax.bitcast_convert_type(prefix, jnp.float32)
    at_or_above = above + hist[d]
    none = k == 0
    value = jnp.where(none, jnp.inf, value)
    return Threshold(value=value, inclusive=(at_or_above <= k) & ~none), n


# Tensors stacked on a leading axis (`kth_largest`'s `stacked`, `quantize.per_tensor_map`) of at least this many
# elements each are processed one at a time (lax.map) rather than as one batch or one scatter over them all.
MAP_MIN_SIZE = 1 << 20


def _digit_counts(bits: jax.Array, shift: int, width: int, prefix: jax.Array, stacked: bool) -> jax.Array:
    """Counts of the `width`-bit digit at `shift` of the elements whose higher bits are `prefix`."""
    def counts(b):
        digit = jnp.where((b >> (shift + width)) == prefix, (b >> shift) & ((1 << width) - 1), 1 << width)
        return jnp.zeros(1 << width, jnp.int32).at[digit].add(1, mode="drop")

    if stacked and bits.ndim >= 1 and bits[0].size >= MAP_MIN_SIZE:
        return jnp.sum(jax.lax.map(counts, bits), axis=0)
    return counts(bits)


def kth_smallest_complement(scores: Sequence[jax.Array], masks: Sequence[jax.Array], k: jax.Array | None = None,
                            *, fraction: jax.Array | None = None, stacked: bool = False
                            ) -> tuple[Threshold, jax.Array]:
    """For pruning: the `k` (or `fraction`) smallest masked scores are those NOT selected by the returned
    threshold.

    Returns (threshold over the n - k largest, n), n the number of masked elements. With ties at the cut the
    complement holds fewer than k elements, never more. `fraction`, `stacked`: as for `kth_largest`.
    """
    # Keep the n - k largest with every tie at the cut kept, so at most k are left to prune (the value is +inf
    # only when nothing is kept).
    t, n = _kth_largest(scores, masks, lambda n: n - _count(k, fraction, n), stacked)
    return Threshold(value=t.value, inclusive=t.value < jnp.inf), n
