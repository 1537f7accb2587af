"""Weighted k-means on the sketch vs the exact optimum (dynamic programming), by number of restarts.

Usage: python benchmarks/kmeans_quality.py [--out benchmarks/results/kmeans_quality.md]
Data: 300 Student-t(3) samples x 0.1 per seed, 20 seeds; objective: the sigma = 0.2 bucket-weighted loss.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_kmeans import optimal_kmeans_loss  # noqa: E402

from inshrink_jax import kmeans, sketch  # noqa: E402
import report  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    spec = sketch.SketchSpec(0.01)
    values = jnp.asarray(spec.representatives())
    lines = ["# k-means loss / exact optimum (mean, max over 20 seeds)", "",
             "Command: `python benchmarks/kmeans_quality.py --out benchmarks/results/kmeans_quality.md`", "",
             "| restarts | K=2 | K=4 | K=8 | K=16 |", "|---:|---|---|---|---|"]
    for restarts in (1, 3):
        cells = []
        for k in (2, 4, 8, 16):
            r = []
            for seed in range(20):
                x = (np.random.default_rng(seed).standard_t(3, 300) * 0.1).astype(np.float32)
                h = sketch.histogram(jnp.asarray(x), spec)
                w = kmeans.bucket_weights(h, values, 0.2)
                c = kmeans.histogram_kmeans(h, spec, k, 0.2, jax.random.PRNGKey(seed), restarts=restarts)
                nz = np.asarray(w) > 0
                r.append(float(kmeans.loss(values, w, c)) / optimal_kmeans_loss(np.asarray(values)[nz],
                                                                                np.asarray(w)[nz], k))
            cells.append(f"{np.mean(r):.3f} ({np.max(r):.3f})")
        lines.append(f"| {restarts} | " + " | ".join(cells) + " |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
