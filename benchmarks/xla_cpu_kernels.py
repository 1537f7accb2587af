"""The kernel shapes a large state's closed-loop residual save avoids on XLA's CPU backend, each timed side by side
with what it does instead, in one process.

Usage: python benchmarks/xla_cpu_kernels.py [--params 1e8] [--out FILE]

A synthetic params-only state (bench_handler.py's: four Student-t matrices of 4096 columns) and an offset near it
(the previous reconstruction of a residual save). Rows, each the best of 3 timed calls after a warm-up:

- the proxy's two sums (`quantize.error_sums`) masked to the finite elements, against plain sums over every
  element (what `quantize.proxy_ratio` runs unless a plain sum comes out non-finite);
- which of 254 cells the uint8 codes of 63 uniform cells take: a scatter of every code, against the range of the
  codes (`quantize._taken_range`: two reductions);
- that range where nothing is pruned or protected (a residual's codes): reductions over the codes masked to the
  quantized values, against plain reductions over the codes (what `_taken_range` runs without pruning, and
  where no protected code is present); and in the encode of a 63-cell residual configuration, masked or plain
  reductions inside the encoder's kernel, against plain ones in a call of their own over the codes it returns
  (`quantize._encode_alone`);
- the encode of a 63-cell residual configuration (`quantize.encode_on_device`) with the alike tensors stacked into
  one call, against each tensor of `quantize.ALONE_FROM` values or more encoded by a call of its own;
- packing 25M-value streams of 9 values two to a byte (`codec._pack`, the ranks' relabelling folded in) digit by
  digit, against one lookup per pair of bytes.
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
import report  # noqa: E402
from bench_handler import synthetic  # noqa: E402

import inshrink_jax as ij  # noqa: E402
from inshrink_jax import codec, quantize  # noqa: E402
from inshrink_jax.config import QuantConfig  # noqa: E402


def best(f, repeats: int = 3) -> float:
    """Seconds of the fastest of `repeats` calls of `f` (its result waited for), after one warm-up call."""
    return min(report.call_seconds(f, repeats))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    state = synthetic(int(args.params))["params"]
    xs = [state[k] for k in sorted(state)]
    offs = [x + 1e-3 * jnp.std(x) * jax.random.normal(jax.random.PRNGKey(i), x.shape) for i, x in enumerate(xs)]
    n = sum(x.size for x in xs)
    rows = []

    def sums(masked):
        return jax.jit(lambda xs, ds: [quantize.error_sums(x, d, None, d, masked) for x, d in zip(xs, ds)])

    plain, masked = sums(False), sums(True)
    rows.append(("the proxy's two sums", "masked to the finite elements", best(lambda: masked(xs, offs)),
                 "plain", best(lambda: plain(xs, offs))))

    q = QuantConfig(bins=63, protect_fraction=0.0, prune_fraction=0.0, step=1.5)
    cfg = ij.CompressionConfig()
    devs = quantize.encode_on_device(xs, [None] * len(xs), ["dense"] * len(xs), q, cfg, offsets=offs,
                                     sigma=quantize.RESIDUAL_SIGMA)
    codes = jnp.stack([d.codes for d in devs])
    scatter = jax.jit(lambda c: jax.vmap(lambda t: jnp.zeros(254, bool).at[t.reshape(-1).astype(jnp.int32) - 1].max(
        (t.reshape(-1) >= 1) & (t.reshape(-1) <= 63)))(c))
    ranged = jax.jit(lambda c: quantize._taken_range(c, jnp.int32(63), 254))
    rows.append(("taken cells of 63", "scatter of every code", best(lambda: scatter(codes)),
                 "range of the codes", best(lambda: ranged(codes))))
    plain_range = jax.jit(lambda c: quantize._taken_range(c, jnp.int32(63), 254, False))
    rows.append(("range of 63 cells' codes, nothing pruned", "masked reductions", best(lambda: ranged(codes)),
                 "plain reductions", best(lambda: plain_range(codes))))

    def encode():
        return [d.codes for d in quantize.encode_on_device(xs, [None] * len(xs), ["dense"] * len(xs), q, cfg,
                                                          offsets=offs, sigma=quantize.RESIDUAL_SIGMA)]

    alone_s = best(encode)

    def in_kernel(*a, **kw):  # the range reduced inside the encoder's kernel
        [[(c, lv, v)]] = quantize._encode(*a, **kw)
        return c[0], lv[0], v[0]

    taken, alone = quantize._taken_range, quantize._encode_alone
    quantize._encode_alone = in_kernel
    try:
        jax.clear_caches()
        plain_in_s = best(encode)
        quantize._taken_range = lambda code, bins, capacity, pruned=True: taken(code, bins, capacity, True)
        jax.clear_caches()  # the encoder traced again, with the masked reductions
        masked_in_s = best(encode)
    finally:
        quantize._taken_range, quantize._encode_alone = taken, alone
        jax.clear_caches()
    for avoided, t in (("masked reductions in the kernel", masked_in_s), ("plain reductions in the kernel", plain_in_s)):
        rows.append(("encode, 63 cells, nothing pruned: the codes' range", avoided, t,
                     "plain reductions, a call of their own", alone_s))
    alone_from = quantize.ALONE_FROM
    quantize.ALONE_FROM = 1 << 62  # every tensor in the joint, stacked call
    try:
        stacked_s = best(encode)
    finally:
        quantize.ALONE_FROM = alone_from
    rows.append(("encode, 63 cells", "alike tensors stacked", stacked_s, "large tensors alone", alone_s))

    size = 25_000_000
    alphabet = np.arange(0, 18, 2, dtype=np.uint8)
    stream = alphabet[np.random.default_rng(0).integers(0, alphabet.size, size)]
    table = codec._rank_table(alphabet, 0)
    pair_from = codec._PAIR_TABLE_FROM
    codec._PAIR_TABLE_FROM = 1 << 62
    try:
        digits = best(lambda: codec._pack(stream, alphabet.size, table))
    finally:
        codec._PAIR_TABLE_FROM = pair_from
    rows.append(("packing 25M codes of 9 values", "digit by digit", digits, "pair table",
                 best(lambda: codec._pack(stream, alphabet.size, table))))

    lines = ["# Kernel shapes on XLA's CPU backend: what a residual save avoids, side by side", "",
             f"Command: `python benchmarks/xla_cpu_kernels.py --params {args.params:g}"
             + (f" --out {args.out}`" if args.out else "`"), "",
             f"A synthetic params-only state of {n:,} values (four {xs[0].shape[0]} x {xs[0].shape[1]} float32 "
             "matrices) and an offset near it; best of 3 timed calls after a warm-up, 2-core CPU. Ratio: the "
             "avoided shape's time over the one used.", "",
             "| work | avoided | s | used | s | ratio |", "|---|---|---:|---|---:|---:|"]
    lines += [f"| {w} | {a} | {ta:.3f} | {u} | {tu:.3f} | {ta / tu:.1f}x |" for w, a, ta, u, tu in rows]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
