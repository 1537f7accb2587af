"""A real write error from the operating system mid-save (the file-size limit RLIMIT_FSIZE makes write() fail
with EFBIG, as a full disk makes it fail with ENOSPC): the error surfaces, no partial step is listed, earlier
steps still restore, and the next save that fits works."""

import subprocess
import sys

CODE = r"""
import errno, resource, signal
import jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
import inshrink_jax as ij
from inshrink_jax import cli

root = sys.argv[1]
small = {"params": {"w": jnp.asarray(np.random.default_rng(0).normal(size=(128, 64)), jnp.float32)}, "step": 0}
big = dict(small, noise=np.random.default_rng(1).bytes(4_000_000))  # incompressible: written as it is
big["noise"] = np.frombuffer(big["noise"], np.uint8).copy()
mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler())
mngr.save(0, args=ij.InshrinkSave(small))
mngr.wait_until_finished()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, resource.RLIM_INFINITY))
try:
    mngr.save(1, args=ij.InshrinkSave(big))
    mngr.wait_until_finished()
    raise SystemExit("the save that cannot be written did not fail")
except OSError as e:
    assert e.errno == errno.EFBIG, e
    print("save 1 failed:", e)
except Exception as e:  # Orbax may wrap the commit thread's error
    cause = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None and cause.errno == errno.EFBIG, repr(e)
    print("save 1 failed:", repr(e)[:200])
mngr.reload()
assert mngr.all_steps() == [0], mngr.all_steps()
small2 = dict(small, step=2)
mngr.save(2, args=ij.InshrinkSave(small2))
mngr.wait_until_finished()
assert mngr.all_steps() == [0, 2], mngr.all_steps()
import os  # the failed save's partial object was collected by the next save
assert sorted(os.listdir(os.path.join(root, "inshrink_objects", "default"))) == ["0.0", "2.0"]
for s in (0, 2):
    r = mngr.restore(s)
    assert r["step"] == s
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
assert cli.main(["verify", root]) == 0
print("ok")
"""


def test_a_real_write_error_fails_the_save_and_loses_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import sys\n" + CODE, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout[-2000:], done.stderr[-4000:])
    assert "save 1 failed" in done.stdout


def test_a_failed_orbax_metadata_write_never_lists_a_broken_step(tmp_path, monkeypatch):
    """Orbax writes its own step metadata (`_CHECKPOINT_METADATA`) on a background thread while it commits the
    step: when that write fails (a full disk), `wait_until_finished` raises, yet Orbax may still rename the step,
    which a reload then lists. Whichever happens, a listed step is whole: it restores to exactly what was saved
    and verify passes; and the next save works."""
    import errno
    import time

    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.metadata import checkpoint as orbax_metadata

    import inshrink_jax as ij
    from inshrink_jax import cli

    write = orbax_metadata._MetadataStoreImpl.write
    failing = {"on": False}

    def full_disk(self, file_path, *args, **kwargs):
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device", str(file_path))
        return write(self, file_path, *args, **kwargs)

    monkeypatch.setattr(orbax_metadata._MetadataStoreImpl, "write", full_disk)
    root = tmp_path / "ckpt"
    rng = np.random.default_rng(0)
    trees = [{"params": {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)}, "x": rng.normal(size=5),
              "step": i} for i in range(3)]
    mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
        search=False)))
    mngr.save(0, args=ij.InshrinkSave(trees[0]))
    mngr.wait_until_finished()
    failing["on"] = True
    raised = []
    try:
        mngr.save(1, args=ij.InshrinkSave(trees[1]))
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 (Orbax wraps it)
        raised.append(e)
    failing["on"] = False
    for _ in range(2):  # on a loaded machine Orbax may report the failed write at the next save instead
        try:
            mngr.save(2, args=ij.InshrinkSave(trees[2]))
            mngr.wait_until_finished()
            break
        except Exception as e:  # noqa: BLE001
            raised.append(e)
    assert raised, "the failed metadata write was never reported"
    cause = raised[0]
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None and cause.errno == errno.ENOSPC, repr(raised[0])
    time.sleep(0.5)  # let Orbax's background commit of step 1, if it goes on, finish
    mngr.close()
    mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
        search=False)))
    assert {0, 2} <= set(mngr.all_steps()) <= {0, 1, 2}
    for step in mngr.all_steps():
        restored = mngr.restore(step)
        assert restored["step"] == step
        np.testing.assert_array_equal(restored["x"], trees[step]["x"])
    assert cli.main(["verify", str(root)]) == 0


def _tmpfs(path, size: str) -> bool:
    """Mount a tmpfs of `size` at `path` (needs root and a kernel that allows it); whether it worked."""
    path.mkdir()
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_a_full_disk_fails_the_save_and_loses_nothing(tmp_path):
    """Async saves into a real 1 MiB filesystem until it is full (ENOSPC from the kernel): the save that does not
    fit raises from wait_until_finished, every listed step restores exactly, verify passes, and once space is
    freed (steps deleted, their objects collected by `inshrink-jax gc`) the next save works."""
    import errno

    import numpy as np
    import orbax.checkpoint as ocp
    import pytest

    import inshrink_jax as ij
    from inshrink_jax import cli

    disk = tmp_path / "disk"
    if not _tmpfs(disk, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        root = disk / "ckpt"
        rng = np.random.default_rng(0)
        noise = [np.frombuffer(rng.bytes(150_000), np.uint8).copy() for _ in range(12)]
        mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler())
        failed = None
        for step, x in enumerate(noise):
            try:
                mngr.save(step, args=ij.InshrinkSave({"x": x, "step": step}))
                mngr.wait_until_finished()
            except Exception as e:  # noqa: BLE001 (Orbax may wrap the commit thread's OSError)
                cause = e
                while cause is not None and not isinstance(cause, OSError):
                    cause = cause.__cause__ or cause.__context__
                assert cause is not None and cause.errno == errno.ENOSPC, repr(e)
                failed = step
                break
        assert failed is not None and failed >= 2
        mngr.close()
        mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=2),
                                     item_handlers=ij.InshrinkCheckpointHandler())
        listed = mngr.all_steps()
        assert set(range(failed)) <= set(listed) <= set(range(failed + 1))
        for step in listed:
            np.testing.assert_array_equal(mngr.restore(step)["x"], noise[step])
        assert cli.main(["verify", str(root)]) == 0
        for s in listed[:-1]:
            mngr.delete(s)
        assert cli.main(["gc", str(root), "--apply"]) == 0  # the deleted steps' objects and the partial one
        mngr.save(failed + 1, args=ij.InshrinkSave({"x": noise[failed + 1], "step": failed + 1}))
        mngr.wait_until_finished()
        np.testing.assert_array_equal(mngr.restore(failed + 1)["x"], noise[failed + 1])
        assert cli.main(["verify", str(root)]) == 0
        mngr.close()
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)
