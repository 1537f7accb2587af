"""A character-level transformer language model on Python's own reference text (`pydoc_data.topics`, always
installed: about 465k characters, no download). Used by the fault-tolerance benchmark; the loss, train step and
accuracy helpers of digits.py apply unchanged (logits (batch, time, vocab) against integer labels (batch, time)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from flax import linen as nn
from flax.training import train_state

CONTEXT = 128


def load() -> tuple[np.ndarray, np.ndarray, int]:
    """(train ids, held-out ids, vocabulary size): the corpus as int32 character ids, the last 10% held out."""
    from pydoc_data import topics

    text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
    vocab = sorted(set(text))
    ids = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    lookup = {ord(c): i for i, c in enumerate(vocab)}
    ids = np.vectorize(lookup.__getitem__, otypes=[np.int32])(ids)
    split = int(len(ids) * 0.9)
    return ids[:split], ids[split:], len(vocab)


def windows(ids: np.ndarray, starts: np.ndarray, context: int = CONTEXT) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, next-character targets), each (len(starts), context)."""
    idx = starts[:, None] + np.arange(context + 1)[None, :]
    w = ids[idx]
    return w[:, :-1], w[:, 1:]


class Block(nn.Module):
    d: int
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.SelfAttention(num_heads=self.heads, qkv_features=self.d, deterministic=True)(nn.LayerNorm()(x), mask)
        h = nn.Dense(4 * self.d)(nn.LayerNorm()(x))
        return x + nn.Dense(self.d)(nn.gelu(h))


class CharTransformer(nn.Module):
    """Pre-norm decoder-only transformer: token and position embeddings, `layers` blocks, a tied-free output
    projection. d=128, 4 heads, 2 layers: about 420k parameters for a 100-character vocabulary."""

    vocab: int
    d: int = 128
    heads: int = 4
    layers: int = 2
    context: int = CONTEXT

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.context, self.d))[: tokens.shape[1]]
        for _ in range(self.layers):
            x = Block(self.d, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def create_state(vocab: int, seed: int = 0, steps: int = 1000, peak_lr: float = 3e-3, d: int = 128,
                 layers: int = 2, context: int = CONTEXT, optimizer: str = "adamw") -> train_state.TrainState:
    """AdamW (weight decay 0.01), Lion (`optimizer="lion"`: weight decay 0.1, the 10x larger decay and smaller
    `peak_lr` Lion's authors pair with it) or Muon (`optimizer="muon"`: optax.contrib.muon on the matrices at
    `MUON_LR` times the schedule, AdamW at `peak_lr` on the rest, weight decay 0.01), with min(50, steps / 10)
    warm-up steps and cosine decay to 10% of the peak at `steps`, or schedule-free AdamW
    (`optimizer="schedule-free"`: `peak_lr` after 50 warm-up steps, no decay; its parameters are the point
    gradients are taken at, not its average); a `CharTransformer` of width `d`, `layers` blocks and `context`
    positions."""
    model = CharTransformer(vocab, d=d, layers=layers, context=context)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, context), jnp.int32))["params"]
    warmup = min(50, steps // 10)
    lr = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, steps, end_value=peak_lr * 0.1)
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=_optimizer(optimizer, lr, peak_lr))


MUON_LR = 0.02  # Muon's usual peak learning rate on matrices


def _optimizer(name: str, lr, peak_lr: float) -> optax.GradientTransformation:
    if name == "lion":
        return optax.lion(lr, weight_decay=0.1)
    if name == "muon":
        return optax.contrib.muon(lambda t: lr(t) * (MUON_LR / peak_lr), weight_decay=0.01, adam_learning_rate=lr,
                                  adam_weight_decay=0.01)
    if name == "schedule-free":
        return optax.contrib.schedule_free_adamw(peak_lr, warmup_steps=50, weight_decay=0.01)
    if name != "adamw":
        raise ValueError(f"optimizer {name!r}: one of 'adamw', 'lion', 'muon', 'schedule-free'")
    return optax.adamw(lr, weight_decay=0.01)
