"""Log-bucket histograms of signed values (ALGORITHM.md step 3: DDSketch without bucket collapsing).

A value x != 0 falls in bucket key(x) = ceil(log_gamma |x|), gamma = (1 + alpha) / (1 - alpha), on the side of
its sign; 0 has a bucket of its own. Every bucket of key k is represented by sign * 2 gamma^k / (gamma + 1),
which is within relative error alpha of every value in the bucket. A histogram has a static number of buckets
(it covers all float32 normals), so it is a fixed-shape array under jit; histograms of shards, tensors or layers
merge by adding counts, which is what makes one global histogram of a sharded tensor a single reduction.

Index layout (ascending in value): [negative keys, largest |x| first] [zero] [positive keys, smallest first].
Subnormal magnitudes (< 2^-126) share the smallest bucket; NaN and +-Inf are never counted.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

_MIN_NORMAL_EXP = -125  # frexp exponent of the smallest float32 normal, 2^-126 = 0.5 * 2^-125
_MAX_EXP = 128  # frexp exponent of the largest float32, < 2^128


@dataclasses.dataclass(frozen=True)
class SketchSpec:
    """The bucket layout for relative accuracy `alpha` (hashable, so a static jit argument)."""

    alpha: float = 0.01

    @property
    def gamma(self) -> float:
        return (1.0 + self.alpha) / (1.0 - self.alpha)

    @property
    def min_key(self) -> int:
        return math.ceil((_MIN_NORMAL_EXP - 1) * math.log(2.0) / math.log(self.gamma))

    @property
    def max_key(self) -> int:
        return math.ceil(_MAX_EXP * math.log(2.0) / math.log(self.gamma))

    @property
    def num_keys(self) -> int:
        return self.max_key - self.min_key + 1

    @property
    def zero_index(self) -> int:
        return self.num_keys

    @property
    def num_buckets(self) -> int:
        return 2 * self.num_keys + 1

    def representatives(self) -> np.ndarray:
        """float32 value of every bucket, ascending; the signed midpoint sign * 2 gamma^k / (gamma + 1)."""
        keys = np.arange(self.min_key, self.max_key + 1, dtype=np.float64)
        pos = 2.0 * np.exp(keys * math.log(self.gamma)) / (self.gamma + 1.0)
        pos = np.minimum(pos, np.finfo(np.float32).max)
        return np.concatenate([-pos[::-1], [0.0], pos]).astype(np.float32)

    def _exponent_split(self) -> tuple[float, float]:
        """ln 2 / ln gamma as c_hi + c_lo, c_hi with so few significant bits that e * c_hi is exact in float32
        for every exponent e of a float32 (|e| <= 2^7): e * ln2 / ln gamma is then split exactly into an
        integer and a fractional part, so the float32 part of the key computation stays small and keys are
        exact up to float32 rounding of values within ~1e-7 of a bucket boundary."""
        c = math.log(2.0) / math.log(self.gamma)
        scale = 2.0 ** (17 - math.ceil(math.log2(c + 1.0)))  # |e| * c_hi * scale < 2^24
        hi = round(c * scale) / scale
        return hi, c - hi


def bucket_index(x: jax.Array, spec: SketchSpec) -> jax.Array:
    """int32 histogram index of every element of `x` (any float dtype). Non-finite values get index 0."""
    x = x.astype(jnp.float32)
    ax = jnp.abs(x)
    tiny = jnp.float32(2.0**-126)
    clamped = jnp.maximum(ax, tiny)
    bits = jax.lax.bitcast_convert_type(clamped, jnp.int32)
    # clamped = m * 2^e with m in [0.5, 1): e from the exponent field, m rebuilt with exponent 126.
    e = (bits >> 23) - 126
    m = jax.lax.bitcast_convert_type((bits & 0x7FFFFF) | (126 << 23), jnp.float32)
    # Arithmetic, not a lookup in per-exponent tables: XLA's CPU backend does not vectorise a gather, and the
    # key is the costliest part of a histogram pass.
    c_hi, c_lo = spec._exponent_split()
    ef = e.astype(jnp.float32)
    scaled = ef * np.float32(c_hi)  # exact
    whole = jnp.floor(scaled)
    inv_log_gamma = np.float32(1.0 / math.log(spec.gamma))
    key = whole.astype(jnp.int32) + jnp.ceil((scaled - whole) + ef * np.float32(c_lo) +
                                             jnp.log(m) * inv_log_gamma).astype(jnp.int32)
    offset = jnp.clip(key - spec.min_key, 0, spec.num_keys - 1) + 1
    idx = jnp.where(x > 0, spec.zero_index + offset, spec.zero_index - offset)
    idx = jnp.where(x == 0, spec.zero_index, idx)
    return jnp.where(jnp.isfinite(x), idx, 0)


# A tensor of at least SAMPLE_MIN_SIZE elements (on one device) is histogrammed from a sample of about
# HISTOGRAM_SAMPLES of them (`sample_stride`): a histogram pass is a scatter, which XLA's CPU backend runs as a
# serial loop (about 4 ns an element, the largest cost of encoding a large tensor: benchmarks/results/stages.md),
# and k-means levels, a uniform quantizer's width and its outer cells' means are statistics that a million
# values fix far below the quantization's own error.
HISTOGRAM_SAMPLES = 1 << 20
SAMPLE_MIN_SIZE = 3 * HISTOGRAM_SAMPLES


def _is_prime(k: int) -> bool:
    return k >= 2 and all(k % d for d in range(2, math.isqrt(k) + 1))


def sample_stride(shape, one_device: bool) -> int:
    """The step between the elements (of the row-major flattened tensor) that `histogram` counts for a tensor of
    `shape`: 1 (every element) below SAMPLE_MIN_SIZE elements or for a tensor spread over several devices (each
    device counts its own shard; sampling it would move data between them), else the largest prime <=
    size / HISTOGRAM_SAMPLES that divides no axis length, so the sample walks through every column of a matrix
    (a stride that divides a row's length takes the same columns in every row: a biased sample where columns
    differ, as they do between attention heads or channels)."""
    size = int(np.prod(shape, dtype=np.int64))
    if not one_device or size < SAMPLE_MIN_SIZE:
        return 1
    for stride in range(size // HISTOGRAM_SAMPLES, 2, -1):
        if _is_prime(stride) and all(int(d) % stride for d in shape):
            return stride
    return 1


def histogram(x: jax.Array, spec: SketchSpec, mask: jax.Array | None = None, stride: int = 1) -> jax.Array:
    """int32 counts per bucket of the finite elements of `x` (where `mask` is True); with `stride` > 1 (static,
    `sample_stride`) of every `stride`-th element of the row-major flattened `x` only, from the first.

    Works on sharded `x` inside jit: each shard scatters into a replicated histogram, then one all-reduce.
    """
    if stride > 1:
        x = x.reshape(-1)[::stride]
        mask = None if mask is None else mask.reshape(-1)[::stride]
    # Elements not counted get an index past the end, which the scatter drops: cheaper than adding a 0 or 1
    # for every element.
    keep = jnp.isfinite(x) if mask is None else (mask & jnp.isfinite(x))
    index = jnp.where(keep, bucket_index(x, spec), spec.num_buckets)
    return jnp.zeros(spec.num_buckets, jnp.int32).at[index].add(1, mode="drop")
