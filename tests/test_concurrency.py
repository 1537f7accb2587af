"""A reader restores steps while a writer keeps saving and retention deletes old steps: every restore either
returns exactly the saved state of that step or fails because the step is gone (inshrink_jax's error says so;
Orbax's own errors, when the step directory vanishes before the handler runs, vary); never other values."""

import gc
import os
import shutil
import sys
import threading
import time

import orbax.checkpoint as ocp
import pytest

import inshrink_jax as ij
from inshrink_jax import store

sys.path.insert(0, os.path.dirname(__file__))
import sigkill_worker as worker  # noqa: E402


@pytest.mark.slow  # 20 s; .ci/run runs it
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


@pytest.mark.slow  # 24 s; .ci/run runs it
def test_gc_between_commit_and_rename_keeps_the_step(tmp_path):
    """A save whose object is committed but whose step directory Orbax has not yet renamed (the window between
    `finalize` and the rename) keeps its data when `inshrink-jax gc --apply` runs in that window."""
    from inshrink_jax import cli

    root = tmp_path / "ckpt"
    mngr = worker.manager(str(root))
    for step in range(3):
        mngr.save(step, args=ij.InshrinkSave(worker.state_at(step)))
    mngr.wait_until_finished()
    final, in_flight = root / "2", root / ("2" + store.TMP_SUFFIX)
    os.rename(final, in_flight)  # as Orbax's tree looks before its rename
    assert cli.main(["gc", str(root), "--apply"]) == 0
    os.rename(in_flight, final)
    r = worker.manager(str(root)).restore(2)
    assert int(r["step"]) == 2 and float(r["params"]["bias"][0]) == 2
    assert cli.main(["verify", str(root)]) == 0


def test_collectors_racing_with_saves_lose_nothing(tmp_path):
    """`gc --apply` in a loop (two collectors) while a job saves with retention: no save fails, and every step
    Orbax lists at the end restores to its own state and verifies."""
    root = str(tmp_path / "ckpt")
    writer = worker.manager(root)
    writer.save(0, args=ij.InshrinkSave(worker.state_at(0)))
    writer.wait_until_finished()
    done = threading.Event()
    failures = []

    def collect():
        while not done.is_set():
            try:
                store.collect_garbage(root, "default", concurrent=True)
            except Exception as e:  # noqa: BLE001 (any failure of a collector is a finding)
                failures.append(repr(e))

    threads = [threading.Thread(target=collect) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for step in range(1, 25):
            writer.save(step, args=ij.InshrinkSave(worker.state_at(step)))
        writer.wait_until_finished()
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
    assert not failures, failures[:3]
    fresh = worker.manager(root)
    for s in fresh.all_steps():
        r = fresh.restore(s)
        assert int(r["step"]) == s and float(r["params"]["bias"][0]) == s
    from inshrink_jax import cli
    assert cli.main(["verify", root]) == 0


def test_a_file_missing_from_a_step_being_deleted_is_named_as_a_deletion(tmp_path, monkeypatch):
    """Retention deletes a step file by file: a reader that finds one gone while the directory is still there
    waits for the directory to go (then: deleted while read) and, if it stays, calls the step damaged."""
    item = tmp_path / "ckpt" / "7" / "default"
    item.mkdir(parents=True)
    (item / "manifest.json").write_text("{}")
    remover = threading.Timer(0.3, lambda: shutil.rmtree(tmp_path / "ckpt" / "7"))
    remover.start()
    err = store._missing(item, "commit record commit.json")
    remover.join()
    assert "step 7, item 'default'" in str(err) and "was deleted while it was being read" in str(err)
    item.mkdir(parents=True)
    monkeypatch.setattr(store, "DELETION_GRACE_SECONDS", 0.2)
    t0 = time.monotonic()
    err = store._missing(item, "commit record commit.json")
    assert str(err).endswith("commit record commit.json is missing") and time.monotonic() - t0 >= 0.2


def test_held_interpreter_settings_are_reentrant_across_threads_and_put_back():
    """The collector is off while any block holding it off runs (blocks opened by two threads overlap: the first
    to end does not turn it back on), and afterwards as it was before the first opened; a caller's own choice to
    run without it is kept; the switch interval is lowered, never raised, and put back unless changed meanwhile."""
    from inshrink_jax.handler import _COLLECTOR_PAUSED, _SHORT_SWITCHES, SWITCH_INTERVAL_S
    assert gc.isenabled()
    entered, leave = threading.Event(), threading.Event()

    def other():
        with _COLLECTOR_PAUSED:
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with _COLLECTOR_PAUSED:
        assert not gc.isenabled()
        t.start()
        assert entered.wait(10)
        with _COLLECTOR_PAUSED:
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's block is still open
    leave.set()
    t.join()
    assert gc.isenabled()
    gc.disable()
    try:
        with _COLLECTOR_PAUSED:
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        with _SHORT_SWITCHES:
            assert sys.getswitchinterval() == SWITCH_INTERVAL_S
        assert sys.getswitchinterval() == 0.005
        sys.setswitchinterval(0.0001)
        lower = sys.getswitchinterval()  # the interpreter keeps whole microseconds
        with _SHORT_SWITCHES:
            assert sys.getswitchinterval() == lower
        assert sys.getswitchinterval() == lower
        with _SHORT_SWITCHES:
            sys.setswitchinterval(0.01)  # someone else's setting, made meanwhile, is theirs to keep
        assert sys.getswitchinterval() == 0.01
    finally:
        sys.setswitchinterval(before)
