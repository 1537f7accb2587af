"""One process of the two-process save/restore test (run by tests/test_multiprocess.py)."""

import os
import sys

process_id, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)

import numpy as np  # noqa: E402
import optax
import orbax.checkpoint as ocp  # noqa: E402

import inshrink_jax as ij  # noqa: E402

P = jax.sharding.PartitionSpec
devs = np.array(jax.devices())
rng = np.random.default_rng(0)  # same values on both processes
host = {"params": {"w": rng.normal(size=(64, 48)).astype(np.float32)},
        "opt": optax.TraceState(trace=rng.normal(size=(64, 48)).astype(np.float32))}
save_sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(devs.reshape(4), ("x",)), P("x", None))
state = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, save_sharding, lambda i, x=x: x[i]), host)
# Optimizer state lossless: its "trace" marks bit-exactly which step and which shards came back.
handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(optimizer="lossless"))
mngr = ocp.CheckpointManager(root, item_handlers=handler)
mngr.save(0, args=ij.InshrinkSave(state))
mngr.wait_until_finished()
# a second save: each process stores the change of its own shards since step 0
host1 = jax.tree.map(lambda x: x + 0.01 * rng.normal(size=x.shape).astype(np.float32), host)
state1 = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, save_sharding, lambda i, x=x: x[i]), host1)
mngr.save(1, args=ij.InshrinkSave(state1))
mngr.wait_until_finished()
assert mngr.item_metadata(1)["kind"] == "delta", mngr.item_metadata(1)

reader = ij.store.Reader(os.path.join(root, "0", "default"))
written = sorted(f for f in os.listdir(reader.own.path) if f.startswith("blob."))
restore_sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(devs.reshape(2, 2), ("a", "b")), P("b", "a"))
target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=restore_sharding), host)
r = mngr.restore(0, args=ij.InshrinkRestore(target))
for s in r["opt"].trace.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), host["opt"].trace[s.index])
for s in r["params"]["w"].addressable_shards:
    assert np.max(np.abs(np.asarray(s.data) - host["params"]["w"][s.index])) < 0.5
per_process = {p: sum(1 for v in reader.shards.values() for q, _ in v if q == p) for p in (0, 1)}
r1 = mngr.restore(1, args=ij.InshrinkRestore(target))
for s in r1["opt"].trace.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), host1["opt"].trace[s.index])
for s in r1["params"]["w"].addressable_shards:
    assert np.max(np.abs(np.asarray(s.data) - host1["params"]["w"][s.index])) < 0.5

# Adam's moments quantized (the default policy), sharded over both processes (each writes its own shards' codes
# against one value table a moment): restored in another layout, every process's shards of the first moments are
# within the first-moment budget of the update
nu = (rng.uniform(0.5, 2.0, size=(2, 64, 48)) * [[[1e-4]], [[1e-6]]]).astype(np.float32)
mu = (rng.standard_normal(size=nu.shape) * np.sqrt(nu) * [[[0.3]], [[0.03]]]).astype(np.float32)
adam_host = {"params": {"a": host["params"]["w"], "b": host1["params"]["w"]},
             "opt": optax.ScaleByAdamState(count=np.int32(3), mu={"a": mu[0], "b": mu[1]},
                                           nu={"a": nu[0], "b": nu[1]})}
adam = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, save_sharding, lambda i, x=x: x[i])
                    if np.ndim(x) == 2 else x, adam_host)
cfg = ij.CompressionConfig()
moment_mngr = ocp.CheckpointManager(os.path.join(root, "moments"), item_handlers=ij.InshrinkCheckpointHandler(cfg))
moment_mngr.save(0, args=ij.InshrinkSave(adam))
moment_mngr.wait_until_finished()
moment_target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=restore_sharding)
                             if np.ndim(x) == 2 else x, adam_host)
got = moment_mngr.restore(0, args=ij.InshrinkRestore(moment_target))
err = energy = 0.0
for k in ("a", "b"):
    for m, n in zip(got["opt"].mu[k].addressable_shards, got["opt"].nu[k].addressable_shards):
        u = adam_host["opt"].mu[k][m.index] / np.sqrt(np.asarray(n.data, np.float64))
        err += float(((np.asarray(m.data, np.float64) / np.sqrt(np.asarray(n.data, np.float64)) - u) ** 2).sum())
        energy += float((u ** 2).sum())
assert err <= (np.sqrt(cfg.effective_moment_budget) + 0.05) ** 2 * energy, (err, energy)
print(f"moments error {err / energy:.4f}", flush=True)
print(f"OK process {process_id} blobs={written} shards_per_process={per_process}", flush=True)
