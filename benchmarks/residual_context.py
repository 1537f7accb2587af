"""Is there information left in a closed-loop residual's codes that a context model could use? Conditional
order-0 entropy of the residual codes given contexts a decoder has, and how much of Adam's ratio mu / sqrt(nu)
the interval's weight change predicts.

Usage: python benchmarks/residual_context.py [--cells 1.5] [--out FILE]   (needs the `bench` extra)

The character transformer of bench_fault_tolerance.py (600 steps, seed 0), a save every 30 steps. The parameters
of every tensor of at least 1,000 elements are coded as a closed loop in NumPy (the first save exact, each later
one the residual against the previous reconstruction, on unclipped cells of `--cells` times the residual's RMS,
decoded to their centres: restore_chain.py's "NumPy uniform" coder). Per save and tensor: the order-0 entropy of
the codes, and the entropy of the codes given a context, summed over the context's values (a coder that kept one
frequency table per context value would reach it, before the tables' own cost), for each of `CONTEXTS` (the
moments and the previous codes are what a restore has decoded before a parameter's link, if the format stored
them first).

Then, per save: the share of the variance of the ratio u = mu / sqrt(nu) left after the least-squares prediction
c * (w_t - w_(t-1)) per tensor: what coding Adam's first moment against the parameters' change would leave to code.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fault_tolerance as ft  # noqa: E402
import digits  # noqa: E402  (examples/, on the path through bench_fault_tolerance)
import report  # noqa: E402
from residual_coding import entropy_bits  # noqa: E402

STEPS, EVERY, MIN_SIZE = 600, 30, 1000
CONTEXTS = {
    "none (order 0)": "one table for all codes",
    "abs(previous code)": "the same weight's absolute code at the previous save: 0, 1, 2 or more",
    "abs(mu)/sqrt(nu) quartile": "quartile (within the tensor) of Adam's abs(mu) / sqrt(nu) at this save",
    "sqrt(nu) quartile": "quartile of sqrt(nu)",
    "abs(w) quartile": "quartile of the weight's magnitude",
    "abs(previous code) x abs(mu)/sqrt(nu) quartile": "both of the above",
    "sign of mu": "-1, 0 or +1",
}


def conditional_bits(codes: np.ndarray, context: np.ndarray) -> float:
    """Sum over the context's values of the order-0 entropy (bits) of the codes with that value."""
    return sum(entropy_bits(codes[context == v]) for v in np.unique(context))


def quartile(x: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.quantile(x, [0.25, 0.5, 0.75]), x)


def adam(state):
    return next(x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
                if hasattr(x, "mu"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=float, default=1.5, help="cell width, times the residual's RMS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    work = ft.CharLM(0, STEPS)
    state = work.create_state()
    recon, previous, prev_w = None, None, None
    bits, n, left = {}, 0, []
    for step in range(1, STEPS + 1):
        state, _, _ = digits.train_step(state, *work.batch(step))
        if step % EVERY:
            continue
        a = adam(state)
        w = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(state.params)]
        mu = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a.mu)]
        nu = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a.nu)]
        if recon is None:
            recon, previous, prev_w = [x.copy() for x in w], [np.zeros(x.size, np.int64) for x in w], w
            continue
        total_u = total_e = 0.0
        for i, (x, m, v) in enumerate(zip(w, mu, nu)):
            if x.size < MIN_SIZE:
                continue
            r = x - recon[i]
            cell = args.cells * np.sqrt(np.mean(r * r)) + 1e-30
            q = np.round(r / cell).astype(np.int64)
            recon[i] = recon[i] + q * cell
            ratio = m / np.sqrt(v + 1e-16)
            before, size = np.minimum(np.abs(previous[i]), 2), quartile(np.abs(ratio))
            contexts = dict(zip(CONTEXTS, (np.zeros(q.size, np.int64), before, size, quartile(np.sqrt(v)),
                                           quartile(np.abs(x)), before * 4 + size, np.sign(m).astype(np.int64) + 1)))
            for name, c in contexts.items():
                bits[name] = bits.get(name, 0.0) + conditional_bits(q, c)
            n += q.size
            previous[i] = q
            d = x - prev_w[i]
            c = (ratio @ d) / max(d @ d, 1e-30)
            total_u += ratio @ ratio
            total_e += (ratio - c * d) @ (ratio - c * d)
        left.append((step, total_e / total_u))
        prev_w = w
    base = bits["none (order 0)"]
    cmd = f"python benchmarks/residual_context.py --cells {args.cells:g}" + (f" --out {args.out}" if args.out else "")
    lines = ["# Context left in closed-loop residual codes (character transformer)", "", f"Command: `{cmd}`", "",
             " ".join(__doc__.split("\n\n")[2].split()) + f" Cells of {args.cells:g} RMS; {n:,} codes over "
             f"{STEPS // EVERY - 1} residual saves.", "",
             "| context | what it is | bits a code | against order 0 |", "|---|---|---:|---:|"]
    lines += [f"| {name} | {CONTEXTS[name]} | {b / n:.3f} | {b / base - 1:+.1%} |" for name, b in bits.items()]
    lines += ["", "Adam's ratio mu / sqrt(nu) predicted from the interval's weight change, per tensor (least squares): "
              "share of its variance left, per save: " + ", ".join(f"step {s} {v:.2f}" for s, v in left) +
              f" (mean {np.mean([v for _, v in left]):.2f}).", ""]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
