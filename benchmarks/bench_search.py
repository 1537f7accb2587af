"""The configuration search on a real training run: what it chooses at every save, whether the choice meets
epsilon, how often the exhaustive search runs, and what the search costs next to a training step and an
eval_fn call; then a calibration of the data-free proxy's budget against the real eval.

Usage: python benchmarks/bench_search.py [--steps 1000] [--every 50] [--epsilon 0.05] [--batch 4]
                                         [--out benchmarks/results/search.md]
(needs the `bench` extra for MNIST: pip install -e '.[bench]')

Run: the MNIST CNN of examples/mnist.py (222k parameters), Adam 1e-3, batch 128, a checkpoint every --every
steps; sensitivity from `GradientEMA` (window 50); eval_fn = cross-entropy loss on 2,000 fixed held-out test
images (lower is better), jitted. Relative degradation = (loss of the quantize-dequantized state - loss of the
state) / loss of the state, at the same step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import digits  # noqa: E402
import mnist  # noqa: E402

import inshrink_jax as ij  # noqa: E402
from inshrink_jax import codec, quantize, save, search  # noqa: E402
import report  # noqa: E402


def timed(fn, n):
    """Median seconds of n calls of fn (results blocked on)."""
    return statistics.median(report.call_seconds(fn, n, warm_up=False))


def calibrate(state, ema, eval_fn, cfg, epsilon):
    """Eval degradation and proxy of every configuration (magnitude metric) of the cube for one state."""
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    plan = save.plan(state.params, None, None, cfg)
    metas, qidx = plan.records, plan.weights
    xs = [flat[i][1] for i in qidx]
    gs = [jax.tree.leaves(ema)[i] for i in qidx]
    lts = [metas[i].layer_type for i in qidx]
    leaves, treedef = jax.tree_util.tree_flatten(state.params)
    q0 = float(eval_fn(state))
    cube = search.Cube.build(cfg.search_space, False, cfg.quant)
    rows = []
    for p in itertools.product(*[range(len(v)) for v in cube.values]):
        q = cube.config(p, "magnitude")
        devs = quantize.encode_on_device(xs, gs, lts, q, cfg)
        deq = [d.dequantize(x.dtype) for d, x in zip(devs, xs)]
        new = list(leaves)
        for i, v in zip(qidx, deq):
            new[i] = v
        d = (float(eval_fn(state.replace(params=jax.tree_util.tree_unflatten(treedef, new)))) - q0) / abs(q0)
        rows.append((float(search.proxy_degradation(xs, deq, gs)), d))
    rows.sort()
    # The largest proxy budget under which every accepted configuration meets epsilon on the real eval.
    safe = 0.0
    for proxy, d in rows:
        if d > epsilon:
            break
        safe = proxy
    feasible = sum(d <= epsilon for _, d in rows)
    return {"safe": safe, "feasible": feasible, "n": len(rows),
            "accepted": lambda budget: (sum(pr <= budget for pr, _ in rows),
                                        sum(pr <= budget and d <= epsilon for pr, d in rows))}


def entropy_table(state, cfg):
    """Order-0 entropy ratio of a keyframe's codes (+ 16-bit protected values) against `estimated_ratio`, for a
    few configurations: the measurement behind the estimate the search ranks candidates by."""
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    plan = save.plan(state.params, None, None, cfg)
    metas, qidx = plan.records, plan.weights
    xs = [flat[i][1] for i in qidx]
    lts = [metas[i].layer_type for i in qidx]
    sizes: dict = {}
    for x, lt in zip(xs, lts):
        sizes[lt] = sizes.get(lt, 0) + x.size
    n = sum(sizes.values())
    rows = []
    for bins in (4, 8, 16, 32):
        for prune in (0.0, 0.2, 0.5):
            q = ij.QuantConfig(bins=bins, prune_fraction=prune, protect_fraction=0.0005)
            encs = quantize.encode_tensors(xs, [None] * len(xs), lts, q, cfg)
            h0 = sum(codec.order0_entropy_bytes(e.codes) + e.protected.nbytes for e in encs)
            rows.append(f"| {bins} | {prune:.0%} | {4 * n / h0:.1f}x | "
                        f"{search.estimated_ratio(q, sizes, {lt: 32 for lt in sizes}):.1f}x |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--epsilon", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--calibrate-at", type=int, nargs="*", default=None,
                    help="steps at which to calibrate the proxy (default: first, middle and last save)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = ij.CompressionConfig(epsilon=args.epsilon, search_batch=args.batch)
    tx, ty, vx, vy = mnist.load()
    ex, ey = jnp.asarray(vx[:2000]), jnp.asarray(vy[:2000])
    state = mnist.create_state(0)
    eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, ex, ey))
    sens = ij.GradientEMA(every=args.every)
    ema = sens.init(state.params)
    stream = digits.batches(tx, ty, 128, 0)
    calib_steps = args.calibrate_at if args.calibrate_at is not None else sorted(
        {args.every, (args.steps // (2 * args.every)) * args.every, args.steps})
    tmp = tempfile.mkdtemp()
    mngr = ocp.CheckpointManager(tmp, item_handlers=ij.InshrinkCheckpointHandler(cfg),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2))
    rows, calib, step_times = [], {}, []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        state, _, grads = digits.train_step(state, *next(stream))
        if sens.active(step):
            ema = sens.update(ema, grads)
        jax.block_until_ready(state)
        step_times.append(time.perf_counter() - t)
        if step % args.every == 0:
            mngr.save(step, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
            mngr.wait_until_finished()
            fig = mngr.item_metadata(step)
            rows.append((step, fig))
            r = fig["search"]
            print(step, r["mode"], r["chosen"], f"degradation {r['degradation']:.4f}", f"candidates {r['candidates']}",
                  f"{r['seconds']:.2f}s", f"params {fig['ratio']['params']:.1f}x", flush=True)
            if step in calib_steps:
                calib[step] = calibrate(state, ema, eval_fn, cfg, args.epsilon)
                print("calibration", step, {k: v for k, v in calib[step].items() if k != "accepted"}, flush=True)
    elapsed = time.perf_counter() - t_start
    t_step = statistics.median(step_times[10:])
    t_eval = timed(lambda: eval_fn(state), 20)
    acc = digits.accuracy(state.params, state.apply_fn, vx, vy)
    acc_q = digits.accuracy(mngr.restore(args.steps)["params"], state.apply_fn, vx, vy)
    mngr.close()
    shutil.rmtree(tmp)

    def axes(q):
        return None if q == search.LOSSLESS else (q["bins"], -q["prune_fraction"], q["protect_fraction"])

    violations = [s for s, f in rows if f["search"]["degradation"] > args.epsilon]
    loosened = [s for (_, a), (s, b) in zip(rows, rows[1:])
                if axes(a["search"]["chosen"]) is not None and (axes(b["search"]["chosen"]) is not None and any(
                    y < x for x, y in zip(axes(a["search"]["chosen"]), axes(b["search"]["chosen"]))))]
    by_mode: dict[str, list] = {}
    for _, f in rows:
        by_mode.setdefault(f["search"]["mode"], []).append(f["search"])
    raw = sum(f["raw_bytes"]["params"] for _, f in rows)
    stored = sum(f["stored_bytes"]["params"] for _, f in rows)

    def fmt_q(q):
        if q == search.LOSSLESS:
            return "lossless"
        return f"{q['bins']} bins, prune {q['prune_fraction']:.0%} ({q['prune_metric']}), protect {q['protect_fraction']:.2%}"

    lines = ["# Configuration search on a real training run", "",
             f"Command: `python benchmarks/bench_search.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             f"MNIST CNN ({sum(x.size for x in jax.tree.leaves(state.params)):,} parameters), Adam 1e-3, batch 128, "
             f"{len(rows)} checkpoints every {args.every} steps, epsilon {args.epsilon}, search_batch {args.batch}. "
             "eval_fn: cross-entropy on 2,000 fixed held-out test images (jitted). GradientEMA window 50. "
             f"Run time {elapsed:.0f} s on 2 CPU cores (calibration included).", "",
             f"- Every save met epsilon on the eval batches: **{'yes' if not violations else 'no: ' + str(violations)}**"
             f" (largest measured degradation {max(f['search']['degradation'] for _, f in rows):.4f}).",
             f"- Precision never decreased (bins never fewer, pruning never more, protection never less): "
             f"**{'yes' if not loosened else 'no: ' + str(loosened)}**.",
             f"- Exhaustive search entered {len(by_mode.get('exhaustive', []))} time(s) (first save) and "
             f"{len(by_mode.get('fallback', []))} time(s) as a fallback; "
             f"{len(by_mode.get('neighbourhood', []))} saves were settled by the neighbourhood search.",
             f"- Parameters over all saves: {raw / stored:.1f}x smaller than float32 (deltas included). Test "
             f"accuracy at step {args.steps}: {acc:.4f} float32, {acc_q:.4f} restored.", "",
             f"One training step: {t_step * 1e3:.1f} ms (median); one eval_fn call: {t_eval * 1e3:.1f} ms (median).", "",
             "## Search cost per save, by kind of search", "",
             "| search | saves | candidates per save (mean, max) | eval_fn calls per save (mean) | seconds per save "
             "(mean) | in training steps | in eval_fn calls |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for mode in ("exhaustive", "fallback", "neighbourhood", "lossless"):
        rs = by_mode.get(mode)
        if not rs:
            continue
        sec = statistics.mean(r["seconds"] for r in rs)
        lines.append(f"| {mode} | {len(rs)} | {statistics.mean(r['candidates'] for r in rs):.1f}, "
                     f"{max(r['candidates'] for r in rs)} | {statistics.mean(r['eval_fn_calls'] for r in rs):.1f} | "
                     f"{sec:.2f} | {sec / t_step:.0f} | {sec / t_eval:.0f} |")
    lines += ["", "The first save's seconds include compiling the encoder (once per state structure, whatever the "
              "configuration).", "",
              "## Per save", "",
              "| step | search | chosen | degradation | candidates | rounds | seconds | params ratio (this save) | kind |",
              "|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for s, f in rows:
        r = f["search"]
        lines.append(f"| {s} | {r['mode']} | {fmt_q(r['chosen'])} | {r['degradation']:.4f} | {r['candidates']} | "
                     f"{r['rounds']} | {r['seconds']:.2f} | {f['ratio']['params']:.1f}x | {f['kind']} |")
    lines += ["", "## Calibrating the data-free proxy", "",
              "For every configuration of the cube (magnitude prune metric, 108 points) at the given steps: the "
              "sensitivity-weighted relative reconstruction error (the proxy used without an eval_fn) and the real "
              f"degradation. 'Safe budget' = the largest proxy value below which every configuration met epsilon "
              f"{args.epsilon}; the default `proxy_budget` is {cfg.effective_proxy_budget}.", "",
              f"| step | configurations meeting epsilon | safe budget | accepted at proxy_budget={cfg.effective_proxy_budget} "
              "(of them meeting epsilon) |", "|---:|---:|---:|---:|"]
    for s, c in sorted(calib.items()):
        acc_n, ok_n = c["accepted"](cfg.effective_proxy_budget)
        lines.append(f"| {s} | {c['feasible']} of {c['n']} | {c['safe']:.4g} | {acc_n} ({ok_n}) |")
    lines += ["", "## What the ranking estimate rests on", "",
              "The final state's compressed leaves as one keyframe (protect 0.05%, magnitude): the order-0 entropy "
              "ratio of the codes plus 16-bit protected values, and `search.estimated_ratio`. Pruning does not "
              "always pay in entropy, which is why the search does not assume it does.", "",
              "| bins | prune | H0 ratio | estimated ratio |", "|---:|---:|---:|---:|"]
    lines += entropy_table(state, cfg)
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
