"""On-disk layout: step manifests that reference objects in a store beside the steps; chains; checksums; GC.

    <root>/<step>/<item>/manifest.json            primary host, in the commit: format, config, tree, per-leaf
                                                  kind/shape/dtype/centres, and the id of the step's object
    <root>/<step>/<item>/commit.json              primary host, in `finalize`: every object the step needs (its
                                                  own and all its delta bases) with the CRC32 of their records
    <root>/inshrink_objects/<item>/<id>/blob.<p>          process p: its shards' code streams (the chain part)
    <root>/inshrink_objects/<item>/<id>/data.<p>          process p: every other segment (protected values,
                                                  lossless leaves): only the object's own step reads them
    <root>/inshrink_objects/<item>/<id>/index.<p>.json    process p: offset table (leaf, box, segments, CRC32s)
    <root>/inshrink_objects/<item>/<id>/commit.json       primary host, in `finalize`: sizes and CRC32s of every
                                                  blob and index, the objects this one's deltas build on

Why an object store (DESIGN.md section 4, design (a)): a delta needs its bases. Orbax deletes step directories
by its own rules (`max_to_keep`, `keep_period`, `best_fn`, preservation policies, `mngr.delete`, a user's `rm`);
none of them can take a base away from a listed step, because a step directory holds only references. The
primary host deletes an object only when no committed step references it (`collect_garbage`, run in
`finalize`), so the data of steps Orbax deleted disappears at the next save. An object that later deltas still
need but whose own step is gone keeps only its code streams: its `data.<p>` files go (a chain of deltas would
otherwise keep every lossless optimizer state along it).

Nothing here executes code from the files (JSON only, no pickle). Every read is checked: a missing file, a
wrong size or a CRC mismatch raises `CheckpointCorruptError` naming the step, the item and the leaf.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any

import numpy as np

from inshrink_jax import codec, delta

FORMAT = "inshrink_jax"
FORMAT_VERSION = 6  # 4: leaves of kind "dropped"; quantized leaves of method "moments"
# 5: level-index deltas against a base checkpoint of another root (no longer read: they lost the fine-tune)
# 6: weights stored as residuals against a base checkpoint (leaf field `base_leaf`, manifest `base`, the base's
#    object listed by absolute path in the step's commit record)
MANIFEST = "manifest.json"
COMMIT = "commit.json"
OBJECTS = "inshrink_objects"
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated or does not match its checksum."""


def _base(name: str) -> str:
    return name.split(TMP_SUFFIX)[0]


def locate(directory) -> tuple[str, str, str]:
    """(root, item name, step name) of an Orbax item directory `<root>/<step>[tmp]/<item>[tmp]`."""
    d = os.path.normpath(os.fspath(directory))
    step_dir = os.path.dirname(d)
    return os.path.dirname(step_dir), _base(os.path.basename(d)), _base(os.path.basename(step_dir))


def describe(directory) -> str:
    """'step S, item I (path)' for error messages, from an Orbax item directory."""
    _, item, step = locate(directory)
    return f"step {step}, item {item!r} ({os.fspath(directory)})"


def _missing(directory, what: str) -> CheckpointCorruptError:
    """The error for a file that is not there: a step deleted while it was read (retention, `mngr.delete`) is
    told apart from a damaged one."""
    if not os.path.isdir(os.fspath(directory)):
        return CheckpointCorruptError(f"{describe(directory)} was deleted while it was being read (retention or "
                                      f"mngr.delete): {what} is gone. Restore a step that is still listed.")
    return CheckpointCorruptError(f"{describe(directory)}: {what} is missing")


def objects_dir(root: str, item: str) -> str:
    return os.path.join(root, OBJECTS, item)


def object_path(root: str, item: str, ref: str) -> str:
    """Directory of the object `ref`: a name in this root's store, or the absolute path of an object in another
    root's store (the base checkpoint of fine-tunes, `InshrinkCheckpointHandler(base=...)`)."""
    return ref if os.path.isabs(ref) else os.path.join(objects_dir(root, item), ref)


def is_external(ref: str) -> bool:
    """Whether an object reference points into another root's store."""
    return os.path.isabs(ref)


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


CODES_FILE, DATA_FILE = "blob", "data"


def blob_name(process: int, file: str = CODES_FILE) -> str:
    """`blob.<p>` (code streams, needed by later deltas) or `data.<p>` (everything else)."""
    return f"{file}.{process}"


def index_name(process: int) -> str:
    return f"index.{process}.json"


def _canonical(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def write_json(path, obj) -> bytes:
    """Write `obj` as JSON with a CRC32 of its canonical form, so any changed byte is detected on read.
    Returns the bytes written."""
    body = _canonical(obj)
    raw = b'{"crc32":%d,"body":' % crc32(body) + body + b"}"
    with open(path, "wb") as f:
        f.write(raw)
    return raw


def read_json(path, what: str, directory) -> tuple[Any, bytes]:
    """(object, raw file bytes) of a file written by `write_json`, checked against its CRC32."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise _missing(directory, f"{what} {path}") from None
    try:
        wrapped = json.loads(raw)
        body = wrapped["body"]
        ok = crc32(_canonical(body)) == wrapped["crc32"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointCorruptError(f"{describe(directory)}: {what} {path} is truncated or corrupted "
                                     "(checksum mismatch)")
    return body, raw


# ------------------------------------------------------------------------------------------------- objects
def is_committed(root: str, item: str, object_id: str) -> bool:
    """Whether `object_id` was finalized (its commit record exists): only such objects are delta bases."""
    return os.path.exists(os.path.join(object_path(root, item, object_id), COMMIT))


def record_crc(path: str) -> int | None:
    """CRC32 of the commit record of the object directory `path`, or None if it has none that reads back whole
    (a base checkpoint deleted or being replaced)."""
    try:
        _, raw = read_json(os.path.join(path, COMMIT), "commit record", path)
    except (CheckpointCorruptError, OSError):
        return None
    return crc32(raw)


def new_object_id(root: str, item: str, step: str) -> str:
    """`<step>.<n>`, n one more than any committed object of the same step name (a step saved again after
    `mngr.delete` must not overwrite data that later deltas still use). Every process computes the same id:
    objects are committed only in `finalize`, which Orbax completes on all processes before the next save."""
    try:
        names = os.listdir(objects_dir(root, item))
    except FileNotFoundError:
        names = []
    used = [int(n.rsplit(".", 1)[1]) for n in names
            if n.rsplit(".", 1)[0] == step and n.rsplit(".", 1)[-1].isdigit() and is_committed(root, item, n)]
    return f"{step}.{max(used) + 1 if used else 0}"


class BlobWriter:
    """Accumulates this process's segments of one object; `close` writes blob.<p> (code streams), data.<p>
    (every other segment) and index.<p>.json."""

    def __init__(self, object_path: str, process: int):
        self.path = object_path
        self.process = process
        self.entries: list[dict] = []
        self._parts: dict[str, list[bytes]] = {CODES_FILE: [], DATA_FILE: []}
        self._offset = {CODES_FILE: 0, DATA_FILE: 0}

    def add(self, leaf: str, box: list[list[int]], segments: dict[str, tuple[bytes, str, dict]]) -> None:
        """One shard of one leaf (by key path): segments name -> (compressed bytes, codec id, extra fields).
        The segment named "codes" goes to the code-stream file, the others to the data file."""
        entry = {"leaf": leaf, "box": box, "segments": {}}
        for name, (data, codec_id, extra) in segments.items():
            file = CODES_FILE if name == "codes" else DATA_FILE
            entry["segments"][name] = {"file": file, "offset": self._offset[file], "length": len(data),
                                       "crc32": crc32(data), "codec": codec_id, **extra}
            self._parts[file].append(data)
            self._offset[file] += len(data)
        self.entries.append(entry)

    @property
    def nbytes(self) -> int:
        return sum(self._offset.values())

    def close(self, figures: dict) -> None:
        os.makedirs(self.path, exist_ok=True)
        for file, parts in self._parts.items():
            with open(os.path.join(self.path, blob_name(self.process, file)), "wb") as f:
                for part in parts:
                    f.write(part)
        write_json(os.path.join(self.path, index_name(self.process)),
                   {"process": self.process, "blob_bytes": self._offset[CODES_FILE],
                    "data_bytes": self._offset[DATA_FILE], "entries": self.entries, "figures": figures})


def finalize(directory, object_id: str, process_count: int, base: tuple[str, int] | None = None) -> dict:
    """Commit one save (primary host, after every process wrote): check each process's blob and index, check
    that every object its deltas build on is committed, write the object's and the step's commit records, then
    collect unreferenced objects. Returns the object's commit record.

    `base`: (reference, CRC32 of its commit record as the handler read it) of the base checkpoint's object the
    step's residual leaves build on; it is listed in the step's commit record, so a restore checks it.

    Raises CheckpointCorruptError if a process's files or a delta base are missing, or if the base is gone or
    changed: the save then fails and Orbax does not list the step.
    """
    root, item, _ = locate(directory)
    path = os.path.join(objects_dir(root, item), object_id)
    record: dict = {"processes": [], "bases": []}
    bases = set()
    for p in range(process_count):
        index, raw = read_json(os.path.join(path, index_name(p)), "offset table", directory)
        for file, key in ((CODES_FILE, "blob_bytes"), (DATA_FILE, "data_bytes")):
            blob = os.path.join(path, blob_name(p, file))
            if not os.path.exists(blob) or os.path.getsize(blob) != index[key]:
                raise CheckpointCorruptError(f"{describe(directory)}: {blob_name(p, file)} of process {p} in {path} "
                                             "is missing or has the wrong size; the save did not complete")
        record["processes"].append({"index_crc32": crc32(raw), "blob_bytes": index["blob_bytes"],
                                    "data_bytes": index["data_bytes"], "figures": index["figures"]})
        bases.update(s["base"] for e in index["entries"] for s in e["segments"].values() if "base" in s)
    closure: dict[str, int] = {}
    for b in sorted(bases):
        base_record, raw = read_json(os.path.join(objects_dir(root, item), b, COMMIT),
                                     f"commit record of delta base {b}", directory)
        closure[b] = crc32(raw)
        closure.update(base_record["closure"])
    record["bases"] = sorted(bases)
    record["closure"] = closure
    outside: dict[str, int] = {}
    if base is not None:
        ref, expected = base
        if record_crc(object_path(root, item, ref)) != expected:
            raise CheckpointCorruptError(f"{describe(directory)}: the base checkpoint object {ref} was deleted or "
                                         "changed while this step was saved against it; the save did not complete")
        outside[ref] = expected
    raw = write_json(os.path.join(path, COMMIT), record)
    write_json(os.path.join(directory, COMMIT),
               {"object": object_id, "objects": {object_id: crc32(raw), **closure, **outside}})
    collect_garbage(root, item, current=directory)
    return record


def referenced_objects(root: str, item: str, current=None) -> tuple[set[str], set[str]] | None:
    """(objects referenced by the committed steps under `root` and the step being finalized at `current`, the
    subset that is some such step's own object). None if some step's records cannot be read: then nothing may
    be deleted."""
    refs: set[str] = set()
    own: set[str] = set()
    dirs = [os.path.join(root, d, item) for d in os.listdir(root) if TMP_SUFFIX not in d and d != OBJECTS]
    for d in dirs + ([os.fspath(current)] if current is not None else []):
        if not os.path.isdir(d):
            continue
        try:
            commit, _ = read_json(os.path.join(d, COMMIT), "commit record", d)
        except (CheckpointCorruptError, OSError):
            if os.path.exists(os.path.join(d, MANIFEST)):
                return None  # a step we cannot read: keep everything rather than guess
            continue
        refs.update(commit["objects"])
        own.add(commit["object"])
    return refs, own


def collect_garbage(root: str, item: str, current=None, dry_run: bool = False, keep_uncommitted: bool = False):
    """Delete the objects no committed step references, and the data files of objects only later deltas
    reference (primary host only). Returns (ids of the objects, [(path, bytes)] of the data files) deleted, or
    that would be with `dry_run`; None when some step's records cannot be read (then nothing is deleted).
    `keep_uncommitted` leaves objects without a commit record alone (a save may be writing them: outside
    `finalize` nobody can tell a save in flight from one that crashed)."""
    found = referenced_objects(root, item, current)
    if found is None:
        return None
    refs, own = found
    try:
        names = os.listdir(objects_dir(root, item))
    except FileNotFoundError:
        return [], []
    gone = sorted(n for n in names if n not in refs and not (keep_uncommitted and not is_committed(root, item, n)))
    files = []
    for n in sorted(r for r in refs - own if not is_external(r)):
        # a delta base whose own step is gone: its code streams are all that is read. (Objects of another root,
        # the base of fine-tunes, belong to that root: never touched here.)
        path = os.path.join(objects_dir(root, item), n)
        for f in sorted(os.listdir(path)) if os.path.isdir(path) else []:
            if f.startswith(DATA_FILE + "."):
                files.append((os.path.join(path, f), os.path.getsize(os.path.join(path, f))))
    if not dry_run:
        for n in gone:
            shutil.rmtree(os.path.join(objects_dir(root, item), n), ignore_errors=True)
        for f, _ in files:
            os.remove(f)
    return gone, files


# ---------------------------------------------------------------------------------------------------- read
class _Object:
    """Checked access to one object's indices and blobs."""

    def __init__(self, root: str, item: str, object_id: str, record_crc: int, directory):
        self.id = object_id
        self.directory = directory
        self.path = object_path(root, item, object_id)
        external = is_external(object_id)
        if not os.path.isdir(self.path):
            if not os.path.isdir(os.fspath(directory)):
                raise _missing(directory, f"object {object_id}")
            if external:
                raise CheckpointCorruptError(
                    f"{describe(directory)}: is stored against a base checkpoint in another directory, and needs "
                    f"its object {self.path}, which is missing: the base was deleted or moved. Put the base "
                    "checkpoint back where it was; this step cannot be restored without it.")
            raise CheckpointCorruptError(
                f"{describe(directory)}: needs object {object_id} ({self.path}), which is missing; it was deleted "
                "outside inshrink_jax. This step cannot be restored; restore another step.")
        try:
            self.commit, raw = read_json(os.path.join(self.path, COMMIT), f"commit record of object {object_id}",
                                         directory)
        except CheckpointCorruptError:
            if external and not os.path.exists(os.path.join(self.path, COMMIT)):
                raise CheckpointCorruptError(
                    f"{describe(directory)}: the base checkpoint object {self.path} it is stored against has no "
                    "commit record: the base was deleted or replaced. Put the base checkpoint back.") from None
            raise
        if crc32(raw) != record_crc:
            if external:
                raise CheckpointCorruptError(
                    f"{describe(directory)}: the base checkpoint object {self.path} it is stored against has "
                    "changed since this step was saved (its commit record differs: a different checkpoint was "
                    "saved there). This step decodes only against the base it was saved with.")
            raise CheckpointCorruptError(f"{describe(directory)}: commit record of object {object_id} does not "
                                         "match the step's commit record (file replaced or corrupted)")
        self.entries: dict[tuple, tuple[int, dict]] = {}
        for p, rec in enumerate(self.commit["processes"]):
            index, raw = read_json(os.path.join(self.path, index_name(p)), "offset table", directory)
            if crc32(raw) != rec["index_crc32"]:
                raise CheckpointCorruptError(f"{describe(directory)}: offset table of process {p} in object "
                                             f"{object_id} does not match its checksum in the commit record")
            for entry in index["entries"]:
                self.entries[(entry["leaf"], box_key(entry["box"]))] = (p, entry)
        self._blobs: dict[tuple, Any] = {}

    def _blob(self, p: int, file: str, leaf: str):
        if (p, file) not in self._blobs:
            path = os.path.join(self.path, blob_name(p, file))
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise _missing(self.directory, f"{path} (read for leaf {leaf})") from None
            expect = self.commit["processes"][p]["blob_bytes" if file == CODES_FILE else "data_bytes"]
            if size != expect:
                raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: {path} has {size} bytes, "
                                             f"expected {expect} (truncated?)")
            self._blobs[(p, file)] = np.memmap(path, np.uint8, "r") if size else b""
        return self._blobs[(p, file)]

    def segment(self, leaf: str, p: int, seg: dict, name: str) -> bytes:
        file = seg.get("file", CODES_FILE)  # format version 2 kept every segment in blob.<p>
        data = bytes(self._blob(p, file, leaf)[seg["offset"]: seg["offset"] + seg["length"]])
        if len(data) != seg["length"] or crc32(data) != seg["crc32"]:
            raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: segment {name!r} in "
                                         f"{self.path}/{blob_name(p, file)} does not match its checksum "
                                         "(corrupted file)")
        return data


def box_key(box) -> tuple:
    """A shard box ([[start, stop], ...]) as a hashable key."""
    return tuple(tuple(b) for b in box)


class Reader:
    """Checked access to one step's item: its manifest, its own object's shards, and codes along delta chains."""

    def __init__(self, directory):
        self.directory = os.fspath(directory)
        self.root, self.item, self.step = locate(self.directory)
        self.manifest, _ = read_json(os.path.join(self.directory, MANIFEST), "manifest", self.directory)
        if self.manifest.get("format") != FORMAT:
            raise CheckpointCorruptError(f"{describe(self.directory)}: not an inshrink_jax checkpoint item")
        if self.manifest.get("version", 0) > FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"{describe(self.directory)}: written by format version {self.manifest['version']}, this release "
                f"reads up to {FORMAT_VERSION}; upgrade inshrink_jax")
        if self.manifest.get("version") == 5 and self.manifest.get("base"):
            raise CheckpointCorruptError(
                f"{describe(self.directory)}: a fine-tune of format version 5 (level-index deltas against a base "
                "checkpoint, which kept only weights that changed level: the fine-tune was lost); this release "
                "does not read it. Save the fine-tuned weights again against the base.")
        self.commit, _ = read_json(os.path.join(self.directory, COMMIT), "commit record", self.directory)
        self.object_id = self.commit["object"]
        self._base: Reader | None = None
        self._objects: dict[str, _Object] = {}
        self.own = self.object(self.object_id)
        self.leaves = {m["keystr"]: m for m in self.manifest["leaves"]}  # key path -> manifest entry
        self.shards: dict[str, list[tuple[int, dict]]] = {}
        for (leaf, _), (p, entry) in self.own.entries.items():
            self.shards.setdefault(leaf, []).append((p, entry))
        self.codes_cache: dict[tuple, tuple[np.ndarray, int]] = {}  # (object, leaf, box) -> (codes, depth)

    def object(self, object_id: str) -> _Object:
        if object_id not in self._objects:
            if object_id not in self.commit["objects"]:
                raise CheckpointCorruptError(f"{describe(self.directory)}: object {object_id} is used but not "
                                             "listed in the step's commit record")
            self._objects[object_id] = _Object(self.root, self.item, object_id, self.commit["objects"][object_id],
                                               self.directory)
        return self._objects[object_id]

    def segment(self, leaf: str, p: int, seg: dict, name: str) -> bytes:
        return self.own.segment(leaf, p, seg, name)

    def base(self) -> "Reader | None":
        """The base checkpoint this step's residual leaves are stored against (None if it has none), checked to
        be the one it was saved against: a clear error if it is gone, moved or saved again."""
        info = self.manifest.get("base")
        if info is None:
            return None
        if self._base is None:
            self.object(info["object"])  # there, and the very object the step was saved against
            try:
                reader = Reader(info["directory"])
            except (CheckpointCorruptError, OSError) as e:
                raise CheckpointCorruptError(
                    f"{describe(self.directory)}: is stored against the base checkpoint {info['directory']}, "
                    f"which cannot be read ({e}). Put the base checkpoint back where it was.") from None
            if os.path.abspath(object_path(reader.root, reader.item, reader.object_id)) != \
                    os.path.abspath(object_path(self.root, self.item, info["object"])):
                raise CheckpointCorruptError(
                    f"{describe(self.directory)}: the base checkpoint {info['directory']} now holds another save "
                    f"than the one this step is stored against (object {info['object']}). Put that one back.")
            self._base = reader
        return self._base

    def codes(self, leaf: str, box) -> tuple[np.ndarray, int]:
        """(uint8 codes, chain depth) of one shard of this step, walking its delta chain back to the keyframe.

        Only the step's own result is cached (a shard may overlap several target boxes), not the chain's."""
        key = (leaf, box_key(box))
        if key in self.codes_cache:
            return self.codes_cache[key]
        shape = [b[1] - b[0] for b in box]
        chain, object_id = [], self.object_id
        while True:  # back to the keyframe
            obj = self.object(object_id)
            found = obj.entries.get(key)
            if found is None:
                raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: object {object_id} has no "
                                             f"shard {box} (a delta chain is broken)")
            seg = found[1]["segments"]["codes"]
            chain.append((obj, found[0], seg))
            if "base" not in seg:
                break
            object_id = seg["base"]
        codes = None
        for obj, p, seg in reversed(chain):
            stream = np.frombuffer(codec.decompress(obj.segment(leaf, p, seg, "codes"), seg["codec"]), np.uint8)
            if stream.size != int(np.prod(shape)):
                raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: codes of shard {box} in "
                                             f"object {obj.id} hold {stream.size} values, expected "
                                             f"{int(np.prod(shape))}")
            codes = stream.reshape(shape) if codes is None else delta.decode(codes, stream, seg["modulus"])
        self.codes_cache[key] = (codes, len(chain) - 1)
        return self.codes_cache[key]
