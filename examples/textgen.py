"""A pretrained character LSTM to fine-tune: textgenrnn's model (Max Woolf, MIT licence), 462k parameters,
pretrained on hundreds of thousands of web texts, rebuilt in Flax from the weights its PyPI sdist ships.

The model reads the last 40 characters (ids of its 465-entry vocabulary, 0 = padding) and predicts the next one:
embedding (100) -> two LSTM layers (128, Keras gate order i, f, c, o, sigmoid gates) -> the embedding and both
layers' outputs concatenated (356 channels per step) -> attention-weighted average over the 40 steps (one
weight vector) -> softmax over the vocabulary.

The weights come from `pip download --no-deps textgenrnn==2.0.0` (the sdist: its declared dependencies, such as
TensorFlow, are neither installed nor needed), read with h5py out of the archive. `fetch()` runs that download
once into `~/.cache/inshrink_jax/textgenrnn/` (or $INSHRINK_TEXTGEN_DIR).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

CONTEXT = 40
SDIST = "textgenrnn-2.0.0.tar.gz"


def fetch() -> str:
    """The path of textgenrnn's sdist, downloaded with pip on first use."""
    folder = os.environ.get("INSHRINK_TEXTGEN_DIR") or os.path.expanduser("~/.cache/inshrink_jax/textgenrnn")
    path = os.path.join(folder, SDIST)
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "textgenrnn==2.0.0", "-d", folder], check=True)
    return path


def pretrained() -> tuple[dict, dict[str, int]]:
    """(params, vocabulary: character -> id) of the pretrained model, params shaped for `TextgenRNN`."""
    import h5py

    with tarfile.open(fetch()) as tar:
        weights = tar.extractfile("textgenrnn-2.0.0/textgenrnn/textgenrnn_weights.hdf5").read()
        vocab = json.loads(tar.extractfile("textgenrnn-2.0.0/textgenrnn/textgenrnn_vocab.json").read())
    with h5py.File(io.BytesIO(weights), "r") as f:
        def w(path):
            return np.asarray(f[path][...], np.float32)

        params = {"embedding": w("embedding/embedding/embeddings:0"),
                  "attention": w("attention/attention/attention_W:0")[:, 0],
                  "output": {"kernel": w("output/output/kernel:0"), "bias": w("output/output/bias:0")}}
        for i in (1, 2):
            # CuDNN layout, converted as Keras converts it for its LSTM layer: per gate, the input kernel
            # transposed and re-read in Fortran order, the recurrent kernel transposed; the input and recurrent
            # biases summed.
            kernel, recurrent = w(f"rnn_{i}/rnn_{i}/kernel:0"), w(f"rnn_{i}/rnn_{i}/recurrent_kernel:0")
            bias = w(f"rnn_{i}/rnn_{i}/bias:0")
            params[f"rnn_{i}"] = {
                "kernel": np.hstack([k.T.reshape(k.shape, order="F") for k in np.hsplit(kernel, 4)]),
                "recurrent_kernel": np.hstack([k.T for k in np.hsplit(recurrent, 4)]),
                "bias": bias[: bias.size // 2] + bias[bias.size // 2:]}
    return params, vocab


def encode(text: str, vocab: dict[str, int]) -> np.ndarray:
    """Character ids of `text`; characters outside the vocabulary are dropped."""
    return np.array([vocab[c] for c in text if c in vocab], np.int32)


def corpus(vocab: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids) of Python's reference text (pydoc_data.topics), the last 10% held out."""
    from pydoc_data import topics

    ids = encode("\n".join(topics.topics[k] for k in sorted(topics.topics)), vocab)
    split = int(len(ids) * 0.9)
    return ids[:split], ids[split:]


def windows(ids: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs (n, 40), next characters (n,))."""
    idx = starts[:, None] + np.arange(CONTEXT + 1)[None, :]
    w = ids[idx]
    return w[:, :-1], w[:, -1]


class LSTM(nn.Module):
    """One Keras LSTM layer (return_sequences): z = x K + h R + b; i, f, c~, o = split(z); sigmoid gates."""

    size: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        init = nn.initializers.glorot_uniform()
        kernel = self.param("kernel", init, (d, 4 * self.size))
        recurrent = self.param("recurrent_kernel", nn.initializers.orthogonal(), (self.size, 4 * self.size))
        bias = self.param("bias", nn.initializers.zeros, (4 * self.size,))
        inputs = jnp.einsum("btd,dg->tbg", x, kernel) + bias

        def step(carry, z):
            h, c = carry
            i, f, g, o = jnp.split(z + h @ recurrent, 4, axis=-1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (h, c), h

        zeros = jnp.zeros((x.shape[0], self.size), x.dtype)
        _, hs = jax.lax.scan(step, (zeros, zeros), inputs)
        return hs.transpose(1, 0, 2)


class TextgenRNN(nn.Module):
    vocab: int = 465
    dim: int = 100
    size: int = 128

    @nn.compact
    def __call__(self, tokens):
        e = self.param("embedding", nn.initializers.uniform(0.1), (self.vocab, self.dim))[tokens]
        h1 = LSTM(self.size, name="rnn_1")(e)
        h2 = LSTM(self.size, name="rnn_2")(h1)
        seq = jnp.concatenate([e, h1, h2], axis=-1)
        w = self.param("attention", nn.initializers.uniform(0.1), (seq.shape[-1],))
        a = jax.nn.softmax(seq @ w, axis=-1)
        return nn.Dense(self.vocab, name="output")(jnp.einsum("bt,btd->bd", a, seq))


def create_state(params: dict, steps: int, peak_lr: float = 1e-3) -> train_state.TrainState:
    """Adam with min(50, steps / 10) warm-up steps and cosine decay to 10% of `peak_lr` at `steps`, gradients
    clipped to global norm 1, from `params` (the pretrained ones to fine-tune). (In a first trial without clipping
    and at a peak of 2e-3, not kept, one data order of three ended 13% above the others.)"""
    warmup = min(50, steps // 10)
    lr = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, steps, end_value=peak_lr * 0.1)
    return train_state.TrainState.create(apply_fn=TextgenRNN().apply, params=jax.tree.map(jnp.asarray, params),
                                         tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)))
