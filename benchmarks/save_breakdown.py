"""Where the bytes of one save go, and what a restore of it costs in a new process.

Usage: python benchmarks/save_breakdown.py [--workload charlm] [--saves 4] [--config "moment_budget=0.1;..."]
[--out FILE] (needs the `bench` extra: pip install -e '.[bench]')

Trains one of bench_fidelity.py's workloads (default: the character transformer, 440k parameters, AdamW) with the
default CompressionConfig (or --config overrides, as bench_fidelity.py's inshrink[...]), a GradientEMA and the
eval_fn of bench_fidelity.py (held-out loss, or accuracy for the image workloads), saving at the workload's
checkpoint interval --saves times. Then splits the last save's bytes by leaf group (parameters,
Adam's mu and nu; quantized or stored exactly) and by file (code and data blobs, manifest, offset table), and
restores that step without a target in a fresh Python process: wall time and the number of decode kernels it
compiled; then, in that process, the same restore again (warm) alternated with Orbax's StandardCheckpointer
restoring the same state from its own checkpoint (medians, and their ratio). It also records every code stream
the run's saves stored against its order-0 entropy (bench_delta.py's recorder and table).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

import orbax.checkpoint as ocp
import zstandard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_delta  # noqa: E402
import bench_fault_tolerance as ft  # noqa: E402
import bench_fidelity  # noqa: E402
import report  # noqa: E402

from inshrink_jax import save, store  # noqa: E402

RESTORE = """
import json, statistics, sys, tempfile, time
import jax, orbax.checkpoint as ocp
import inshrink_jax as ij
from inshrink_jax import quantize
m = ocp.CheckpointManager(sys.argv[1], item_handlers=ij.InshrinkCheckpointHandler())
t = time.perf_counter()
state = jax.block_until_ready(m.restore(int(sys.argv[2]), args=ij.InshrinkRestore()))
first, kernels = time.perf_counter() - t, quantize._chain_group._cache_size()
# Then, alternately, the same restore again and Orbax's restore of the same state from its default checkpoint.
std, path = ocp.StandardCheckpointer(), tempfile.mkdtemp() + "/std"
std.save(path, state)
std.wait_until_finished()
ours, orbax = [], []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    jax.block_until_ready(m.restore(int(sys.argv[2]), args=ij.InshrinkRestore()))
    ours.append(time.perf_counter() - t)
    t = time.perf_counter()
    jax.block_until_ready(std.restore(path))
    orbax.append(time.perf_counter() - t)
print(json.dumps({"seconds": first, "kernels": kernels, "again": statistics.median(ours),
                  "orbax": statistics.median(orbax)}))
"""
REPEATS = 7  # warm restores of each kind, alternated; the table gives their medians
RECORD_LEVELS = (3, 15, 19)  # zstd levels the last save's records are also compressed at (store.RECORD_LEVEL's choice)


def record_levels(body) -> list[tuple[int, float]]:
    """(bytes, best-of-3 milliseconds) of a record as `store.write_json` frames it, zstd-coded at each of
    `RECORD_LEVELS`."""
    raw = store.framed_json(body)
    out = []
    for level in RECORD_LEVELS:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            n = len(zstandard.ZstdCompressor(level=level).compress(raw))
            times.append(time.perf_counter() - t)
        out.append((n, 1e3 * min(times)))
    return out


def train_saving(work, every: int, saves: int, eval_fn, mngr, root: str):
    """Train `work` (a bench_fidelity workload) for `saves` checkpoints, one every `every` steps, each saved through
    `mngr` with a GradientEMA and `eval_fn` and waited for; yields after each save (step, state, {path: bytes} of
    the files under `root` the save wrote or changed)."""
    state = work.create_state()
    sens = ft.ij.GradientEMA(every=every)
    ema = sens.init(state.params)
    seen: dict = {}
    for step in range(1, every * saves + 1):
        state, _, grads = work.train_step(state, *work.batch(step))
        if sens.active(step):
            ema = sens.update(ema, grads)
        if step % every == 0:
            mngr.save(step, args=ft.ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
            mngr.wait_until_finished()
            now = report.files(root)
            new, seen = {p: n for p, n in now.items() if seen.get(p) != n}, now
            yield step, state, new


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(bench_fidelity.WORKLOADS), default="charlm")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--config", default="", help="CompressionConfig overrides, key=value;key=value")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = ft.ij.CompressionConfig(**bench_fidelity.overrides(args.config))
    cls = bench_fidelity.WORKLOADS[args.workload]
    work, every = (cls(0) if cls is ft.Mnist else cls(0, cls.steps)), cls.every
    root = tempfile.mkdtemp()
    mngr = ocp.CheckpointManager(root, item_handlers=ft.ij.InshrinkCheckpointHandler(cfg),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=3))
    streams = []
    original, save._encode_shard = save._encode_shard, bench_delta.recording_streams(streams)
    for _, state, new in train_saving(work, every, args.saves, ft.eval_fn_of(work, cls.metric), mngr, root):
        pass
    mngr.close()
    save._encode_shard = original
    last = every * args.saves
    reader = store.Reader(os.path.join(root, str(last), "default"))
    groups = collections.Counter()
    for leaf, shards in reader.shards.items():
        meta = reader.leaves[leaf]
        who = ("mu" if ".mu" in leaf else "nu" if ".nu" in leaf else "momentum" if ".trace" in leaf else
               "parameters" if meta.part == "params" else "other")
        how = "quantized" if meta.kind == "quantized" else "stored exactly"
        groups[f"{who}, {how}"] += sum(s.length for _, sh in shards for s in sh.segments.values())
    files, as_json, levels = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    for path, n in new.items():
        name = os.path.basename(path)
        kind = name.split(".")[0] if name.split(".")[0] in ("blob", "data", "index", "manifest") else "other"
        files[kind] += n
        if kind in ("index", "manifest"):  # what the record would be as plain JSON (format 7 wrote it so)
            body, _ = store.read_json(path, kind, os.path.dirname(path))
            as_json[kind] += len(store._canonical(body))
            levels[kind].append(record_levels(body))
    out = subprocess.run([sys.executable, "-c", RESTORE, root, str(last), str(REPEATS)], capture_output=True,
                         text=True, check=True)
    restored = json.loads(out.stdout.strip().splitlines()[-1])
    total = sum(new.values())
    cmd = f"python benchmarks/save_breakdown.py --workload {args.workload} --saves {args.saves}" + \
        (f" --config '{args.config}'" if args.config else "") + (f" --out {args.out}" if args.out else "")
    lines = [f"# One save of the {args.workload} workload (step {last}), byte by byte", "", f"Command: `{cmd}`", "",
             f"{work.describe(cls.steps)}.", "",
             f"Configuration: CompressionConfig({args.config.replace(';', ', ')}); {args.saves} saves, one every {every} "
             f"steps; the last one wrote {total:,} bytes (raw state "
             f"{ft.nbytes(state.params) + ft.nbytes(state.opt_state) + ft.nbytes(state.step):,}).", "",
             "| leaf group | segment bytes |", "|---|---:|"]
    lines += [f"| {k} | {v:,} |" for k, v in sorted(groups.items())]
    lines += ["", "| file | bytes written |", "|---|---:|"]
    lines += [f"| {k} | {v:,} |" for k, v in sorted(files.items())]
    lines += ["", "Records as plain JSON (before zstd): " + ", ".join(f"{k} {v:,} bytes" for k, v in
                                                                   sorted(as_json.items())) + "."]
    lines += ["", f"Records at zstd levels {', '.join(map(str, RECORD_LEVELS))} (store.RECORD_LEVEL = "
                  f"{store.RECORD_LEVEL} is written), bytes and milliseconds to compress (best of 3): " + "; ".join(
                      f"{kind} " + ", ".join(f"{sum(r[i][0] for r in rows):,} B ({sum(r[i][1] for r in rows):.1f} ms)"
                                             for i in range(len(RECORD_LEVELS)))
                      for kind, rows in sorted(levels.items())) + "."]
    lines += ["", f"Restore of step {last} without a target in a new process: {restored['seconds']:.2f} s, "
                  f"{restored['kernels']} closed-loop decode kernels compiled. The same restore again in that process "
                  f"(median of {REPEATS}): {restored['again']:.3f} s, against {restored['orbax']:.3f} s for Orbax's "
                  f"StandardCheckpointer restoring the same state from its default checkpoint, alternated with it: "
                  f"{restored['again'] / restored['orbax']:.1f}x."]
    lines += ["", f"Every code stream the {args.saves} saves stored, decoded from its bytes, against its order-0 "
                  "entropy (bench_delta.py's table):", ""] + bench_delta.stream_table(streams)
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
