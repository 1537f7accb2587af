"""Speed of the jitted compression core: ns per parameter of encode and decode.

Usage: python benchmarks/bench_core.py [--sizes 1e6 1e7 5e7] [--out benchmarks/results/core_speed.md]

Encode = the whole `quantize.encode_tensors` call (scores, exact protect/prune thresholds, sketch histogram,
batched k-means, codes, the host-side protected-position scan and gather), ending with the codes and
protected values on the host. Decode = `quantize.decode` until the array is ready on the device. Each figure
is the best of --repeats runs after one warm-up (compilation excluded).
"""

from __future__ import annotations

import argparse
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from inshrink_jax import CompressionConfig, QuantConfig, quantize
import report  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def best_of(fn, repeats):
    return min(report.call_seconds(fn, repeats))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 5e7])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the result table (markdown) here")
    args = ap.parse_args(argv)
    cfg = CompressionConfig()
    qc = QuantConfig(bins=16, prune_fraction=0.2, protect_fraction=0.005, prune_metric="sensitivity")
    rows = []
    for size in args.sizes:
        n = int(size)
        cols = 1000
        rng = np.random.default_rng(0)
        x = jnp.asarray((rng.standard_t(3, size=(n // cols, cols)) * 0.05).astype(np.float32))
        g = jnp.asarray(rng.normal(size=(n // cols, cols)).astype(np.float32))
        n = x.size
        enc = None

        def encode():
            nonlocal enc
            (enc,) = quantize.encode_tensors([x], [g], ["dense"], qc, cfg)

        t_enc = best_of(encode, args.repeats)
        t_dec = best_of(lambda: jax.block_until_ready(quantize.decode(enc)), args.repeats)
        err = float(jnp.sqrt(jnp.mean((quantize.decode(enc) - x) ** 2)) / jnp.sqrt(jnp.mean(x**2)))
        rows.append((n, t_enc / n * 1e9, t_dec / n * 1e9, err))
        print(f"{n:>12,d} params  encode {t_enc / n * 1e9:6.1f} ns/param  decode {t_dec / n * 1e9:5.2f} ns/param"
              f"  relative RMS error {err:.4f}", flush=True)
    lines = [
        "# Compression core speed",
        "",
        f"Command: `python benchmarks/bench_core.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        f"Machine: {platform.machine()}, {jax.device_count()} x {jax.devices()[0].platform} device(s), "
        f"jax {jax.__version__}. Tensor: Student-t(3) weights, Gaussian gradients; config: 16 bins, prune 20% by "
        "sensitivity, protect 0.5%. Best of "
        f"{args.repeats} after a warm-up.",
        "",
        "| parameters | encode ns/param | decode ns/param | relative RMS error |",
        "|---:|---:|---:|---:|",
    ] + [f"| {n:,d} | {e:.1f} | {d:.2f} | {r:.4f} |" for n, e, d, r in rows]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
