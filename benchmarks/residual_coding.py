"""Bits and error of one closed-loop residual under the residual quantizers: k-means levels (the paper's,
`KMEANS_RESIDUAL_SPACE`) against the entropy-coded uniform quantizer (`RESIDUAL_SPACE`, `QuantConfig.step`)
with 63, 31, 13, 7 and 5 cells, and entropy-constrained levels (`ENTROPY_RESIDUAL_SPACE`, `QuantConfig.rate`).

Usage: python benchmarks/residual_coding.py [--out FILE]   (needs the `bench` extra: pip install -e '.[bench]')

Trains the character transformer of bench_fault_tolerance.py for 300 steps and codes the change of its
quantized weights between steps 270 and 300 (one interval of the fidelity benchmark) against the weights at 270.
Error: the squared error over the residual's energy (`search.proxy_degradation`, what `residual_budget` bounds).
H0: order-0 entropy of the code streams; stored: what the handler's code codecs (`codec.CODE_CODECS`) write.
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

from inshrink_jax import codec, config, quantize, search  # noqa: E402
from inshrink_jax.config import CompressionConfig, QuantConfig  # noqa: E402


def entropy_bits(codes: np.ndarray) -> float:
    _, counts = np.unique(codes, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum() * codes.size)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    work = ft.CharLM(0, 600)
    state, snap = work.create_state(), {}
    for step in range(1, 301):
        state, _, _ = digits.train_step(state, *work.batch(step))
        if step in (270, 300):
            snap[step] = jax.tree.leaves(state.params)
    pairs = [(w, w0) for w, w0 in zip(snap[300], snap[270]) if w.ndim >= 2 and w.size >= 1024]
    xs, offs = [w for w, _ in pairs], [w0 for _, w0 in pairs]
    n = sum(int(x.size) for x in xs)
    cfg = CompressionConfig()
    quants = [("k-means", QuantConfig(bins=k, embedding_bins=k, protect_fraction=0.0)) for k in (3, 4, 8)]
    quants += [(f"uniform, {k} cells", QuantConfig(bins=k, embedding_bins=k, protect_fraction=0.0, step=s))
               for k in (63, 31, 13, 7, 5) for s in (1.0, 1.5, 2.0, 2.5, 3.0)]
    quants += [("entropy-constrained", QuantConfig(bins=14, embedding_bins=14, protect_fraction=0.0, rate=r))
               for r in config.ENTROPY_RESIDUAL_SPACE.rates]
    lines = ["# Closed-loop residual coding: k-means levels, an entropy-coded uniform quantizer, entropy-constrained "
             "levels", "",
             "Command: `python benchmarks/residual_coding.py" + (f" --out {args.out}`" if args.out else "`"), "",
             f"The change of the character transformer's {len(xs)} quantized weights ({n:,} values) between steps 270 "
             "and 300, coded against the weights at step 270 (no pruning, no protection).", "",
             "Entropy-constrained: a zero level and 14 others (`QuantConfig.rate`, the rates of "
             "`config.ENTROPY_RESIDUAL_SPACE`); their step column gives the rate.", "",
             "| quantizer | levels | step (x RMS) | error | H0 bits a value | stored bits a value | stored / H0 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, q in quants:
        devs = quantize.encode_on_device(xs, [None] * len(xs), ["dense"] * len(xs), q, cfg, offsets=offs,
                                         sigma=quantize.RESIDUAL_SIGMA)
        deq = quantize.dequantize_all(devs, [x.dtype for x in xs])
        err = float(search.proxy_degradation(xs, deq, [None] * len(xs), offs))
        h = sum(entropy_bits(np.asarray(d.codes).ravel()) for d in devs) / n
        z = sum(8 * len(codec.compress_best(np.asarray(d.codes), codec.CODE_CODECS, codec.CODE_LEVEL)[0])
                for d in devs) / n
        knob = f"rate {q.rate}" if q.rate else q.step or ""
        lines.append(f"| {name} | {q.bins} | {knob} | {err:.3f} | {h:.2f} | {z:.2f} | {z / h:.2f} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
