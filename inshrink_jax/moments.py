"""Optimizer moments, quantized (`CompressionConfig.optimizer = "quantize"`): sign kept, levels in log|m| (jit).

Adam's second moment `nu` is non-negative and spans many decades inside one tensor; its first moment `mu` is
signed and does too. A training step divides one by the square root of the other, so what must survive is the
*relative* size of each value, its sign, and its zeros: a `nu` that comes back 0 (or tiny) where `mu` is not
makes a huge update. So a moment is quantized in the log domain, per tensor:

    code 0            exact zero: a zero moment, or the first moment of a weight pruned at this save
    codes 1 .. K      negative values, level K-1 (largest |m|) first: ascending in value
    codes K+1 .. 2K   positive values, level 0 (smallest |m|) first
    code 2K + 1       a non-finite value, stored exactly (the weights' "protected" code)

K levels (`CompressionConfig.first_moment_bins` for a first moment, `moment_bins` for a second), shared by both signs, are the centres of weighted k-means
(kmeans.py) on log|m| over the log-bucket histogram of |m| (sketch.py: its buckets are uniform in log|m|, so it
*is* the log-domain histogram), weighted by count only. A value takes the level nearest in log|m|, so its
relative error is bounded by the gap between two neighbouring levels, never by the tensor's range.

The output has the shape of the weights' encoder output (quantize.DeviceCodes with a value table of 2K
entries instead of K centres), so deltas against the previous save, entropy coding, storage and decoding on
restore are the ones of the weights: a restore maps codes through the table, bit-identical to `dequantize`.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from inshrink_jax import kmeans, sketch
from inshrink_jax.config import CompressionConfig
from inshrink_jax.quantize import PRUNED, DeviceCodes, protected_code, seed_key

# Which leaves are moments, and which are first moments, is policy.py's decision. First moments follow their
# weight's pruning; second moments never do: a weight pruned to 0 with mu = 0 and its nu kept gets a small first
# update (mu / sqrt(nu) starts at (1 - b1) g / sqrt(nu)), while mu = nu = 0 would make Adam's next updates
# (1 - b1^t) / sqrt(1 - b2^t) ~ 3-6.5 times the learning rate on those weights.


def table_size(bins: int) -> int:
    """Entries of the value table of a moment quantized to `bins` levels per sign."""
    return 2 * bins


@functools.partial(jax.jit, static_argnames=("bins", "spec", "iters", "tol", "restarts", "dtypes"))
def _encode_moments(ms, weight_codes, key, *, bins, spec, iters, tol, restarts, dtypes):
    reps = spec.representatives()
    positive = reps > 0
    log_reps = jnp.asarray(np.log(np.where(positive, reps, 1.0)).astype(np.float32))
    tiny = np.float32(np.finfo(np.float32).tiny)
    prepared, hists = [], []
    for m, wc in zip(ms, weight_codes):
        m32 = m.astype(jnp.float32)
        finite = jnp.isfinite(m32)
        # Sign and zero from the bits: XLA's CPU backend flushes subnormals to 0 in comparisons, and a subnormal
        # moment must keep its sign (and not become 0).
        bits = jax.lax.bitcast_convert_type(m32, jnp.int32)
        keep = finite & ((bits & 0x7FFFFFFF) != 0)
        if wc is not None:
            keep = keep & (wc != PRUNED)
        mag = jnp.abs(m32)
        prepared.append((m, m32, finite, keep, bits < 0, mag))
        hists.append(sketch.histogram(mag, spec, keep))
    counts = jnp.stack(hists).astype(jnp.float32)
    weights = jnp.where(positive, counts / jnp.maximum(jnp.max(counts, axis=1, keepdims=True), 1.0), 0.0)
    keys = jax.random.split(key, len(ms))
    centres = jax.vmap(lambda w, k: kmeans.weighted_kmeans(log_reps, w, bins, k, iters=iters, tol=tol,
                                                           restarts=restarts))(weights, keys)
    codes, tables, in_place = [], [], []
    for (m, m32, finite, keep, negative, mag), c, dtype in zip(prepared, centres, dtypes):
        # Levels inside the leaf dtype's normal range (before assignment, so each value still takes the nearest
        # level it decodes to): a non-zero moment never decodes to 0 or Inf.
        info = jnp.finfo(dtype)
        c = jnp.clip(c, float(np.log(info.tiny)), float(np.log(info.max)))
        level = kmeans.assign(jnp.log(jnp.maximum(mag, tiny)), c)
        code = jnp.where(negative, bins - level, bins + 1 + level)
        code = jnp.where(keep, code, PRUNED)
        codes.append(jnp.where(finite, code, protected_code(table_size(bins))).astype(jnp.uint8))
        levels = jnp.clip(jnp.exp(c), float(info.tiny), float(info.max))
        tables.append(jnp.concatenate([-levels[::-1], levels]))
        in_place.append(jnp.where(finite, jnp.zeros((), m.dtype), m))
    return codes, tables, in_place


def encode_on_device(ms: Sequence[jax.Array], weight_codes: Sequence[jax.Array | None], cfg: CompressionConfig,
                     key: jax.Array | None = None, first: Sequence[bool] | None = None) -> list[DeviceCodes]:
    """Quantize optimizer moments (see the module docstring), dispatched and not waited for.

    Args:
      ms: float moment tensors (float32, bfloat16, float16), any shape and sharding.
      weight_codes: for each moment, the codes of its weight at this save (its zeros where the weight was
        pruned are zeros of the moment), or None.
      cfg: `moment_bins`, and the k-means parameters.
      key: PRNG key for k-means++; defaults to a fold of PRNGKey(cfg.seed).
      first: for each moment, whether it is a first moment (K = `cfg.first_moment_bins`; otherwise
        `cfg.moment_bins`); None: all second moments.

    Returns:
      One `DeviceCodes` per moment whose `centres` is the 2K-entry value table and whose `bins` is 2K.
    """
    first = [False] * len(ms) if first is None else list(first)
    if not len(ms) == len(weight_codes) == len(first):
        raise ValueError("moments.encode_on_device needs one weight-codes array (or None) and one first-moment "
                         "flag per moment")
    key = seed_key(cfg.seed, 0x6D6F6D) if key is None else key
    out: list[DeviceCodes | None] = [None] * len(ms)
    for group, bins in ((False, cfg.moment_bins), (True, cfg.first_moment_bins)):
        idx = [i for i, f in enumerate(first) if f == group]
        if not idx:
            continue
        codes, tables, in_place = _encode_moments(
            [ms[i] for i in idx], [weight_codes[i] for i in idx], jax.random.fold_in(key, int(group)), bins=bins,
            spec=sketch.SketchSpec(cfg.alpha), iters=cfg.kmeans_iters, tol=cfg.kmeans_tol,
            restarts=cfg.kmeans_restarts, dtypes=tuple(jnp.dtype(ms[i].dtype) for i in idx))
        for i, c, t, v in zip(idx, codes, tables, in_place):
            out[i] = DeviceCodes(c, t, v, table_size(bins))
    return out
