"""A Flax Linen training loop (TrainState) with compressed, resumable checkpoints.

The digits CNN of digits.py (scikit-learn's bundled digits, no download) trained with Adam; every `--every` steps
the whole TrainState is saved through inshrink_jax with the gradient sensitivity (`GradientEMA`) and an eval_fn
for the configuration search, keeping the last 3 steps. Started again with the same `--dir`, it resumes from the
latest checkpoint. `--crash-at N` ends the process abruptly after step N (a simulated failure, no clean
shutdown): run it with that, then without, and the second run resumes.

  python examples/linen_train.py --dir /tmp/linen_ckpt --crash-at 170
  python examples/linen_train.py --dir /tmp/linen_ckpt            # resumes from step 150
"""

from __future__ import annotations

import os
import sys

import jax
import orbax.checkpoint as ocp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402
import loop_cli  # noqa: E402

import inshrink_jax as ij  # noqa: E402


def main(argv=None):
    args = loop_cli.parse_args(__doc__, argv)
    ij.enable_compilation_cache()  # a resumed process loads the encoders compiled before instead of compiling

    train_x, train_y, (eval_x, eval_y), test_x, test_y = digits.load_with_eval()
    # The eval_fn gets a TrainState whose compressed leaves are replaced by their dequantized values.
    eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, eval_x, eval_y))

    state = digits.create_state(seed=0)
    mngr = ocp.CheckpointManager(
        os.path.abspath(args.dir),
        item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig()),
        options=ocp.CheckpointManagerOptions(max_to_keep=3))
    start = mngr.latest_step() or 0
    if start:
        # The abstract target gives the TrainState's structure, dtypes and shardings; apply_fn and tx come from it.
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = mngr.restore(start, args=ij.InshrinkRestore(abstract))
        print(f"resumed from step {start}")

    sens = ij.GradientEMA(every=args.every)
    ema = sens.init(state.params)
    stream = digits.batches(train_x, train_y, 64, seed=0)
    for _ in range(start):  # the data order continues where the checkpoint left it
        next(stream)
    for step in range(start + 1, args.steps + 1):
        state, loss, grads = digits.train_step(state, *next(stream))
        if sens.active(step):
            ema = sens.update(ema, grads)
        if step % args.every == 0:
            mngr.save(step, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
            loop_cli.report_save(mngr, step, loss)
        loop_cli.maybe_crash(step, args.crash_at)
    mngr.close()
    print(f"test accuracy after {args.steps} steps: {digits.accuracy(state.params, state.apply_fn, test_x, test_y):.4f}")


if __name__ == "__main__":
    main()
