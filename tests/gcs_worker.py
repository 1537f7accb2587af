"""Runs in a process of its own (tests/test_gcs.py), with STORAGE_EMULATOR_HOST pointing gcsfs at the emulator:
a delta chain saved to gs://BUCKET/run through Orbax's CheckpointManager, its restores against the same saves in a
local root, retention, the command line (inspect, verify, gc, copy) on the gs:// root, a damaged blob found.
Prints one JSON line of what it saw."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

import inshrink_jax as ij
from inshrink_jax import cli, store


def state_at(step: int) -> dict:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(96, 64)).astype(np.float32)
    drift = np.random.default_rng(step).normal(size=w.shape).astype(np.float32)
    return {"params": {"w": jnp.asarray(w + 0.01 * step * drift), "b": jnp.arange(4.0) + step},
            "opt": {"mu": jnp.asarray(w * 0.1 + step), "nu": jnp.asarray(w * w + step)}, "step": step}


def manager(root):
    handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False, keyframe_every=4))
    return ocp.CheckpointManager(root, item_handlers=handler, options=ocp.CheckpointManagerOptions(max_to_keep=3))


def main() -> None:
    remote, local = sys.argv[1], sys.argv[2]
    seen = {}
    for root in (remote, local):
        for first in (0, 3):  # a new manager (a restarted job) for the last three saves
            m = manager(root)
            for step in range(first, first + 3):
                m.save(step, args=ij.InshrinkSave(state_at(step)))
                m.wait_until_finished()
            steps = m.all_steps()
            m.close()
        seen[root] = {"steps": steps, "kinds": [store.Reader(epath.Path(root) / str(s) / "default").figures()["kind"]
                                                for s in steps]}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x,
                            state_at(0))
    restored = {root: {s: manager(root).restore(s, args=ij.InshrinkRestore(abstract)) for s in (3, 4, 5)}
                for root in (remote, local)}
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for s in (3, 4, 5)
               for a, b in zip(jax.tree.leaves(restored[remote][s]), jax.tree.leaves(restored[local][s])))
    err = float(np.max(np.abs(np.asarray(restored[remote][5]["params"]["w"]) - state_at(5)["params"]["w"])))
    objects = store.object_names(remote, "default")
    codes = {"inspect": cli.main(["inspect", remote]), "verify": cli.main(["verify", remote]),
             "gc": cli.main(["gc", remote, "--apply"])}
    codes["copy"] = cli.main(["copy", remote, "--step", "5", remote + "-copy"])
    epath.Path(remote).rmtree()  # the copy restores with the original gone
    copied = manager(remote + "-copy").restore(5, args=ij.InshrinkRestore(abstract))
    copy_same = all(np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(restored[local][5])))
    blob = next(f for f in cli._files(remote + "-copy") if f.name.startswith("blob"))
    raw = bytearray(blob.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    blob.write_bytes(bytes(raw))
    codes["verify damaged"] = cli.main(["verify", remote + "-copy"])
    print(json.dumps({"seen": seen, "same": same, "max_error": err, "objects": len(objects), "codes": codes,
                      "copy_same": copy_same, "bytes": cli._tree_bytes(remote + "-copy")}))


if __name__ == "__main__":
    main()
