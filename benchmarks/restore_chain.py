"""What 10 restores cost training, per residual coder: the parameters restored 10 times from a coder's closed-loop
chain, everything else exact, against the uninterrupted run.

Usage: python benchmarks/restore_chain.py [--coders NAME ...] [--out FILE]   (needs the `bench` extra)

The character transformer of bench_fault_tolerance.py (600 steps, seed 0), a save every 30 steps coded as in
restore_damage.py (the first save exact, each later one the parameters' residual against the coder's previous
reconstruction), and the failures of the fidelity benchmark (after steps 45, 105, ..., 585): at each, training
goes back to the latest save with its parameters replaced by the coder's reconstruction and the optimizer state
and step exact, and replays the same batches. So the only difference from the uninterrupted run is the
parameters' coding, which bench_fidelity.py's attribution rows found to be the whole of the default's damage
(benchmarks/results/fidelity_charlm_attribution.md), and no configuration search runs: each coder keeps its one
configuration at every save. restore_damage.py measures one restore of each coder with nothing carried over; this
measures whether what it found holds when the damage of 10 restores can add up.

Final: the held-out loss after step 600 against the uninterrupted run's (final quality scatters under any
perturbation: the fidelity benchmark's noise floor on this workload is 3.75%); paired: the mean training loss of
the 10 steps after each resume against the uninterrupted run's on the same batches, and its mean over resumes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fault_tolerance as ft  # noqa: E402
import digits  # noqa: E402  (examples/, on the path through bench_fault_tolerance)
import report  # noqa: E402
from restore_damage import EVERY, STEPS, WINDOW, LIBRARY, REFERENCE, code_save, k_means, second_moment  # noqa: E402

from inshrink_jax.config import CompressionConfig  # noqa: E402

FAILURES = tuple(range(45, STEPS, 60))
CODERS = {"k-means 4 levels, half pruned": LIBRARY["k-means 4 levels, half pruned"],
          "k-means 3 levels, half pruned": LIBRARY["k-means 3 levels, half pruned"],
          "k-means 3 levels, 80% pruned": (k_means(3, 0.8), "plain"),
          "NumPy uniform, cells of 1.5 RMS": REFERENCE["NumPy uniform, cells of 1.5 RMS"],
          "NumPy uniform, cells of 2 RMS": ("none", 2.0),
          "NumPy uniform, cells of 1.5 RMS, cells' means": ("none", 1.5, "means"),
          "NumPy uniform, cells of 1.45 RMS": ("none", 1.45),
          "NumPy uniform, cells of 1.55 RMS": ("none", 1.55),
          "NumPy uniform, cells of 1.45 RMS, cells' means": ("none", 1.45, "means"),
          "NumPy uniform, 5 cells of 1.5 RMS": ("none", 1.5, "grid", 5),
          "uniform 5 cells of 1.5 RMS": LIBRARY["uniform 5 cells of 1.5 RMS"],
          "NumPy uniform, cells of 1.5 RMS, weighted per element":
              REFERENCE["NumPy uniform, cells of 1.5 RMS, weighted per element"],
          "NumPy uniform, cells of 2 RMS, weighted per element":
              REFERENCE["NumPy uniform, cells of 2 RMS, weighted per element"],
          "NumPy uniform, cells of 2.5 RMS, weighted per element": ("element", 2.5)}


def run(work, coder, cfg):
    """(training loss per step as first trained, training losses of the WINDOW steps after each resume, final
    held-out loss, bits a parameter per residual save, seconds). `coder` None: the uninterrupted run."""
    t0 = time.perf_counter()
    state = work.create_state()
    tdef = jax.tree.structure(state.params)
    recon, saved, kept, bits = None, None, {}, []
    losses, after, failures = {}, [], list(FAILURES)
    step, resumed_at = 1, None
    while step <= STEPS:
        state, loss, _ = digits.train_step(state, *work.batch(step))
        if resumed_at is not None and step <= resumed_at + WINDOW:
            after[-1].append(float(loss))
        losses.setdefault(step, float(loss))
        if coder is not None and step % EVERY == 0:
            flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
            if recon is None:
                recon = [x for _, x in flat]
            else:
                recon, b, _ = code_save(coder, flat, second_moment(state), recon, cfg, kept)
                bits.append(b)
            saved = (step, state.replace(params=jax.tree.unflatten(tdef, recon)))
        if coder is not None and failures and step == failures[0]:
            failures.pop(0)
            step, state = saved
            resumed_at = step
            after.append([])
        step += 1
    final = work.quality(state)[0]
    return losses, after, final, bits, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--coders", nargs="*", default=list(CODERS), choices=list(CODERS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = CompressionConfig()
    work = ft.CharLM(0, STEPS)
    ref_losses, _, ref_final, _, ref_s = run(work, None, cfg)
    print(f"uninterrupted: final {ref_final:.4f} ({ref_s:.0f} s)", flush=True)
    resumes = [f - f % EVERY for f in FAILURES]
    rows = []
    for name in args.coders:
        _, after, final, bits, secs = run(work, CODERS[name], cfg)
        paired = [np.mean(a) / np.mean([ref_losses[s] for s in range(t + 1, t + WINDOW + 1)]) - 1
                  for a, t in zip(after, resumes)]
        rows.append((name, np.mean(bits), final / ref_final - 1, paired))
        print(f"{name}: {np.mean(bits):.3f} bits, final {final / ref_final - 1:+.2%}, paired "
              f"{np.mean(paired):+.3%} ({secs:.0f} s)", flush=True)
    cmd = "python benchmarks/restore_chain.py" + (" --coders " + " ".join(f"'{c}'" for c in args.coders)
                                                   if args.coders != list(CODERS) else "")
    lines = ["# Ten restores per residual coder (character transformer, parameters only)", "",
             f"Command: `{cmd}" + (f" --out {args.out}`" if args.out else "`"), "",
             __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "",
             f"Uninterrupted: held-out loss {ref_final:.4f} after step {STEPS}. Resumes from the saves at steps "
             f"{', '.join(map(str, resumes))}. Bits: the mean over the {STEPS // EVERY - 1} residual saves "
             "(library coders: stored code streams; NumPy: order-0 entropy).", "",
             "| coder | bits a parameter | final held-out loss | paired, after each resume | paired, mean |",
             "|---|---:|---:|---|---:|"]
    for name, b, fin, paired in rows:
        lines.append(f"| {name} | {b:.3f} | {fin:+.2%} | {' / '.join(f'{p:+.2%}' for p in paired)} | "
                     f"{np.mean(paired):+.3%} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
