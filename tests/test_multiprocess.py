import os
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_each_write_their_own_blob_and_restore_into_another_layout(tmp_path):
    worker = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, worker, str(i), port, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        outs.append(out)
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
        # each process wrote one blob and owns two of the four shards of each array
        assert "blobs=['blob.0', 'blob.1']" in out and "shards_per_process={0: 4, 1: 4}" in out, out[-2000:]
