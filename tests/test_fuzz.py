"""Crafted checkpoints: every record of a real checkpoint mutated at random and re-signed (its CRC32 and every
CRC32 that covers it recomputed, as an attacker or a buggy tool would), then restored and verified. Whatever the
mutation, reading raises `CheckpointCorruptError` or returns a tree; nothing else escapes (no KeyError,
TypeError, RecursionError, MemoryError...), and nothing is read outside the checkpoint root.

CI runs a short slice; `INSHRINK_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz.py -p no:xdist` runs more."""

import os
import shutil

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import inshrink_jax as ij
from inshrink_jax import cli, store

EXAMPLES = int(os.environ.get("INSHRINK_FUZZ_EXAMPLES", "60"))
FILES = ("step/manifest.json", "step/commit.json", "object/commit.json", "object/index.0.json")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A root with a keyframe and a delta step: quantized weights, a lossless leaf, a key, scalars."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 32)).astype(np.float32)
    mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
        search=False)))
    for step in (0, 1):
        tree = {"params": {"w": jnp.asarray(w + 0.01 * step), "b": jnp.arange(8.0)}, "step": step,
                "name": "run", "np": np.arange(6).reshape(2, 3)}
        mngr.save(step, args=ij.InshrinkSave(tree))
        mngr.wait_until_finished()
    return root


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12)
    | st.sampled_from(["../../outside", "/etc/passwd", "blob", "data", "zstd", "zstd-rle", "raw", "1.0", "0.0"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)


def _paths(node, prefix=()):
    """Every (path) into a JSON value, containers included."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _mutate(body, path, value, delete):
    if not path:
        return value
    node = body
    for k in path[:-1]:
        node = node[k]
    if delete and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


def _resign(root, step: str) -> None:
    """Recompute the CRC32s that cover the step's records: offset tables in the object commit record, the object
    commit record and the manifest in the step commit record."""
    step_dir = root / step / "default"
    commit, _ = store.read_json(step_dir / store.COMMIT, "commit", step_dir)
    if not isinstance(commit, dict) or not isinstance(commit.get("object"), str):
        return
    obj = root / store.OBJECTS / "default" / commit["object"]
    try:
        record, _ = store.read_json(obj / store.COMMIT, "object commit", step_dir)
        for p, proc in enumerate(record["processes"]):
            proc["index_crc32"] = store.crc32((obj / store.index_name(p)).read_bytes())
        raw = store.write_json(obj / store.COMMIT, record)
        commit["objects"][commit["object"]] = store.crc32(raw)
        commit["manifest_crc32"] = store.crc32((step_dir / store.MANIFEST).read_bytes())
    except Exception:  # noqa: BLE001 (the mutation broke the structure the re-signing walks: leave it broken)
        pass
    store.write_json(step_dir / store.COMMIT, commit)


@hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize="INSHRINK_FUZZ_EXAMPLES" not in os.environ,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(data=st.data())
def test_mutated_records_are_refused_by_name_or_read(pristine, tmp_path_factory, data):
    base = tmp_path_factory.mktemp("fuzz")
    root = base / "ckpt"
    shutil.copytree(pristine, root)
    canary = base / "outside"
    canary.mkdir()
    (canary / "data.0").write_bytes(b"canary")
    step = data.draw(st.sampled_from(["0", "1"]))
    which = data.draw(st.sampled_from(FILES))
    step_dir = root / step / "default"
    obj = root / store.OBJECTS / "default" / store.Reader(step_dir).object_id
    path = (step_dir if which.startswith("step") else obj) / which.split("/")[1]
    body, _ = store.read_json(path, "record", step_dir)
    where = data.draw(st.sampled_from(sorted(_paths(body), key=repr)))
    body = _mutate(body, where, data.draw(json_values), data.draw(st.booleans()))
    store.write_json(path, body)
    if which != "step/commit.json":
        _resign(root, step)
    try:
        ij.InshrinkCheckpointHandler().restore(step_dir, ij.InshrinkRestore())
    except ij.CheckpointCorruptError:
        pass
    assert cli.main(["verify", str(root), "--step", step]) in (0, 1)
    assert (canary / "data.0").read_bytes() == b"canary"
    mngr = ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
        search=False)))
    mngr.save(2, args=ij.InshrinkSave({"params": {"w": jnp.ones((64, 32))}}))  # its finalize collects garbage
    mngr.wait_until_finished()
    assert (canary / "data.0").read_bytes() == b"canary"
