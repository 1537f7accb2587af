"""A restore's large closed-loop leaves one at a time or two at a time (`restore.LEAVES_AT_ONCE`), side by side
in one run.

Usage: python benchmarks/restore_leaves.py [--sizes 1e7 1e8] [--rounds 6] [--out benchmarks/results/restore_leaves.md]

Each size's synthetic state (bench_handler.py's: four 4096-column matrices) is saved 10 times with
`CompressionConfig(keyframe_every=10)` (bench_handler.save_chain). First, round after round, a new process per
variant and step restores the keyframe (step 0) or the deepest delta (step 9) once: what a resumed job does (its
kernels compiled in that restore). Then, in this process, round after round, each variant restores both steps
with a fresh manager and Orbax's StandardCheckpointer restores the same state from its own checkpoint,
alternating; the first round is a warm-up (compiles). The table gives medians over the rounds. Variants set
`restore.LEAVES_AT_ONCE`: 1 restores the leaves one after the other (the previous release's order), 2 (the
default) two large chains at a time in threads."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import orbax.checkpoint as ocp

import inshrink_jax as ij
from inshrink_jax import restore
from bench_handler import save_chain, synthetic  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import report  # noqa: E402

DEPTH = 9
VARIANTS = (1, 2)
FIRST = """
import json, sys, time
import jax, orbax.checkpoint as ocp, inshrink_jax as ij
from inshrink_jax import restore
path, step, restore.LEAVES_AT_ONCE, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mngr = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(keyframe_every=every)))
t0 = time.perf_counter()
jax.block_until_ready(mngr.restore(step, args=ij.InshrinkRestore()))
print(json.dumps(time.perf_counter() - t0))
"""


def measure(n: int, rounds: int, tmp: str) -> dict:
    """(variant or "orbax", step) -> restore seconds of each round after the first."""
    state = synthetic(n)
    path = os.path.join(tmp, "chain")
    cfg = ij.CompressionConfig(keyframe_every=DEPTH + 1)
    mngr = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(cfg))
    state, _ = save_chain(mngr, state, DEPTH)
    mngr.close()
    times: dict = {}
    for _ in range(rounds):
        for at in VARIANTS:
            for step in (0, DEPTH):
                out = subprocess.run([sys.executable, "-c", FIRST, path, str(step), str(at), str(DEPTH + 1)],
                                     capture_output=True, text=True, check=True)
                times.setdefault(("first", at, step), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    orbax = ocp.CheckpointManager(os.path.join(tmp, "orbax"))
    orbax.save(0, args=ocp.args.StandardSave(state))
    orbax.wait_until_finished()
    del state
    for r in range(rounds + 1):
        for at in VARIANTS:
            restore.LEAVES_AT_ONCE = at
            for step in (0, DEPTH):
                fresh = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(cfg))
                t0 = time.perf_counter()
                jax.block_until_ready(fresh.restore(step, args=ij.InshrinkRestore(abstract)))
                if r:
                    times.setdefault((at, step), []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(orbax.restore(0, args=ocp.args.StandardRestore(abstract)))
        if r:
            times.setdefault(("orbax", 0), []).append(time.perf_counter() - t0)
    orbax.close()
    shutil.rmtree(tmp)
    os.makedirs(tmp)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e7, 1e8])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    default = restore.LEAVES_AT_ONCE
    tmp = tempfile.mkdtemp()
    rows = []
    try:
        for size in args.sizes:
            n = int(size)
            times = measure(n, args.rounds, tmp)
            med = {k: statistics.median(v) for k, v in times.items()}
            params = sum(x.size for x in jax.tree.leaves(synthetic(n)))
            for step, what in ((0, "keyframe"), (DEPTH, f"depth-{DEPTH} delta")):
                one, two = med[(1, step)], med[(2, step)]
                new1, new2 = med[("first", 1, step)], med[("first", 2, step)]
                rows.append(f"| {params:,} params | {what} | {new1:.3f} | {new2:.3f} | {new1 / new2:.2f}x | {one:.3f} "
                            f"| {two:.3f} | {one / two:.2f}x | {med[('orbax', 0)]:.3f} | {med[('orbax', 0)] / two:.2f}x |")
    finally:
        restore.LEAVES_AT_ONCE = default
        shutil.rmtree(tmp, ignore_errors=True)
    cmd = "python benchmarks/restore_leaves.py --sizes " + " ".join(f"{s:g}" for s in args.sizes) + \
        f" --rounds {args.rounds}" + (f" --out {args.out}" if args.out else "")
    lines = ["# Restore: large closed-loop leaves one at a time or two at a time", "", f"Command: `{cmd}`", "",
             __doc__.split("\n\n", 2)[2].replace("\n", " "), "",
             f"Medians of {args.rounds} rounds (in this process: after a warm-up round), seconds, 2-core CPU.", "",
             "| state | step restored | new process: one leaf at a time s | new process: two at a time s (default) | "
             "one / two | warm: one at a time s | warm: two at a time s | one / two | Orbax warm restore s | "
             "Orbax / two |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"] + rows
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
