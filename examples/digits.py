"""A small Flax Linen CNN on scikit-learn's bundled 8x8 digits (no download), shared by the examples,
the demo, tests and benchmarks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state


class CNN(nn.Module):
    """Two 3x3 convolutions and two dense layers; about 540k parameters."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)


def load(seed: int = 0):
    """(train_x, train_y, test_x, test_y): 1497 training and 300 test digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    y = d.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    return x[300:], y[300:], x[:300], y[:300]


def load_with_eval(seed: int = 0):
    """(train_x, train_y, (eval_x, eval_y), test_x, test_y): `load` with 300 training digits held out, never
    trained on, as the eval_fn's batches (jax arrays)."""
    train_x, train_y, test_x, test_y = load(seed)
    return train_x[300:], train_y[300:], (jnp.asarray(train_x[:300]), jnp.asarray(train_y[:300])), test_x, test_y


def create_state(seed: int = 0, learning_rate: float = 1e-3) -> train_state.TrainState:
    model = CNN()
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 8, 8, 1)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(learning_rate))


def loss_fn(params, apply_fn, x, y):
    logits = apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jax.jit
def train_step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, x, y)
    return state.apply_gradients(grads=grads), loss, grads


def accuracy(params, apply_fn, x, y) -> float:
    return float(jnp.mean(jnp.argmax(apply_fn({"params": params}, x), -1) == y))


def batches(x, y, batch_size: int, seed: int):
    """Endless shuffled batches in a fixed order for a given seed."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(y))
        for i in range(0, len(y) - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            yield x[idx], y[idx]
