"""How few bits any coder could spend on a closed-loop residual at the default's budget: rate-distortion bounds
on the parameters' residuals of real training runs, against what the default's quantizer spends.

Usage: python benchmarks/residual_bound.py [--workloads NAME ...] [--saves N] [--budgets B ...] [--out FILE]
(needs the `bench` extra: pip install -e '.[bench]')

Each workload of bench_fidelity.py trains (seed 0, no checkpoints) for `--saves` of its save intervals (by
default its fidelity run's); its parameters are coded as a closed loop in NumPy: the first save exact (a keyframe,
not counted), each later one the residual r = w - w_hat against the previous reconstruction, on the default
residual space's quantizer (`RESIDUAL_SPACE`: 63 uniform cells decoded to their centres, one step for the whole
state; the outer cells' means are not modelled) with each tensor's cells `step` times its own residual's RMS (the
split of earlier releases: `residual_width_power` 1), the widest step of the space's grid whose squared error is
at most the budget times the residual's energy (what `residual_budget` bounds: `search.proxy_degradation`
without weights, the default's). Tensors as the library quantizes them: float parameters of 64 or more values
(`save.MIN_RESIDUAL_SIZE`); the others are not counted.

Per save, on the same residuals (that chain's), at total squared error D = budget x energy:

- **power 1**: order-0 entropy of those codes (what the code streams cost within a few percent: the stored
  streams are within 1.05x of it, docs/results.md).
- **power 1, exact step**: the same cells with the step solved to meet the budget exactly (not on the grid).
- **power 1/2 (default)**, **power 0**: the cells of `CompressionConfig.residual_width_power` 1/2 (the default)
  and 0: each tensor's width `step` times the whole state's residual RMS^(1 - p) times its own RMS^p, at least
  1/8 of `step` times its own RMS (`quantize.uniform_levels`), the widest step of the grid within the budget.
  The budget bounds the state's total squared error; power 1 splits it between tensors in proportion to their
  residuals' energy, while at high resolution the split that takes the fewest bits for the same total (equal
  slopes) gives every tensor the same width (power 0).
- **lower bound, each tensor's budget**: the Shannon lower bound summed over tensors, each allowed the budget
  times its own residual's energy (power 1's split): h(r_i) - n_i/2 log2(2 pi e budget var_i), h from a
  per-tensor histogram 1/64 of the RMS wide (the plug-in estimate, at least 0 a tensor). No coder of the
  residual, scalar or vector, spends less with the error split that way (up to the estimate's error; values that
  did not change at all, an embedding's unused rows, make the estimate low).
- **Gaussian bound, the state's budget**: R(D) of a Gaussian source of the residual's per-tensor variances, the
  total error D split by reverse water-filling: the most an optimal coder of this residual needs at that total
  (the Gaussian is the hardest source of a given variance).

All are bits per coded parameter per residual save, averaged over the saves, and 32 over them (float32
parameters): the parameters' ratio of residual saves alone, with keyframes free, so above what a run with
keyframes, value tables and records reaches.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fault_tolerance as ft  # noqa: E402
import bench_fidelity as bf  # noqa: E402
import report  # noqa: E402
from residual_coding import entropy_bits  # noqa: E402

from inshrink_jax import config, save  # noqa: E402

CELLS = 63
HALF = (CELLS - 1) // 2
GRID = tuple(sorted(config.RESIDUAL_SPACE.steps))
COLUMNS = ("power 1", "power 1, exact step", "power 1/2 (default)", "power 0", "lower bound, each tensor's budget",
           "Gaussian bound, the state's budget")


def quantized(rs, widths):
    """(codes, decoded) of each residual on centred cells of its width, clipped to the 63 cells."""
    out = []
    for r, w in zip(rs, widths):
        q = np.clip(np.round(r / w), -HALF, HALF)
        out.append((q, q * w))
    return out


def error(rs, coded) -> float:
    return float(sum(((r - d) ** 2).sum() for r, (_, d) in zip(rs, coded)))


def widths_of(rs, step: float, power: float):
    """Cell widths: `step` times the whole state's residual RMS^(1 - power) times the tensor's RMS^power (power
    1: each tensor's own RMS, earlier releases'; 1/2: the default's; 0: one width), at least an eighth of the
    tensor's own step, so 63 cells span its values."""
    rms = [math.sqrt(float((r.astype(np.float64) ** 2).mean())) for r in rs]
    whole = math.sqrt(sum(float((r.astype(np.float64) ** 2).sum()) for r in rs) / sum(r.size for r in rs))
    return [max(step * whole ** (1 - power) * x ** power, step * x / 8, 1e-30) for x in rms]


def widest(rs, budget: float, power: float):
    """The codes of the widest step of the grid whose error is at most `budget` of the energy (the finest if
    none), cells of `power` (`widths_of`)."""
    energy = sum(float((r.astype(np.float64) ** 2).sum()) for r in rs)
    best = None
    for s in GRID:
        coded = quantized(rs, widths_of(rs, s, power))
        if best is None or error(rs, coded) <= budget * energy:
            best = coded
    return best


def exact_step(rs, budget: float, power: float):
    """The codes of the step that meets the budget exactly (bisection on log step; the error rises with it)."""
    energy = sum(float((r.astype(np.float64) ** 2).sum()) for r in rs)
    lo, hi = math.log(0.05), math.log(20.0)
    for _ in range(30):
        mid = (lo + hi) / 2
        if error(rs, quantized(rs, widths_of(rs, math.exp(mid), power))) <= budget * energy:
            lo = mid
        else:
            hi = mid
    return quantized(rs, widths_of(rs, math.exp(lo), power))


def gaussian_bound(rs, budget: float) -> float:
    """Bits of R(D) for independent Gaussians of the tensors' variances, D split by reverse water-filling."""
    var = np.array([float((r.astype(np.float64) ** 2).mean()) for r in rs])
    n = np.array([r.size for r in rs], np.float64)
    target = budget * float((n * var).sum())
    lo, hi = 0.0, float(var.max())
    for _ in range(100):  # theta with sum n min(theta, var) = D
        theta = (lo + hi) / 2
        if float((n * np.minimum(theta, var)).sum()) <= target:
            lo = theta
        else:
            hi = theta
    keep = var > lo
    return float((n[keep] * 0.5 * np.log2(var[keep] / lo)).sum())


def shannon_lower_bound(rs, budget: float) -> float:
    """Bits of the Shannon lower bound summed over the tensors, each allowed the budget times its own energy:
    h(r_i) - n_i/2 log2(2 pi e budget var_i), h from a plug-in histogram 1/64 of the RMS wide, at least 0."""
    total = 0.0
    for r in rs:
        var = float((r.astype(np.float64) ** 2).mean())
        if var == 0:
            continue  # an unchanged tensor: nothing to code
        delta = math.sqrt(var) / 64
        h = entropy_bits(np.floor(r / delta)) + r.size * math.log2(delta)
        total += max(0.0, h - r.size / 2 * math.log2(2 * math.pi * math.e * budget * var))
    return total


def coded_parameters(state) -> list[np.ndarray]:
    """The float parameters of 64+ values (`save.MIN_RESIDUAL_SIZE`) of a training state, as float32 arrays."""
    leaves = [np.asarray(a, np.float32) for a in jax.tree_util.tree_leaves(state.params)
              if np.issubdtype(np.asarray(a).dtype, np.floating)]
    return [a for a in leaves if a.ndim >= 1 and a.size >= save.MIN_RESIDUAL_SIZE]


def trajectory(name: str, saves: int, take=coded_parameters):
    """(workload, [take(state) at each save]) of seed 0, `saves` intervals (0: the workload's whole run); by
    default the float parameters of 64+ values."""
    cls = bf.WORKLOADS[name]
    work = cls(0) if cls is ft.Mnist else cls(0, cls.steps)
    return work, cls, saved(work, cls.every, saves or cls.steps // cls.every, take)


def saved(work, every: int, saves: int, take) -> list:
    """[take(state) at each of the first `saves` saves] of `work` (`create_state`, `batch`, `train_step`) trained
    from its initial state, a save every `every` steps."""
    state, snaps = work.create_state(), []
    for step in range(1, every * saves + 1):
        state, _, _ = work.train_step(state, *work.batch(step))
        if step % every == 0:
            snaps.append(take(state))
    return snaps


def measure(snaps, budget: float) -> dict:
    """Bits per coded value per residual save, averaged, of each of COLUMNS."""
    hat = [a.copy() for a in snaps[0]]
    totals = dict.fromkeys(COLUMNS, 0.0)
    n = 0
    for params in snaps[1:]:
        rs = [w - h for w, h in zip(params, hat)]
        coded = widest(rs, budget, 1.0)
        totals["power 1"] += sum(entropy_bits(q) for q, _ in coded)
        totals["power 1, exact step"] += sum(entropy_bits(q) for q, _ in exact_step(rs, budget, 1.0))
        for name, power in (("power 1/2 (default)", 0.5), ("power 0", 0.0)):
            totals[name] += sum(entropy_bits(q) for q, _ in widest(rs, budget, power))
        totals["lower bound, each tensor's budget"] += shannon_lower_bound(rs, budget)
        totals["Gaussian bound, the state's budget"] += gaussian_bound(rs, budget)
        hat = [h + d for h, (_, d) in zip(hat, coded)]
        n += sum(r.size for r in rs)
    return {k: v / n for k, v in totals.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["charlm", "resnet", "vit", "mixer"],
                    choices=sorted(bf.WORKLOADS))
    ap.add_argument("--saves", type=int, default=0,
                    help="save intervals trained per workload (the first exact); 0: the fidelity run's")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.4],
                    help="residual budgets (0.2: the default, epsilon 0.01; 20 x epsilon)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows, about = [], []
    for name in args.workloads:
        t0 = time.perf_counter()
        work, cls, snaps = trajectory(name, args.saves)
        about.append(f"- {name}: {work.describe(cls.steps)}; a save every {cls.every} steps, the first "
                     f"{cls.every * len(snaps)} steps; {len(snaps[0])} tensors, "
                     f"{sum(a.size for a in snaps[0]):,} coded values")
        for b in args.budgets:
            bits = measure(snaps, b)
            rows.append([name, f"{b:g}"] + [f"{bits[c]:.3f} ({32 / bits[c]:.1f}x)" if bits[c] > 0 else "0"
                                             for c in COLUMNS]
                        + [f"{bits[COLUMNS[2]] / bits[COLUMNS[4]]:.2f}x"])
            print(name, b, {k: round(v, 3) for k, v in bits.items()}, f"{time.perf_counter() - t0:.0f} s",
                  flush=True)
    head = ["workload", "budget", *COLUMNS, "power 1/2 / lower bound"]
    report.emit([
        "# Bits of a closed-loop residual save: the default's quantizer against rate-distortion bounds", "",
        "Command: `python benchmarks/residual_bound.py " + " ".join(argv if argv is not None else sys.argv[1:])
        + "`", "", __doc__.split("\n\n", 2)[2].strip(), "", "Workloads:", "", *about, "",
        "Bits per coded parameter per residual save (in brackets: 32 over it, the parameters' ratio of residual "
        "saves alone), and the default's (power 1/2) bits over the lower bound:", "",
        "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1),
        *("| " + " | ".join(r) + " |" for r in rows)], args.out)

if __name__ == "__main__":
    main()
