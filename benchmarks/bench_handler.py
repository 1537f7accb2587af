"""Handler vs Orbax's StandardCheckpointer on the same state, in one run: stored bytes, save() blocking time,
total save time, restore time, as ratios.

Usage: python benchmarks/bench_handler.py [--sizes 1e6 1e7 1e8] [--depth 9] [--repeats 2]
           [--out benchmarks/results/handler.md]

States: the digits CNN TrainState (adam) after 200 steps on real data, and params-only states of --sizes
float32 parameters (Student-t weights, 4096-wide matrices), each also saved as a delta chain to time the restore
of its deepest delta. inshrink_jax runs with 16 bins, protect 0.5%, no
pruning, no delta (one keyframe), no configuration search, the default optimizer policy. Each timing is the best of --repeats saves to fresh directories after one
warm-up save (compilation excluded).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import digits  # noqa: E402

import inshrink_jax as ij  # noqa: E402
import report  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


FIXED = ij.CompressionConfig(search=False)  # the pipeline's own cost; bench_search.py measures the search


def measure(kind, state, tmp, repeats):
    """(stored bytes, blocking s, total s, restore s, blocking s inside the handler's async_save) for 'orbax' or
    'inshrink' (the last is None for Orbax)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, state)
    best = [np.inf] * 3
    size, inner = 0, np.inf
    for rep in range(repeats + 1):
        path = os.path.join(tmp, f"{kind}{rep}")
        if kind == "orbax":
            mngr = ocp.CheckpointManager(path)
            save_args, restore_args = ocp.args.StandardSave(state), ocp.args.StandardRestore(abstract)
        else:
            mngr = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(FIXED))
            save_args, restore_args = ij.InshrinkSave(state), ij.InshrinkRestore(abstract)
        t0 = time.perf_counter()
        mngr.save(0, args=save_args)
        t1 = time.perf_counter()
        mngr.wait_until_finished()
        t2 = time.perf_counter()
        jax.block_until_ready(mngr.restore(0, args=restore_args))
        t3 = time.perf_counter()
        size = report.dir_bytes(path)  # the whole root: inshrink_jax keeps the step's data beside the step directory
        if rep:  # rep 0 is the warm-up
            best = [min(b, t) for b, t in zip(best, (t1 - t0, t2 - t0, t3 - t2))]
            if kind != "orbax":  # the handler's own part of save() (its per-save figures record it)
                inner = min(inner, mngr.item_metadata(0)["blocking_seconds"])
        mngr.close()
        shutil.rmtree(path)
    return size, *best, (None if kind == "orbax" else inner)


def params_only_bytes(kind, params, tmp):
    path = os.path.join(tmp, f"p_{kind}")
    mngr = (ocp.CheckpointManager(path) if kind == "orbax"
            else ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(FIXED)))
    mngr.save(0, args=ocp.args.StandardSave(params) if kind == "orbax" else ij.InshrinkSave(params))
    mngr.wait_until_finished()
    size = report.dir_bytes(path)
    shutil.rmtree(path)
    return size


# The chains timed: the fixed configuration of the table above, and the default one (its search with the data-free
# proxy, no eval_fn: keyframes of the search's choice, closed-loop residuals on uniform cells, entropy-packed).
CHAIN_CONFIGS = (("fixed (as above)", dict(search=False)), ("default", {}))


def chain_restore(state, tmp, depth, repeats, config: dict):
    """(restore seconds of a keyframe, of the step `depth` deltas after it (keyframe_every = depth + 1), of Orbax's
    default checkpoint of the chain's last state, params bytes per save, total seconds of each save (save() to
    written)), on states that drift like training weights between checkpoints; `config`: the CompressionConfig's
    fields besides keyframe_every. The three restores are timed in turn, each with a fresh manager, so each
    best-of is taken in the same state of the process (Orbax's restore timed right after its own save, in the
    table above, moves by half from run to run at 100M parameters)."""
    path = os.path.join(tmp, "chain")
    cfg = ij.CompressionConfig(keyframe_every=depth + 1, **config)
    mngr = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(cfg))
    state, save_s = save_chain(mngr, state, depth)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    kinds = [(mngr.item_metadata(s)["kind"], mngr.item_metadata(s)["chain_depth"]) for s in (0, depth)]
    assert kinds == [("keyframe", 0), ("delta", depth)], kinds
    orbax_path = os.path.join(tmp, "chain_orbax")
    with ocp.CheckpointManager(orbax_path) as orbax:
        orbax.save(0, args=ocp.args.StandardSave(state))
        orbax.wait_until_finished()
    times = {"orbax": np.inf, 0: np.inf, depth: np.inf}
    for rep in range(repeats + 1):  # rep 0 is the warm-up
        for which in times:
            if which == "orbax":
                fresh, args = ocp.CheckpointManager(orbax_path), ocp.args.StandardRestore(abstract)
            else:
                fresh = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(cfg))
                args = ij.InshrinkRestore(abstract)
            t0 = time.perf_counter()
            out = fresh.restore(0 if which == "orbax" else which, args=args)
            jax.block_until_ready(out)
            if rep:
                times[which] = min(times[which], time.perf_counter() - t0)
            del out
            fresh.close()
    sizes = [mngr.item_metadata(s)["stored_bytes"]["params"] for s in range(depth + 1)]
    mngr.close()
    shutil.rmtree(path)
    shutil.rmtree(orbax_path)
    return times[0], times[depth], times["orbax"], sizes, save_s


def save_chain(mngr, state, depth: int, clock=time.perf_counter, save_args=ij.InshrinkSave):
    """Steps 0..`depth` of `state` saved through `mngr` (as `save_args(state)`; ocp.args.StandardSave for Orbax's
    handler), each save followed by a drift of every weight by 1e-3 of its tensor's std (as training moves weights
    between checkpoints): (the last state, each save's `clock()` difference from save() until written: seconds by
    default; `report.usage` gives time, CPU and fresh memory)."""
    key = jax.random.PRNGKey(0)
    save_s = []
    for step in range(depth + 1):
        jax.block_until_ready(state)  # the drift's device work is not the save's
        t0 = clock()
        mngr.save(step, args=save_args(state))
        mngr.wait_until_finished()
        save_s.append(clock() - t0)
        key, sub = jax.random.split(key)
        state = jax.tree.map(lambda x: x + 1e-3 * jax.numpy.std(x) * jax.random.normal(sub, x.shape), state)
    mngr.wait_until_finished()
    return state, save_s


def synthetic(n: int, seed: int = 0) -> dict:
    """A params-only state of about `n` float32 parameters: four (n / 16384, 4096) Student-t(3) matrices."""
    rng = np.random.default_rng(seed)
    rows = max(1, n // 4096 // 4)
    return {"params": {f"layer{i}": jax.numpy.asarray((rng.standard_t(3, size=(rows, 4096)) * 0.02).astype(np.float32))
                       for i in range(4)}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1e8],
                    help="parameter counts of the synthetic params-only states")
    ap.add_argument("--depth", type=int, default=9, help="deltas after the keyframe in the chain restore")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tx, ty, _, _ = digits.load()
    state = digits.create_state(0)
    stream = digits.batches(tx, ty, 64, 0)
    for _ in range(200):
        state, _, _ = digits.train_step(state, *next(stream))
    cnn = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
    states = [("digits CNN TrainState (adam)", cnn, state.params, None)]
    for n in args.sizes:
        big = synthetic(int(n))
        states.append((f"{sum(x.size for x in jax.tree.leaves(big)):,} params", big, big["params"], big))
    rows, chains = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, st, params, big in states:
            o = measure("orbax", st, tmp, args.repeats)
            i = measure("inshrink", st, tmp, args.repeats)
            po, pi = params_only_bytes("orbax", params, tmp), params_only_bytes("inshrink", params, tmp)
            n = sum(x.size for x in jax.tree.leaves(params))
            rows.append((name, n, o, i, po, pi))
            print(name, "orbax", o, "inshrink", i, "params bytes", po, pi, flush=True)
            if big is not None:
                for label, config in CHAIN_CONFIGS:
                    t_key, t_deep, t_orbax, sizes, save_s = chain_restore(big, tmp, args.depth, args.repeats,
                                                                          config)
                    chains.append((name, label, n, t_orbax, t_key, t_deep, sizes, o[2], save_s))
                    print("chain restore", label, t_key, t_deep, t_orbax, sizes, save_s, flush=True)
            del st, params, big
    lines = ["# Handler vs ocp.StandardCheckpointer (same state, same run)", "",
             f"Command: `python benchmarks/bench_handler.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             "inshrink_jax: 16 bins, protect 0.5%, no pruning, one keyframe (the first save of a run), no search; "
             "optimizer state under the default policy (quantize: Adam's moments in log-domain and relative "
             "levels); small leaves "
             "lossless. Sizes are whole step directories (metadata included). Times: best of "
             f"{args.repeats} after a warm-up, 2-core CPU; ratio = Orbax / inshrink_jax (> 1: inshrink_jax smaller "
             "or faster). Synthetic states: four 4096-column float32 matrices of Student-t(3) weights.", "",
             "| state | Orbax bytes | inshrink bytes | size ratio | params-only ratio | blocking s (Orbax / ours) "
             "| of ours, in the handler's async_save | total save s (Orbax / ours) | ours: save ns/param | "
             "restore s (Orbax / ours) | ours: restore ns/param |",
             "|---|---:|---:|---:|---:|---|---:|---|---:|---|---:|"]
    for name, n, o, i, po, pi in rows:
        lines.append(f"| {name} | {o[0]:,} | {i[0]:,} | {o[0] / i[0]:.2f}x | {po / pi:.2f}x | "
                     f"{o[1]:.3f} / {i[1]:.3f} ({o[1] / i[1]:.2f}x) | {i[4]:.3f} | "
                     f"{o[2]:.3f} / {i[2]:.3f} ({o[2] / i[2]:.2f}x) | {i[2] / n * 1e9:.1f} | "
                     f"{o[3]:.3f} / {i[3]:.3f} ({o[3] / i[3]:.2f}x) | {i[3] / n * 1e9:.1f} |")
    lines += ["", "## Restore time along a delta chain", "",
              f"Each synthetic state saved {args.depth + 1} times with keyframe_every={args.depth + 1} (each save "
              "drifts every weight by 1e-3 of its tensor's std): restore of the keyframe (step 0) and of the "
              f"deepest delta (step {args.depth}, {args.depth} deltas applied), into the saved layout, best of "
              f"{args.repeats} with a fresh manager each time, against Orbax's restore of the chain's last state "
              "from its default checkpoint, timed in turn with ours (keyframe, deep, Orbax; the same way: a fresh "
              "manager each time, best of the same repeats). The default closed-loop chain: each later save stores the residual against the previous "
              "save's reconstruction, so the first one also carries the keyframe's quantization error, which on "
              "this random drift (far smaller than that error) makes every residual about as large as the "
              "keyframe; real training moves weights by more between checkpoints (benchmarks/results/"
              "fidelity_*.md). Two configurations: the fixed one of the table above (every link 16 k-means levels, "
              "protect 0.5%), and the default one (CompressionConfig(keyframe_every=...), no eval_fn: the search's "
              "keyframe, then residuals on uniform cells without protected values, whose streams are mostly "
              "radix-packed; what a user gets). Saves: each save's total time (save() until written, the "
              "configuration search included), the first (its compiles and, default configuration, the "
              "exhaustive keyframe search) and the median of the later ones (residual saves after the "
              "first, whose compiles they do not pay), against Orbax's total save of the state (best of "
              f"{args.repeats}, table above).", "",
              f"| state | configuration | Orbax restore s | ours: keyframe s | ours: depth-{args.depth} delta s | "
              "Orbax / deep | Orbax / keyframe | deep / keyframe | ours: deep ns/param | Orbax save s | ours: first "
              "save s | ours: later saves s (median) | Orbax / later saves | params bytes per save (keyframe, then "
              "deltas) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, label, n, t_orbax, t_key, t_deep, sizes, o_save, save_s in chains:
        later = float(np.median(save_s[2:])) if len(save_s) > 2 else float("nan")
        lines.append(f"| {name} | {label} | {t_orbax:.3f} | {t_key:.3f} | {t_deep:.3f} | {t_orbax / t_deep:.2f}x | "
                     f"{t_orbax / t_key:.2f}x | {t_deep / t_key:.2f}x | {t_deep / n * 1e9:.1f} | {o_save:.3f} | "
                     f"{save_s[0]:.2f} | {later:.3f} | {o_save / later:.2f}x | {', '.join(f'{b:,}' for b in sizes)} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
