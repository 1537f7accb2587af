"""Gradient sensitivity for the partition and the prune metric (ALGORITHM.md step 1).

The sensitivity of a weight is |g_ema * w|, where g_ema is an exponential moving average of the training
gradients over the last `window` steps before a checkpoint, the newest gradient weighted `decay` (0.9):
    ema <- decay * g + (1 - decay) * ema
It uses the gradients the train step already computes: no extra backward pass.

The average lives on the device, with the parameters' sharding: it is a pytree of float32 arrays of the
parameters' shapes, updated by one fused elementwise jitted step (or inside the user's own jitted train step).
Keeping it on the host would copy every gradient off the device at every step of the window; on the device it
costs one parameter-sized buffer and one elementwise pass per step of the window, and nothing outside it.

A Flax loop adopts it in four lines (the train step returns its gradients):

    sens = inshrink_jax.GradientEMA(every=ckpt_every)                  # once
    ema = sens.init(state.params)                                       # once
    if sens.active(step): ema = sens.update(ema, grads)                 # after each train step
    mngr.save(step, args=inshrink_jax.InshrinkSave(state, grads=ema))   # at a checkpoint
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("decay",))
def _update(ema, grads, *, decay):
    return jax.tree.map(lambda e, g: decay * g.astype(jnp.float32) + (1.0 - decay) * e, ema, grads)


@dataclasses.dataclass(frozen=True)
class GradientEMA:
    """The gradient EMA of the `window` steps before each checkpoint.

    Attributes:
      every: checkpoint interval in steps: checkpoints are at the steps divisible by `every`.
      window: steps before (and including) each checkpoint step whose gradients are averaged.
      decay: weight of the newest gradient (the paper's 0.9).
    """

    every: int
    window: int = 50
    decay: float = 0.9

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"GradientEMA.every must be an int >= 1 (the checkpoint interval), got {self.every!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"GradientEMA.window must be an int >= 1, got {self.window!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"GradientEMA.decay must be in (0, 1], got {self.decay!r}")

    def init(self, params: Any) -> Any:
        """Zeros of the parameters' structure, shapes and shardings, in float32."""
        return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32, device=getattr(p, "sharding", None)), params)

    def active(self, step: int) -> bool:
        """Whether the gradients of `step` enter the average: the `window` steps up to the next checkpoint."""
        return (-int(step)) % self.every < self.window

    def update(self, ema: Any, grads: Any) -> Any:
        """The average with `grads` (same structure as the parameters) folded in. Jitted, and donates `ema`
        (do not use the old value afterwards); inside a jitted train step it traces into it."""
        return _update(ema, grads, decay=self.decay)
