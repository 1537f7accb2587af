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
width w centred on zero, as many as the ratio's range needs (at most `FIRST_CAPACITY`). The first moments of a
save share one budget: their widths are a step s times G^(1 - p) times each ratio's RMS^p (at least s times its
RMS / 8; `quantize.uniform_levels`' width reference), G the RMS of all their ratios, p
`CompressionConfig.moment_width_power`, and s is chosen at every save, on the device, as the widest of
`FIRST_STEPS`, refined 1.022x apart (`FIRST_REFINE`), whose squared update error summed over them, measured on
the ratios' histograms (`RATIO_SKETCH`), is at most `CompressionConfig.effective_moment_budget` of their
updates' (the least error of them if none is): the same bound on every model, with no data needed. As a
residual's (`CompressionConfig.residual_width_power`), p = 1 splits that total in proportion to each moment's
energy and p = 0 gives all one width, the split of the fewest bits at high resolution; 0.5, the default, took
fewer bits than 1 on every workload measured, the most where the moments' scales differ most
(benchmarks/results/moment_split.md). Moments of another budget factor (Lion's and Muon's `mu`), of other units
(with no second moment beside them against with one) or on another device set share a budget of their own; Lion's
and Muon's, whose updates are normalized per tensor, are each coded within its own.
Codes are the
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


# Steps of a first moment's cells, relative to its width reference (its ratio's RMS at moment_width_power 1),
# finest first (encode_first_on_device picks one per budget and save), and the most cells (odd: one centred on
# zero). The widest of FIRST_STEPS within the budget is refined by FIRST_REFINE steps between it and the next
# wider one (1.186x apart, then 1.022x): at the coarse grid's choice a tensor's error sat on average half a coarse
# step below its budget, and its codes took 8-10% more bits than at the width that meets it
# (benchmarks/results/moment_split.md); 39 steps evaluated instead of 128 on one fine grid.
FIRST_STEPS = tuple(float(x) for x in np.geomspace(0.02, 4.0, 32))
FIRST_REFINE = 7
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


def _cells_at(hist, step, reference, *, spec):
    """(levels in `FIRST_CAPACITY` slots, cell count, cell width, squared error on the histogram) of the cells
    `step` times the ratio's width reference wide (`quantize.uniform_levels`: [scale, power], so step times
    max(scale RMS^power, RMS / 8); [1, 1]: step times its own RMS), as many as the ratio's range needs."""
    reps = jnp.asarray(spec.representatives())
    h = hist.astype(jnp.float32)
    busy = h > 0
    rms = jnp.sqrt(jnp.sum(jnp.where(busy, h * reps * reps, 0.0)) / jnp.maximum(jnp.sum(h), 1.0))
    top = jnp.max(jnp.where(busy, jnp.abs(reps), 0.0))
    scale, power = reference[0], reference[1]
    width = step * jnp.where(power == 1, rms, jnp.maximum(scale * rms ** power, rms / 8))
    width = jnp.where(rms > 0, width, 1.0)  # quantize.uniform_levels' width
    cells = 2 * jnp.clip(jnp.ceil(top / width - 0.5), 0, (FIRST_CAPACITY - 1) // 2).astype(jnp.int32) + 1
    levels, width = quantize.uniform_levels(h, spec, cells, step, FIRST_CAPACITY, centred=False, reference=reference)
    levels = jnp.where(jnp.arange(FIRST_CAPACITY) < cells, levels, 0.0)
    err = jnp.sum(jnp.where(busy, h * (reps - levels[quantize.uniform_cell(reps, width, cells)]) ** 2, 0.0))
    return levels, cells, width, err


@functools.partial(jax.jit, static_argnames=("spec",))
def _energy(hist, *, spec):
    """(sum of squares, count) of the ratio's values on its histogram."""
    reps = jnp.asarray(spec.representatives())
    h = hist.astype(jnp.float32)
    return jnp.sum(jnp.where(h > 0, h * reps * reps, 0.0)), jnp.sum(h)


@functools.partial(jax.jit, static_argnames=("spec",))
def _errors(hist, steps, reference, *, spec):
    """The squared error on the histogram of the cells of each of `steps` (`_cells_at`)."""
    return jax.vmap(lambda step: _cells_at(hist, step, reference, spec=spec)[3])(steps)


@functools.partial(jax.jit, static_argnames=("spec",))
def _levels(hist, step, reference, *, spec):
    """(levels, cell count, cell width) of the cells of `step` (`_cells_at`)."""
    return _cells_at(hist, step, reference, spec=spec)[:3]


@jax.jit
def _reference(energies, counts, power):
    """[G^(1 - power), power] of moments whose ratios' sums of squares and counts are given, G the RMS of all
    their values ([1, 1] where G is 0)."""
    g = jnp.sqrt(jnp.sum(energies) / jnp.maximum(jnp.sum(counts), 1.0))
    return jnp.stack([jnp.where(g > 0, g ** (1 - power), 1.0), jnp.where(g > 0, power, 1.0)])


@jax.jit
def _coarse(errs, allowed):
    """(index of the widest of `FIRST_STEPS` whose summed error is within `allowed`, or of the least error where
    none is; whether one is; the steps between it and the next wider one that refine it)."""
    steps = jnp.asarray(FIRST_STEPS, jnp.float32)
    within = errs <= allowed
    found = jnp.any(within)
    k = jnp.where(found, len(FIRST_STEPS) - 1 - jnp.argmax(within[::-1]), jnp.argmin(errs))
    wider = steps[jnp.minimum(k + 1, len(FIRST_STEPS) - 1)]
    fractions = jnp.arange(1, FIRST_REFINE + 1, dtype=jnp.float32) / (FIRST_REFINE + 1)
    return steps[k], found, steps[k] * (wider / steps[k]) ** fractions


@jax.jit
def _fine(step, found, fine_steps, fine_errs, allowed):
    """The widest of `fine_steps` whose summed error is within `allowed` where the coarse step was, else it."""
    within = (fine_errs <= allowed) & found
    return jnp.where(jnp.any(within), fine_steps[FIRST_REFINE - 1 - jnp.argmax(within[::-1])], step)


def _steps(hists: list, budget: float, power: float) -> tuple[jax.Array, jax.Array]:
    """(step, width reference) of first moments coded within one budget (`encode_first_on_device`): the widest
    step whose squared error summed over all of them is at most `budget` of their summed squares (the least
    error of `FIRST_STEPS` if none is), on `FIRST_STEPS` refined by `FIRST_REFINE`; each moment's cells `step`
    times G^(1 - power) times its ratio's RMS^power (at least step times its RMS / 8), G the RMS of all their
    ratios. Device values, not waited for (the arrays are of one device set)."""
    spec = RATIO_SKETCH
    sums = [_energy(h, spec=spec) for h in hists]
    energies, counts = jnp.stack([e for e, _ in sums]), jnp.stack([c for _, c in sums])
    reference = _reference(energies, counts, np.float32(power))
    allowed = np.float32(budget) * jnp.sum(energies)
    steps = jnp.asarray(FIRST_STEPS, jnp.float32)
    step, found, fine_steps = _coarse(sum(_errors(h, steps, reference, spec=spec) for h in hists), allowed)
    fine_errs = sum(_errors(h, fine_steps, reference, spec=spec) for h in hists)
    return _fine(step, found, fine_steps, fine_errs, allowed), reference


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
      cfg: its `effective_moment_budget` and `moment_width_power`.
      prunes: for each, whether its weight's pruned codes prune it (None: all do). False for the codes of a
        closed-loop residual, whose pruned entries keep the weight's previous value: passed anyway, so a
        residual save runs the kernels a keyframe compiled.
      budgets: for each, the factor of `effective_moment_budget` it is coded within (None: 1 for all; Lion's
        and Muon's `mu` take `policy.NORMALIZED_BUDGET`): the moments of one factor, of the same units (a scale
        or None) and on one device set share that budget, its total error split by `moment_width_power`.

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
    ratios = [_ratio(m, s, wc, np.bool_(pr), spec=RATIO_SKETCH)
              for m, s, wc, pr in zip(ms, scales, weight_codes, prunes)]
    # One budget for the moments of one budget factor, of the same units (relative to a second moment or not)
    # and on one device set. A moment coded within less than the full budget is one whose update is normalized
    # per tensor (Lion's sign, Muon's polar factor: policy.MOMENT_BUDGETS): a small moment's update is as large as
    # a large one's, so each is coded within its own budget, alone. (Sharing one at power 0.5, then at power 1,
    # ended a Muon transformer +1.83% and +2.52% against a noise floor of 1.25%, where each moment within its own
    # had ended +0.74%.)
    groups: dict = {}
    for u, unit in enumerate(quantize.device_units(list(ms))):
        for i in unit:
            groups.setdefault((u, budgets[i], scales[i] is None, i if budgets[i] < 1 else None), []).append(i)
    out: list[DeviceCodes | None] = [None] * len(ms)
    for (_, b, _, _), members in groups.items():
        step, reference = _steps([ratios[i][3] for i in members], b * cfg.effective_moment_budget,
                                 cfg.moment_width_power)
        for i in members:
            r, zero, exact, hist = ratios[i]
            levels, cells, width = _levels(hist, step, reference, spec=RATIO_SKETCH)
            codes, table, in_place = _codes(ms[i], r, zero, exact, levels, cells, width)
            out[i] = DeviceCodes(codes, table, in_place, cells, scale=scales[i])
    return out
