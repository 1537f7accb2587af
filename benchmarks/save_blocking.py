"""What a save costs the training loop: the search and encoders on the caller's thread against in the background.

Usage: python benchmarks/save_blocking.py [--saves 14] [--out benchmarks/results/save_blocking.md]
(needs the `bench` extra: pip install -e '.[bench]')

Trains the character transformer of bench_fault_tolerance.py (440k parameters, AdamW) with the default
CompressionConfig, a GradientEMA and the held-out loss as eval_fn, saving every 30 steps through a
CheckpointManager as a training loop does (nothing waits for a save except the next save() and the end of the
run), once with `InshrinkCheckpointHandler(background=False)` (the configuration search, its eval_fn calls and
the encoders run inside save()) and once with `background=True` (save() plans and copies the state on the
device, the rest runs in Orbax's commit thread while training goes on; the default for a single-device state in
one process), and, in the same run, Orbax's StandardCheckpointer-equivalent default (`ocp.args.StandardSave`).
Each save() call is timed (what the training loop waits for: in the background mode this includes waiting for
the previous save to finish, as Orbax's manager does), after the training steps dispatched before it are
waited for, so their compute is not counted; the final wait_until_finished() counts too. The figures of each
save (the search's seconds and candidates) are read back from the manifests after the run.
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

from inshrink_jax import store  # noqa: E402

EVERY = 30
WARM = 3  # saves left out of the steady figures: a keyframe and the compiles of the first residual saves


def run(mode: str, saves: int) -> dict:
    """One training run of `saves` saves; per-save blocking seconds, the final wait, run and training seconds."""
    work = ft.CharLM(0, 600)
    state = work.create_state()
    eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, *work.eval))
    sens = ft.ij.GradientEMA(every=EVERY)
    ema = sens.init(state.params)
    root = tempfile.mkdtemp()
    if mode == "orbax":
        mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions())
    else:
        handler = ft.ij.InshrinkCheckpointHandler(background=mode == "background")
        mngr = ocp.CheckpointManager(root, item_handlers=handler, options=ocp.CheckpointManagerOptions())
    blocks, train = {}, 0.0
    t_run = time.perf_counter()
    for step in range(1, EVERY * saves + 1):
        t = time.perf_counter()
        state, _, grads = digits.train_step(state, *work.batch(step))
        if sens.active(step):
            ema = sens.update(ema, grads)
        if step % EVERY == 0:
            jax.block_until_ready((state, ema))
            train += time.perf_counter() - t
            t = time.perf_counter()
            if mode == "orbax":
                mngr.save(step, args=ocp.args.StandardSave(state))
            else:
                mngr.save(step, args=ft.ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
            blocks[step] = time.perf_counter() - t
        else:
            train += time.perf_counter() - t
    t = time.perf_counter()
    mngr.wait_until_finished()
    final = time.perf_counter() - t
    seconds = time.perf_counter() - t_run
    search = {}
    if mode != "orbax":
        for step in blocks:
            rec = store.Reader(os.path.join(root, str(step), "default")).figures()["search"] or {}
            search[step] = (rec.get("seconds", 0.0), rec.get("candidates", 0))
    mngr.close()
    return dict(blocks=blocks, final=final, seconds=seconds, train=train, search=search)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=14)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    modes = ("orbax", "caller", "background")
    runs = {}
    for mode in modes:
        print(f"  {mode} ...", flush=True)
        runs[mode] = run(mode, args.saves)
    steps = sorted(runs["caller"]["blocks"])
    cmd = f"python benchmarks/save_blocking.py --saves {args.saves}" + (f" --out {args.out}" if args.out else "")
    lines = ["# What a save costs the training loop (character transformer)", "", f"Command: `{cmd}`", "",
             " ".join(__doc__.split("\n\n")[2].split()), "",
             f"{args.saves} saves every {EVERY} steps, on {jax.devices()[0].platform} "
             f"({os.cpu_count()} cores); steady: saves {WARM + 1} to {args.saves}.", "",
             "| mode | first save blocks s | second save blocks s | steady save blocks s (median) | "
             "all saves block s (final wait included) | training s | blocking / training | run s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in modes:
        r = runs[mode]
        b = [r["blocks"][s] for s in steps]
        total = sum(b) + r["final"]
        lines.append(f"| {mode} | {b[0]:.2f} | {b[1]:.2f} | {statistics.median(b[WARM:]):.3f} | {total:.2f} | "
                     f"{r['train']:.1f} | {total / r['train']:.1%} | {r['seconds']:.1f} |")
    base = runs["orbax"]
    base_total = sum(base["blocks"].values()) + base["final"]
    lines += ["", "Blocking over Orbax's in the same run: " + ", ".join(
        f"{m} {(sum(runs[m]['blocks'].values()) + runs[m]['final']) / base_total:.1f}x" for m in modes[1:]) + ".",
              "", "Per save (seconds save() blocked; the search's own seconds and candidates, from the manifests):",
              "", "| step | orbax | caller | background | search s (caller) | search s (background) | candidates |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for s in steps:
        lines.append(f"| {s} | {base['blocks'][s]:.3f} | {runs['caller']['blocks'][s]:.3f} | "
                     f"{runs['background']['blocks'][s]:.3f} | {runs['caller']['search'][s][0]:.2f} | "
                     f"{runs['background']['search'][s][0]:.2f} | {runs['caller']['search'][s][1]} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
