"""One process of the two-process kill test (run by tests/test_multiprocess.py): both processes save steps 0 and
1 of a state sharded across them; at step 2, process 1 is killed (SIGKILL) in its commit thread, after writing
its part of the step and before the step is finalized."""

import os
import signal
import sys

import numpy as np


def host_state(step: int) -> dict:
    """The state of `step`, the same on both processes (and in the test that checks the restores)."""
    w = np.random.default_rng(0).normal(size=(64, 48)).astype(np.float32)
    drift = np.random.default_rng(step).normal(size=w.shape).astype(np.float32)
    return {"params": {"w": w + 0.01 * step * drift}, "x": np.full((64, 8), step, np.float32)}


def main(process_id: int, port: str, root: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    import orbax.checkpoint as ocp

    import inshrink_jax as ij
    from inshrink_jax import save

    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()).reshape(4), ("x",)),
                                          jax.sharding.PartitionSpec("x", None))

    def state(step):
        return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i]),
                            host_state(step))

    mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
        search=False)))
    for step in (0, 1):
        mngr.save(step, args=ij.InshrinkSave(state(step)))
        mngr.wait_until_finished()
    print(f"process {process_id} saved steps 0 and 1", flush=True)
    if process_id == 1:
        write = save.write

        async def write_then_die(*args, **kwargs):
            await write(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        save.write = write_then_die
    mngr.save(2, args=ij.InshrinkSave(state(2)))
    mngr.wait_until_finished()  # process 0 waits here for process 1, which is gone
    print(f"process {process_id} finished step 2", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
