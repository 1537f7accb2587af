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

    def _exponent_tables(self) -> tuple[np.ndarray, np.ndarray]:
        # e * ln2 / ln(gamma) split exactly (in float64) into an integer and a fractional part per frexp
        # exponent e, so the float32 part of the key computation stays small and keys are exact up to
        # float32 rounding of values within ~1e-7 of a bucket boundary.
        e = np.arange(_MIN_NORMAL_EXP, _MAX_EXP + 1, dtype=np.float64)
        scaled = e * math.log(2.0) / math.log(self.gamma)
        whole = np.floor(scaled)
        return whole.astype(np.int32), (scaled - whole).astype(np.float32)


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
    whole, frac = spec._exponent_tables()
    e_idx = jnp.clip(e - _MIN_NORMAL_EXP, 0, whole.shape[0] - 1)
    inv_log_gamma = np.float32(1.0 / math.log(spec.gamma))
    key = jnp.asarray(whole)[e_idx] + jnp.ceil(jnp.asarray(frac)[e_idx] + jnp.log(m) * inv_log_gamma).astype(
        jnp.int32
    )
    offset = jnp.clip(key - spec.min_key, 0, spec.num_keys - 1) + 1
    idx = jnp.where(x > 0, spec.zero_index + offset, spec.zero_index - offset)
    idx = jnp.where(x == 0, spec.zero_index, idx)
    return jnp.where(jnp.isfinite(x), idx, 0)


def histogram(x: jax.Array, spec: SketchSpec, mask: jax.Array | None = None) -> jax.Array:
    """int32 counts per bucket of the finite elements of `x` (where `mask` is True).

    Works on sharded `x` inside jit: each shard scatters into a replicated histogram, then one all-reduce.
    """
    keep = jnp.isfinite(x) if mask is None else (mask & jnp.isfinite(x))
    return jnp.zeros(spec.num_buckets, jnp.int32).at[bucket_index(x, spec)].add(keep.astype(jnp.int32))
