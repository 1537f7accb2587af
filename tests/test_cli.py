"""The inshrink-jax command: inspect, verify (exit code, naming the problem), export, gc."""

import json
import re
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import inshrink_jax as ij
from inshrink_jax import cli, store


def state_at(i):
    rng = np.random.default_rng(0)
    w = rng.standard_t(3, size=(128, 64)).astype(np.float32) * 0.05
    drift = np.random.default_rng(i).normal(size=w.shape).astype(np.float32) * 1e-3 * i
    return {"params": {"dense": {"kernel": jnp.asarray(w + drift), "bias": jnp.zeros((64,))}},
            "opt_state": {"mu": jnp.asarray(w * 0.1), "nu": jnp.asarray(w**2), "count": jnp.int32(i)},
            "step": jnp.int32(i)}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    cfg = ij.CompressionConfig(search=False, optimizer="quantize")
    mngr = ocp.CheckpointManager(path, item_handlers=ij.InshrinkCheckpointHandler(cfg))
    for i in range(3):
        mngr.save(i, args=ij.InshrinkSave(state_at(i)))
        mngr.wait_until_finished()
    mngr.close()
    return path


def copy(root, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(root, dst)
    return dst


def test_inspect_lists_steps_chains_and_ratios(root, capsys):
    assert cli.main(["inspect", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "item 'default', 3 step(s)" in out
    assert "inspect: 3/3 step 2" in err  # progress on stderr (not a terminal: a line per 10%), the table on stdout
    lines = [l.split() for l in out.splitlines() if l.strip()[:1].isdigit()]
    assert [(l[0], l[1], l[2]) for l in lines] == [("0", "keyframe", "0"), ("1", "delta", "1"), ("2", "delta", "2")]
    files = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert f"on disk: {cli._fmt_bytes(files)} in all" in out
    assert cli.main(["inspect", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    own = {s: sum(p.stat().st_size for p in (root / store.OBJECTS / "default" / data[s]["object"]).rglob("*")
                  if p.is_file()) for s in data}
    assert data["0"]["needs_bytes"] > own["0"] and data["2"]["needs_bytes"] > own["2"] + own["1"] + own["0"]
    assert sorted(data) == ["0", "1", "2"]
    assert data["2"]["bases"] == [data["1"]["object"]] and data["2"]["kind"] == "delta"
    assert data["2"]["ratio"]["params"] > 4 and data["2"]["config"]["optimizer"] == "quantize"
    assert cli.main(["inspect", str(root), "--step", "1"]) == 0
    detail = capsys.readouterr().out
    assert "['params']['dense']['kernel']" in detail and "quantized (moments, 32 levels)" in detail


def test_verify_passes_on_a_healthy_root(root, capsys):
    assert cli.main(["verify", str(root)]) == 0
    assert "3 step(s) checked, all good" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["flip", "truncate"])
@pytest.mark.parametrize("target", ["blob", "data", "index", "object commit", "manifest", "step commit"])
def test_any_damaged_file_is_named_by_verify_and_restore(root, tmp_path, capsys, target, mode):
    dst = copy(root, tmp_path)
    objects = dst / store.OBJECTS / "default"
    obj = sorted(os.listdir(objects))[0]  # step 0's object: the base of every later step
    path = {"blob": objects / obj / "blob.0", "data": objects / obj / "data.0", "index": objects / obj / "index.0.json",
            "object commit": objects / obj / store.COMMIT, "manifest": dst / "0" / "default" / store.MANIFEST,
            "step commit": dst / "0" / "default" / store.COMMIT}[target]
    raw = bytearray(path.read_bytes())
    if mode == "flip":
        raw[len(raw) // 2] ^= 0x10
    else:
        del raw[len(raw) // 2:]
    path.write_bytes(bytes(raw))
    assert cli.main(["verify", str(dst)]) == 1
    out = capsys.readouterr().out
    problems = [l for l in out.splitlines() if l.startswith("PROBLEM")]
    steps = {p.split("step ")[1].split(",")[0] for p in problems}
    # files of step 0's object are read by every step whose chain goes through it; the data file and the step's
    # own records only by step 0
    assert steps == ({"0"} if target in ("data", "manifest", "step commit") else {"0", "1", "2"}), problems
    if target in ("blob", "data"):
        assert all("leaf" in p for p in problems)
    with pytest.raises(store.CheckpointCorruptError, match="step 0, item 'default'"):
        ij.InshrinkCheckpointHandler().restore(dst / "0" / "default", ij.InshrinkRestore())


def test_verify_finds_a_missing_base_object(root, tmp_path, capsys):
    dst = copy(root, tmp_path)
    objects = dst / store.OBJECTS / "default"
    shutil.rmtree(objects / sorted(os.listdir(objects))[0])
    assert cli.main(["verify", str(dst), "--step", "2"]) == 1
    assert "which is missing" in capsys.readouterr().out


def test_export_writes_a_plain_orbax_checkpoint_of_the_restored_state(root, tmp_path, capsys):
    out = tmp_path / "plain"
    assert cli.main(["export", str(root), "--step", "2", str(out)]) == 0
    assert capsys.readouterr().err.splitlines()[-2:] == ["export: 1/2 step 2 decoded", "export: 2/2 written"]
    plain = ocp.StandardCheckpointer().restore(out.resolve())
    ours = ij.InshrinkCheckpointHandler().restore(root / "2" / "default", ij.InshrinkRestore())
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(plain)[0], jax.tree_util.tree_flatten_with_path(ours)[0]
    assert [jax.tree_util.keystr(p) for p, _ in flat_a] == [jax.tree_util.keystr(p) for p, _ in flat_b]
    for (_, a), (_, b) in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(SystemExit, match="exists"):
        cli.main(["export", str(root), "--step", "2", str(out)])


def test_gc_is_a_dry_run_unless_applied(root, tmp_path, capsys):
    dst = copy(root, tmp_path)
    objects = dst / store.OBJECTS / "default"
    # an object no step references (as a crash between finalize steps could leave), and an uncommitted one
    shutil.copytree(objects / sorted(os.listdir(objects))[0], objects / "7.0")
    (objects / "8.0").mkdir()
    assert cli.main(["gc", str(dst)]) == 0
    out = capsys.readouterr().out
    assert "would delete 1 unreferenced object(s)" in out and "object 7.0" in out and "8.0" in out
    assert (objects / "7.0").exists()
    assert cli.main(["gc", str(dst), "--apply"]) == 0
    assert not (objects / "7.0").exists() and (objects / "8.0").exists()  # an uncommitted object may be in flight
    assert cli.main(["verify", str(dst)]) == 0


def test_bad_paths_and_steps_are_clear_errors(root, tmp_path):
    with pytest.raises(SystemExit, match="not a directory"):
        cli.main(["inspect", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit, match="no inshrink_jax checkpoint item"):
        cli.main(["inspect", str(tmp_path)])
    with pytest.raises(SystemExit, match="step 9 is not under"):
        cli.main(["verify", str(root), "--step", "9"])


def test_the_console_script_is_installed(root):
    exe = shutil.which("inshrink-jax", path=os.path.dirname(sys.executable))
    assert exe is not None, "pip install -e . installs the inshrink-jax command next to the interpreter"
    done = subprocess.run([exe, "verify", str(root)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "all good" in done.stdout


@pytest.mark.parametrize("options", [dict(step_prefix="ckpt"), dict(step_format_fixed_length=6),
                                     dict(step_prefix="run", step_format_fixed_length=4)])
def test_step_names_of_any_manager_options(tmp_path, capsys, options):
    cfg = ij.CompressionConfig(search=False, optimizer="quantize")
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler(cfg),
                                 options=ocp.CheckpointManagerOptions(**options))
    for i in (3, 12):
        mngr.save(i, args=ij.InshrinkSave(state_at(i)))
        mngr.wait_until_finished()
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != store.OBJECTS)
    assert all(not n.isdigit() or len(n) > 2 for n in names), names  # really not plain step numbers
    assert cli.main(["inspect", str(tmp_path)]) == 0
    rows = [l.split()[:2] for l in capsys.readouterr().out.splitlines() if l.strip()[:1].isdigit()]
    assert rows == [["3", "keyframe"], ["12", "delta"]]
    assert cli.main(["verify", str(tmp_path)]) == 0
    assert cli.main(["inspect", str(tmp_path), "--step", "12"]) == 0
    out = tmp_path.parent / f"export-{tmp_path.name}"
    assert cli.main(["export", str(tmp_path), "--step", "12", str(out)]) == 0
    restored = ocp.StandardCheckpointer().restore(out)
    assert int(restored["step"]) == 12


def test_verify_and_inspect_of_a_root_whose_steps_were_all_deleted(tmp_path, capsys):
    root = tmp_path / "empty"
    mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False)))
    mngr.save(0, args=ij.InshrinkSave(state_at(0)))
    mngr.wait_until_finished()
    mngr.delete(0)
    assert cli.main(["verify", str(root)]) == 0 and "no steps" in capsys.readouterr().out
    assert cli.main(["inspect", str(root)]) == 0
    assert cli.main(["gc", str(root), "--apply"]) == 0
    assert not any((root / store.OBJECTS / "default").iterdir())


@pytest.mark.parametrize("files", [("manifest.json",), ("commit.json",), ("manifest.json", "commit.json")])
def test_files_swapped_between_steps_are_refused(root, tmp_path, files):
    """A step's records replaced by another step's (every CRC valid: a partial rsync, a mixed-up backup) are
    refused by restore and by verify, never restored as the other step's values."""
    dst = copy(root, tmp_path)
    for name in files:
        shutil.copyfile(dst / "2" / "default" / name, dst / "1" / "default" / name)
    with pytest.raises(ij.CheckpointCorruptError, match="step 1"):
        ij.InshrinkCheckpointHandler().restore(dst / "1" / "default", ij.InshrinkRestore())
    assert cli.main(["verify", str(dst), "--step", "1"]) == 1
    assert cli.main(["verify", str(dst), "--step", "2"]) == 0


def test_every_file_swapped_between_any_two_steps_is_refused(tmp_path_factory, capsys):
    """72 swaps: each file name of a step (its manifest and commit record) and of its object (commit record,
    offset table, code blob, data file) replaced by the same file of each other step of a 4-step root (every
    checksum valid). Every one is refused by restore and by verify; none restores other values."""
    src = tmp_path_factory.mktemp("swap") / "ckpt"
    mngr = ocp.CheckpointManager(src, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
        search=False, optimizer="quantize")))
    for i in range(4):
        mngr.save(i, args=ij.InshrinkSave(state_at(i)))
        mngr.wait_until_finished()
    mngr.close()
    objects = src / store.OBJECTS / "default"

    def files(step):
        obj = objects / store.Reader(src / str(step) / "default").object_id
        return {"step/manifest.json": src / str(step) / "default" / store.MANIFEST,
                "step/commit.json": src / str(step) / "default" / store.COMMIT,
                "object/commit.json": obj / store.COMMIT, "object/index.0.json": obj / store.index_name(0),
                "object/blob.0": obj / store.blob_name(0), "object/data.0": obj / store.blob_name(0, store.DATA_FILE)}

    names = {i: files(i) for i in range(4)}
    swaps = 0
    for name in names[0]:
        for a in range(4):
            for b in range(4):
                if a == b:
                    continue
                dst = tmp_path_factory.mktemp("swapped") / "ckpt"
                shutil.copytree(src, dst)
                target = dst / names[b][name].relative_to(src)
                assert target.read_bytes() != names[a][name].read_bytes(), (name, a, b)
                shutil.copyfile(names[a][name], target)
                with pytest.raises(ij.CheckpointCorruptError, match=f"step {b}"):
                    ij.InshrinkCheckpointHandler().restore(dst / str(b) / "default", ij.InshrinkRestore())
                assert cli.main(["verify", str(dst), "--step", str(b)]) == 1, (name, a, b)
                shutil.rmtree(dst)
                swaps += 1
    capsys.readouterr()
    assert swaps == 72


def test_copy_makes_a_step_that_restores_on_its_own_and_a_bare_copy_says_how(root, tmp_path, capsys):
    """`inshrink-jax copy` takes a delta step and the objects of its chain into a new root that restores with the
    original gone, passes verify and accepts saves; a step directory copied on its own names the missing object
    and that command."""
    src = copy(root, tmp_path)
    want = ij.InshrinkCheckpointHandler().restore(src / "2" / "default", ij.InshrinkRestore())
    assert cli.main(["copy", str(src), "--step", "2", str(tmp_path / "alone")]) == 0
    assert "copied to" in capsys.readouterr().out
    bare = tmp_path / "bare"
    shutil.copytree(src / "2", bare / "2")
    shutil.rmtree(src)
    got = ij.InshrinkCheckpointHandler().restore(tmp_path / "alone" / "2" / "default", ij.InshrinkRestore())
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert cli.main(["verify", str(tmp_path / "alone")]) == 0
    mngr = ocp.CheckpointManager(tmp_path / "alone", item_handlers=ij.InshrinkCheckpointHandler(
        ij.CompressionConfig(search=False, optimizer="quantize")))
    assert mngr.all_steps() == [2]
    mngr.save(3, args=ij.InshrinkSave(state_at(3)))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 3] and mngr.restore(3)["step"] == 3
    with pytest.raises(ij.CheckpointCorruptError, match=r"needs object 2\.0, which is not here.*inshrink-jax copy "
                                                         r"ROOT --step 2 NEW_ROOT"):
        ij.InshrinkCheckpointHandler().restore(bare / "2" / "default", ij.InshrinkRestore())
    with pytest.raises(SystemExit, match="exists"):
        cli.main(["copy", str(tmp_path / "alone"), "--step", "2", str(bare)])


def test_a_foreign_entry_in_the_object_store_neither_fails_a_save_nor_is_deleted(root, tmp_path):
    dst = copy(root, tmp_path)
    foreign = dst / store.OBJECTS / "default" / "notes (copy)"
    foreign.mkdir()
    mngr = ocp.CheckpointManager(dst, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
        search=False, optimizer="quantize")))
    mngr.save(3, args=ij.InshrinkSave(state_at(3)))  # its finalize collects garbage
    mngr.wait_until_finished()
    assert foreign.is_dir() and 3 in mngr.all_steps()
    assert cli.main(["gc", str(dst), "--apply"]) == 0 and foreign.is_dir()


def test_inspect_exits_1_when_a_step_cannot_be_read_and_still_lists_the_others(root, tmp_path, capsys):
    dst = copy(root, tmp_path)
    (dst / "1" / "default" / store.MANIFEST).write_bytes(b"{}")
    assert cli.main(["inspect", str(dst)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^ +1 +ERROR +.*step 1", out, re.M) and re.search(r"^ +2 ", out, re.M)
    assert cli.main(["inspect", str(dst), "--json"]) == 1


def test_version_and_a_closed_pipe(root, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and f"inshrink-jax {ij.__version__}" in capsys.readouterr().out
    # `inshrink-jax inspect ROOT | head`: the reader has gone before anything is written; no traceback
    r, w = os.pipe()
    os.close(r)
    run = subprocess.run([sys.executable, "-c", "import sys; from inshrink_jax import cli; "
                          f"sys.exit(cli.main(['inspect', {str(root)!r}]))"], stdout=w, stderr=subprocess.PIPE,
                         text=True, timeout=300)
    os.close(w)
    assert run.returncode == 1 and "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr


def test_plot_draws_bytes_and_the_measured_degradation_of_every_save(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    small = ij.SearchSpace(bins=(4, 8), prune_fractions=(0.0,), protect_fractions=(0.005,), prune_metrics=("magnitude",))
    cfg = ij.CompressionConfig(search_space=small, residual_space=small)
    target = state_at(0)["params"]["dense"]["kernel"]
    eval_fn = jax.jit(lambda s: 1.0 + jnp.mean((s["params"]["dense"]["kernel"] - target) ** 2))
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_handlers=ij.InshrinkCheckpointHandler(cfg))
    for i in range(3):
        mngr.save(i, args=ij.InshrinkSave(state_at(i), eval_fn=eval_fn))
        mngr.wait_until_finished()
    mngr.close()
    assert cli.main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(isinstance(cli._degradation(f), float) for f in data.values())  # each save measured one
    image = tmp_path / "plot.png"
    assert cli.main(["plot", str(tmp_path / "ckpt"), "--out", str(image)]) == 0
    assert f"{image}: bytes and degradation of 3 step(s)" in capsys.readouterr().out
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 20_000


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux, to run the command line in a terminal")
def test_in_a_terminal_the_tables_and_progress_bars_render(root, tmp_path):
    """inspect and verify in a real terminal (a tmux pane, 150 columns): verify's progress bar ends full, inspect's
    table has its header rule and every step's row, and long key paths wrap inside their column."""
    import time

    sock, cmd = f"inshrink-{os.getpid()}", f"{sys.executable} -m inshrink_jax.cli"
    script = tmp_path / "run.sh"
    script.write_text(f"{cmd} verify {root}; {cmd} inspect {root}; {cmd} inspect {root} --step 2; "
                      "echo INSHRINK-DONE; sleep 120\n")
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-x", "150", "-y", "80", f"bash {script}"], check=True)
    try:
        deadline, pane = time.monotonic() + 120, ""
        while "INSHRINK-DONE" not in pane and time.monotonic() < deadline:
            time.sleep(0.5)
            pane = subprocess.run(["tmux", "-L", sock, "capture-pane", "-p", "-S", "-200"], capture_output=True,
                                  text=True).stdout
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
    assert "INSHRINK-DONE" in pane, pane
    assert "Traceback" not in pane, pane
    assert re.search(r"^verify +━+ +3/3", pane, re.M), pane  # rich's bar, drawn to the end
    assert re.search(r"^ step +kind +depth +stored +needs", pane, re.M) and "───────" in pane, pane
    assert [m.group(1) for m in re.finditer(r"^ +(\d) +(?:keyframe|delta) ", pane, re.M)] == ["0", "1", "2", "2"]
    assert "item 'default': 3 step(s) checked, all good" in pane
    assert all(len(line) <= 150 for line in pane.splitlines())


def test_an_item_another_handler_wrote_is_named_as_such(tmp_path, capsys):
    """`--item` naming a composite checkpoint's item that Orbax's JSON handler wrote: a clear refusal that lists
    inshrink_jax's items, not 'manifest missing' problems; an item of ours with its manifest deleted is still
    reported as damaged."""
    handler = ij.InshrinkCheckpointHandler(ij.CompressionConfig(search=False))
    mngr = ocp.CheckpointManager(tmp_path, item_names=("state", "meta"),
                                 item_handlers={"state": handler, "meta": ocp.JsonCheckpointHandler()})
    mngr.save(0, args=ocp.args.Composite(state=ij.InshrinkSave(state_at(0)), meta=ocp.args.JsonSave({"a": 1})))
    mngr.wait_until_finished()
    mngr.close()
    for command in ("verify", "inspect"):
        with pytest.raises(SystemExit, match=r"item 'meta' .* was not written by inshrink_jax .*\['state'\]"):
            cli.main([command, str(tmp_path), "--item", "meta"])
    assert cli.main(["verify", str(tmp_path), "--item", "state"]) == 0
    (tmp_path / "0" / "state" / store.MANIFEST).unlink()
    assert cli.main(["verify", str(tmp_path), "--item", "state"]) == 1
    assert "manifest" in capsys.readouterr().out


def test_a_choice_is_described_with_its_step_or_bins():
    q = {"bins": 254, "step": 0.125, "prune_fraction": 0.0, "protect_fraction": 0.0, "prune_metric": "magnitude"}
    assert cli.describe_choice(q) == "254 cells of 0.125 RMS, prune 0%, protect 0.00%"
    q = {**q, "bins": 6, "step": 0.0, "prune_fraction": 0.5, "protect_fraction": 0.005}
    assert cli.describe_choice(q, metric=True) == "6 bins, prune 50% (magnitude), protect 0.50%"
    assert cli.describe_choice("lossless") == "lossless"
    q = {**q, "bins": 14, "prune_fraction": 0.0, "protect_fraction": 0.0, "rate": 0.2}
    assert cli.describe_choice(q) == "0 + 14 levels at rate 0.2, protect 0.00%"
