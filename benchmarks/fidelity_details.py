"""Per-resume and per-save figures of inshrink_jax's rows in fidelity figure files (what the tables sum up).

Usage: python benchmarks/fidelity_details.py FIGURES.json [...] [--out FILE]

Reads the .json that bench_fidelity.py writes beside each table (nothing is run again). For every row (the
baselines too):

- paired, per resume: the mean training loss of the 10 steps after each resume against the seed-0 reference's on
  the same batches (the table's "training loss after resumes" is the same ratio over all resumes' steps together,
  so resumes early in training, where the loss is large, weigh most in it);

and for inshrink_jax's rows:

- per save: its kind, the configuration the search chose (bins), the parameters' stored bytes and bits a parameter
  (of float32 parameters), the rest of what the save wrote (optimizer state, other leaves, records);
- the saves whose chosen candidate measured better than the unquantized state by more than epsilon on the
  eval_fn (`search_degradation` below -epsilon): how often the search accepts a reading of that kind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fidelity  # noqa: E402
import report  # noqa: E402


def paired(row: dict, reference: dict) -> list[tuple[int, float, float]]:
    """(step resumed from, mean training loss of the steps after it / the reference's - 1, the reference's mean
    training loss over those steps) per resume."""
    after = {int(k): v for k, v in row["after"].items()}
    losses = {int(k): v for k, v in reference["losses"].items()}
    out = []
    for start in row["resumes"]:
        steps = [k for k in after if start < k <= start + bench_fidelity.ft.RESUME_WINDOW]
        ref = sum(losses[k] for k in steps)
        out.append((start, sum(after[k] for k in steps) / ref - 1, ref / len(steps)))
    return out


def paired_line(row: dict, reference: dict) -> str:
    return ("Paired, per resume (the reference's training loss there): "
            + ", ".join(f"step {k} {v:+.1%} ({ref:.3f})" for k, v, ref in paired(row, reference)) + ".")


def row_lines(workload: str, name: str, row: dict, reference: dict) -> list[str]:
    eps = bench_fidelity.method(name.split(" (")[0]).cfg.epsilon  # an earlier release's row: "NAME (release)"
    n = row["raw_params"] / 4
    saves = sorted((int(k), s) for k, s in row["saves"].items())
    better = [(k, s["search_degradation"]) for k, s in saves
              if s.get("search_degradation") is not None and s["search_degradation"] < -eps]
    bits = [8 * s["params"] / n for _, s in saves]
    lines = [f"### {workload}: {name} (epsilon {eps:g})", "",
             paired_line(row, reference), "",
             f"Chosen candidate better than the unquantized state by more than epsilon: {len(better)} of "
             f"{len(saves)} saves" + (": " + ", ".join(f"step {k} {v:+.2%}" for k, v in better) if better else "")
             + ".", "",
             f"Parameters: {min(bits):.2f}-{max(bits):.2f} bits a parameter (median {np.median(bits):.2f}); the rest "
             f"of each save {min(s['written'] - s['params'] for _, s in saves):,}-"
             f"{max(s['written'] - s['params'] for _, s in saves):,} bytes.", "",
             "| step | kind | bins | parameters' bytes | bits a parameter | rest of the save, bytes |",
             "|---:|---|---:|---:|---:|---:|"]
    for (k, s), b in zip(saves, bits):
        chosen = s.get("chosen") or {}
        bins = chosen if isinstance(chosen, str) else chosen.get("bins", "-")  # "lossless": nothing quantized
        lines.append(f"| {k} | {s['kind']} | {bins} | {s['params']:,} | {b:.2f} | "
                     f"{s['written'] - s['params']:,} |")
    return lines + [""]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("figures", nargs="+", help="figure files (.json) of bench_fidelity.py")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cmd = "python benchmarks/fidelity_details.py " + " ".join(args.figures) + (f" --out {args.out}" if args.out else "")
    lines = ["# Fidelity runs, resume by resume and save by save", "", f"Command: `{cmd}`", "",
             "\n\n".join(__doc__.split("\n\n")[2:]).strip(), ""]
    for path in args.figures:
        with open(path) as f:
            figures = json.load(f)
        workload = os.path.basename(path)[len("fidelity_"):-len(".json")]
        reference = figures["references"][0]
        for name, row in figures["rows"].items():
            if name.startswith("inshrink"):
                lines += row_lines(workload, name, row, reference)
            else:
                lines += [f"### {workload}: {name}", "", paired_line(row, reference), ""]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
