"""Weighted 1-D k-means on a log-bucket histogram (ALGORITHM.md step 4) (jit).

Clustering runs on the histogram's non-empty buckets (a few thousand points even for 100M+ weights), not on
the weights: each bucket is a point at its representative value with weight
    W = sigma * count / max(count) + (1 - sigma) * |value| / max(|value|),
so large weights pull centres towards themselves even where they are rare. Initialisation is weighted
k-means++ (the next centre drawn with probability proportional to W * squared distance), then weighted Lloyd
iterations. Centres come out sorted ascending, so the codes built on them are ordinal.

The number of centres `k` may be a traced value below a static `capacity`: the arrays hold `capacity` slots
and the unused ones sit at +inf, where no point is ever assigned. One compiled kernel then serves every bin
count the configuration search tries (XLA compiles the encoder in seconds on CPU; `assign`'s
comparisons are memory-bound, so the unused slots cost little).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from inshrink_jax.sketch import SketchSpec


def bucket_weights(counts: jax.Array, values: jax.Array, sigma: float) -> jax.Array:
    """The k-means weight of each bucket (0 for empty buckets); see the module docstring."""
    counts = counts.astype(jnp.float32)
    present = counts > 0
    mag = jnp.where(present, jnp.abs(values), 0.0)
    norm_count = counts / jnp.maximum(jnp.max(counts), 1.0)
    max_mag = jnp.max(mag)
    norm_mag = jnp.where(max_mag > 0, mag / jnp.where(max_mag > 0, max_mag, 1.0), 0.0)
    return jnp.where(present, sigma * norm_count + (1.0 - sigma) * norm_mag, 0.0)


def assign(points: jax.Array, centres: jax.Array) -> jax.Array:
    """Index of the nearest of the ascending `centres` for each point (ties go to the lower centre). Unused
    slots at +inf are never chosen."""
    # The sort (of midpoints already ascending: it changes nothing) makes them an array computed once: XLA does
    # not fuse a sort into the per-point loop, into which it otherwise fuses the midpoints' computation (and
    # the pick of the best k-means restart's centres) and redoes it for every point (on its CPU backend, where an
    # optimization barrier is removed before fusion, that made the codes several times slower).
    mids = jnp.sort(0.5 * (centres[1:] + centres[:-1]))
    return jnp.sum(points[..., None] > mids, axis=-1).astype(jnp.int32)


def loss(points: jax.Array, weights: jax.Array, centres: jax.Array) -> jax.Array:
    """Weighted sum of squared distances to the nearest centre (points of weight 0 ignored)."""
    d2 = (points - centres[assign(points, centres)]) ** 2
    return jnp.sum(jnp.where(weights > 0, weights * d2, 0.0))


def kmeans_pp_init(points: jax.Array, weights: jax.Array, k, key: jax.Array, capacity: int) -> jax.Array:
    """Weighted k-means++: k centres drawn with probability ~ weight * squared distance to the chosen ones,
    ascending in `capacity` slots (the unused ones +inf).

    One uniform draw per centre, inverted through the cumulative distribution (cheaper than a categorical
    draw over thousands of buckets).
    """
    present = weights > 0

    def dist2(c):  # 0 for absent points, whose value may be far out (a histogram's empty end buckets)
        return jnp.where(present, (points - c) ** 2, 0.0)

    def draw(u, p):
        cum = jnp.cumsum(p)
        return points[jnp.clip(jnp.searchsorted(cum, u * cum[-1], side="right"), 0, points.shape[0] - 1)]

    us = jax.random.uniform(key, (capacity,))
    first = draw(us[0], weights)

    def body(i, carry):
        centres, d2 = carry
        p = weights * d2
        # Fewer distinct points than k: every point is already a centre, so repeat by weight.
        c = draw(us[i], jnp.where(jnp.sum(p) > 0, p, weights))
        return centres.at[i].set(c), jnp.minimum(d2, dist2(c))

    centres, _ = jax.lax.fori_loop(1, k, body, (jnp.full((capacity,), first), dist2(first)))
    return jnp.sort(jnp.where(jnp.arange(capacity) < k, centres, jnp.inf))


def prefix_sums(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inclusive prefix sums of a float32 vector with a leading 0, as pairs (hi, lo) whose sum is the prefix
    sum: the sum of x[i:j] is `range_sums` of them, accurate to a few float32 roundings of the sum of |x| over
    i:j alone, however large the sums before i (a plain float32 cumsum's difference is off by roundings of
    those). hi is the float32 cumsum; lo is the cumsum of what each step of it rounded away, x_k - (hi_k -
    hi_(k-1)), whatever order XLA summed in."""
    zero = jnp.zeros((1,), x.dtype)
    hi = jnp.concatenate([zero, jnp.cumsum(x)])
    return hi, jnp.concatenate([zero, jnp.cumsum(x - (hi[1:] - hi[:-1]))])


def range_sums(prefix: tuple[jax.Array, jax.Array], ends: jax.Array) -> jax.Array:
    """Sums of the consecutive ranges [ends[j - 1], ends[j]) (ends[-1] read as 0) of the vector `prefix` was
    made of."""
    hi, lo = prefix
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    return (hi[ends] - hi[starts]) + (lo[ends] - lo[starts])


def lloyd(points: jax.Array, weights: jax.Array, centres: jax.Array, iters: int, tol: float) -> jax.Array:
    """Weighted Lloyd iterations from ascending `centres` (unused slots +inf, and they stay there) until no
    centre moves more than `tol` times the spread of the points, or `iters` iterations.

    `points` must be non-decreasing (a histogram's representatives are). Every centre's points are then one
    contiguous range, bounded by a binary search of each midpoint, and its weight and weighted sum are
    differences of prefix sums taken once: an iteration costs O(k log n), not O(n) (a histogram of 1% buckets
    has 17,607 points; scattering them into the k sums took 90% of the encoder's time on CPU)."""
    present = weights > 0
    spread = jnp.max(jnp.where(present, points, -jnp.inf)) - jnp.min(jnp.where(present, points, jnp.inf))
    limit = tol * jnp.where(jnp.isfinite(spread), spread, 0.0)
    w_prefix = prefix_sums(weights)
    wx_prefix = prefix_sums(jnp.where(present, weights * points, 0.0))
    last = jnp.full((1,), points.shape[0], jnp.int32)

    def step(carry):
        c, _, it = carry
        # Centre j takes the points p with mids[j - 1] < p <= mids[j] (ties go to the lower centre, as in
        # `assign`): the range ending at the number of points <= mids[j].
        ends = jnp.concatenate([jnp.searchsorted(points, 0.5 * (c[1:] + c[:-1]), side="right").astype(jnp.int32),
                                last])
        wsum, vsum = range_sums(w_prefix, ends), range_sums(wx_prefix, ends)
        new = jnp.sort(jnp.where(wsum > 0, vsum / jnp.where(wsum > 0, wsum, 1.0), c))
        return new, jnp.max(jnp.where(jnp.isfinite(c), jnp.abs(new - c), 0.0)), it + 1

    def cond(carry):
        _, moved, it = carry
        return (it < iters) & (moved > limit)

    c, _, _ = jax.lax.while_loop(cond, step, (centres, jnp.asarray(jnp.inf, centres.dtype), 0))
    return c


def weighted_kmeans(
    points: jax.Array, weights: jax.Array, k, key: jax.Array, iters: int = 20, tol: float = 1e-4, restarts: int = 1,
    capacity: int | None = None,
) -> jax.Array:
    """k ascending centres of the weighted 1-D points (non-decreasing): the best of `restarts` k-means++ + Lloyd
    runs.

    Points with weight 0 are ignored. With no weighted point at all, every centre is 0. `k` is a static int
    (returns k centres), or with `capacity` (static) a traced int in [1, capacity] (returns `capacity` slots,
    the last `capacity - k` at +inf).
    """
    return _weighted_kmeans(points, weights, k, key, tol, iters=iters, restarts=restarts,
                            capacity=k if capacity is None else capacity)


# Points k-means runs on after `compact`: a histogram of 1% buckets has 17,607, of which a tensor fills a few
# hundred to about two thousand (its values' span in decades times 116 a sign); k-means++'s passes and the restarts'
# losses then run on at most a quarter of the points (benchmarks/results/compile_scaling.md: steady saves of a
# state of many small tensors).
COMPACT_SLOTS = 4096


def compact(points: jax.Array, weights: jax.Array, slots: int = COMPACT_SLOTS) -> tuple[jax.Array, jax.Array]:
    """The points of positive weight, in order, in `slots` slots: themselves when there are at most `slots`
    (bit-identical values and weights; the slots after them at the last point's value with weight 0, so the points
    stay non-decreasing), else consecutive ones merged, slot j taking those of rank r with r * slots // n = j, at
    their weighted mean with their summed weight (n the number of points of positive weight). k-means on the
    result is k-means on the points when nothing is merged: points of weight 0 take no part in it."""
    present = weights > 0
    n = jnp.sum(present.astype(jnp.int32))
    rank = jnp.cumsum(present.astype(jnp.int32)) - 1
    merged = n > slots
    slot = jnp.where(merged, rank * slots // jnp.maximum(n, 1), rank)  # rank * slots < 2^31 for any histogram
    slot = jnp.where(present, slot, slots)  # out of range: dropped
    kept_points = jnp.full((slots,), points[-1]).at[slot].set(points, mode="drop")
    kept_weights = jnp.zeros((slots,), weights.dtype).at[slot].set(weights, mode="drop")
    w = jnp.zeros((slots,), weights.dtype).at[slot].add(weights, mode="drop")
    wx = jnp.zeros((slots,), weights.dtype).at[slot].add(weights * points, mode="drop")
    mean = jnp.where(w > 0, wx / jnp.where(w > 0, w, 1.0), points[-1])
    return jnp.where(merged, mean, kept_points), jnp.where(merged, w, kept_weights)


@functools.partial(jax.jit, static_argnames=("iters", "restarts", "capacity"))
def _weighted_kmeans(points, weights, k, key, tol, *, iters, restarts, capacity):
    total = jnp.sum(weights)
    if points.shape[-1] > COMPACT_SLOTS:
        points, weights = compact(points, weights)

    def one(key):
        c = lloyd(points, weights, kmeans_pp_init(points, weights, k, key, capacity), iters, tol)
        return c, loss(points, weights, c)

    centres, losses = jax.vmap(one)(jax.random.split(key, restarts))
    best = centres[jnp.argmin(losses)]
    return jnp.where(total > 0, best, jnp.where(jnp.isfinite(best), 0.0, best))


def histogram_kmeans(
    counts: jax.Array, spec: SketchSpec, k, sigma: float, key: jax.Array, iters: int = 20, tol: float = 1e-4,
    restarts: int = 1, capacity: int | None = None,
) -> jax.Array:
    """k ascending centres for the data behind a log-bucket histogram (see the module docstring; `k` and
    `capacity` as in `weighted_kmeans`)."""
    values = jnp.asarray(spec.representatives())
    weights = bucket_weights(counts, values, sigma)
    return weighted_kmeans(values, weights, k, key, iters=iters, tol=tol, restarts=restarts, capacity=capacity)


# ------------------------------------------------------------------------------ entropy-constrained levels
# Histogram buckets merged for the entropy-constrained iterations: their levels need a few percent of a value's
# precision, not the sketch's 1% (the dense level-by-point cost of `entropy_constrained` then runs on a quarter of
# the points).
COARSEN = 4
ENTROPY_ITERS = 12


def coarsen(points: jax.Array, weights: jax.Array, factor: int = COARSEN) -> tuple[jax.Array, jax.Array]:
    """Every `factor` adjacent (non-decreasing) points merged into one at their weighted mean, with their summed
    weight (a merged point of weight 0 sits at 0)."""
    pad = -points.shape[0] % factor
    p = jnp.concatenate([points, jnp.zeros((pad,), points.dtype)]).reshape(-1, factor)
    w = jnp.concatenate([weights, jnp.zeros((pad,), weights.dtype)]).reshape(-1, factor)
    total = jnp.sum(w, axis=1)
    wx = jnp.sum(jnp.where(w > 0, w * p, 0.0), axis=1)
    return jnp.where(total > 0, wx / jnp.where(total > 0, total, 1.0), 0.0), total


def penalised_assign(x: jax.Array, levels: jax.Array, lengths: jax.Array, lam) -> jax.Array:
    """Index of the level minimising (x - level)^2 + lam * length for each element of `x` (ties to the lower
    index; a level of infinite length is never chosen). One fused pass per level, nothing of size
    x.size * levels.size is materialised."""
    best = jnp.full(x.shape, jnp.inf, jnp.float32)
    index = jnp.zeros(x.shape, jnp.int32)
    for j in range(levels.shape[0]):
        cost = jnp.square(x - levels[j]) + lam * lengths[j]
        take = cost < best
        best = jnp.where(take, cost, best)
        index = jnp.where(take, j, index)
    return index


def entropy_constrained(points: jax.Array, weights: jax.Array, slots: int, lam, scale, iters: int = ENTROPY_ITERS
                        ) -> tuple[jax.Array, jax.Array]:
    """Entropy-constrained scalar quantizer levels of the weighted 1-D points (Chou, Lookabaugh and Gray, 1989):
    Lloyd iterations in which a point takes the level minimising squared error + `lam` * the level's code length
    -log2(p) (p: the level's share of the weight), so that at the same squared error the codes have a lower
    order-0 entropy than the nearest of K levels give (an entropy coder then stores them near that entropy).

    Level 0 is fixed at exactly 0 (a residual of 0: the weight keeps its previous value); `slots` (even) others
    start at +-(1 .. slots/2) * 3 / (slots/2) * `scale` (the data's RMS) and move to their points' means; a level
    that loses all its points is dropped (length +inf). `lam` is in squared units of the points.

    Returns (levels, lengths): `slots + 1` levels, [0, then the others ascending], and their code lengths in bits.
    """
    half = slots // 2
    grid = jnp.arange(1, half + 1, dtype=jnp.float32) * (3.0 / half) * scale
    levels = jnp.concatenate([jnp.zeros((1,), jnp.float32), -grid[::-1], grid])
    lengths = jnp.full((slots + 1,), jnp.log2(slots + 1.0), jnp.float32)
    total = jnp.maximum(jnp.sum(weights), 1e-30)

    def step(_, carry):
        levels, lengths = carry
        idx = penalised_assign(points, levels, lengths, lam)
        w = jax.ops.segment_sum(weights, idx, num_segments=slots + 1)
        wx = jax.ops.segment_sum(weights * points, idx, num_segments=slots + 1)
        moved = jnp.where(w > 0, wx / jnp.where(w > 0, w, 1.0), levels)
        levels = moved.at[0].set(0.0)
        lengths = jnp.where(w > 0, -jnp.log2(jnp.maximum(w / total, 1e-30)), jnp.inf)
        return levels, lengths

    levels, lengths = jax.lax.fori_loop(0, iters, step, (levels, lengths))
    # The non-zero levels ascending (a level's place among the codes does not change its cost).
    order = jnp.argsort(levels[1:])
    return jnp.concatenate([levels[:1], levels[1:][order]]), jnp.concatenate([lengths[:1], lengths[1:][order]])
