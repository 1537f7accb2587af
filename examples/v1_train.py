"""The Linen training loop of linen_train.py, checkpointed through Orbax's v1 API (`ocp.v1.training.Checkpointer`)
with `ij.Compressed`: the same compressed format, delta chains and resume, with a v1 preservation policy
keeping the last 3 steps.

  python examples/v1_train.py --dir /tmp/v1_ckpt --crash-at 170
  python examples/v1_train.py --dir /tmp/v1_ckpt            # resumes from step 150
"""

from __future__ import annotations

import os
import sys

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import v1 as ocp1
from orbax.checkpoint.experimental.v1._src.training import preservation_policies

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402
import loop_cli  # noqa: E402

import inshrink_jax as ij  # noqa: E402


def main(argv=None):
    args = loop_cli.parse_args(__doc__, argv)
    ij.enable_compilation_cache()  # a resumed process loads the encoders compiled before instead of compiling

    train_x, train_y, (eval_x, eval_y), test_x, test_y = digits.load_with_eval()
    eval_fn = jax.jit(lambda s: digits.loss_fn(s.params, s.apply_fn, eval_x, eval_y))
    config = ij.CompressionConfig()  # the same at every save, so saves chain

    state = digits.create_state(seed=0)
    root = os.path.abspath(args.dir)
    ckptr = ocp1.training.Checkpointer(root, preservation_policy=preservation_policies.LatestN(3))
    start = ckptr.latest.step if ckptr.latest else 0
    if start:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        loaded = ckptr.load_checkpointables(start, {"state": ij.Compressed(abstract, config=config)})
        state = loaded["state"].state
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
            ckptr.save_checkpointables(step, {"state": ij.Compressed(state, grads=ema, eval_fn=eval_fn,
                                                                     config=config)})
            loop_cli.report_figures(step, loss, ij.store.Reader(os.path.join(root, str(step), "state")).figures())
        loop_cli.maybe_crash(step, args.crash_at)
    ckptr.close()
    print(f"test accuracy after {args.steps} steps: {digits.accuracy(state.params, state.apply_fn, test_x, test_y):.4f}")


if __name__ == "__main__":
    main()
