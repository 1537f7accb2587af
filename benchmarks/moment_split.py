"""How many bits a first moment's cells take: the library's per-tensor width on a coarse grid, a refined grid,
and one budget per save split between tensors as a closed-loop residual's is (not built: measured here and in
fidelity runs, docs/results.md).

Usage: python benchmarks/moment_split.py [--workloads NAME ...] [--saves N] [--out FILE]
(needs the `bench` extra: pip install -e '.[bench]')

Each workload of bench_fidelity.py trains (seed 0, no checkpoints) for `--saves` of its save intervals. At each
save, the first moments the default stores quantized (`save.plan` with `CompressionConfig()`: Adam's `mu`, SGD's
`trace` ...) are taken as the library codes them: the ratio r = mu / sqrt(nu) to the second moment it is coded
relative to (the unquantized `nu` here, where a save uses the stored one; mu itself where there is none), within
its factor of the budget (`policy.LeafPolicy.budget`) times `effective_moment_budget` (0.3 at the default
epsilon). The quantizer is moments.py's: cells of width w centred on zero, as many as the ratio's range needs (at
most `moments.FIRST_CAPACITY`), each decoded to its values' mean; the error is the squared error of the ratio,
the update's. Columns, bits per first-moment value per save (order-0 entropy of the codes, what the stored
streams cost within a few percent), averaged over the saves, and the error over the budget:

- **each tensor, coarse grid**: each tensor's widest width of `moments.FIRST_STEPS` (times its ratio's RMS,
  1.186x apart) whose error is at most the budget times its energy (the least error of them if none is): the
  library's choice.
- **each tensor, refined**: the same, refined by `REFINE` widths between it and the next wider step (1.022x apart).
- **whole save, power p**: one budget for all of a save's first moments of one budget factor and units (relative
  to a second moment or not), the total error at most the budget times their total energy, each tensor's width `s`
  G^(1-p) RMS_i^p (at least `s` RMS_i / 8; G the RMS of all their ratios), `s` solved to meet it (bisection): power
  1 shares the error in proportion to each tensor's energy, power 0 gives all one width (equal slopes: the fewest
  bits for the same total at high resolution), as `CompressionConfig.residual_width_power` splits a residual's.
- **..., at the coarse grid's error**: the same, its total error the coarse grid's (which sits below the budget
  by up to a step): what the split gains at equal error.
- **library**: `moments.encode_first_on_device`'s codes (its width measured on the ratio's histogram, buckets 5%
  wide), to check the model of the first column.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from residual_bound import trajectory, widths_of  # noqa: E402
from residual_coding import entropy_bits  # noqa: E402

from inshrink_jax import CompressionConfig, moments, save  # noqa: E402

CFG = CompressionConfig()
HALF = (moments.FIRST_CAPACITY - 1) // 2
REFINE = 7  # steps between two of FIRST_STEPS in "each tensor, refined"
COLUMNS = ("each tensor, coarse grid", "each tensor, refined", "whole save, power 1", "whole save, power 1/2",
           "whole save, power 0", "whole save, power 1, at the coarse grid's error",
           "whole save, power 1/2, at the coarse grid's error", "library")


def first_moments(state):
    """[(ratio, the unquantized moment, its scale or None, budget)] of the state's quantized first moments."""
    p = save.plan(state, None, None, CFG)
    out = []
    for i, first, budget, j in zip(p.moments, p.first, p.budgets, p.scales):
        if not first or p.records[i].kind != "quantized":
            continue
        m = np.asarray(p.leaves[i], np.float64)
        s = None if j is None else np.asarray(p.leaves[j], np.float64)
        r = m if s is None else np.divide(m, np.sqrt(s), out=np.zeros_like(m), where=s > 0)
        r = np.where(np.isfinite(r), r, 0.0).ravel()
        out.append((r, p.leaves[i], None if j is None else p.leaves[j], budget * CFG.effective_moment_budget))
    return out


def coded(r: np.ndarray, width: float):
    """(codes, squared error) of `r` on centred cells of `width`, each decoded to its values' mean."""
    top = float(np.abs(r).max()) if r.size else 0.0
    half = int(min(HALF, max(0, math.ceil(top / width - 0.5))))
    q = np.clip(np.round(r / width), -half, half).astype(np.int64)
    sums = np.bincount(q + half, weights=r, minlength=2 * half + 1)
    counts = np.bincount(q + half, minlength=2 * half + 1)
    means = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
    return q, float(((r - means[q + half]) ** 2).sum())


def per_tensor(r, budget, refine: bool):
    """(codes, error) of the widest step within `budget` of r's energy: moments.py's choice, with or without its
    refinement."""
    energy = float((r ** 2).sum())
    rms = math.sqrt(energy / r.size) or 1.0
    steps = moments.FIRST_STEPS
    tries = [coded(r, s * rms) for s in steps]
    within = [k for k, (_, e) in enumerate(tries) if e <= budget * energy]
    if not within:
        return min(tries, key=lambda t: t[1])
    k = within[-1]
    best = tries[k]
    if refine and k + 1 < len(steps):
        for f in range(1, REFINE + 1):
            t = coded(r, steps[k] * (steps[k + 1] / steps[k]) ** (f / (REFINE + 1)) * rms)
            if t[1] <= budget * energy:
                best = t
    return best


def library(moms) -> list:
    """[(codes, error)] of moments.encode_first_on_device on `moms`, as a save codes them."""
    devs = moments.encode_first_on_device(
        [jnp.asarray(m) for _, m, _, _ in moms], [None if s is None else jnp.asarray(s) for _, _, s, _ in moms],
        [None] * len(moms), CFG, budgets=[b / CFG.effective_moment_budget for *_, b in moms])
    out = []
    for d, (_, m, s, _) in zip(devs, moms):
        decoded = np.asarray(d.dequantize(jnp.float32), np.float64).ravel()
        m = np.asarray(m, np.float64).ravel()
        root = np.ones_like(m) if s is None else np.sqrt(np.asarray(s, np.float64).ravel())
        ok = root > 0
        out.append((np.asarray(d.codes).ravel(), float((((decoded - m)[ok] / root[ok]) ** 2).sum())))
    return out


def whole_save(rs, budget, power):
    """[(codes, error)] of one step `s` for all of `rs`, widths s G^(1-p) RMS_i^p (at least s RMS_i / 8:
    `residual_bound.widths_of`), the widest whose total error is within `budget` of the total energy (bisection
    on log s)."""
    energy = sum(float((r ** 2).sum()) for r in rs)

    def at(s):
        return [coded(r, w) for r, w in zip(rs, widths_of(rs, s, power))]

    lo, hi = math.log(0.01), math.log(20.0)
    for _ in range(16):
        mid = (lo + hi) / 2
        if sum(e for _, e in at(math.exp(mid))) <= budget * energy:
            lo = mid
        else:
            hi = mid
    return at(math.exp(lo))


def measure(snaps) -> dict:
    """{column: (bits per value per save, error over the budget)} averaged over the saves."""
    bits = dict.fromkeys(COLUMNS, 0.0)
    err = dict.fromkeys(COLUMNS, 0.0)
    allowed = values = 0.0
    for moms in snaps:
        allowed += sum(b * float((r ** 2).sum()) for r, _, _, b in moms)
        values += sum(r.size for r, _, _, _ in moms)
        outs = {COLUMNS[0]: [per_tensor(r, b, False) for r, _, _, b in moms],
                COLUMNS[1]: [per_tensor(r, b, True) for r, _, _, b in moms],
                COLUMNS[7]: library(moms)}
        for name in COLUMNS[2:7]:
            outs[name] = [None] * len(moms)
        for b, alone in {(mom[3], mom[2] is None) for mom in moms}:  # one budget factor and units
            idx = [k for k, mom in enumerate(moms) if (mom[3], mom[2] is None) == (b, alone)]
            rs = [moms[k][0] for k in idx]
            energy = sum(float((r ** 2).sum()) for r in rs)
            coarse = sum(outs[COLUMNS[0]][k][1] for k in idx) / max(energy, 1e-300)
            for name, power, budget in zip(COLUMNS[2:7], (1.0, 0.5, 0.0, 1.0, 0.5), (b, b, b, coarse, coarse)):
                for k, o in zip(idx, whole_save(rs, budget, power)):
                    outs[name][k] = o
        for name, o in outs.items():
            bits[name] += sum(entropy_bits(q) for q, _ in o)
            err[name] += sum(e for _, e in o)
    return {c: (bits[c] / values, err[c] / allowed) for c in COLUMNS}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["charlm", "vit", "mixer", "resnet"])
    ap.add_argument("--saves", type=int, default=6, help="save intervals trained per workload, each one measured")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows, about = [], []
    for name in args.workloads:
        t0 = time.perf_counter()
        work, cls, snaps = trajectory(name, args.saves, first_moments)
        about.append(f"- {name}: {work.describe(cls.steps)}; a save every {cls.every} steps, the first "
                     f"{cls.every * len(snaps)} steps; {len(snaps[0])} first moments, "
                     f"{sum(r.size for r, *_ in snaps[0]):,} values")
        got = measure(snaps)
        base = got[COLUMNS[0]][0]
        rows.append([name] + [f"{b:.3f} ({b / base - 1:+.1%}), {e:.2f}" for b, e in got.values()])
        print(name, {k: (round(b, 3), round(e, 3)) for k, (b, e) in got.items()},
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    report.emit([
        "# A first moment's bits: per-tensor widths on a coarse and a refined grid, and one budget a save", "",
        "Command: `python benchmarks/moment_split.py " + " ".join(argv if argv is not None else sys.argv[1:])
        + "`", "", __doc__.split("\n\n", 2)[2].strip(), "", "Workloads:", "", *about, "",
        "Bits per first-moment value per save (against the coarse grid's), and the error over what the budget "
        "allows (the update's squared error summed over the saves' first moments over the budget times their "
        "energy):", "",
        "| " + " | ".join(["workload", *COLUMNS]) + " |", "|---|" + "---:|" * len(COLUMNS),
        *("| " + " | ".join(r) + " |" for r in rows)], args.out)


if __name__ == "__main__":
    main()
