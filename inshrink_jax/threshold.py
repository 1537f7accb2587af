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


def kth_largest(scores: Sequence[jax.Array], masks: Sequence[jax.Array], k: jax.Array) -> Threshold:
    """Threshold selecting the `k` largest of the finite, non-negative `scores` where `masks` is True.

    Args:
      scores: arrays of any shapes (and shardings), all non-negative where masked in.
      masks: boolean arrays of the same shapes; elements outside are ignored. Must exclude NaN/Inf.
      k: how many to select (int32, may be traced); 0 selects none, >= the count selects all.

    Returns:
      The `Threshold` (value, inclusive).
    """
    bits = [_bits(s) for s in scores]
    masks = [m.astype(jnp.int32) for m in masks]
    total = sum(jnp.sum(m) for m in masks)
    k = jnp.clip(jnp.asarray(k, jnp.int32), 0, total)
    digits = SMALL_DIGITS if sum(s.size for s in scores) <= SMALL else DIGITS
    prefix = jnp.zeros((), jnp.int32)  # the bits of the k-th largest found so far
    above = jnp.zeros((), jnp.int32)  # elements known to be larger
    shift = 31
    for j, width in enumerate(digits):
        shift -= width
        hist = sum(jnp.zeros(1 << width, jnp.int32).at[(b >> shift) & ((1 << width) - 1)].add(
            m if j == 0 else m * ((b >> (shift + width)) == prefix)) for b, m in zip(bits, masks))
        d, more = _last_bucket_with_at_least(hist, k - above)
        prefix, above = (prefix << width) | d, above + more
    value = jax.lax.bitcast_convert_type(prefix, jnp.float32)
    at_or_above = above + hist[d]
    none = k == 0
    value = jnp.where(none, jnp.inf, value)
    return Threshold(value=value, inclusive=(at_or_above <= k) & ~none)


def kth_smallest_complement(
    scores: Sequence[jax.Array], masks: Sequence[jax.Array], k: jax.Array
) -> tuple[Threshold, jax.Array]:
    """For pruning: the `k` smallest masked scores are those NOT selected by the returned threshold.

    Returns (threshold over the n - k largest, n), n the number of masked elements. With ties at the cut the
    complement holds fewer than k elements, never more.
    """
    n = sum(jnp.sum(m.astype(jnp.int32)) for m in masks)
    k = jnp.clip(jnp.asarray(k, jnp.int32), 0, n)
    # Keep the n - k largest with every tie at the cut kept, so at most k are left to prune.
    t = kth_largest(scores, masks, n - k)
    return Threshold(value=t.value, inclusive=n - k > 0), n
