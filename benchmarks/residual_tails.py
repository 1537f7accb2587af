"""Closed-loop residual saves of a large state under two kinds of drift between saves, Gaussian and heavy-tailed,
inshrink_jax beside Orbax, for one or more source trees of the library, each in new processes, alternately, in
one run.

Usage: python benchmarks/residual_tails.py [--sizes 1e7 1e8] [--saves 8] [--rounds 2] [--trees DIR ...]
           [--cases NAME ...] [--dir DIR] [--out FILE]

A residual save of a state of `search.SCORED_WITHOUT_ENCODING` values or more searches its candidates on row
samples of the large tensors, then encodes its choice and measures it on the whole state. Where no configuration
of the residual space meets the budget (a heavy-tailed residual, whose clipped tail dominates the error of the
space's cells; a tight epsilon), it goes to finer cells than the space holds. This measures what such saves cost.

Per process, size and drift: bench_handler.py's synthetic state (four Student-t matrices of 4096 columns), saved
--saves times with `CompressionConfig(keyframe_every=1000)` (a keyframe, then residual saves; case "gaussian,
epsilon 0.002": with epsilon=0.002, whose residual budget no cells of the space meet), each save followed by a
drift of every weight: "gaussian", a normal step of 1e-3 of its tensor's std (bench_handler.save_chain's drift,
drawn by NumPy); "heavy-tailed", a Student-t(2.5) step of 1e-2 of its tensor's std, four times larger on every 7th row (weights
that move more than the others). Orbax's StandardCheckpointer saves the same states in the same process, each
after ours. Save times are save() until written, the median of the saves from the fourth on (the second and third
compile the residual kernels); the search's record (mode, candidates, rounds: a round is one call of the
evaluator) of the last save; the parameters' stored bytes summed over the residual saves. A tree's processes
import inshrink_jax from that tree (`--trees`: checkouts of the repository; default: this one). Directories under
--dir (default: the system's temporary directory).
"""

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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402

# (name, drift, epsilon of the CompressionConfig)
CASES = (("gaussian", "gaussian", 0.01), ("gaussian, epsilon 0.002", "gaussian", 0.002),
         ("heavy-tailed", "heavy-tailed", 0.01))


def drifted(state, kind: str, rng):
    """`state` after one interval's drift of `kind` (see the module docstring)."""
    import jax
    import numpy as np

    def move(x):
        x = np.asarray(x)
        std = float(np.std(x))
        if kind == "gaussian":
            step = 1e-3 * std * rng.standard_normal(x.shape, dtype=np.float32)
        else:
            rows = np.where(np.arange(x.shape[0]) % 7 == 0, 4.0, 1.0).astype(np.float32)
            step = 1e-2 * std * rng.standard_t(2.5, size=x.shape).astype(np.float32) * rows.reshape(
                (-1,) + (1,) * (x.ndim - 1))
        return jax.numpy.asarray(x + step)

    return jax.tree.map(move, state)


def worker(n: int, case: str, saves: int, root: str) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    import inshrink_jax as ij
    from bench_handler import synthetic

    _, kind, epsilon = next(c for c in CASES if c[0] == case)
    state = synthetic(n)
    rng = np.random.default_rng(1)
    path = tempfile.mkdtemp(dir=root)
    ours = ocp.CheckpointManager(os.path.join(path, "c"), item_handlers=ij.InshrinkCheckpointHandler(
        ij.CompressionConfig(keyframe_every=1000, epsilon=epsilon)))
    orbax = ocp.CheckpointManager(os.path.join(path, "o"))
    times, orbax_times = [], []
    for step in range(saves):
        jax.block_until_ready(state)
        for mngr, args, out in ((ours, ij.InshrinkSave, times), (orbax, ocp.args.StandardSave, orbax_times)):
            t0 = time.perf_counter()
            mngr.save(step, args=args(state))
            mngr.wait_until_finished()
            out.append(time.perf_counter() - t0)
        state = drifted(state, kind, rng)
    record = ours.item_metadata(saves - 1)["search"]
    params = sum(ours.item_metadata(s)["stored_bytes"]["params"] for s in range(1, saves))
    ours.close()
    orbax.close()
    shutil.rmtree(path)
    return {"save": statistics.median(times[3:]), "orbax_save": statistics.median(orbax_times[3:]),
            "mode": record["mode"], "candidates": record["candidates"], "rounds": record["rounds"],
            "chosen": record["chosen"], "params_bytes": params, "library": ij.__file__}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e7, 1e8])
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trees", nargs="+", default=[os.path.dirname(HERE)])
    ap.add_argument("--cases", nargs="+", default=[c[0] for c in CASES], help="names of the cases to run")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if set(args.cases) - {c[0] for c in CASES}:
        ap.error(f"--cases: the cases are {[c[0] for c in CASES]}")
    if args.saves < 5:
        ap.error("--saves must be at least 5 (the median is of the saves from the fourth on)")
    if args.worker is not None:
        print(json.dumps(worker(int(float(args.worker[0])), args.worker[1], args.saves, args.dir)))
        return
    trees = [os.path.abspath(t) for t in args.trees]
    for t in trees:
        if not os.path.isfile(os.path.join(t, "inshrink_jax", "__init__.py")):
            ap.error(f"--trees: {t} holds no inshrink_jax package")
    lines = ["# Residual saves of a large state: Gaussian and heavy-tailed drift", "",
             f"Command: `python benchmarks/residual_tails.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             __doc__.split("\n\n")[2].replace("\n", " "), "", __doc__.split("\n\n")[3].replace("\n", " "), "",
             f"{os.cpu_count()} CPU cores. Medians of {args.rounds} processes a tree; search record and bytes of "
             "the last round's process.", "",
             "| params | case | tree | ours: residual save s | Orbax save s | ours / Orbax | last save: mode, "
             "candidates, rounds | its cells (bins, step) | params bytes, residual saves |",
             "|---:|---|---|---:|---:|---:|---|---|---:|"]
    for n in args.sizes:
        for kind in [c[0] for c in CASES if c[0] in args.cases]:
            runs: dict[str, list[dict]] = {t: [] for t in trees}
            for _ in range(args.rounds):
                for t in trees:
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                        [t] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
                    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(n), kind,
                           "--saves", str(args.saves)] + (["--dir", args.dir] if args.dir else [])
                    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                    got = json.loads(out.strip().splitlines()[-1])
                    if not got["library"].startswith(t):
                        raise RuntimeError(f"the worker for {t} imported inshrink_jax from {got['library']}")
                    runs[t].append(got)
            for t, rs in runs.items():
                save, orbax = statistics.median(r["save"] for r in rs), statistics.median(r["orbax_save"] for r in rs)
                last = rs[-1]
                q = last["chosen"]
                cells = f"{q['bins']}, {q['step']:g}" if isinstance(q, dict) else str(q)
                lines.append(f"| {n:,.0f} | {kind} | {os.path.basename(t) or t} | {save:.3f} | {orbax:.3f} | "
                             f"{save / orbax:.2f}x | {last['mode']}, {last['candidates']}, {last['rounds']} | "
                             f"{cells} | {last['params_bytes']:,} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
