"""Demo: a Flax training loop that checkpoints through inshrink_jax, crashes, resumes from its compressed
checkpoint, and prints what it cost and what it saved.

Two runs of the same training (digits CNN, Adam, same seed and data order):
- reference: no failure, uncompressed checkpoints with Orbax's default `StandardSave`;
- inshrink: checkpoints through `InshrinkCheckpointHandler` with gradient sensitivity (`GradientEMA`) and an
  eval_fn (loss on 300 held-out digits) for the configuration search; at step FAIL_AT the process "dies" (state, handler and manager are
  dropped), then a fresh manager restores the latest checkpoint and training goes on to the end.
The report compares final test accuracy and checkpoint bytes.

Run: python examples/demo.py
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import jax
import orbax.checkpoint as ocp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402

import inshrink_jax as ij  # noqa: E402
from inshrink_jax.cli import describe_choice  # noqa: E402

STEPS, EVERY, FAIL_AT, KEEP = int(os.environ.get("DEMO_STEPS", 600)), 50, 370, 3
CONFIG = ij.CompressionConfig()  # the defaults: closed-loop saves, the search, the default optimizer-state policy


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def data_from(train_x, train_y, step: int):
    """The batch stream positioned after `step` training steps (same order in every run)."""
    stream = digits.batches(train_x, train_y, 64, seed=0)
    for _ in range(step):
        next(stream)
    return stream


def reference_run(data, root):
    train_x, train_y, _, _, _ = data
    state, stream = digits.create_state(seed=0), data_from(train_x, train_y, 0)
    mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=KEEP))
    per_save = 0
    for step in range(1, STEPS + 1):
        state, _, _ = digits.train_step(state, *next(stream))
        if step % EVERY == 0:
            mngr.save(step, args=ocp.args.StandardSave(state))
            mngr.wait_until_finished()
            per_save = dir_bytes(os.path.join(root, str(step)))
    mngr.close()
    return state, per_save


def inshrink_run(data, root):
    train_x, train_y, _, _, (eval_x, eval_y) = data
    eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, eval_x, eval_y))
    sens = ij.GradientEMA(every=EVERY)

    def open_manager():
        return ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(CONFIG),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=KEEP))

    figures, blocking = [], []
    mngr, state, start, failed = open_manager(), digits.create_state(seed=0), 0, False
    while start < STEPS:
        ema, stream = sens.init(state.params), data_from(train_x, train_y, start)
        crashed = False
        for step in range(start + 1, STEPS + 1):
            state, _, grads = digits.train_step(state, *next(stream))
            if sens.active(step):
                ema = sens.update(ema, grads)
            if step % EVERY == 0:
                t = time.perf_counter()
                mngr.save(step, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
                blocking.append(time.perf_counter() - t)
                mngr.wait_until_finished()
                figures.append((step, mngr.item_metadata(step)))
            if step == FAIL_AT and not failed:
                crashed = failed = True
                break
        if not crashed:
            break
        # The process dies here: everything in memory is lost. A new process restores the latest checkpoint.
        print(f"  -- simulated failure after step {FAIL_AT}: state, handler and manager dropped")
        del state, mngr, ema
        mngr = open_manager()
        start = mngr.latest_step()
        state = mngr.restore(start, args=ij.InshrinkRestore(abstract(digits.create_state(seed=0))))
        print(f"  -- resumed from the compressed checkpoint of step {start} "
              f"(steps {start + 1}-{FAIL_AT} are trained again)")
    mngr.close()
    return state, figures, blocking


def main():
    # 300 training digits are held out as the eval_fn's batches (validation loss), never trained on.
    train_x, train_y, held_out, test_x, test_y = digits.load_with_eval()
    data = (train_x, train_y, test_x, test_y, held_out)
    tmp = tempfile.mkdtemp()
    try:
        print(f"Training the digits CNN for {STEPS} steps, a checkpoint every {EVERY}, keeping {KEEP}.")
        t0 = time.perf_counter()
        ref_state, orbax_per_save = reference_run(data, os.path.join(tmp, "orbax"))
        t_ref = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, figures, blocking = inshrink_run(data, os.path.join(tmp, "inshrink"))
        t_ins = time.perf_counter() - t0
        acc_ref = digits.accuracy(ref_state.params, ref_state.apply_fn, test_x, test_y)
        acc = digits.accuracy(state.params, state.apply_fn, test_x, test_y)

        print("\nPer save (inshrink_jax):")
        print(f"  {'step':>5} {'kind':>8} {'search':>13} {'chosen':<34} {'degr.':>7} {'params':>8} {'whole':>7}")
        for step, f in figures:
            s = f["search"]
            q = s["chosen"]
            chosen = describe_choice(q)
            print(f"  {step:>5} {f['kind']:>8} {s['mode']:>13} {chosen:<34} {s['degradation']:>7.4f} "
                  f"{f['ratio']['params']:>7.1f}x {f['ratio']['total']:>6.2f}x")
        raw = {p: sum(f["raw_bytes"][p] for _, f in figures) for p in ("params", "optimizer", "other")}
        stored = {p: sum(f["stored_bytes"][p] for _, f in figures) for p in ("params", "optimizer", "other")}
        print(f"\nAll {len(figures)} saves together (each save's own stored bytes, deltas included):")
        for p in ("params", "optimizer", "other"):
            ratio = f"{raw[p] / stored[p]:.1f}x" if stored[p] else "not stored"
            print(f"  {p:<9} raw {raw[p]:>11,d} B  stored {stored[p]:>10,d} B  ({ratio})")
        total_raw, total_stored = sum(raw.values()), sum(stored.values())
        print(f"  whole     raw {total_raw:>11,d} B  stored {total_stored:>10,d} B  ({total_raw / total_stored:.2f}x); "
              f"Orbax default stores {orbax_per_save:,d} B per save ({orbax_per_save * len(figures) / total_stored:.2f}x "
              "more over the run)")
        print(f"  (optimizer-state policy {CONFIG.optimizer!r}: Adam's mu and nu are 2/3 of the raw bytes of this "
              "TrainState; CompressionConfig(optimizer=...) picks lossless, quantize or drop)")
        print(f"\nOn disk now (last {KEEP} steps): Orbax {dir_bytes(os.path.join(tmp, 'orbax')):,d} B, "
              f"inshrink_jax {dir_bytes(os.path.join(tmp, 'inshrink')):,d} B (its kept steps, the keyframes their "
              "deltas build on, and until the next save the data of the step Orbax dropped last)")
        print(f"save() blocking time: mean {sum(blocking) / len(blocking):.2f} s (a single-device state is copied on "
              f"the device and the search and encoders run in the background: save() waits for the previous save)")
        print(f"Training time: reference {t_ref:.1f} s, with compressed checkpoints, failure and resume {t_ins:.1f} s")
        print(f"\nTest accuracy after {STEPS} steps: reference {acc_ref:.4f}, resumed from compressed checkpoints "
              f"{acc:.4f} (relative change {(acc - acc_ref) / acc_ref:+.2%})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
