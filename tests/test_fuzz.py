"""Crafted checkpoints: every record of a real checkpoint mutated at random and re-signed (its CRC32 and every
CRC32 that covers it recomputed, as an attacker or a buggy tool would), then restored and verified. Whatever the
mutation, reading raises `CheckpointCorruptError` or returns a tree; nothing else escapes (no KeyError,
TypeError, RecursionError, MemoryError...), and nothing is read outside the checkpoint root.

CI runs a short slice; `INSHRINK_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz.py -n 0` runs more."""

import json
import os
import shutil

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import inshrink_jax as ij
from inshrink_jax import cli, codec, store

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


def _mutate_bytes(raw: bytes, how: str, at: int, value: bytes) -> bytes:
    at = at % (len(raw) + 1)
    if how == "replace":
        return raw[:at] + value + raw[at + len(value):]
    if how == "insert":
        return raw[:at] + value + raw[at:]
    return raw[:at]  # truncate


# u64 header fields (counts), zstd frame headers, and plain noise
header_bytes = st.one_of(
    st.integers(0, 2**64 - 1).map(lambda v: v.to_bytes(8, "little")),
    st.sampled_from([b"\x28\xb5\x2f\xfd", b"\xe0" + (1 << 40).to_bytes(8, "little"), b"\xff" * 4, b"\x00"]),
    st.binary(min_size=1, max_size=16))


@hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize="INSHRINK_FUZZ_EXAMPLES" not in os.environ,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(step=st.sampled_from(["0", "1"]), leaf=st.integers(0, 63), segment=st.integers(0, 7),
                  codec_id=st.sampled_from([None, *codec.CODE_CODECS, codec.RAW, codec.ZSTD_PLANES]),
                  how=st.sampled_from(["replace", "insert", "truncate"]), at=st.integers(0, 64), value=header_bytes)
def test_mutated_streams_are_refused_by_name_or_read(pristine, tmp_path_factory, step, leaf, segment, codec_id,
                                                     how, at, value):
    """A stored stream's bytes (its codec's header fields, its zstd frame, its body) or its codec changed, with
    every checksum re-signed: reading raises CheckpointCorruptError naming the step, or returns a tree."""
    base = tmp_path_factory.mktemp("fuzz")
    root = base / "ckpt"
    shutil.copytree(pristine, root)
    _craft_segment(root, leaf, segment, codec_id, lambda raw: _mutate_bytes(raw, how, at, value), step)
    try:
        ij.InshrinkCheckpointHandler().restore(root / step / "default", ij.InshrinkRestore())
    except ij.CheckpointCorruptError as e:
        assert f"step {step}" in str(e)
    assert cli.main(["verify", str(root), "--step", step]) in (0, 1)
    shutil.rmtree(base)


# ------------------------------------------------------------------------------------- paths out of the root
def _point_outside(body, key, ref):
    """Make the record's object reference(s) `key` point at `ref`."""
    if key == "objects":
        body["objects"][ref] = next(iter(body["objects"].values()))
    else:
        body[key] = ref


ESCAPES = {
    "a step listing ../../../outside as an object": [("step/commit.json", lambda b: _point_outside(
        b, "objects", "../../../outside"))],
    "a step whose object is ../../../outside/0.0": [
        ("step/manifest.json", lambda b: _point_outside(b, "object", "../../../outside/0.0")),
        ("step/commit.json", lambda b: _point_outside(b, "object", "../../../outside/0.0"))],
    "a step whose object is the absolute path of a copy outside": [
        ("step/manifest.json", lambda b: _point_outside(b, "object", "{outside}/0.0")),
        ("step/commit.json", lambda b: (_point_outside(b, "object", "{outside}/0.0"),
                                        _point_outside(b, "objects", "{outside}/0.0")))],
    "a segment in ../../../../outside/secret": [("object/index.0.json", lambda b: b["entries"][0]["segments"][
        sorted(b["entries"][0]["segments"])[0]].update(file="../../../../outside/secret"))],
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_references_out_of_the_root_are_refused_and_nothing_outside_is_touched(pristine, tmp_path, name):
    """Object references and file names of re-signed records that lead out of the root (relative climbs, an
    absolute path that is not the manifest's base checkpoint): restore and verify refuse them by name, and
    neither they nor a save's garbage collection and `inshrink-jax gc --apply` read or delete anything outside
    the root, where a copy of a real object waits to be 'stolen'."""
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    outside = tmp_path / "outside"
    shutil.copytree(_object_of(root, root / "0" / "default"), outside / "0.0")
    (outside / "secret.0").write_bytes(b"secret")
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    for which, edit in ESCAPES[name]:
        def fill(body, edit=edit):
            edit(body)
            for key in ("object", "objects"):  # "{outside}" stands for the absolute path of the copy
                if isinstance(body.get(key), str):
                    body[key] = body[key].format(outside=outside)
                elif isinstance(body.get(key), dict):
                    body[key] = {k.format(outside=outside): v for k, v in body[key].items()}
        _craft_record(root, which, fill)
    with pytest.raises(ij.CheckpointCorruptError, match="step 0"):
        ij.InshrinkCheckpointHandler().restore(root / "0" / "default", ij.InshrinkRestore())
    assert cli.main(["verify", str(root), "--step", "0"]) == 1
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
            search=False))) as mngr:
        mngr.save(2, args=ij.InshrinkSave({"params": {"w": jnp.ones((64, 32))}}))  # its finalize collects
    assert cli.main(["gc", str(root), "--apply"]) == 0
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------------------------ crafted size claims
N = 1 << 22  # elements of each of the two leaves below: 16 MiB of float32 each


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """A step with a quantized 2048 x 2048 weight (its code stream) and a lossless 4M-element vector."""
    root = tmp_path_factory.mktemp("large") / "ckpt"
    rng = np.random.default_rng(0)
    tree = {"w": jnp.asarray(rng.normal(size=(2048, N // 2048)).astype(np.float32)),
            "x": rng.normal(size=N).astype(np.float32)}
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
            search=False))) as mngr:
        mngr.save(0, args=ij.InshrinkSave(tree))
    return root


def _object_of(root, step_dir):
    return root / store.OBJECTS / "default" / store.read_json(step_dir / store.COMMIT, "commit", step_dir)[0]["object"]


def _craft_segment(root, leaf: str | int, name: str | int, codec: str | None, data, step: str = "0") -> None:
    """Replace segment `name` of `leaf` in the step's object by `data` (bytes, or a function of the segment's
    bytes) coded as `codec` (None: as it was), every checksum re-signed. An int `leaf` or `name` picks the
    entry or segment by its position."""
    step_dir = root / step / "default"
    obj = _object_of(root, step_dir)
    index, _ = store.read_json(obj / store.index_name(0), "index", step_dir)
    record, _ = store.read_json(obj / store.COMMIT, "commit", step_dir)
    entries = index["entries"]
    entry = entries[leaf % len(entries)] if isinstance(leaf, int) else next(e for e in entries if e["leaf"] == leaf)
    segs = entry["segments"]
    seg = segs[sorted(segs)[name % len(segs)] if isinstance(name, int) else name]
    if callable(data):
        with open(obj / store.blob_name(0, seg["file"]), "rb") as f:
            f.seek(seg["offset"])
            data = data(f.read(seg["length"]))
    path = obj / store.blob_name(0, seg["file"])
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(data)
    seg.update(offset=offset, length=len(data), crc32=store.crc32(data), codec=codec or seg["codec"])
    key = "blob_bytes" if seg["file"] == store.CODES_FILE else "data_bytes"
    index[key] = record["processes"][0][key] = offset + len(data)
    store.write_json(obj / store.index_name(0), index)
    store.write_json(obj / store.COMMIT, record)
    _resign(root, step)


def _craft_record(root, which: str, edit) -> None:
    """Apply `edit` to a record of step 0 (FILES), every checksum re-signed."""
    step_dir = root / "0" / "default"
    obj = _object_of(root, step_dir)
    path = (step_dir if which.startswith("step") else obj) / which.split("/")[1]
    body, _ = store.read_json(path, "record", step_dir)
    edit(body)
    store.write_json(path, body)
    _resign(root, "0")


def _leaf(name):
    return lambda body: next(l for l in body["leaves"] if l["keystr"] == f"['{name}']")


def _entry(name):
    return lambda body: next(e for e in body["entries"] if e["leaf"] == f"['{name}']")


def _u64(*values) -> bytes:
    return np.asarray(values, "<u8").tobytes()


CRAFTED = {
    "manifest shape 2^20 x 2^20": lambda r: _craft_record(r, "step/manifest.json",
                                                         lambda b: _leaf("x")(b).update(shape=[1 << 20, 1 << 20])),
    "manifest shape and box 2^40": lambda r: (
        _craft_record(r, "object/index.0.json", lambda b: _entry("x")(b).update(box=[[0, 1 << 40]])),
        _craft_record(r, "step/manifest.json", lambda b: _leaf("x")(b).update(shape=[1 << 40]))),
    "box of 2^31 rows": lambda r: _craft_record(r, "object/index.0.json",
                                                lambda b: _entry("w")(b).update(box=[[0, 1 << 31], [0, N // 2048]])),
    "zstd-rle header: 2^31 codes": lambda r: _craft_segment(r, "['w']", "codes", "zstd-rle",
                                                            _u64(1 << 31, 8) + b"\0" * 64),
    "zstd-rle header: 2^40 codes": lambda r: _craft_segment(r, "['w']", "codes", "zstd-rle", _u64(1 << 40, 8)),
    "zstd frame declaring 2^40 bytes": lambda r: _craft_segment(
        r, "['x']", "data", "zstd", codec.compress(b"\0" * 64)[:4] + b"\xe0" + (1 << 40).to_bytes(8, "little")),
    "zstd-radix header: 2^40 codes": lambda r: _craft_segment(r, "['w']", "codes", "zstd-radix",
                                                              b"\x04" + _u64(1 << 40) + codec.compress(b"\0")),
    "ranks frame declaring 2^40 bytes": lambda r: _craft_segment(
        r, "['w']", "codes", "ranks", bytes([2 | codec._RANKS_ZSTD, 1, 2]) + codec.compress(b"\0" * 64)[:4] + b"\xe0"
        + (1 << 40).to_bytes(8, "little")),
    "zstd-rle: a run at every code, all codes 255": lambda r: _craft_segment(
        r, "['w']", "codes", "zstd-rle", (lambda runs, vals: _u64(N, len(runs)) + runs + vals)(
            codec.compress(bytes(N)), codec.compress(b"\xff" * N))),
}

MEASURE = r"""
import json, sys
import inshrink_jax as ij
from inshrink_jax import store


def status(field):  # kB
    return int(next(l for l in open("/proc/self/status") if l.startswith(field + ":")).split()[1])


store.Reader(sys.argv[1] + "/pristine/0/default")  # imports and first reads done before measuring
out = {}
for name in json.loads(sys.argv[2]):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current resident set
    base = status("VmRSS")
    try:
        ij.InshrinkCheckpointHandler().restore(f"{sys.argv[1]}/{name}/0/default", ij.InshrinkRestore())
        error = None
    except Exception as e:
        error = f"{type(e).__module__}.{type(e).__name__}: {e}"
    out[name] = (error, (status("VmHWM") - base) * 1024)
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures peak RSS through Linux's /proc")
def test_crafted_sizes_are_refused_before_they_are_allocated(large, tmp_path):
    """Sizes claimed by re-signed records and stream headers, far beyond what the leaves' real shapes hold (a
    manifest shape, a shard box, codec headers, a zstd frame header), and a stream that decodes to codes past the
    leaf's levels: each restore raises CheckpointCorruptError naming the step and leaf, and the restoring
    process's peak RSS grows by at most twice the bytes of the leaves the pristine manifest describes, or by what
    the legitimate restore of the same step grew, if that is more (leaves decode in parallel threads, so how far
    the others got before the crafted one fails varies from run to run: 12-75 MB measured for the stream of codes
    255, against 140 MB for the legitimate restore and a bound of 67 MB)."""
    import subprocess
    import sys

    shutil.copytree(large, tmp_path / "pristine")
    names = {"pristine": "the pristine step"}
    for i, (name, craft) in enumerate(CRAFTED.items()):
        shutil.copytree(large, tmp_path / str(i))
        craft(tmp_path / str(i))
        names[str(i)] = name
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path), json.dumps(list(names))],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    legit = 2 * N * 4
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    error, pristine = measured.pop("pristine")
    assert error is None
    bound = max(2 * legit, pristine)
    for i, (error, grew) in measured.items():
        assert error is not None and error.startswith("inshrink_jax.store.CheckpointCorruptError: step 0"), \
            (names[i], error)
        assert "['w']" in error or "['x']" in error, (names[i], error)
        assert grew <= bound, (names[i], grew, legit, pristine)
    print({names[i]: grew for i, (_, grew) in json.loads(done.stdout.strip().splitlines()[-1]).items()})
