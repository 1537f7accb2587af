"""What a closed-loop chain layout with fewer links per restore would cost in bits: each residual coded against an
older reconstruction than the last save's (a format not built).

Usage: python benchmarks/chain_layout.py [--keyframe-every 10 20] [--cells 1.5] [--out FILE]   (needs the `bench` extra)

A restore of the k-th link of today's chain adds k residuals one after the other; at 10M parameters each costs
more than a tenth of Orbax's whole restore (benchmarks/results/handler.md), so a restore at Orbax's speed needs
fewer links, not faster ones. A link may instead code the parameters against the reconstruction of an older save of
its chain (its reference), still a closed loop: the decoder has that reconstruction exactly, so no error
accumulates; a restore then adds the links from the keyframe to it along the references (its depth). The residual
against an older save spans several intervals' updates, so at the same error it costs more bits.

The character transformer of bench_fault_tolerance.py (600 steps, seed 0), a save every 30 steps (20 saves). The
parameters of every tensor of at least 1,000 elements are coded in NumPy as residual_context.py codes them
(restore_chain.py's "NumPy uniform" coder: unclipped cells decoded to their centres), a keyframe (stored exact here)
every `--keyframe-every` saves, under each layout:
  chain   each link against the previous save (today's layout; depth k at the k-th link);
  star    each link against its keyframe (depth 1);
  two-level  every m-th link (m = ceil(sqrt(keyframe_every))) against the previous such link or the keyframe, the
          others against the previous save (depth at most about 2 sqrt(keyframe_every));
  binary  the k-th link against link k with its lowest set bit cleared (a skip list; depth = the set bits of k).
Every layout codes a save's residual on the same cells, `--cells` times the RMS of the chain layout's residual at
that save and tensor: the same quantization error wherever the cells are fine against the residual's spread, so the
layouts' bits compare at equal error (the error columns check it). Bits: the order-0 entropy of the codes, a
value a save, over the residual saves; error: the RMS of the reconstruction's error over the parameters, against the
chain layout's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fault_tolerance as ft  # noqa: E402
import digits  # noqa: E402  (examples/, on the path through bench_fault_tolerance)
import report  # noqa: E402
from residual_coding import entropy_bits  # noqa: E402

import jax  # noqa: E402

STEPS, EVERY, MIN_SIZE = 600, 30, 1000


def references(layout: str, every: int) -> list[int]:
    """Per link k = 1 .. every - 1 of a keyframe period, the link it codes against (0: the keyframe)."""
    m = math.ceil(math.sqrt(every))
    refs = [0]
    for k in range(1, every):
        if layout == "chain":
            refs.append(k - 1)
        elif layout == "star":
            refs.append(0)
        elif layout == "two-level":
            refs.append(k - m if k % m == 0 else k - 1)
        elif layout == "binary":
            refs.append(k & (k - 1))
        else:
            raise ValueError(layout)
    return refs


def depth(refs: list[int], k: int) -> int:
    """Links a restore of link k adds (the keyframe not counted)."""
    d = 0
    while k:
        k, d = refs[k], d + 1
    return d


LAYOUTS = ("chain", "star", "two-level", "binary")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keyframe-every", type=int, nargs="+", default=[10, 20])
    ap.add_argument("--cells", type=float, default=1.5, help="cell width, times the chain layout's residual RMS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    work = ft.CharLM(0, STEPS)
    state = work.create_state()
    saves = []
    for step in range(1, STEPS + 1):
        state, _, _ = digits.train_step(state, *work.batch(step))
        if step % EVERY == 0:
            saves.append([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(state.params)
                          if x.size >= MIN_SIZE])
    rows = []
    for every in args.keyframe_every:
        refs = {name: references(name, every) for name in LAYOUTS}
        bits = {name: 0.0 for name in LAYOUTS}
        err = {name: 0.0 for name in LAYOUTS}
        n = 0
        recon: dict[str, list] = {}
        for s, w in enumerate(saves):
            k = s % every
            if k == 0:  # a keyframe, exact: every layout's reconstructions start again from it
                recon = {name: [list(w)] for name in LAYOUTS}
                continue
            for t, x in enumerate(w):
                cell = args.cells * np.sqrt(np.mean((x - recon["chain"][k - 1][t]) ** 2)) + 1e-30
                for name in LAYOUTS:
                    base = recon[name][refs[name][k]][t]
                    q = np.round((x - base) / cell).astype(np.int64)
                    if t == 0:
                        recon[name].append([])
                    recon[name][k].append(base + q * cell)
                    bits[name] += entropy_bits(q)
                    err[name] += float(np.sum((recon[name][k][t] - x) ** 2))
                n += x.size
        for name in LAYOUTS:
            depths = [depth(refs[name], k) for k in range(1, every)]
            rows.append((every, name, max(depths), float(np.mean(depths)), bits[name] / n,
                         bits[name] / bits["chain"], math.sqrt(err[name] / err["chain"])))
    cmd = "python benchmarks/chain_layout.py --keyframe-every " + " ".join(map(str, args.keyframe_every)) + \
        f" --cells {args.cells:g}" + (f" --out {args.out}" if args.out else "")
    lines = ["# Chain layouts with fewer links per restore: their cost in bits (character transformer)", "",
             f"Command: `{cmd}`", "", " ".join(__doc__.split("\n\n", 2)[2].split()), "",
             "| keyframe every | layout | links a restore adds: most | mean | bits a value a save | against the chain "
             "| reconstruction error against the chain's |", "|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {e} | {name} | {dmax} | {dmean:.1f} | {b:.3f} | {r:.2f}x | {er:.3f}x |"
              for e, name, dmax, dmean, b, r, er in rows]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
