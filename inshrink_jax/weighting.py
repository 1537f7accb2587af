"""Where a closed-loop residual's error may go: a per-weight scale from the optimizer's second moment.

A restore's error e costs about 1/2 sum(h_i e_i^2) in loss, h the loss's curvature. Adam's second moment `nu`
(a running mean of squared gradients, the diagonal of the empirical Fisher) estimates where h is large, while
Adam moves every weight by about the same step whatever its `nu`: a residual coded with the same error
everywhere spends its bits alike on weights the loss hardly sees and on those it sees most. A weighted residual
is coded as u = r / M and decodes to u * M, with M = nu^(-1/4) up to a power of two: the squared error is then
weighted by nu^(1/2) (not by nu, which also holds the gradients' noise, no curvature). The search bounds the same
weighted error (`search.proxy_degradation` with weights 1 / M). Off by default (CompressionConfig.weighted_residuals:
after 10 restores it moved along the default's frontier, not past it; docs/results.md).

The decoder needs M without the optimizer state, so it is stored with each link, separably: one small integer
per index of every axis (`factors`, in octaves of nu: the main effects of -log2(nu) about its mean, which is
what Adafactor's row and column statistics capture of a second moment), and the element's exponent is
    K = clip(floor((sum over axes of factor[i_axis] + 2) / 4), -OCTAVES, OCTAVES),    M = 2^K.
M is a power of two, so u * M and r / M are exact (no rounding, whatever fusing or FMA contraction a backend
does), and K is integer arithmetic: the save's reconstruction and every restore agree bit for bit. A tensor of
2 or more dimensions whose weight has a second moment of its shape in the state is weighted; others take M = 1
(no factors stored).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Largest |K|: M within 2^-8..2^8 of the tensor's geometric mean (squared-error weights within 2^-16..2^16).
OCTAVES = 8
# Largest |factor| stored (octaves of nu); a reader refuses more.
FACTOR_LIMIT = 127
# A second moment below this fraction of its tensor's largest counts as this fraction (octaves: 2^-48): a weight
# that never had a gradient would otherwise pull its row's and column's factors far off.
_FLOOR_OCTAVES = 48


def _factors_one(nu: jax.Array) -> tuple[jax.Array, ...]:
    nu = jnp.where(jnp.isfinite(nu), nu.astype(jnp.float32), 0.0)
    top = jnp.max(nu)
    floor = jnp.maximum(top * 2.0 ** -_FLOOR_OCTAVES, jnp.finfo(jnp.float32).tiny)
    lg = -jnp.log2(jnp.maximum(nu, floor))
    mu = jnp.mean(lg)
    axes = range(nu.ndim)
    return tuple(jnp.clip(jnp.round(jnp.mean(lg, axis=tuple(a for a in axes if a != d)) - mu),
                          -FACTOR_LIMIT, FACTOR_LIMIT).astype(jnp.int32) for d in axes)


@jax.jit
def factors(nus: Sequence[jax.Array]) -> list[tuple[jax.Array, ...]]:
    """Per second moment, one int32 vector per axis (its length that axis's): the rounded main effects of
    -log2(nu) about its mean. One call (one compiled kernel) for a state's tensors."""
    return [_factors_one(nu) for nu in nus]


def exponents(fs: Sequence[jax.Array]) -> jax.Array:
    """K of every element (int32) from the per-axis factors (inside a jitted kernel, or on device arrays).
    `fs` may carry a leading stacking axis (all of them alike: a bucket of stacked tensors)."""
    lead = fs[0].ndim - 1
    nd = len(fs)
    total = 0
    for d, f in enumerate(fs):
        total = total + f.reshape(f.shape[:lead] + tuple(f.shape[-1] if a == d else 1 for a in range(nd)))
    return jnp.clip(jnp.floor_divide(total + 2, 4), -OCTAVES, OCTAVES)


def pow2(k: jax.Array) -> jax.Array:
    """2.0^k in float32, exactly, for integer k in [-126, 127] (the exponent bits written directly)."""
    return jax.lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)


def exponents_host(fs: Sequence[np.ndarray]) -> np.ndarray:
    """`exponents` on the host (NumPy, int32): the same integers."""
    nd = len(fs)
    total = np.zeros((1,) * nd, np.int64)
    for d, f in enumerate(fs):
        total = total + np.asarray(f, np.int64).reshape(tuple(-1 if a == d else 1 for a in range(nd)))
    return np.clip((total + 2) // 4, -OCTAVES, OCTAVES).astype(np.int32)


@jax.jit
def inverse_multipliers(fss: Sequence[tuple[jax.Array, ...] | None]) -> list:
    """1 / M of each weighted tensor (None where unweighted): the weights of the search's proxy."""
    return [None if fs is None else pow2(-exponents(fs)) for fs in fss]


def times_multiplier(r: jax.Array, k: jax.Array) -> jax.Array:
    """A weighted residual's decoded value: the level (or stored value) r times 2^k, exact (float32)."""
    return r * pow2(k)


def replicated(a: jax.Array, like: jax.Array) -> jax.Array:
    """`a` (a small factor vector) whole on every device of `like` (the tensor it weights): each process then
    writes its shards' part of it from the whole, as it does a tensor's levels, and the encoder takes it with
    the tensor (one jitted call takes arrays of one device set)."""
    s = like.sharding
    target = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec()) \
        if isinstance(s, jax.sharding.NamedSharding) else s
    return a if a.sharding.is_equivalent_to(target, a.ndim) else jax.device_put(a, target)
