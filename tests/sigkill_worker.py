"""A training job for tests/test_sigkill.py: resumes from the latest checkpoint under ROOT (checking it), then
saves step after step without waiting, until it is killed. The state of step s is a fixed function of s."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import inshrink_jax as ij  # noqa: E402

CONFIG = ij.CompressionConfig(search=False, keyframe_every=4, optimizer="quantize")


def state_at(step: int) -> dict:
    """Weights that drift a little per step (deltas stay small), moments, and exact markers of the step (the bias:
    fewer elements than save.MIN_RESIDUAL_SIZE, so stored exactly at every save)."""
    base = np.random.default_rng(0).standard_t(3, size=(256, 128)).astype(np.float32) * 0.05
    drift = np.random.default_rng(step).normal(size=base.shape).astype(np.float32) * 1e-3
    w = base + drift
    return {"params": {"kernel": jnp.asarray(w), "bias": jnp.full((32,), step, jnp.float32)},
            "opt_state": {"mu": jnp.asarray(w * 0.1), "nu": jnp.asarray(w * w), "count": jnp.int32(step)},
            "step": jnp.int32(step)}


def manager(root: str) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(CONFIG),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=3, keep_period=5))


if __name__ == "__main__":
    root = sys.argv[1]
    mngr = manager(root)
    step = mngr.latest_step()
    if step is not None:  # resume: the latest step must restore, and be that step's state
        restored = mngr.restore(step)
        assert int(restored["step"]) == step and float(restored["params"]["bias"][0]) == step, step
    step = -1 if step is None else step
    print(f"ready {step}", flush=True)
    while True:
        step += 1
        mngr.save(step, args=ij.InshrinkSave(state_at(step)))  # async: the kill lands in any phase of a save
        print(f"saving {step}", flush=True)
