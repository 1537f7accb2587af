"""Saves and restores of a large state on the CPU with glibc's default allocator settings and with transparent huge
pages for malloc (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`), inshrink_jax beside Orbax, each setting in new
processes, alternately, in one run.

Usage: python benchmarks/hugepages.py [--sizes 1e7 1e8] [--rounds 2] [--dir DIR] [--out FILE]

XLA's CPU backend allocates every output buffer with malloc; glibc serves an allocation of more than 32 MB from a
fresh mmap and gives it back to the system when it is freed, so every large buffer a kernel writes is first-touched
memory: a page fault per 4 KiB page. A closed-loop residual save of 100M parameters writes several such buffers
(codes, the new reconstruction, the encoder's temporaries). With `glibc.malloc.hugetlb=1` (glibc 2.35 or newer)
malloc asks for transparent huge pages on its mmaps (madvise; the kernel's setting in
/sys/kernel/mm/transparent_hugepage/enabled must be `madvise` or `always`): one fault per 2 MiB. The variable is
read when a process starts, so each setting runs in processes of its own; both settings apply to Orbax alike.

Per process and size: bench_handler.py's synthetic state (four Student-t matrices of 4096 columns), a chain of 10
saves with `CompressionConfig(keyframe_every=10)` (each after a drift of every weight by 1e-3 of its tensor's
std: bench_handler.save_chain): the median of the residual saves after the first (save() until written), then restores of the keyframe and
of the deepest delta (best of 2, a fresh manager each); Orbax's StandardCheckpointer saving the same state 3 times
(the median of the last 2) and restoring it (best of 2). Process CPU seconds (user + system) and fresh memory (minor
faults times the page size) of the residual saves, per save. Medians over the rounds' processes. Directories under
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

TUNABLE = "glibc.malloc.hugetlb=1"
DEPTH = 9  # deltas after the keyframe: keyframe_every = DEPTH + 1


def worker(n: int, root: str) -> dict:
    import jax
    import orbax.checkpoint as ocp

    import inshrink_jax as ij
    from bench_handler import save_chain, synthetic

    state0 = synthetic(n)
    cfg = ij.CompressionConfig(keyframe_every=DEPTH + 1)
    path = tempfile.mkdtemp(dir=root)
    mngr = ocp.CheckpointManager(os.path.join(path, "c"), item_handlers=ij.InshrinkCheckpointHandler(cfg))
    saves = save_chain(mngr, state0, DEPTH, clock=report.usage)[1]  # [wall, user, system, fresh MB] each
    mngr.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state0)
    restores = {}
    for step in (0, DEPTH):
        best = float("inf")
        for _ in range(2):
            fresh = ocp.CheckpointManager(os.path.join(path, "c"), item_handlers=ij.InshrinkCheckpointHandler(cfg))
            t0 = time.perf_counter()
            jax.block_until_ready(fresh.restore(step, args=ij.InshrinkRestore(abstract)))
            best = min(best, time.perf_counter() - t0)
            fresh.close()
        restores[step] = best
    orbax = ocp.CheckpointManager(os.path.join(path, "o"))
    orbax_saves = []
    for step in range(3):
        t0 = time.perf_counter()
        orbax.save(step, args=ocp.args.StandardSave(state0))
        orbax.wait_until_finished()
        orbax_saves.append(time.perf_counter() - t0)
    orbax_restore = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        jax.block_until_ready(orbax.restore(2, args=ocp.args.StandardRestore(abstract)))
        orbax_restore = min(orbax_restore, time.perf_counter() - t0)
    orbax.close()
    shutil.rmtree(path)
    later = saves[2:]  # residual saves after the first (which compiles the residual kernels)
    return {"save": statistics.median(s[0] for s in later), "cpu": statistics.median(s[1] + s[2] for s in later),
            "fresh_mb": statistics.median(s[3] for s in later), "keyframe_restore": restores[0],
            "deep_restore": restores[DEPTH], "orbax_save": statistics.median(orbax_saves[1:]),
            "orbax_restore": orbax_restore}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e7, 1e8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(int(args.worker), args.dir)))
        return
    settings = {"glibc default": None, TUNABLE: TUNABLE}
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "not readable"
    lines = ["# Large saves and restores on the CPU: glibc's default malloc against transparent huge pages", "",
             f"Command: `python benchmarks/hugepages.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             __doc__.split("\n\n")[2].replace("\n", " "), "", __doc__.split("\n\n")[3].replace("\n", " "), "",
             f"This machine: transparent_hugepage/enabled = `{thp}`; {os.cpu_count()} CPU cores. Seconds, medians of "
             f"{args.rounds} processes a setting.", "",
             "| params | setting | ours: residual save s | CPU s a save | fresh MB a save | Orbax save s | "
             "Orbax / ours, save | ours: keyframe restore s | ours: depth-9 restore s | Orbax restore s | "
             "Orbax / keyframe | Orbax / deep |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in args.sizes:
        runs: dict[str, list[dict]] = {s: [] for s in settings}
        for _ in range(args.rounds):
            for name, tunable in settings.items():
                env = dict(os.environ)
                env.pop("GLIBC_TUNABLES", None)
                if tunable:
                    env["GLIBC_TUNABLES"] = tunable
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(n)] + (
                    ["--dir", args.dir] if args.dir else [])
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                runs[name].append(json.loads(out.strip().splitlines()[-1]))
        for name, rs in runs.items():
            m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            lines.append(f"| {n:,.0f} | {name} | {m['save']:.3f} | {m['cpu']:.2f} | {m['fresh_mb']:,.0f} | "
                         f"{m['orbax_save']:.3f} | {m['orbax_save'] / m['save']:.2f}x | {m['keyframe_restore']:.3f} | "
                         f"{m['deep_restore']:.3f} | {m['orbax_restore']:.3f} | "
                         f"{m['orbax_restore'] / m['keyframe_restore']:.2f}x | "
                         f"{m['orbax_restore'] / m['deep_restore']:.2f}x |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
