"""Where a steady save's blocking time goes: the configuration search against the rest of save().

Usage: python benchmarks/save_blocking.py [--saves 14] [--out benchmarks/results/save_blocking.md]
(needs the `bench` extra: pip install -e '.[bench]')

Trains the character transformer of bench_fault_tolerance.py (440k parameters, AdamW) with the default
CompressionConfig, a GradientEMA and the held-out loss as eval_fn, saving every 30 steps, and times each save()
call (what the training loop waits for) and, inside it, `search.choose` (the closed-loop residual search: each
candidate encoded, decoded and scored by the proxy, the choice checked with the eval_fn) and the number of
candidates it evaluated. The first three saves (a keyframe and the compiles of the first residual saves) are
left out: the figures are the steady state's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import orbax.checkpoint as ocp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fault_tolerance as ft  # noqa: E402
import digits  # noqa: E402  (examples/, on the path through bench_fault_tolerance)
import report  # noqa: E402

from inshrink_jax import search  # noqa: E402

WARM = 3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=14)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    spent = {"choose": 0.0, "candidates": 0}
    choose, call = search.choose, search.Evaluator.__call__

    def timed_choose(*a, **k):
        t = time.perf_counter()
        try:
            return choose(*a, **k)
        finally:
            spent["choose"] += time.perf_counter() - t

    def counted_call(self, quants):
        spent["candidates"] += len(quants)
        return call(self, quants)

    search.choose, search.Evaluator.__call__ = timed_choose, counted_call
    work = ft.CharLM(0, 600)
    state = work.create_state()
    eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, *work.eval))
    sens = ft.ij.GradientEMA(every=30)
    ema = sens.init(state.params)
    mngr = ocp.CheckpointManager(tempfile.mkdtemp(), item_handlers=ft.ij.InshrinkCheckpointHandler(),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=3))
    rows = []
    for step in range(1, 30 * args.saves + 1):
        state, _, grads = digits.train_step(state, *work.batch(step))
        if sens.active(step):
            ema = sens.update(ema, grads)
        if step % 30 == 0:
            spent.update(choose=0.0, candidates=0)
            t = time.perf_counter()
            mngr.save(step, args=ft.ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
            blocked = time.perf_counter() - t
            mngr.wait_until_finished()
            rows.append((step, blocked, spent["choose"], spent["candidates"]))
    mngr.close()
    steady = rows[WARM:]
    blocked = [r[1] for r in steady]
    chosen = [r[2] for r in steady]
    cands = [r[3] for r in steady]
    cmd = f"python benchmarks/save_blocking.py --saves {args.saves}" + (f" --out {args.out}" if args.out else "")
    lines = ["# Where a steady save's blocking time goes (character transformer)", "", f"Command: `{cmd}`", "",
             " ".join(__doc__.split("\n\n")[2].split()), "",
             f"Saves {WARM + 1} to {args.saves} (steps {steady[0][0]} to {steady[-1][0]}), on {jax.devices()[0].platform}:", "",
             "| figure | median | min | max |", "|---|---:|---:|---:|",
             f"| save() blocks, s | {statistics.median(blocked):.2f} | {min(blocked):.2f} | {max(blocked):.2f} |",
             f"| of which search.choose, s | {statistics.median(chosen):.2f} | {min(chosen):.2f} | {max(chosen):.2f} |",
             f"| candidates evaluated | {statistics.median(cands):.0f} | {min(cands)} | {max(cands)} |", "",
             f"search.choose is {sum(chosen) / sum(blocked):.0%} of the blocking time of these saves, "
             f"{sum(chosen) / max(sum(cands), 1):.2f} s a candidate.", "",
             "| step | blocks s | search.choose s | candidates |", "|---:|---:|---:|---:|"]
    lines += [f"| {s} | {b:.2f} | {c:.2f} | {n} |" for s, b, c, n in rows]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
