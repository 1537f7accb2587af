"""Sensitivity floor: what does a restore cost a workload when the restored parameters are off by a tiny relative
error, whatever the format? Trains bench_fidelity.py's workload uninterrupted (seed 0, its data order), and at
each step a failure of its harness would resume from (the checkpoint before each failure) multiplies every
parameter by (1 + eps * N(0, 1)) (optimizer state exact); the final quality against the unperturbed run, for
several noise seeds.

Usage:
  python benchmarks/perturbation.py --workload lstm --eps 1e-6 1e-3 --seeds 0 1 2 \
      --out benchmarks/results/perturbation_lstm.md
(needs the `bench` extra)

A workload whose final quality moves by more than its noise floor at eps = 1e-3 (a thousand times below any
quantization error, eight times below bfloat16 rounding) cannot hold any lossy format "within noise" after its
restores; its paired figures (training loss after resumes) are then the measure to read.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

import bench_fidelity as bf
import bench_fault_tolerance as ft
import report


def perturbed_run(work, steps: int, every: int, resumes: list[int], eps: float, seed: int) -> tuple[float, float]:
    """(final metric, seconds) of the uninterrupted run with the parameters perturbed after each step of
    `resumes`."""
    state, key, t = work.create_state(), jax.random.PRNGKey(seed), time.perf_counter()
    for step in range(1, steps + 1):
        state, _, _ = ft.digits.train_step(state, *work.batch(step))
        if eps and step in resumes:
            key, sub = jax.random.split(key)
            leaves, treedef = jax.tree.flatten(state.params)
            keys = jax.random.split(sub, len(leaves))
            state = state.replace(params=jax.tree.unflatten(treedef, [
                x * (1 + eps * jax.random.normal(k, x.shape, x.dtype)) for x, k in zip(leaves, keys)]))
    return work.quality(state)[0], time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(bf.WORKLOADS), default="lstm")
    ap.add_argument("--eps", type=float, nargs="+", default=[1e-6, 1e-3])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--failures", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cls = bf.WORKLOADS[args.workload]
    steps, every = cls.steps, cls.every
    work = cls(0) if cls is ft.Mnist else cls(0, steps)
    span = steps / args.failures
    failures = [int((k + 0.5) * span) // every * every + every // 2 for k in range(args.failures)]
    resumes = [f // every * every for f in failures]  # the checkpoint each failure resumes from
    base, _ = perturbed_run(work, steps, every, resumes, 0.0, 0)
    rows = []
    for eps in args.eps:
        for seed in args.seeds:
            q, s = perturbed_run(work, steps, every, resumes, eps, seed)
            d = (base - q) / base if work.higher else (q - base) / base
            rows.append((eps, seed, q, d))
            print(f"eps {eps:g}, noise seed {seed}: {work.metric} {q:.4f} ({d:+.2%}), {s:.0f} s", flush=True)
    lines = [f"# Sensitivity floor ({work.name}): tiny relative errors in the parameters at the restore points", "",
             f"Command: `python benchmarks/perturbation.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             f"{work.describe(steps)}. Unperturbed (seed 0, no checkpoints) final {work.metric} **{base:.4f}**. "
             f"Perturbed after steps {', '.join(map(str, resumes))} (the checkpoints bench_fidelity.py's failures "
             "resume from): every parameter times (1 + eps N(0, 1)), optimizer state exact.", "",
             f"| eps | noise seed | final {work.metric} | degradation |", "|---:|---:|---:|---:|"]
    lines += [f"| {eps:g} | {seed} | {q:.4f} | {d:+.2%} |" for eps, seed, q, d in rows]
    for eps in args.eps:
        ds = [d for e, _, _, d in rows if e == eps]
        lines.append(f"| {eps:g} | mean | | {np.mean(ds):+.2%} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
