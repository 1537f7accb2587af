"""Compose a workload's fidelity figure files after some of its rows were run again.

Usage: python benchmarks/fidelity_compose.py WORKLOAD NEW.json [NEW.json ...] --label ' (what changed, commit X)'
           [--keep ROW ...] [--out-dir DIR]

Reads benchmarks/results/fidelity_WORKLOAD.json and fidelity_WORKLOAD_previous.json and writes to DIR (default:
the current directory) `main_WORKLOAD.json`, where each row of the NEW figure files replaces the committed row of
the same name in place (new names are appended), and `prev_WORKLOAD.json`, the previous table's rows with each
replaced row added under its name + LABEL (a workload without a `_previous` table keeps the replaced rows in its
own table under those names, after the others). A committed row of this release (a name starting "inshrink" with no
parenthesis) that was not run again is renamed with LABEL in the main table too, unless it is named by --keep (a
row whose saves the change cannot have altered). Then `bench_fidelity.py --workload WORKLOAD --merge
DIR/main_WORKLOAD.json --references benchmarks/results/fidelity_WORKLOAD.json --out ...` writes the table, plot and
figures (and the same with prev_WORKLOAD.json for the `_previous` table).
"""

from __future__ import annotations

import argparse
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def compose(workload: str, news: list[str], label: str, keep: list[str], out_dir: str) -> tuple[list, list]:
    """Write the two figure files; returns (the main table's row names, the rows moved to the previous one)."""
    with open(os.path.join(RESULTS, f"fidelity_{workload}.json")) as f:
        main = json.load(f)
    previous = os.path.join(RESULTS, f"fidelity_{workload}_previous.json")
    prev = None
    if os.path.exists(previous):
        with open(previous) as f:
            prev = json.load(f)
    new_rows, commands = {}, []
    for path in news:
        with open(path) as f:
            figures = json.load(f)
        new_rows.update(figures["rows"])
        commands.append(figures["command"])
    rows, moved = {}, {}
    for name, row in main["rows"].items():
        if name in new_rows:
            rows[name] = new_rows[name]
            moved[name + label] = row
        elif name.startswith("inshrink") and "(" not in name and name not in keep:
            rows[name + label] = row
        else:
            rows[name] = row
    for name, row in new_rows.items():
        rows.setdefault(name, row)
    if prev is None:  # a workload without a `_previous` table keeps the replaced rows in its own, after the rest
        rows.update(moved)
        moved = {}
    main_out = dict(main, rows=rows, command=f"the rows of benchmarks/results/fidelity_{workload}.json, those of the "
                    "same name replaced by the rows of: " + "; ".join(commands))
    outs = [("main", main_out)]
    if prev is not None:
        outs.append(("prev", dict(prev, rows={**moved, **prev["rows"]},
                                  command=f"the rows of benchmarks/results/fidelity_{workload}_previous.json and the "
                                  f"rows {sorted(moved)} of benchmarks/results/fidelity_{workload}.json")))
    for name, figures in outs:
        with open(os.path.join(out_dir, f"{name}_{workload}.json"), "w") as f:
            json.dump(figures, f, default=str)
    return list(rows), list(moved)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload")
    ap.add_argument("new", nargs="+", help="figure files (.json) of bench_fidelity.py runs of this workload")
    ap.add_argument("--label", required=True, help="appended to the names of the rows that were replaced")
    ap.add_argument("--keep", nargs="*", default=[], help="rows of this release not run again that stay as they are")
    ap.add_argument("--out-dir", default=".")
    args = ap.parse_args(argv)
    rows, moved = compose(args.workload, args.new, args.label, args.keep, args.out_dir)
    print(f"main table: {rows}\nmoved to the previous table: {moved}")


if __name__ == "__main__":
    main()
