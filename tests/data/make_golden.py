"""Write a golden checkpoint with the inshrink_jax that is importable now.

    PYTHONPATH=<a checkout of the release that wrote format version N> python tests/data/make_golden.py OUT

OUT/ckpt is a CheckpointManager root with two steps (a keyframe and a delta) of a small state, and
OUT/expected.npz holds what that release restored for each step (a fresh handler, no target), by
`<step><key path>`. tests/test_golden.py restores every OUT with the current code and compares bit for bit.
Arguments only this file's own release knows are passed when its CompressionConfig has them.
"""

import dataclasses
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import inshrink_jax as ij  # noqa: E402


def state(step: int) -> dict:
    rng = np.random.default_rng(0)
    w = rng.standard_t(3, size=(64, 48)).astype(np.float32) * 0.05
    w = w + np.random.default_rng(step + 1).normal(size=w.shape).astype(np.float32) * 1e-3 * step
    # The moments mirror the kernel (from format 11 its residual is weighted by the second moment's rows and
    # columns, which differ by up to 2^12 here).
    nu = w * w * np.outer(np.logspace(0, 12, 64, base=2), np.logspace(0, 4, 48, base=2)).astype(np.float32)
    return {"params": {"dense": {"kernel": jnp.asarray(w), "bias": jnp.arange(48, dtype=jnp.float32)}},
            "opt_state": {"count": jnp.int32(step), "mu": {"dense": {"kernel": jnp.asarray(w * 0.1)}},
                          "nu": {"dense": {"kernel": jnp.asarray(nu)}}},
            "step": jnp.int32(step), "name": "golden", "key": jax.random.PRNGKey(step)}


def main(out: str) -> None:
    fields = {f.name for f in dataclasses.fields(ij.CompressionConfig)}
    kw = {k: v for k, v in (("search", False), ("optimizer", "quantize"), ("first_moment_bins", 2),
                            ("weighted_residuals", True)) if k in fields}
    root = os.path.join(os.path.abspath(out), "ckpt")
    mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(**kw)))
    for s in (0, 1):
        mngr.save(s, args=ij.InshrinkSave(state(s)))
        mngr.wait_until_finished()
    expected = {}
    for s in (0, 1):
        restored = ij.InshrinkCheckpointHandler().restore(os.path.join(root, str(s), "default"), ij.InshrinkRestore())
        for path, x in jax.tree_util.tree_flatten_with_path(restored)[0]:
            if hasattr(x, "shape"):
                expected[f"{s}{jax.tree_util.keystr(path)}"] = np.asarray(x)
    np.savez(os.path.join(out, "expected.npz"), **expected)
    print(f"wrote {out}: format version {ij.store.FORMAT_VERSION}, {len(expected)} arrays")


if __name__ == "__main__":
    main(sys.argv[1])
