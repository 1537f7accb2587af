"""What a resumed job waits for before its first save returns, with and without JAX's persistent compilation
cache (`ij.enable_compilation_cache`), measured side by side in one run.

Usage: python benchmarks/compile_cache.py [--repeats 2] [--out FILE]   (needs the `bench` extra)

Workload: the character transformer of bench_fault_tolerance.py (440k parameters, AdamW), default
CompressionConfig, a GradientEMA and the held-out loss as eval_fn. A first process trains and saves at steps 30,
60 and 90; its later saves are deleted. Then, for each setting, a new process (a resumed job) restores step 30
and trains and saves every 30 steps three times; it reports the restore's seconds, how long its first save
blocked (save() alone) and took (until finished), and the same for its third save (a steady one). Settings: no persistent cache; an empty cache
(the first job on a machine: it compiles and fills the cache); the cache the previous job filled (every later
resume). The two cache settings run both at `ij.cache.MIN_COMPILE_TIME_SECS` (what `ij.enable_compilation_cache`
sets: every compilation is cached) and at a threshold of 0.1 s (the earlier setting, under which the restore's
decode kernels, each compiled in less, were compiled again by every resumed job), each threshold with a cache of
its own. Processes of different settings alternate, `--repeats` times; the table gives each setting's median.
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import jax
import inshrink_jax as ij
if sys.argv[4]:
    ij.enable_compilation_cache(sys.argv[4])
    if sys.argv[5]:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(sys.argv[5]))
import bench_fault_tolerance as ft, digits, orbax.checkpoint as ocp
work = ft.CharLM(0, 600)
state = work.create_state()
eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, *work.eval))
mngr = ocp.CheckpointManager(sys.argv[2], item_handlers=ij.InshrinkCheckpointHandler())
start = int(sys.argv[3])
out = {}
if start:
    t = time.perf_counter()
    state = mngr.restore(start, args=ij.InshrinkRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state)))
    jax.block_until_ready(state)
    out["restore_s"] = time.perf_counter() - t
sens = ij.GradientEMA(every=30)
ema = sens.init(state.params)
for step in range(start + 1, start + 31):
    state, loss, grads = digits.train_step(state, *work.batch(step))
    ema = sens.update(ema, grads)
for k, name in ((1, "save"), (2, None), (3, "steady")):
    if k > 1:
        for step in range(start + 30 * (k - 1) + 1, start + 30 * k + 1):
            state, loss, grads = digits.train_step(state, *work.batch(step))
            ema = sens.update(ema, grads)
    jax.block_until_ready((state, ema))
    t = time.perf_counter()
    mngr.save(start + 30 * k, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
    blocking = time.perf_counter() - t
    mngr.wait_until_finished()
    if name:
        out[name + "_blocking_s"], out[name + "_total_s"] = blocking, time.perf_counter() - t
print(json.dumps(out))
"""


def run(root: str, start: int, cache: str, threshold: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, HERE, root, str(start), cache, threshold],
                          capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp()
    first = os.path.join(work, "first")
    run(first, 0, "")
    for step in ("60", "90"):  # the first process's later saves: a resumed job restores step 30
        shutil.rmtree(os.path.join(first, step))
    # setting -> (its cache: None, or (directory name, empty it first), JAX's threshold: "" for the library's)
    settings = {"no persistent cache": (None, ""),
                "empty cache (first job on a machine)": (("cache", True), ""),
                "cache filled by the previous job": (("cache", False), ""),
                "empty cache, threshold 0.1 s": (("cache01", True), "0.1"),
                "cache filled by the previous job, threshold 0.1 s": (("cache01", False), "0.1")}
    rows: dict[str, list] = {s: [] for s in settings}
    for r in range(args.repeats):
        for setting, (cache, threshold) in settings.items():
            root = os.path.join(work, f"resume{r}-{len(rows[setting])}-{abs(hash(setting))}")
            shutil.copytree(first, root)
            directory = "" if cache is None else os.path.join(work, f"{cache[0]}{r}")
            if cache is not None and cache[1]:
                shutil.rmtree(directory, ignore_errors=True)
            rows[setting].append(run(root, 30, directory, threshold))
            print(setting, rows[setting][-1], flush=True)
    med = {s: {k: statistics.median(x[k] for x in v) for k in v[0]} for s, v in rows.items()}
    base = med["no persistent cache"]["save_total_s"]
    lines = ["# A resumed job's first save, with and without JAX's persistent compilation cache", "",
             f"Command: `python benchmarks/compile_cache.py --repeats {args.repeats}`", "",
             __doc__.split("\n\n", 2)[2].strip(), "",
             "| setting | restore s | first save: blocks s | first save: total s | total vs no cache | "
             "steady save: blocks s | steady save: total s | first / steady (blocks) | first / steady (total) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s, m in med.items():
        lines.append(f"| {s} | {m['restore_s']:.2f} | {m['save_blocking_s']:.3f} | {m['save_total_s']:.2f} | "
                     f"{m['save_total_s'] / base:.2f}x | {m['steady_blocking_s']:.3f} | {m['steady_total_s']:.2f} | "
                     f"{m['save_blocking_s'] / m['steady_blocking_s']:.1f}x | "
                     f"{m['save_total_s'] / m['steady_total_s']:.1f}x |")
    report.emit(lines, args.out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
