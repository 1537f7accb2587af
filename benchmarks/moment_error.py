"""How Adam's moments may be quantized: the error each coding puts into the update `mu / sqrt(nu)`, and its bits.

Usage: python benchmarks/moment_error.py [--workload charlm] [--steps 300] [--out benchmarks/results/moment_error.md]
(needs the `bench` extra: pip install -e '.[bench]')

Trains a workload of bench_fidelity.py (the character transformer by default; `lstm`: the fine-tune of a
pretrained character LSTM) for --steps steps, takes Adam's state of every kernel (the leaves inshrink_jax quantizes) and measures, summed over them:
  - `mu` coded by moments.py relative to sqrt(nu as stored) at several `moment_budget`s (what a checkpoint
    stores: a uniform quantizer whose cell width, and so its number of cells, is chosen per tensor), on its own with K log-levels a sign (the coding of format versions <= 8),
    by uniform levels of `u = mu / sqrt(nu)` (the best step of a scan), or dropped;
  - `nu` coded by moments.py with K levels.
Update error: ||u' - u||^2 / ||u||^2 with u' the update after decoding (eps 1e-8 as optax's default). Bits:
order-0 entropy of the codes (what an ideal entropy coder pays; zstd-radix comes within a few percent). For
`nu`, also the 99th percentile over values of the factor by which a step size moves, max over tensors.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fault_tolerance as ft  # noqa: E402
import bench_fidelity as bf  # noqa: E402
import digits  # noqa: E402  (examples/, on the path through bench_fault_tolerance)
import report  # noqa: E402

from inshrink_jax import moments  # noqa: E402

EPS = 1e-8
BUDGETS = (0.02, 0.05, 0.1, 0.2, 0.3)


def entropy_bits(codes: np.ndarray) -> float:
    _, counts = np.unique(codes, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum()) * codes.size


def decoded(m: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(decoded moment, codes) of moments.py's log-domain coding with `bins` levels a sign."""
    dev, = moments.encode_on_device([jnp.asarray(m)], ft.ij.CompressionConfig(moment_bins=bins))
    return np.asarray(dev.dequantize(np.float32)), np.asarray(dev.codes)


def ratio_decoded(mu: np.ndarray, nu_hat: np.ndarray, budget: float) -> tuple[np.ndarray, np.ndarray, int]:
    """(decoded first moment, codes, levels) of moments.py's coding relative to sqrt(`nu_hat`)."""
    dev, = moments.encode_first_on_device([jnp.asarray(mu)], [jnp.asarray(nu_hat)], [None],
                                          ft.ij.CompressionConfig(moment_budget=budget))
    return np.asarray(dev.dequantize(np.float32)), np.asarray(dev.codes), int(dev.bins)


def uniform_u(u: np.ndarray, levels: int) -> tuple[float, float]:
    """(squared error, bits) of `levels` uniform levels (0 and +-k s) of u, the step s the best of a scan."""
    best = None
    for s in np.geomspace(0.02, 1.0, 40):
        c = np.clip(np.round(u / s), -(levels // 2), levels // 2)
        e = float(((c * s - u) ** 2).sum())
        if best is None or e < best[0]:
            best = (e, entropy_bits(c))
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(set(bf.WORKLOADS) - {"mnist"}), default="charlm")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cls = bf.WORKLOADS[args.workload]
    work = cls(0, cls.steps)
    state = work.create_state()
    for step in range(1, args.steps + 1):
        state, _, _ = digits.train_step(state, *work.batch(step))
    adam, = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "nu") and hasattr(x, "mu"))
             if hasattr(s, "nu")]
    pairs = [(np.asarray(m), np.asarray(v)) for m, v in zip(jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu))
             if m.ndim >= 2 and m.size >= 1024]
    n = sum(m.size for m, _ in pairs)
    rows_mu: dict[str, list[float]] = {}
    rows_nu: dict[int, list[float]] = {}
    levels: dict[str, list[int]] = {}
    for mu, nu in pairs:
        den = np.sqrt(nu) + EPS
        u = mu / den
        uu = float((u ** 2).sum())
        nu_hat, _ = decoded(nu, 16)  # the second moment as the default stores it
        for budget in BUDGETS:
            q, codes, k = ratio_decoded(mu, nu_hat, budget)
            name = f"relative to sqrt(nu as stored), moment_budget {budget} (moments.py)"
            r = rows_mu.setdefault(name, [0.0, 0.0, 0.0])
            r[0] += float((((q - mu) / den) ** 2).sum()); r[1] += uu; r[2] += entropy_bits(codes)
            levels.setdefault(name, []).append(k)
        for bins in (16, 8, 4, 2):
            q, codes = decoded(mu, bins)
            r = rows_mu.setdefault(f"on its own, {bins} log-levels a sign (format <= 8)", [0.0, 0.0, 0.0])
            r[0] += float((((q - mu) / den) ** 2).sum()); r[1] += uu; r[2] += entropy_bits(codes)
        for n_levels in (3, 5, 7):
            e, bits = uniform_u(u, n_levels)
            r = rows_mu.setdefault(f"{n_levels} uniform levels of mu / sqrt(nu)", [0.0, 0.0, 0.0])
            r[0] += e; r[1] += uu; r[2] += bits
        r = rows_mu.setdefault("dropped", [0.0, 0.0, 0.0])
        r[0] += uu; r[1] += uu
        for bins in (64, 32, 16, 8, 4, 2):
            q, codes = decoded(nu, bins)
            uq = mu / (np.sqrt(q) + EPS)
            nz = nu > 0
            factor = np.sqrt(np.maximum(q[nz] / nu[nz], nu[nz] / q[nz]))
            r = rows_nu.setdefault(bins, [0.0, 0.0, 0.0, 0.0])
            r[0] += float(((uq - u) ** 2).sum()); r[1] += uu; r[2] += entropy_bits(codes)
            r[3] = max(r[3], float(np.quantile(factor, 0.99)) if factor.size else 1.0)
    lines = [f"# Adam's moments: update error and bits of each coding ({work.name}, {args.steps} steps)",
             "", f"Command: `python benchmarks/moment_error.py --workload {args.workload} --steps {args.steps}"
                 f"{' --out ' + args.out if args.out else ''}`", "", f"{work.describe(cls.steps)}.", "",
             f"{len(pairs)} kernels, {n:,} values of each moment. Update error: ||u' - u||^2 / ||u||^2 of "
             "u = mu / sqrt(nu); bits: order-0 entropy of the codes a value (a stored delta of `nu` costs less).",
             "", "| `mu` coded | update error | bits a value | levels (cells) per tensor |", "|---|---:|---:|---|"]
    lines += [f"| {k} | {e / t:.1%} | {b / n:.2f} | {' '.join(map(str, levels.get(k, ()))) or '-'} |"
              for k, (e, t, b) in rows_mu.items()]
    lines += ["", "| `nu` coded with | update error | bits a value (own codes) | step-size factor, 99th percentile |",
              "|---|---:|---:|---:|"]
    lines += [f"| {k} log-levels | {e / t:.2%} | {b / n:.2f} | {f:.2f}x |" for k, (e, t, b, f) in rows_nu.items()]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
