"""How the first saves' compile time grows with the number of parameter tensors: the character transformer of
examples/charlm.py at 2 and at 24 layers (width 64), each in a new process without a persistent cache.

Usage: python benchmarks/compile_scaling.py [--layers 2 24] [--out FILE]   (needs the `bench` extra)

Each process builds a TrainState (AdamW) of random weights, takes one training step, and saves three times with the
default CompressionConfig (configuration search with the data-free proxy: no eval_fn, no gradients), one step
apart. It reports how long each save took from save() to finished (wait_until_finished(); save() itself returns
at once, the state being on one device: the work runs in the background) and the seconds XLA spent compiling
during the saves (JAX's `jax_log_compiles` records), with the number of compilations and the three kernels that
took longest. The first save is a keyframe (its encoders, the moments' kernels), the second the first
closed-loop residual (the residual encoder), the third a steady save.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402

CHILD = r"""
import json, logging, re, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import jax, numpy as np
compiles = []


class Compiles(logging.Handler):
    def emit(self, record):
        m = re.search(r"Finished XLA compilation of (.*) in ([0-9.e-]+) sec", record.getMessage())
        if m:
            compiles.append((m.group(1).split(" ")[0], float(m.group(2))))


jax.config.update("jax_log_compiles", True)
logger = logging.getLogger("jax")
logger.addHandler(Compiles())
logger.setLevel(logging.DEBUG)
logger.propagate = False  # the records are counted, not printed
import charlm, digits, orbax.checkpoint as ocp
import inshrink_jax as ij
layers = int(sys.argv[2])
state = charlm.create_state(100, 0, steps=100, d=64, layers=layers)
x = np.random.default_rng(0).integers(0, 100, (8, charlm.CONTEXT + 1)).astype(np.int32)
batch = (x[:, :-1], x[:, 1:])
state, _, _ = digits.train_step(state, *batch)
jax.block_until_ready(state)
out = {"layers": layers, "tensors": len(jax.tree.leaves(state.params)),
       "parameters": sum(v.size for v in jax.tree.leaves(state.params)), "saves": []}
mngr = ocp.CheckpointManager(tempfile.mkdtemp(), item_handlers=ij.InshrinkCheckpointHandler())
for step in range(1, 4):
    compiles.clear()
    t = time.perf_counter()
    mngr.save(step, args=ij.InshrinkSave(state))
    blocked = time.perf_counter() - t
    mngr.wait_until_finished()
    kernels = {}
    for name, sec in compiles:
        kernels[name] = kernels.get(name, 0.0) + sec
    out["saves"].append({"blocks_s": blocked, "total_s": time.perf_counter() - t,
                         "compile_s": sum(sec for _, sec in compiles), "compilations": len(compiles),
                         "kernels": kernels})
    state, _, _ = digits.train_step(state, *batch)
    jax.block_until_ready(state)
print(json.dumps(out))
"""


def run(layers: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", CHILD, os.path.join(HERE, "..", "examples"), str(layers)],
                          capture_output=True, text=True, timeout=3600, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 24])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = []
    for layers in args.layers:
        results.append(run(layers))
        print(json.dumps(results[-1]), flush=True)
    first = results[0]
    lines = ["# First saves' compile time against the number of parameter tensors", "",
             f"Command: `python benchmarks/compile_scaling.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             "| layers | parameter tensors | parameters | save 1 (keyframe): total s, compile s (n) | "
             "save 2 (first residual): total s, compile s (n) | save 3: total s | first two saves' compile s, "
             f"vs {first['layers']} layers |",
             "|---:|---:|---:|---|---|---:|---|"]
    for r in results:
        s1, s2, s3 = r["saves"]
        both = s1["compile_s"] + s2["compile_s"]
        base = first["saves"][0]["compile_s"] + first["saves"][1]["compile_s"]
        lines.append(f"| {r['layers']} | {r['tensors']} | {r['parameters']:,} | {s1['total_s']:.1f}, "
                     f"{s1['compile_s']:.1f} ({s1['compilations']}) | {s2['total_s']:.1f}, {s2['compile_s']:.1f} "
                     f"({s2['compilations']}) | {s3['total_s']:.2f} | {both:.1f}, {both / base:.2f}x |")
    lines += ["", "Longest compilations of the first two saves (seconds):", "",
              "| layers | " + " | ".join(["kernel, s"] * 3) + " |", "|---:|---|---|---|"]
    for r in results:
        kernels: dict = {}
        for sv in r["saves"][:2]:
            for name, sec in sv["kernels"].items():
                kernels[name] = kernels.get(name, 0.0) + sec
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"| {r['layers']} | " + " | ".join(f"`{n}` {v:.1f}" for n, v in top) + " |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
