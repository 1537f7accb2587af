"""A Flax NNX training loop with compressed, resumable checkpoints.

An NNX CNN on scikit-learn's digits (no download) with `nnx.Optimizer(adam)`; every `--every` steps the model
and optimizer states are saved through inshrink_jax with the gradient sensitivity (`GradientEMA`) and an eval_fn
for the configuration search, keeping the last 3 steps. Started again with the same `--dir`, it resumes from the
latest checkpoint. `--crash-at N` ends the process abruptly after step N (a simulated failure, no clean shutdown):
run it with that, then without, and the second run resumes.

  python examples/nnx_train.py --dir /tmp/nnx_ckpt --crash-at 170
  python examples/nnx_train.py --dir /tmp/nnx_ckpt            # resumes from step 150
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402  (data only)
import loop_cli  # noqa: E402

import inshrink_jax as ij  # noqa: E402


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.hidden = nnx.Linear(8 * 8 * 64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv2(nnx.relu(self.conv1(x))))
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def train_step(model, optimizer, x, y):
    """One Adam step; returns the loss and the gradients (an nnx.State of the parameters) for GradientEMA."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss, grads


def main(argv=None):
    args = loop_cli.parse_args(__doc__, argv)
    ij.enable_compilation_cache()  # a resumed process loads the encoders compiled before instead of compiling

    train_x, train_y, (eval_x, eval_y), test_x, test_y = digits.load_with_eval()

    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    graphdef = nnx.graphdef(model)
    # The eval_fn gets the saved tree with compressed leaves replaced by their dequantized values.
    eval_fn = jax.jit(lambda s: loss_fn(nnx.merge(graphdef, s["model"]), eval_x, eval_y))

    mngr = ocp.CheckpointManager(
        os.path.abspath(args.dir),
        item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig()),
        options=ocp.CheckpointManagerOptions(max_to_keep=3))
    start = mngr.latest_step() or 0
    if start:
        # Restore into the live objects: the abstract target gives structure, dtypes and shardings.
        target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = mngr.restore(start, args=ij.InshrinkRestore(abstract))
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["optimizer"])
        print(f"resumed from step {start}")

    sens = ij.GradientEMA(every=args.every)
    ema = sens.init(nnx.state(model, nnx.Param))
    stream = digits.batches(train_x, train_y, 64, seed=0)
    for _ in range(start):  # the data order continues where the checkpoint left it
        next(stream)
    for step in range(start + 1, args.steps + 1):
        loss, grads = train_step(model, optimizer, *next(stream))
        if sens.active(step):
            ema = sens.update(ema, grads)
        if step % args.every == 0:
            state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
            mngr.save(step, args=ij.InshrinkSave(state, grads={"model": ema}, eval_fn=eval_fn))
            loop_cli.report_save(mngr, step, loss)
        loop_cli.maybe_crash(step, args.crash_at)
    mngr.close()
    acc = float(jnp.mean(jnp.argmax(model(jnp.asarray(test_x)), -1) == jnp.asarray(test_y)))
    print(f"test accuracy after {args.steps} steps: {acc:.4f}")


if __name__ == "__main__":
    main()
