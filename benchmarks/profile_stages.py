"""Cost of each encoder stage, and of the alternatives the design rejected, in ns per element.

Usage: python benchmarks/profile_stages.py [--n 1e7] [--out benchmarks/results/stages.md]

Backs decisions in docs/how-it-works.md: thresholds by radix histograms (each histogram pass is one
scatter), protected positions found on the host (numpy flatnonzero on uint8 codes) instead of a device
prefix sum (XLA's cumsum / nonzero); and gives the host cost of one rearranged delta (save and restore side).
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import report  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from inshrink_jax import delta, kmeans, quantize, sketch, threshold


def per_element(fn, args, n, repeats=3):
    jax.block_until_ready(fn(*args))
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=float, default=1e7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n = int(args.n) // 1000 * 1000
    rng = np.random.default_rng(0)
    x = jnp.asarray((rng.standard_t(3, size=(n // 1000, 1000)) * 0.05).astype(np.float32))
    spec = sketch.SketchSpec(0.01)
    mag, fin = jnp.abs(x), jnp.isfinite(x)
    centres = jnp.sort(jax.random.normal(jax.random.PRNGKey(0), (16,)))
    codes = np.asarray(jax.jit(lambda v: (1 + kmeans.assign(v, centres)).astype(jnp.uint8))(x))
    mask = jnp.asarray(codes == 17)
    moved = codes.copy()  # the next checkpoint's codes: 2% of weights one level up
    hit = rng.integers(0, n, n // 50)
    moved.reshape(-1)[hit] = moved.reshape(-1)[hit] % 17 + 1
    stream = delta.encode(codes, moved, 18)
    rows = [
        ("sketch histogram (one scatter pass incl. keys)", jax.jit(lambda v: sketch.histogram(v, spec)), (x,)),
        ("exact k-th largest (two radix histogram passes)",
         jax.jit(lambda m, f: threshold.kth_largest([m], [f], n // 200)), (mag, fin)),
        ("nearest of 16 centres (codes)", jax.jit(lambda v: kmeans.assign(v, centres).astype(jnp.uint8)), (x,)),
        ("device prefix sum (jnp.cumsum), rejected", jax.jit(lambda m: jnp.cumsum(m.astype(jnp.int32))), (mask,)),
        ("device jnp.nonzero(size=n/100), rejected", jax.jit(lambda m: jnp.nonzero(m.reshape(-1), size=n // 100)),
         (mask,)),
        ("host np.flatnonzero on uint8 codes, used", lambda c: quantize.protected_positions(c, 16), (codes,)),
        ("host stable sort of previous codes (np.argsort), inside both delta directions",
         lambda c: np.argsort(c.reshape(-1), kind="stable"), (codes,)),
        ("host rearranged delta encode (save)", lambda a, b: delta.encode(a, b, 18), (codes, moved)),
        ("host rearranged delta decode (restore, per chain link)", lambda a, d: delta.decode(a, d, 18),
         (codes, stream)),
    ]
    lines = ["# Encoder stage costs", "", f"Command: `python benchmarks/profile_stages.py {' '.join(sys.argv[1:])}`",
             "", f"{n:,d} float32 elements, best of 3 after a warm-up, {jax.devices()[0].platform}.", "",
             "| stage | ns / element |", "|---|---:|"]
    for name, fn, a in rows:
        lines.append(f"| {name} | {per_element(fn, a, n):.2f} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
