"""A gs:// root against a local GCS emulator (gcp-storage-emulator, loopback only): the handler's saves, delta
chain, retention and restores, and the command line, all through etils.epath and gcsfs, as on a TPU pod's
bucket. The work runs in a process of its own (tests/gcs_worker.py), so gcsfs reads the emulator's address from
its environment and a hang fails the test at its timeout instead of stalling the run."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gcp_storage_emulator", reason="the dev extra installs gcp-storage-emulator")
pytest.importorskip("gcsfs", reason="the dev extra installs gcsfs")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def emulator():
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "gcs_emulator.py"), "ckpt"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("port "), f"the emulator did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # about a minute (processes, an emulator); .ci/run runs the slow tests too
def test_a_gs_root_saves_chains_restores_and_is_inspected_verified_collected_and_copied(emulator, tmp_path):
    env = dict(os.environ, STORAGE_EMULATOR_HOST=emulator, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
               GOOGLE_CLOUD_PROJECT="test", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, os.path.join(HERE, "gcs_worker.py"), "gs://ckpt/run", str(tmp_path / "run")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    remote, local = got["seen"]["gs://ckpt/run"], got["seen"][str(tmp_path / "run")]
    assert remote == local and remote["steps"] == [3, 4, 5]
    assert remote["kinds"] == ["keyframe", "delta", "delta"], remote  # a new manager's first save is a keyframe
    assert got["same"], "restores from the gs:// root differ from the local root's"
    assert got["max_error"] < 0.1
    assert got["codes"] == {"inspect": 0, "verify": 0, "gc": 0, "copy": 0, "verify damaged": 1}, got["codes"]
    assert got["copy_same"] and got["bytes"] > 0
