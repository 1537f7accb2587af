"""Optimizer moments, quantized (`CompressionConfig.optimizer = "quantize"`) (jit).

Adam's second moment `nu` is non-negative and spans many decades inside one tensor; its first moment `mu` is
signed and does too. A training step divides one by the square root of the other: the update is
u = mu / sqrt(nu) (up to bias corrections and eps). So the two are coded differently.

**Second moments** (`encode_on_device`): what must survive is the *relative* size of each value and its zeros: a
`nu` that comes back 0 (or tiny) where `mu` is not makes a huge update. So a second moment is quantized in the
log domain, per tensor:

    code 0            exact zero
    codes 1 .. K      negative values, level K-1 (largest |m|) first: ascending in value
    codes K+1 .. 2K   positive values, level 0 (smallest |m|) first
    code 2K + 1       a non-finite value, stored exactly (the weights' "protected" code)

K levels (`CompressionConfig.effective_moment_bins`), shared by both signs (a second moment of some optimizers may be
signed), are the centres of weighted k-means (kmeans.py) on log|m| over the log-bucket histogram of |m|
(sketch.py: its buckets are uniform in log|m|, so it
*is* the log-domain histogram), weighted by count only. A value takes the level nearest in log|m|, so its
relative error is bounded by the gap between two neighbouring levels, never by the tensor's range.

The output has the shape of the weights' encoder output (quantize.DeviceCodes with a value table of 2K
entries instead of K centres), so deltas against the previous save, entropy coding, storage and decoding on
restore are the ones of the weights: a restore maps codes through the table, bit-identical to `dequantize`.

**First moments** (`encode_first_on_device`): what the update uses is the ratio r = mu / sqrt(nu_hat), with
nu_hat the second moment *as this save stores it*; so that ratio is what is quantized, and a restore gives
mu' = r' sqrt(nu_hat). Then the first update after a restore is off by exactly the ratio's quantization error,
whatever nu's own error (mu' / sqrt(nu_hat) = r'), and a mu that is tiny where nu is tiny too (a rare token's
row, an input that is seldom on) is never blown up to a level of the tensor's larger values: coded on its own in
the log domain, 2 levels a sign gave a fine-tuned LSTM's update a squared error 17x its own
(benchmarks/results/moment_error_lstm.md). A first moment without a second moment of its shape beside it (SGD
momentum's `trace`, Lion's and Muon's `mu`) is coded the same way with sqrt(nu_hat) = 1: SGD's update is linear
in it; Lion's is the sign of a blend of it and the gradient (and its `mu` the slow average), Muon's the orthogonal
polar factor of its momentum, so theirs are coded within a tenth of the budget (`policy.NORMALIZED_BUDGET`).
The ratio is quantized uniformly with its cells' means as levels (an entropy-coded uniform quantizer: at the same
squared error it takes about 10% fewer bits than k-means levels, and 16-22% fewer at the same budget;
benchmarks/results/moment_error.md): cells of
width w centred on zero, as many as the ratio's range needs (at most `FIRST_CAPACITY`). w is chosen per tensor at
every save, on the device, as the widest of `FIRST_STEPS` (times the ratio's RMS) whose squared update error,
measured on the ratio's histogram (`RATIO_SKETCH`), is at most `CompressionConfig.effective_moment_budget` of the
update's (the least error of them if none is): the same bound on every model, with no data needed. Codes are the
weights' (quantize.py): 0 an exact zero (a zero moment, or the first moment of a weight pruned at this save), 1..K
the cells ascending, K + 1 a value stored exactly (non-finite, or where nu_hat is 0 or not finite).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from inshrink_jax import kmeans, quantize, sketch
from inshrink_jax.config import CompressionConfig
from inshrink_jax.quantize import PRUNED, DeviceCodes, protected_code, seed_key

# Which leaves are moments, and which are first moments, is policy.py's decision; which second moment a first
# moment is coded relative to, save.py's. First moments follow their weight's pruning; second moments never do:
# a weight pruned to 0 with mu = 0 and its nu kept gets a small first update (mu / sqrt(nu) starts at
# (1 - b1) g / sqrt(nu)), while mu = nu = 0 would make Adam's next updates (1 - b1^t) / sqrt(1 - b2^t) ~ 3-6.5
# times the learning rate on those weights.


# Cell widths a first moment's uniform quantizer may take, relative to the ratio's RMS, finest first
# (encode_first_on_device picks one per tensor and save), and the most cells (odd: one centred on zero).
FIRST_STEPS = tuple(float(x) for x in np.geomspace(0.02, 4.0, 32))
FIRST_CAPACITY = 63
# The ratio's histogram: buckets 5% wide (relative), not CompressionConfig.alpha's 1%: the error of every width
# is measured over every bucket, and a value's distance to its bucket, at most 5% of it, moves the measured
# relative error by at most 0.05.
RATIO_SKETCH = sketch.SketchSpec(0.05)


def table_size(bins: int) -> int:
    """Entries of the value table of a moment quantized to `bins` levels per sign."""
    return 2 * bins


@functools.partial(jax.jit, static_argnames=("buckets", "bins", "spec", "iters", "tol", "restarts", "dtypes"))
def _encode_moments(ms, key, *, buckets, bins, spec, iters, tol, restarts, dtypes):
    """Codes, value tables and in-place exact values of second moments, per bucket of moments alike
    (`quantize.buckets`), each stacked: a bucket is encoded by one vmapped pass and returned as stacks
    (`quantize.unstack` gives the tensors), so the compiled program grows with the number of distinct shapes, not
    of tensors."""
    reps = spec.representatives()
    positive = reps > 0
    # (buckets <= 0 take the smallest positive one's value, so the points are non-decreasing as k-means needs;
    # their weight is 0)
    log_reps = jnp.asarray(np.log(np.where(positive, reps, reps[positive].min())).astype(np.float32))
    tiny = np.float32(np.finfo(np.float32).tiny)
    prepared, hists = [], []
    for b in buckets:
        m = quantize.stacked([ms[i] for i in b])
        m32 = m.astype(jnp.float32)
        finite = jnp.isfinite(m32)
        # Sign and zero from the bits: XLA's CPU backend flushes subnormals to 0 in comparisons, and a subnormal
        # moment must keep its sign (and not become 0).
        bits = jax.lax.bitcast_convert_type(m32, jnp.int32)
        keep = finite & ((bits & 0x7FFFFFFF) != 0)
        mag = jnp.abs(m32)
        prepared.append((m, finite, keep, bits < 0, mag))
        hists.append(quantize.per_tensor_map(lambda v, k: sketch.histogram(v, spec, k), mag, keep))
    counts = jnp.concatenate(hists).astype(jnp.float32)
    order = [i for b in buckets for i in b]  # the moment of each row of `counts`
    weights = jnp.where(positive, counts / jnp.maximum(jnp.max(counts, axis=1, keepdims=True), 1.0), 0.0)
    keys = jax.random.split(key, len(ms))[np.asarray(order)]
    centres = jax.vmap(lambda w, k: kmeans.weighted_kmeans(log_reps, w, bins, k, iters=iters, tol=tol,
                                                           restarts=restarts))(weights, keys)
    out = []
    row = 0
    for b, (m, finite, keep, negative, mag) in zip(buckets, prepared):
        # Levels inside the leaf dtype's normal range (before assignment, so each value still takes the nearest
        # level it decodes to): a non-zero moment never decodes to 0 or Inf.
        # Then rounded to bfloat16 as every stored table is (`quantize.bf16_table`; a level of at least `tiny`, a
        # power of two, stays so), and a value takes the nearest in log|m| of those.
        info = jnp.finfo(dtypes[b[0]])
        c = jnp.clip(centres[row:row + len(b)], float(np.log(info.tiny)), float(np.log(info.max)))
        levels = quantize.bf16_table(jnp.clip(jnp.exp(c), float(info.tiny), float(info.max)), float(info.max))
        level = jax.vmap(kmeans.assign)(jnp.log(jnp.maximum(mag, tiny)), jnp.log(levels))
        code = jnp.where(negative, bins - level, bins + 1 + level)
        code = jnp.where(keep, code, PRUNED)
        code = jnp.where(finite, code, protected_code(table_size(bins))).astype(jnp.uint8)
        table = jnp.concatenate([-levels[:, ::-1], levels], axis=1)
        out.append((code, table, jnp.where(finite, jnp.zeros((), m.dtype), m)))
        row += len(b)
    return out


def encode_on_device(ms: Sequence[jax.Array], cfg: CompressionConfig,
                     key: jax.Array | None = None) -> list[DeviceCodes]:
    """Quantize second moments in the log domain (see the module docstring), dispatched and not waited for.

    Args:
      ms: non-negative float tensors (float32, bfloat16, float16), any shape and sharding.
      cfg: its `effective_moment_bins`, and the k-means parameters.
      key: PRNG key for k-means++; defaults to a fold of PRNGKey(cfg.seed).

    Returns:
      One `DeviceCodes` per moment whose `centres` is the 2K-entry value table and whose `bins` is 2K.
    """
    if not ms:
        return []
    key = seed_key(cfg.seed, 0x6D6F6D) if key is None else key
    out: list[DeviceCodes | None] = [None] * len(ms)
    for unit in quantize.device_units(ms):  # one call per device set
        part = [ms[i] for i in unit]
        groups = quantize.buckets(part)
        stacks = _encode_moments(
            part, key, buckets=groups, bins=cfg.effective_moment_bins, spec=sketch.SketchSpec(cfg.alpha),
            iters=cfg.kmeans_iters, tol=cfg.kmeans_tol, restarts=cfg.kmeans_restarts,
            dtypes=tuple(jnp.dtype(m.dtype) for m in part))
        for b, bucket in zip(groups, stacks):
            for j, (c, t, v) in zip(b, zip(*map(quantize.unstack, bucket))):
                out[unit[j]] = DeviceCodes(c, t, v, table_size(cfg.effective_moment_bins))
    return out  # type: ignore[return-value]


# A first moment is encoded in three jitted steps, so compile time does not grow with the number of tensors:
# its ratio and histogram (compiled per shape), the choice of cell width on that histogram (whose shape is the
# sketch's: compiled once), its codes (per shape).
@functools.partial(jax.jit, static_argnames=("spec",))
def _ratio(m, s, wc, prunes, *, spec):
    """(ratio, 0 where not quantized; exact zeros; values stored exactly; the ratio's histogram) of a first
    moment `m` relative to sqrt(`s`) (None: 1), with the codes `wc` of its weight (None: not pruned), whose pruned
    entries are zeros of the moment where the traced bool `prunes` is true (a keyframe's codes; a closed-loop
    residual's are not: traced, so both kinds of save run one compiled kernel)."""
    m32 = m.astype(jnp.float32)
    # Zero from the bits: XLA's CPU backend flushes subnormals to 0 in comparisons, and a subnormal moment must
    # not become 0.
    zero = (jax.lax.bitcast_convert_type(m32, jnp.int32) & 0x7FFFFFFF) == 0
    if wc is not None:
        zero = zero | ((wc == PRUNED) & prunes)
    if s is None:
        r, exact = m32, ~jnp.isfinite(m32)
    else:
        root = jnp.sqrt(s.astype(jnp.float32))
        r = m32 / jnp.where(root > 0, root, 1.0)
        exact = ~(jnp.isfinite(m32) & jnp.isfinite(root) & (root > 0) & jnp.isfinite(r))
    exact = exact & ~zero
    keep = ~zero & ~exact
    return jnp.where(keep, r, 0.0), zero, exact, sketch.histogram(r, spec, keep)


@functools.partial(jax.jit, static_argnames=("spec",))
def _widths(hist, budget, *, spec):
    """(levels in `FIRST_CAPACITY` slots, cell count, cell width) of the widest of `FIRST_STEPS` whose squared
    error on the histogram is at most `budget` of the sum of squares (the least error of them if none is)."""
    reps = jnp.asarray(spec.representatives())
    h = hist.astype(jnp.float32)
    busy = h > 0
    total = jnp.sum(jnp.where(busy, h * reps * reps, 0.0))
    rms = jnp.sqrt(total / jnp.maximum(jnp.sum(h), 1.0))
    top = jnp.max(jnp.where(busy, jnp.abs(reps), 0.0))

    def one(step):
        width = jnp.where(rms > 0, step * rms, 1.0)  # quantize.uniform_levels' width
        cells = 2 * jnp.clip(jnp.ceil(top / width - 0.5), 0, (FIRST_CAPACITY - 1) // 2).astype(jnp.int32) + 1
        levels, width = quantize.uniform_levels(h, spec, cells, step, FIRST_CAPACITY, centred=False)
        levels = jnp.where(jnp.arange(FIRST_CAPACITY) < cells, levels, 0.0)
        err = jnp.sum(jnp.where(busy, h * (reps - levels[quantize.uniform_cell(reps, width, cells)]) ** 2, 0.0))
        return levels, cells, width, err

    levels, cells, widths, errs = jax.vmap(one)(jnp.asarray(FIRST_STEPS, jnp.float32))
    within = errs <= budget * total
    choice = jnp.where(jnp.any(within), len(FIRST_STEPS) - 1 - jnp.argmax(within[::-1]), jnp.argmin(errs))
    return levels[choice], cells[choice], widths[choice]


@jax.jit
def _codes(m, r, zero, exact, levels, cells, width):
    """(uint8 codes, value table, the exact values in place) of one first moment."""
    code = jnp.where(exact, cells + 1, jnp.where(zero, PRUNED, 1 + quantize.uniform_cell(r, width, cells)))
    table = quantize.bf16_table(levels, float(jnp.finfo(jnp.float32).max))  # as every stored table (a ratio)
    return code.astype(jnp.uint8), table, jnp.where(exact, m, jnp.zeros((), m.dtype))


def encode_first_on_device(ms: Sequence[jax.Array], scales: Sequence[jax.Array | None],
                           weight_codes: Sequence[jax.Array | None], cfg: CompressionConfig,
                           prunes: Sequence[bool] | None = None,
                           budgets: Sequence[float] | None = None) -> list[DeviceCodes]:
    """Quantize first moments relative to their second moments (see the module docstring), dispatched and not
    waited for.

    Args:
      ms: float first-moment tensors (float32, bfloat16, float16), any shape and sharding.
      scales: for each, the decoded second moment of its shape and sharding it is coded relative to (what a
        restore gives back for it), or None (coded as it is).
      weight_codes: for each, the codes of its weight at this save (its zeros where the weight was pruned are
        zeros of the moment), or None.
      cfg: its `effective_moment_budget`.
      prunes: for each, whether its weight's pruned codes prune it (None: all do). False for the codes of a
        closed-loop residual, whose pruned entries keep the weight's previous value: passed anyway, so a
        residual save runs the kernels a keyframe compiled.
      budgets: for each, the factor of `effective_moment_budget` it is coded within (None: 1 for all; Lion's
        and Muon's `mu` take `policy.NORMALIZED_BUDGET`).

    Returns:
      One `DeviceCodes` per moment: `centres` the cells' levels in `FIRST_CAPACITY` slots (the first `bins`
      used), `bins` the cell count chosen (a device scalar), `scale` the given scale.
    """
    if not len(ms) == len(scales) == len(weight_codes):
        raise ValueError("moments.encode_first_on_device needs one scale (or None) and one weight-codes array (or "
                         "None) per moment")
    if not ms:
        return []
    prunes = [True] * len(ms) if prunes is None else list(prunes)
    budgets = [1.0] * len(ms) if budgets is None else list(budgets)
    if not len(prunes) == len(budgets) == len(ms):
        raise ValueError("moments.encode_first_on_device needs one prunes flag and one budget factor per moment")
    out = []
    for m, s, wc, pr, b in zip(ms, scales, weight_codes, prunes, budgets):
        r, zero, exact, hist = _ratio(m, s, wc, np.bool_(pr), spec=RATIO_SKETCH)
        levels, cells, width = _widths(hist, np.float32(b * cfg.effective_moment_budget), spec=RATIO_SKETCH)
        codes, table, in_place = _codes(m, r, zero, exact, levels, cells, width)
        out.append(DeviceCodes(codes, table, in_place, cells, scale=s))
    return out
