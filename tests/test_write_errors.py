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
