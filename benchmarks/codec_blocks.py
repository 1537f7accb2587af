"""The host passes of the code codecs over long streams, block by block (`codec._BLOCK` values at a time) against
one pass over the whole stream (the block set past the stream's size), side by side in one process; then the
residual saves of a large state with each.

Usage: python benchmarks/codec_blocks.py [--values 25e6] [--params 1e8] [--rounds 3] [--out FILE]

Streams of `--values` bytes shaped like a save's largest: a closed-loop residual's codes (3 cells, the centre most
frequent: "ranks", 5 to a byte), a keyframe's codes (16 k-means levels: "ranks", 2 to a byte through the table of
pairs) and a residual's with a rare tail (12 cells: "zstd-escape"). Each kernel alone on one thread, then on two
threads at once (a save encodes two shards at a time, `CompressionConfig.encode_threads`), each the median of
`--rounds` rounds that alternate the two settings. Then the state of bench_handler.py (four Student-t matrices
of 4096 columns, `--params` parameters) saved through a CheckpointManager with the default CompressionConfig:
a keyframe, then four residual saves (each after a drift of every weight by 1e-3 of its tensor's std:
bench_handler.save_chain), per setting and round alternately: the median residual save's wall seconds, its process
CPU seconds (user and system) and fresh memory pages (minor faults), and Orbax's StandardCheckpointer saving the
same chain of states in the same rounds (the last four). The directories are under --dir (default: the system's temporary directory).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402

from inshrink_jax import codec  # noqa: E402

WHOLE = 1 << 62  # `codec._BLOCK` past any stream: one pass over the whole stream
STREAMS = {"residual codes, 3 cells": [0.2, 0.6, 0.2],
           "keyframe codes, 16 levels": list(np.full(16, 1 / 16)),
           "residual codes, 12 cells, rare tail": [0.3, 0.3, 0.15, 0.15, 0.05, 0.03] + [0.02 / 6] * 6}


def kernels(a: np.ndarray) -> dict:
    counts = codec.byte_counts(a)
    best = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL, counts)[1]
    return {"byte_counts": lambda: codec.byte_counts(a),
            f"compress_best ({best})": lambda: codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL, counts)}


def on_threads(f, threads: int) -> float:
    """Seconds for `threads` threads each calling `f` once, started together."""
    gate = threading.Barrier(threads + 1)

    def run():
        gate.wait()
        f()
    ts = [threading.Thread(target=run) for _ in range(threads)]
    for t in ts:
        t.start()
    t0 = time.perf_counter()
    gate.wait()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def state_saves(params: float, rounds: int, root: str) -> dict:
    """Per setting ("whole", "blocks", "orbax"): `report.usage` differences ([wall, user, system, fresh MB]) of
    each save after a chain's first (bench_handler.save_chain: residual saves; Orbax's saves of the same drifting
    states), over `rounds` alternating rounds."""
    import orbax.checkpoint as ocp

    import inshrink_jax as ij
    from bench_handler import save_chain, synthetic

    state0 = synthetic(int(params))
    block, out = codec._BLOCK, {"whole": [], "blocks": [], "orbax": []}
    for _ in range(rounds):
        for name in ("whole", "blocks", "orbax"):
            codec._BLOCK = WHOLE if name == "whole" else block
            path = tempfile.mkdtemp(dir=root)
            mngr = (ocp.CheckpointManager(path) if name == "orbax" else
                    ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig())))
            out[name] += save_chain(mngr, state0, 4, clock=report.usage,
                                    save_args=ocp.args.StandardSave if name == "orbax" else ij.InshrinkSave)[1][1:]
            mngr.close()
            shutil.rmtree(path)
    codec._BLOCK = block
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=float, default=25e6)
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n, block = int(args.values), codec._BLOCK
    rng = np.random.default_rng(0)
    lines = ["# Codec host passes: block by block against one pass over the stream", "",
             f"Command: `python benchmarks/codec_blocks.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             f"`codec._BLOCK` = {block:,} values; {n:,} values a stream; milliseconds, median of {args.rounds}.", "",
             "| stream | kernel | threads | one pass ms | blocks ms | one pass / blocks |",
             "|---|---|---:|---:|---:|---:|"]
    for name, p in STREAMS.items():
        a = rng.choice(len(p), n, p=np.asarray(p) / np.sum(p)).astype(np.uint8)
        for kname, f in kernels(a).items():
            codec._BLOCK = WHOLE
            one_pass = codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL)
            codec._BLOCK = block
            assert codec.compress_best(a, codec.CODE_CODECS, codec.CODE_LEVEL) == one_pass  # the same bytes
            for threads in (1, 2):
                times = {"whole": [], "blocks": []}
                for _ in range(args.rounds):
                    for setting in times:
                        codec._BLOCK = WHOLE if setting == "whole" else block
                        times[setting].append(on_threads(f, threads))
                codec._BLOCK = block
                w, b = (statistics.median(times[s]) * 1e3 for s in ("whole", "blocks"))
                lines.append(f"| {name} | {kname} | {threads} | {w:,.1f} | {b:,.1f} | {w / b:.2f}x |")
    lines += ["", f"Residual saves of a {args.params:,.0f}-parameter state (median of {4 * args.rounds} saves, "
              f"{args.rounds} alternating rounds; process-wide figures):", "",
              "| setting | wall s | user s | system s | fresh MB |", "|---|---:|---:|---:|---:|"]
    saves = state_saves(args.params, args.rounds, args.dir)
    labels = {"whole": "one pass over each stream", "blocks": f"blocks of {block:,}",
              "orbax": "Orbax StandardCheckpointer"}
    for name, rows in saves.items():
        med = np.median(np.array(rows), axis=0)
        lines.append(f"| {labels[name]} | {med[0]:.3f} | {med[1]:.2f} | {med[2]:.2f} | {med[3]:,.0f} |")
    w, b, o = (float(np.median(np.array(saves[s])[:, 0])) for s in ("whole", "blocks", "orbax"))
    lines += ["", f"Residual save, one pass / blocks: {w / b:.2f}x; blocks / Orbax: {b / o:.2f}x; "
              f"one pass / Orbax: {w / o:.2f}x."]
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
