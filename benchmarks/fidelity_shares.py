"""Where the default's bytes go on each fidelity workload: the parameters' segments against everything else a run
wrote (the optimizer state, the leaves stored exactly, the records and Orbax's files), from the committed figure
files of bench_fidelity.py (its `inshrink` row: CompressionConfig() with a GradientEMA and the eval_fn).

Usage: python benchmarks/fidelity_shares.py [--out benchmarks/results/fidelity_shares.md]

Columns: the run's figures (degradation, ratios), the bytes written, the parameters' stored bytes and their
share of what was written, and what the whole ratio (raw bytes of the whole state over the run's saves against the
bytes written) would be if each part cost nothing (the other part alone): the ceiling that part leaves to the
whole ratio; and what it would be with the parameters at the issue's 30x and the rest as written. The last three
are computed from the figures, not measured."""

from __future__ import annotations

import argparse
import ast
import json
import os

import report

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ("charlm", "longlm", "mnist", "lstm", "resnet", "vit", "mixer", "mixer-muon", "charlm-lion",
             "charlm-muon", "charlm-schedule-free")


def shares(workload: str) -> dict:
    """The default row's figures of `workload`'s committed fidelity table."""
    with open(os.path.join(HERE, "results", f"fidelity_{workload}.json")) as f:
        row = json.load(f)["rows"]["inshrink"]
    saves = row["saves"] if isinstance(row["saves"], dict) else ast.literal_eval(row["saves"])
    params = sum(s["params"] for s in saves.values())
    return {"saves": len(saves), "raw_params": row["raw_params"], "raw_whole": row["raw_whole"],
            "written": row["written"], "params": params, "whole_ratio": row["whole_ratio"],
            "params_ratio": row["params_ratio"], "degradation": row["degradation"][0]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for w in WORKLOADS:
        s = shares(w)
        rest = s["written"] - s["params"]
        raw = s["raw_whole"] * s["saves"]  # the figure files hold one save's raw bytes
        rows.append(f"| {w} | {s['saves']} | {s['degradation']:+.2%} | {s['params_ratio']:.1f}x | "
                    f"{s['whole_ratio']:.1f}x | {s['written']:,} | {s['params']:,} ({s['params'] / s['written']:.0%}) | "
                    f"{rest:,} ({rest / s['written']:.0%}) | {raw / rest:.1f}x | {raw / s['params']:.1f}x | "
                    f"{raw / (rest + s['raw_params'] * s['saves'] / 30):.1f}x |")
    cmd = "python benchmarks/fidelity_shares.py" + (f" --out {args.out}" if args.out else "")
    lines = ["# The default's bytes on each fidelity workload: parameters against the rest", "",
             f"Command: `{cmd}`", "", __doc__.split("\n\n", 2)[2].replace("\n", " "), "",
             "| workload | saves | degradation | params ratio | whole ratio | bytes written | parameters' segments "
             "(share) | everything else (share) | whole ratio with free parameters | whole ratio with the rest "
             "free | whole ratio with parameters at 30x, the rest as written |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + rows
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
