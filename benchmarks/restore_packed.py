"""The deepest restore of a default closed-loop chain with residual links read packed or code by code, and the
chain kernel with and without the save's per-link formula, side by side in one run.

Usage: python benchmarks/restore_packed.py [--sizes 1e7 1e8] [--rounds 2] [--cache] [--variants LABEL ...]
           [--out benchmarks/results/restore_packed.md]

Each size's synthetic state (bench_handler.py's: four 4096-column matrices) is saved 10 times with
`CompressionConfig(keyframe_every=10)` (bench_handler.save_chain), then step 9 is restored in new processes, one
per variant and round, alternating: the first restore of the process (what a resumed job does) and the median of
`REPEATS` more (warm). Variants set `quantize._PACKED_FROM`, the tensor size from which residual links are read
packed and added by plain sums: the default (1M), 8M (the previous default), never (every code spelled out on the
host and added by the formula) and from 256K values (--variants picks some by label). With
--cache, each variant's processes run with JAX's persistent compilation cache (`ij.enable_compilation_cache`, a
directory per variant) that an unreported process of that variant filled first: a resumed job's restore from its
second resume on, when it enables the cache; without it, every first restore compiles its kernels. Orbax's
StandardCheckpointer restores
the same state in this process, for scale. Then the chain kernel alone on four packed links of one tensor's size
(3 codes a byte): `quantize._chain_group` (the save's formula, which replaces a non-finite sum by 0 at every link)
against `quantize._chain_sum` (plain sums)."""

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

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import inshrink_jax as ij
from inshrink_jax import quantize
from bench_handler import save_chain, synthetic  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPEATS = 5
DEPTH = 9
VARIANTS = [("packed from 1M values (default)", None), ("packed from 8M values (the previous default)", 1 << 23),
            ("never packed", 1 << 62), ("packed from 256K values", 1 << 18)]
RESTORE = """
import json, statistics, sys, time
import jax, orbax.checkpoint as ocp, inshrink_jax as ij
from inshrink_jax import quantize
path, step, packed_from, repeats, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
if cache != "None":
    ij.enable_compilation_cache(cache)
if packed_from != "None":
    quantize._PACKED_FROM = int(packed_from)
cfg = ij.CompressionConfig(keyframe_every=step + 1)
tree = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(cfg)).item_metadata(step)["tree"]
abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
times = []
for _ in range(repeats + 1):
    mngr = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(cfg))
    t0 = time.perf_counter()
    jax.block_until_ready(mngr.restore(step, args=ij.InshrinkRestore(abstract)))
    times.append(time.perf_counter() - t0)
print(json.dumps({"first": times[0], "warm": statistics.median(times[1:])}))
"""


def restore_times(path: str, packed_from, rounds: int, cache: str | None = None) -> tuple[list, list]:
    """(first restores, warm medians) of step DEPTH, one new process per round (`cache`: the directory of its
    persistent compilation cache, or None for none)."""
    firsts, warms = [], []
    for _ in range(rounds):
        out = subprocess.run([sys.executable, "-c", RESTORE, path, str(DEPTH), str(packed_from), str(REPEATS),
                              str(cache)],
                             capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        firsts.append(got["first"])
        warms.append(got["warm"])
    return firsts, warms


def orbax_restore(state, tmp: str) -> float:
    """Median of REPEATS warm restores of `state` from Orbax's default checkpoint."""
    path = os.path.join(tmp, "orbax")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    times = []
    for _ in range(REPEATS + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(ckptr.restore(path, abstract))
        times.append(time.perf_counter() - t0)
    shutil.rmtree(path)
    return statistics.median(times[1:])


def kernels(n: int) -> tuple[float, float]:
    """Seconds (median of REPEATS) of one group of four packed links of a tensor of `n` values, 3 codes a byte:
    (the formula's kernel, plain sums)."""
    rng = np.random.default_rng(0)
    size = quantize.chain_size(n) if quantize.takes_packed(n) else -(-n // quantize.PACKED_MULTIPLE) * \
        quantize.PACKED_MULTIPLE
    codes = tuple(jax.device_put(rng.integers(0, 125, size // 3, dtype=np.uint8)) for _ in range(4))
    tables = tuple(jnp.asarray(rng.normal(size=(256, 3)).astype(np.float32)) for _ in range(4))
    used = jnp.ones(quantize.CHAIN_GROUP, bool)
    calls = {"formula": lambda a: quantize._chain_group(a, codes, tables, used, None, dtype=jnp.dtype("float32")),
             "sums": lambda a: quantize._chain_sum(a, codes, tables, dtype=jnp.dtype("float32"))}
    out = {}
    for name, call in calls.items():
        a = call(jnp.zeros(size, jnp.float32)).block_until_ready()  # compile
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            a = call(a).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out["formula"], out["sums"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e7, 1e8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache", action="store_true", help="restore with a persistent compilation cache, filled first")
    ap.add_argument("--variants", nargs="+", default=None, help="labels of the variants to run (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = VARIANTS if args.variants is None else [v for v in VARIANTS if v[0] in args.variants]
    if args.variants is not None and len(variants) != len(args.variants):
        ap.error(f"--variants: labels are {[label for label, _ in VARIANTS]}")
    rows = []
    for n in args.sizes:
        state = synthetic(int(n))
        count = sum(x.size for x in jax.tree.leaves(state))
        tensor = max(x.size for x in jax.tree.leaves(state))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "chain")
            mngr = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(
                ij.CompressionConfig(keyframe_every=DEPTH + 1)))
            state, _ = save_chain(mngr, state, DEPTH)
            mngr.close()
            orbax = orbax_restore(state, tmp)
            caches = {label: os.path.join(tmp, f"cache{k}") if args.cache else None
                      for k, (label, _) in enumerate(variants)}
            for label, packed_from in variants:  # each cache filled by a process of its own, not reported
                if args.cache:
                    restore_times(path, packed_from, 1, caches[label])
            got = {label: ([], []) for label, _ in variants}
            for _ in range(args.rounds):  # alternating variants
                for label, packed_from in variants:
                    f, w = restore_times(path, packed_from, 1, caches[label])
                    got[label][0].extend(f)
                    got[label][1].extend(w)
            formula, sums = kernels(tensor)
        rows.append((count, tensor, orbax, got, formula, sums))
        print(count, orbax, got, formula, sums, flush=True)
    lines = ["# Deep restore: residual links read packed or code by code", "",
             f"Command: `python benchmarks/restore_packed.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             __doc__.split("\n\n", 2)[2].replace("\n", " "), "",
             "Compilation cache: " + ("on, filled by a first process of each variant." if args.cache else
                                      "none (every first restore compiles its kernels)."), "",
             f"| state | tensors of | variant | first restore in a new process, s (each round) | warm restore, s "
             f"(median of {REPEATS}, each round) | Orbax warm restore s |", "|---|---:|---|---|---|---:|"]
    for count, tensor, orbax, got, _, _ in rows:
        for label, _ in variants:
            f, w = got[label]
            lines.append(f"| {count:,} params | {tensor:,} | {label} | {' / '.join(f'{x:.3f}' for x in f)} | "
                         f"{' / '.join(f'{x:.3f}' for x in w)} | {orbax:.3f} |")
    lines += ["", "| tensor of | four packed links, the formula's kernel s | plain sums s | formula / sums |",
              "|---:|---:|---:|---:|"]
    lines += [f"| {tensor:,} | {formula:.4f} | {sums:.4f} | {formula / sums:.2f}x |"
              for _, tensor, _, _, formula, sums in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
