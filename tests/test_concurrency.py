"""A reader restores steps while a writer keeps saving and retention deletes old steps: every restore either
returns exactly the saved state of that step or fails because the step is gone (inshrink_jax's error says so;
Orbax's own errors, when the step directory vanishes before the handler runs, vary); never other values."""

import os
import sys
import threading
import time

import orbax.checkpoint as ocp

import inshrink_jax as ij
from inshrink_jax import store

sys.path.insert(0, os.path.dirname(__file__))
import sigkill_worker as worker  # noqa: E402


def test_reader_during_saves_and_retention(tmp_path):
    root = str(tmp_path / "ckpt")
    writer = worker.manager(root)
    writer.save(0, args=ij.InshrinkSave(worker.state_at(0)))
    writer.wait_until_finished()
    done = threading.Event()
    outcomes = {"restored": 0, "gone": 0, "relisted": 0}
    errors = []

    def read():
        reader = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(worker.CONFIG),
                                       options=ocp.CheckpointManagerOptions(read_only=True))
        while not done.is_set():
            try:
                reader.reload()
            except FileNotFoundError:  # Orbax's listing races with its own deletion of a step: list again
                outcomes["relisted"] += 1
                continue
            for s in [x for x in reader.all_steps() if x % 5]:  # the steps retention is about to delete
                try:
                    r = reader.restore(s)
                except Exception as e:
                    for _ in range(50):  # a deletion in progress: the step directory goes last
                        if not os.path.exists(os.path.join(root, str(s))):
                            break
                        time.sleep(0.1)
                    if os.path.exists(os.path.join(root, str(s))):
                        errors.append(f"step {s} still listed on disk but failed: {e!r}")
                    elif isinstance(e, store.CheckpointCorruptError) and "was deleted while" not in str(e):
                        # Orbax's own errors for a step that vanished under it vary (FileNotFoundError, or a
                        # ValueError about the default item); ours must say what happened
                        errors.append(f"step {s} was deleted, but the error does not say so: {e!r}")
                    else:
                        outcomes["gone"] += 1
                    continue
                if int(r["step"]) != s or float(r["params"]["bias"][0]) != s:
                    errors.append(f"step {s} restored the values of step {int(r['step'])}")
                outcomes["restored"] += 1

    t = threading.Thread(target=read)
    t.start()
    try:
        for step in range(1, 40):
            writer.save(step, args=ij.InshrinkSave(worker.state_at(step)))
    finally:
        writer.wait_until_finished()
        done.set()
        t.join(timeout=120)
    print("reader outcomes", outcomes)
    assert not errors, errors[:5]
    assert outcomes["restored"] > 5, outcomes
    kept = writer.all_steps()
    assert kept[-1] == 39 and len(kept) <= 3 + len([s for s in range(40) if s % 5 == 0])
