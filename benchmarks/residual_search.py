"""How well the closed-loop residual search chooses: every candidate of the k-means residual space measured at every save.

Usage: python benchmarks/residual_search.py [--saves 20] [--out FILE]   (needs the `bench` extra)

Trains the character transformer of bench_fault_tolerance.py (440k parameters, AdamW) with the default
CompressionConfig but `residual_space=config.KMEANS_RESIDUAL_SPACE` (the default space is one axis of uniform
steps, which the search walks in order), a GradientEMA and the held-out loss as eval_fn, saving every 30 steps --saves times, as
save_breakdown.py does. At every residual save it measures the data-free proxy (the squared error over the
residual's) of each of the space's 12 configurations before the search runs, then lets the search choose as it
does in use. Per save: the search's choice and its number of candidates, the configuration it should choose (the
feasible one of highest estimated ratio, `search.estimated_ratio`), and the pairs of configurations that break
the monotonicity the search infers with (a point feasible while one it takes to be at least as good is not: with
more levels and as much pruning).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile

import jax
import orbax.checkpoint as ocp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fault_tolerance as ft  # noqa: E402
import digits  # noqa: E402  (examples/, on the path through bench_fault_tolerance)
import report  # noqa: E402

from inshrink_jax import search  # noqa: E402


RESIDUAL_POINTS = 12  # the configurations of config.KMEANS_RESIDUAL_SPACE (4 bin counts x 3 prune fractions)


def describe(cube, point) -> str:
    q = cube.config(point, "magnitude")
    return f"{q.bins} levels, {q.prune_fraction:.0%} pruned"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    original = search.search

    def measured(evaluate, cube, metrics, epsilon, batch, estimate, previous, switch_margin=0.2):
        points = list(itertools.product(*[range(t + 1) for t in cube.top]))
        if len(points) > RESIDUAL_POINTS:  # a keyframe's search (its space is the paper's): not measured
            return original(evaluate, cube, metrics, epsilon, batch, estimate, previous, switch_margin)
        error = dict(zip(points, (float(d) for d, _ in evaluate([cube.config(p, metrics[0]) for p in points]))))
        out = original(evaluate, cube, metrics, epsilon, batch, estimate, previous, switch_margin)
        feasible = [p for p in points if error[p] <= epsilon]
        best = max(feasible, key=lambda p: (estimate(p), -error[p]), default=None)
        broken = sum(error[p] <= epsilon < error[q] for p in points for q in points if p != q and cube.below(p, q))
        rows.append((out, cube, best, error, broken, epsilon))
        return out

    search.search = measured
    work = ft.CharLM(0, 600)
    state = work.create_state()
    eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, *work.eval))
    sens = ft.ij.GradientEMA(every=30)
    ema = sens.init(state.params)
    mngr = ocp.CheckpointManager(tempfile.mkdtemp(), item_handlers=ft.ij.InshrinkCheckpointHandler(
                                     ft.ij.CompressionConfig(residual_space=ft.ij.config.KMEANS_RESIDUAL_SPACE)),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=3))
    steps = []
    for step in range(1, 30 * args.saves + 1):
        state, _, grads = digits.train_step(state, *work.batch(step))
        if sens.active(step):
            ema = sens.update(ema, grads)
        if step % 30 == 0:
            n = len(rows)
            mngr.save(step, args=ft.ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
            mngr.wait_until_finished()
            steps += [step] * (len(rows) - n)
    mngr.close()
    search.search = original
    lines = ["# The closed-loop residual search against every candidate measured", "",
             f"Command: `python benchmarks/residual_search.py --saves {args.saves}" +
             (f" --out {args.out}`" if args.out else "`"), "",
             "The character transformer (440k parameters), default CompressionConfig, a save every 30 steps. At each "
             "residual save, the proxy of all 12 configurations of `KMEANS_RESIDUAL_SPACE` (budget: "
             f"{rows[-1][5]:g} of the residual's squared error); 'should choose': the feasible one of highest "
             "estimated ratio; 'broken pairs': a configuration within the budget while one the search takes to be at "
             "least as good (as many levels or more, the same pruning) is not.", "",
             "| step | search's choice | its error | candidates | should choose | its error | broken pairs |",
             "|---:|---|---:|---:|---|---:|---:|"]
    missed = 0
    for step, (out, cube, best, error, broken, _) in zip(steps, rows):
        chosen = None if out.quant is None else cube.point(out.quant)
        missed += best is not None and chosen != best
        lines.append(f"| {step} | {'-' if chosen is None else describe(cube, chosen)} | "
                     f"{'-' if chosen is None else f'{error[chosen]:.3f}'} | {out.evaluations} | "
                     f"{'-' if best is None else describe(cube, best)} | "
                     f"{'-' if best is None else f'{error[best]:.3f}'} | {broken} |")
    lines += ["", f"The search missed the configuration it should choose at {missed} of {len(rows)} residual saves."]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
