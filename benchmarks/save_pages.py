"""What a large state's residual save spends: wall, user and system time and fresh memory pages, per jitted
kernel and per save, with the residual search on row samples (the default) and exact (on the whole state).

Usage: python benchmarks/save_pages.py [--params 1e8] [--saves 5] [--out FILE]

A synthetic params-only state (bench_handler.py's: four Student-t matrices of 4096 columns). First the kernels of
one residual save alone, each timed on its own after a warm-up: the whole-state scoring of four candidates on
uniform cells (`quantize.uniform_residual_scores`, what the exact residual search runs), the chosen candidate's
encode (`quantize.encode_on_device`), its decode to the new reconstruction (`quantize.dequantize_all`) and its
proxy (`search.proxy_degradation`). Then `--saves` saves (a keyframe, then residual saves; each drifts every
weight by 1e-3 of its tensor's std, as bench_handler.py's chains) with the default search and again with the
residual search made exact (`search.SEARCH_SAMPLE` above every tensor's size), and Orbax's StandardCheckpointer
saving the same state. "Fresh MB" is the process's minor page faults times the page size: memory first touched
(on the CPU backend, every new buffer the kernels write). Process-wide figures, so each is measured alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import jax
import orbax.checkpoint as ocp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from bench_handler import synthetic  # noqa: E402

import inshrink_jax as ij  # noqa: E402
from inshrink_jax import quantize, search  # noqa: E402
from inshrink_jax.config import QuantConfig  # noqa: E402


def timed(f, repeats: int = 2):
    """(wall, user, system seconds, fresh MB) of the last of `repeats` calls after one warm-up, and its result."""
    out = jax.block_until_ready(f())
    for _ in range(repeats):
        a = report.usage()
        out = jax.block_until_ready(f())
        b = report.usage()
    return tuple(b - a), out


def saves(state, n: int, exact: bool):
    """Per save (wall, user, system, fresh MB), and the parameter bytes each wrote. `exact`: the residual saves'
    searches on the whole state (`search.SEARCH_SAMPLE` above every tensor's size after the first save, whose
    keyframe search stays sampled)."""
    sample, path = search.SEARCH_SAMPLE, tempfile.mkdtemp() + "/c"
    mngr = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig()))
    key, rows = jax.random.PRNGKey(0), []
    for step in range(n):
        jax.block_until_ready(state)
        a = report.usage()
        mngr.save(step, args=ij.InshrinkSave(state))
        mngr.wait_until_finished()
        b = report.usage()
        rows.append(tuple(b - a))
        if exact:
            search.SEARCH_SAMPLE = sum(x.size for x in jax.tree.leaves(state))
        key, sub = jax.random.split(key)
        state = jax.tree.map(lambda x: x + 1e-3 * jax.numpy.std(x) * jax.random.normal(sub, x.shape), state)
    search.SEARCH_SAMPLE = sample
    sizes = [mngr.item_metadata(s)["stored_bytes"]["params"] for s in range(n)]
    mngr.close()
    return rows, sizes


def fmt(r) -> str:
    return f"{r[0]:.3f} | {r[1]:.2f} | {r[2]:.2f} | {r[3]:,.0f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    state = synthetic(int(args.params))
    xs = [state["params"][k] for k in sorted(state["params"])]
    offs = [jax.block_until_ready(x + 0.01 * jax.random.normal(jax.random.PRNGKey(i), x.shape))
            for i, x in enumerate(xs)]
    n = sum(x.size for x in xs)
    cfg, lts = ij.CompressionConfig(), ["dense"] * len(xs)
    quants = [QuantConfig(bins=63, embedding_bins=63, protect_fraction=0.0, prune_fraction=0.0, step=s)
              for s in (1.0, 1.5, 2.0, 3.0)]
    kernels = []
    t, _ = timed(lambda: quantize.uniform_residual_scores(xs, offs, None, lts, quants, cfg))
    kernels.append(("whole-state scoring of 4 candidates (`uniform_residual_scores`)", t))
    t, devs = timed(lambda: quantize.encode_on_device(xs, [None] * len(xs), lts, quants[1], cfg, offsets=offs,
                                                      sigma=quantize.RESIDUAL_SIGMA))
    kernels.append(("encode of the chosen one (`encode_on_device`)", t))
    t, deq = timed(lambda: quantize.dequantize_all(devs, [x.dtype for x in xs]))
    kernels.append(("its decode, the new reconstruction (`dequantize_all`)", t))
    t, _ = timed(lambda: search.proxy_degradation(xs, deq, [None] * len(xs), offs))
    kernels.append(("its proxy (`proxy_degradation`)", t))
    devs = deq = None  # their buffers freed before the saves

    sampled, sampled_sizes = saves(state, args.saves, exact=False)
    exact, exact_sizes = saves(state, args.saves, exact=True)
    std, orbax = ocp.StandardCheckpointer(), []
    for i in range(3):
        a = report.usage()
        std.save(tempfile.mkdtemp() + "/s", state)
        std.wait_until_finished()
        b = report.usage()
        orbax.append(tuple(b - a))

    def median(rows):
        return tuple(statistics.median(r[k] for r in rows) for k in range(4))

    cmd = f"python benchmarks/save_pages.py --params {args.params:g} --saves {args.saves}" + \
        (f" --out {args.out}" if args.out else "")
    lines = [f"# A residual save of a {n:,}-parameter state: time and fresh memory pages", "", f"Command: `{cmd}`",
             "", __doc__.split("\n\n")[2].replace("\n", " "), "",
             "| kernel (alone, after a warm-up) | wall s | user s | system s | fresh MB |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {fmt(t)} |" for name, t in kernels]
    lines += ["", "| saves | first (keyframe) | median of the residual saves after the first: wall s | user s | "
                  "system s | fresh MB |", "|---|---:|---:|---:|---:|---:|"]
    for name, rows in (("residual search on row samples (default)", sampled), ("residual search exact", exact)):
        lines.append(f"| {name} | {rows[0][0]:.2f} | {fmt(median(rows[2:]))} |")
    lines.append(f"| Orbax StandardCheckpointer (median of the 2nd and 3rd) | | {fmt(median(orbax[1:]))} |")
    lines += ["", f"Parameter bytes of each save: sampled {sampled_sizes}; exact {exact_sizes} "
                  f"({'the same' if sampled_sizes == exact_sizes else 'they differ'})."]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
