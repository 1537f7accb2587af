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

First-moment coders (names starting "mu:") code Adam's `mu` instead, everything else exact (the parameters too): a
NumPy coder modelled on the library's first-moment quantizer (moments.py) at a fixed cell width (the library picks
the width per tensor from its budget, and decodes the cell around zero to its mean, where this coder decodes it to
0): the ratio u = mu / nu^p uniformly quantized in cells of a multiple of its RMS, each cell decoding to its
values' mean, and mu' = u' nu^p; p = 1/2 as the library codes it, p = 1/4 as a test of weighting the update's
error by nu^(1/2) (the parameters' weighting argument of weighting.py). Bits: order-0 entropy of the cell indices.

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
from residual_coding import entropy_bits  # noqa: E402
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
          "NumPy uniform, cells of 2.5 RMS, weighted per element": ("element", 2.5),
          "mu: cells of 1.1 RMS of mu / sqrt(nu)": ("mu", 0.5, 1.1),
          "mu: cells of 1.9 RMS of mu / sqrt(nu)": ("mu", 0.5, 1.9),
          "mu: cells of 1.1 RMS of mu / nu^(1/4)": ("mu", 0.25, 1.1),
          "mu: cells of 1.9 RMS of mu / nu^(1/4)": ("mu", 0.25, 1.9)}


def code_first_moments(state, power: float, step: float):
    """(state with Adam's `mu` replaced by its coding, bits a first-moment element): u = mu / nu^power in uniform
    cells of `step` times u's RMS, each cell decoding to its values' mean (0 stays 0), per tensor of 64 or more
    elements (smaller ones exact)."""
    def is_adam(x):
        return hasattr(x, "nu") and hasattr(x, "mu")
    adam = [s for s in jax.tree_util.tree_leaves(state.opt_state, is_leaf=is_adam) if is_adam(s)][0]
    coded, bits, n = [], 0.0, 0
    for m, v in zip(jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)):
        if m.size < 64:
            coded.append(m)
            continue
        m64, v64 = np.asarray(m, np.float64), np.asarray(v, np.float64)
        scale = np.where(v64 > 0, v64, 1.0) ** power
        u = np.where(v64 > 0, m64 / scale, 0.0)
        q = np.round(u / (step * np.sqrt(np.mean(u * u)) + 1e-30)).astype(np.int64)
        _, inv = np.unique(q, return_inverse=True)
        means = (np.bincount(inv.ravel(), u.ravel()) / np.bincount(inv.ravel()))[inv].reshape(u.shape)
        coded.append(jax.numpy.asarray(np.where(q == 0, 0.0, means) * scale, m.dtype))
        bits += entropy_bits(q)
        n += m.size
    mu = jax.tree.unflatten(jax.tree.structure(adam.mu), coded)
    opt = jax.tree.map(lambda x: x._replace(mu=mu) if is_adam(x) else x, state.opt_state, is_leaf=is_adam)
    return state.replace(opt_state=opt), bits / n


def run(work, coder, cfg):
    """(training loss per step as first trained, training losses of the WINDOW steps after each resume, final
    held-out loss, bits an element per coded save, seconds). `coder` None: the uninterrupted run."""
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
        if coder is not None and coder[0] == "mu" and step % EVERY == 0:
            coded, b = code_first_moments(state, *coder[1:])
            bits.append(b)
            saved = (step, coded)
        elif coder is not None and step % EVERY == 0:
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
    lines = ["# Ten restores per coder (character transformer, one part of the state coded)", "",
             f"Command: `{cmd}" + (f" --out {args.out}`" if args.out else "`"), "",
             __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "",
             f"Uninterrupted: held-out loss {ref_final:.4f} after step {STEPS}. Resumes from the saves at steps "
             f"{', '.join(map(str, resumes))}. Bits: per element of the part coded, the mean over the saves coded "
             f"(the {STEPS // EVERY - 1} residual saves of the parameters; all {STEPS // EVERY} of a first moment) "
             "(library coders: stored code streams; NumPy: order-0 entropy).", "",
             "| coder | bits an element | final held-out loss | paired, after each resume | paired, mean |",
             "|---|---:|---:|---|---:|"]
    for name, b, fin, paired in rows:
        lines.append(f"| {name} | {b:.3f} | {fin:+.2%} | {' / '.join(f'{p:+.2%}' for p in paired)} | "
                     f"{np.mean(paired):+.3%} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
