"""Orbax's concurrent-bytes limits (`save_concurrent_gb`, `restore_concurrent_gb`) on a compressed state: the
bytes in flight never exceed the limit, every shard and leaf takes its bytes, and the checkpoint is the same as
without a limit. (Orbax's own timing test of the limiter runs in tests/test_orbax_conformance.py.)"""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.serialization import limits

import inshrink_jax as ij


class Peak(limits.LimitInFlightBytes):
    """Orbax's limiter, recording each request and the most bytes held at once."""

    def __init__(self, n):
        super().__init__(n)
        self.requests, self.held, self.peak = [], 0, 0

    async def wait_for_bytes(self, n):
        await super().wait_for_bytes(n)
        self.requests.append(n)
        self.held += n
        self.peak = max(self.peak, self.held)

    async def release_bytes(self, n):
        self.held -= n
        await super().release_bytes(n)


def state():
    rng = np.random.default_rng(0)
    return {"params": {f"w{i}": jnp.asarray(rng.normal(size=(64, 128)).astype(np.float32)) for i in range(6)},
            "opt": {"nu": jnp.asarray(rng.random((64, 128)).astype(np.float32))}, "step": jnp.int32(3)}


def test_a_save_and_a_restore_keep_within_the_limit_and_write_what_an_unlimited_one_writes(tmp_path):
    cfg = ij.CompressionConfig(search=False)
    limit = 3 * 64 * 128 + 1  # room for three shards of codes (a byte per weight), not for seven
    used = {}
    for name, gb in (("unlimited", None), ("limited", limit / 10**9)):
        limiters = []

        def make(n, limiters=limiters):
            limiters.append(Peak(n) if n is not None else limits.UnlimitedInFlightBytes())
            return limiters[-1]

        handler = ij.InshrinkCheckpointHandler(cfg, save_concurrent_gb=gb, restore_concurrent_gb=gb)
        mngr = ocp.CheckpointManager(tmp_path / name, item_handlers=handler)
        with mock.patch.object(limits, "get_byte_limiter", make):
            mngr.save(0, args=ij.InshrinkSave(state()))
            mngr.wait_until_finished()
            used[name] = (jax.tree.map(np.asarray, mngr.restore(0, args=ij.InshrinkRestore())), limiters)
        mngr.close()
    np.testing.assert_equal(used["limited"][0], used["unlimited"][0])
    saving, restoring = used["limited"][1]
    assert isinstance(saving, Peak) and isinstance(restoring, Peak)
    assert saving.peak <= limit and restoring.peak <= limit
    assert len(saving.requests) == 8 and saving.peak > 64 * 128  # every shard took its bytes; several at once
    # One request per leaf, its float32 bytes (a leaf larger than the limit takes all of it and goes alone).
    assert sorted(restoring.requests) == [4] + [limit - 1] * 7 and restoring.peak == limit - 1
    assert saving.held == 0 and restoring.held == 0


@pytest.mark.parametrize("bad", [0, -1.0])
def test_a_limit_that_is_not_positive_is_refused(bad):
    with pytest.raises(ValueError, match="save_concurrent_gb must be a positive number"):
        ij.InshrinkCheckpointHandler(save_concurrent_gb=bad)
