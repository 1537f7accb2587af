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
wrong size, a CRC mismatch, a record that does not parse (records.py) or a stream that does not decode to the
size its record states raises `CheckpointCorruptError` naming the step, the item and the leaf; `Reader.array` is
the one checked decode path (restore, delta chains and `inshrink-jax verify` all read through it). An object
reference is a plain name inside this root's store or, for the base of fine-tunes only, an absolute path named
by the manifest. All I/O goes through `etils.epath`, so any root Orbax accepts is a root this store accepts.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
import warnings
import zlib
from typing import Any

import numpy as np
from etils import epath

from inshrink_jax import codec, delta, quantize, records
from inshrink_jax.records import CODES_FILE, DATA_FILE, STORED_KINDS

FORMAT = "inshrink_jax"
FORMAT_VERSION = 16  # 4: leaves of kind "dropped"; quantized leaves of method "moments"; 7: closed-loop chains;
# 8: the codec zstd-radix; 9: first moments coded relative to a second moment (leaf field `scale_leaf`);
# 10: the codecs zstd-runs (written instead of zstd-rle) and zstd-rank; 11: weighted closed-loop residuals
# (segment field `weighting`); 12: the codec zstd-escape; 13: a second moment's value table stored by its
# positive half, and no manifest centres for closed-loop parameters (records.Leaf.table); 14: the codec ranks
# (written instead of zstd-radix and zstd-rank); 15: the codec prefix; 16: the codec mode, and value tables
# as bfloat16 bit patterns (leaf field `centres16`, segment field `levels16`)
# 5: level-index deltas against a base checkpoint of another root (no longer read: they lost the fine-tune)
# 6: weights stored as residuals against a base checkpoint (leaf field `base_leaf`, manifest `base`, the base's
#    object listed by absolute path in the step's commit record)
OLDEST_READ = 2  # tests/data/format_v<N>: a golden checkpoint of every version read
MANIFEST = "manifest.json"
COMMIT = "commit.json"
OBJECTS = "inshrink_objects"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
_OBJECT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\Z")


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated, does not match its checksum, or does not parse."""


@contextlib.contextmanager
def reading(directory, what: str = ""):
    """Turn any failure while reading a checkpoint's files into a `CheckpointCorruptError` that names the step,
    item and `what` (a leaf, a file): a crafted or damaged record that passes its checksum must not surface as a
    bare KeyError or TypeError."""
    try:
        yield
    except CheckpointCorruptError:
        raise
    except (KeyError, TypeError, IndexError, ValueError, AttributeError, RecursionError, OverflowError,
            MemoryError, UnicodeError) as e:
        where = f": {what}" if what else ""
        raise CheckpointCorruptError(f"{describe(directory)}{where}: a record or stream does not parse "
                                     f"({type(e).__name__}: {str(e)[:200]})") from None


def _base(name: str) -> str:
    return name.split(TMP_SUFFIX)[0]


# The item name of a standalone checkpoint (written by a plain `ocp.Checkpointer`, not a CheckpointManager): its
# objects live inside it, under `inshrink_objects/standalone/`, and its one save is step "0".
STANDALONE = "standalone"


def is_standalone(directory) -> bool:
    """Whether the handler's directory is a checkpoint of its own (a plain `ocp.Checkpointer(handler)` gives the
    handler the checkpoint's path) rather than an item of a CheckpointManager step (`<root>/<step>/<item>`). While
    Orbax saves on a local filesystem it names the directory it writes `<path>.orbax-checkpoint-tmp`, and a step's
    item directory sits in a temporary step directory too; once saved, a standalone checkpoint holds its object
    store. (On storage where Orbax writes in place, such as GCS, a save cannot tell: it takes the managed layout.)"""
    d = epath.Path(directory)
    if TMP_SUFFIX in d.name:
        return TMP_SUFFIX not in d.parent.name
    return (d / OBJECTS).is_dir()


def locate(directory) -> tuple[epath.Path, str, str]:
    """(root, item name, step name) of an Orbax item directory `<root>/<step>[tmp]/<item>[tmp]`; of a standalone
    checkpoint, (itself, STANDALONE, "0")."""
    d = epath.Path(directory)
    if is_standalone(d):
        return d, STANDALONE, "0"
    return d.parent.parent, _base(d.name), _base(d.parent.name)


def describe(directory) -> str:
    """'step S, item I (path)' for error messages, from an Orbax item directory ('checkpoint (path)' for a
    standalone one)."""
    _, item, step = locate(directory)
    return f"checkpoint ({directory})" if item == STANDALONE else f"step {step}, item {item!r} ({directory})"


# How long a reader that finds a file missing watches its item directory before it calls the step damaged:
# retention and mngr.delete remove a step file by file (rmtree), so a reader can find a file gone while the
# directory is still there for a moment.
DELETION_GRACE_SECONDS = 2.0


def _missing(directory, what: str) -> CheckpointCorruptError:
    """The error for a file that is not there: a step deleted while it was read (retention, `mngr.delete`: its
    directory is gone, or goes within `DELETION_GRACE_SECONDS`) is told apart from a damaged one."""
    deadline = time.monotonic() + DELETION_GRACE_SECONDS
    while epath.Path(directory).is_dir():
        if time.monotonic() >= deadline:
            return CheckpointCorruptError(f"{describe(directory)}: {what} is missing")
        time.sleep(0.05)
    return CheckpointCorruptError(f"{describe(directory)} was deleted while it was being read (retention or "
                                  f"mngr.delete): {what} is gone. Restore a step that is still listed.")


def objects_dir(root, item: str) -> epath.Path:
    return epath.Path(root) / OBJECTS / item


def is_external(ref: str) -> bool:
    """Whether an object reference points into another root's store (an absolute path or URL)."""
    return ref.startswith("/") or "://" in ref


def is_plain_name(ref) -> bool:
    """Whether an object reference is a name in this root's store (no separator, no '..')."""
    return isinstance(ref, str) and bool(_OBJECT_NAME.match(ref)) and ".." not in ref


def object_path(root, item: str, ref: str) -> epath.Path:
    """Directory of the object `ref`: a name in this root's store, or the absolute path of an object in another
    root's store (the base checkpoint of fine-tunes, `InshrinkCheckpointHandler(base=...)`). A name that could
    leave the store (a separator, '..') is refused."""
    if is_external(ref):
        return epath.Path(ref)
    if not is_plain_name(ref):
        raise CheckpointCorruptError(f"object reference {ref!r} is not a plain object name of {objects_dir(root, item)}")
    return objects_dir(root, item) / ref


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def blob_name(process: int, file: str = CODES_FILE) -> str:
    """`blob.<p>` (code streams, needed by later deltas) or `data.<p>` (everything else)."""
    return f"{file}.{process}"


def index_name(process: int) -> str:
    return f"index.{process}.json"


def _canonical(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


# Records over this size are written as one zstandard frame of their JSON (format 8): a manifest and an offset
# table repeat every leaf's key path, sharding and level table at every save: for the 117 leaves of a
# 440k-parameter transformer with Adam, as much as a fifth of a closed-loop save; zstd-coded they are 10 kB of
# its 299 kB (benchmarks/results/save_breakdown.md).
# Smaller ones (commit records, small states) stay plain JSON. A reader tells them apart by zstd's magic number.
JSON_ZSTD_OVER = 4096
# at this zstd level: the optimal parser (btopt, from level 15) stores a record's repeated key paths in about a
# fifth fewer bytes than level 3, nearly all that level 19 gains, at several times level 19's speed
# (benchmarks/results/save_breakdown_vit.md: the last save's records at each level).
RECORD_LEVEL = 15
# A record that decompresses to more than this, or to more than JSON_ZSTD_RATIO times its stored bytes, is refused
# before it is allocated (the manifests of real states compress 5-10x: their level tables are random floats).
MAX_JSON_BYTES = 1 << 30
JSON_ZSTD_RATIO = 256
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_JSON_HEAD = re.compile(rb'\{"crc32":(\d{1,10}),"body":')  # what write_json puts before the canonical body


def framed_json(obj) -> bytes:
    """`obj` as `write_json` frames it before any zstd: its canonical JSON with the CRC32 of that JSON."""
    body = _canonical(obj)
    return b'{"crc32":%d,"body":' % crc32(body) + body + b"}"


def write_json(path, obj) -> bytes:
    """Write `obj` as JSON with a CRC32 of its canonical form, so any changed byte is detected on read; over
    `JSON_ZSTD_OVER` bytes, zstandard-coded. Returns the bytes written."""
    raw = framed_json(obj)
    if len(raw) > JSON_ZSTD_OVER:
        raw = codec.compress(raw, codec.ZSTD, RECORD_LEVEL)
    epath.Path(path).write_bytes(raw)
    return raw


def read_json(path, what: str, directory) -> tuple[Any, bytes]:
    """(object, raw file bytes) of a file written by `write_json`, checked against its CRC32."""
    try:
        raw = epath.Path(path).read_bytes()
    except FileNotFoundError:
        raise _missing(directory, f"{what} {path}") from None
    try:
        text = (codec.decompress_bounded(raw, min(MAX_JSON_BYTES, JSON_ZSTD_RATIO * len(raw)))
                if raw[:4] == _ZSTD_MAGIC else raw)
        head = _JSON_HEAD.match(text)
        if head and text.endswith(b"}") and crc32(text[head.end():-1]) == int(head.group(1)):
            # As `write_json` wrote it: the checksum is of these very bytes (no need to re-serialise the body).
            body, ok = json.loads(text[head.end():-1]), True
        else:  # another layout of the same JSON (a tool re-wrote it): the checksum is of the canonical form
            wrapped = json.loads(text)
            body = wrapped["body"]
            ok = crc32(_canonical(body)) == wrapped["crc32"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError, codec.CodecError):
        ok = False
    if not ok:
        raise CheckpointCorruptError(f"{describe(directory)}: {what} {path} is truncated or corrupted "
                                     "(checksum mismatch)")
    return body, raw


ORBAX_METADATA = "_METADATA"  # the tree metadata of an item Orbax's PyTree / Standard handler wrote


class OrbaxWrittenStep(CheckpointCorruptError):
    """A step item written by Orbax's own PyTree / Standard handler, not by inshrink_jax (a run that moved over
    keeps its earlier steps in the same root): InshrinkCheckpointHandler.restore reads it through Orbax; the
    command line lists it and reads no further."""


def read_manifest(directory) -> tuple[records.Manifest, int]:
    """(the checked manifest of a step item, the CRC32 of its file); a newer format, a foreign item, a bad record
    or a manifest whose object belongs to another step is a named error; an item Orbax wrote is
    `OrbaxWrittenStep`."""
    try:
        body, raw = read_json(epath.Path(directory) / MANIFEST, "manifest", directory)
    except CheckpointCorruptError:
        if not (epath.Path(directory) / MANIFEST).exists() and (epath.Path(directory) / ORBAX_METADATA).exists():
            raise OrbaxWrittenStep(
                f"{describe(directory)}: written by Orbax's own handler, not inshrink_jax. "
                "InshrinkCheckpointHandler.restore reads it (through Orbax); inspect, verify and copy do not.") from None
        raise
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{describe(directory)}: not an inshrink_jax checkpoint item")
    version = body.get("version")
    if isinstance(version, int) and version < OLDEST_READ:
        raise CheckpointCorruptError(f"{describe(directory)}: written by format version {version} (before the "
                                     f"object store), which this release does not read; it reads versions "
                                     f"{OLDEST_READ} to {FORMAT_VERSION}")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointCorruptError(f"{describe(directory)}: written by format version {version}, this release "
                                     f"reads up to {FORMAT_VERSION}; upgrade inshrink_jax")
    if version == 5 and body.get("base"):
        raise CheckpointCorruptError(
            f"{describe(directory)}: a fine-tune of format version 5 (level-index deltas against a base "
            "checkpoint, which kept only weights that changed level: the fine-tune was lost); this release "
            "does not read it. Save the fine-tuned weights again against the base.")
    try:
        manifest = records.Manifest.from_json(body)
    except (records.RecordError, TypeError) as e:
        raise CheckpointCorruptError(f"{describe(directory)}: manifest: {e}") from None
    step = locate(directory)[2]
    if manifest.object.rsplit(".", 1)[0] != step:
        raise CheckpointCorruptError(f"{describe(directory)}: the manifest is of step "
                                     f"{manifest.object.rsplit('.', 1)[0]} (object {manifest.object}), not of step "
                                     f"{step}: a file copied from another step")
    return manifest, crc32(raw)


# ------------------------------------------------------------------------------------------------- objects
def is_committed(root, item: str, object_id: str) -> bool:
    """Whether `object_id` was finalized (its commit record exists): only such objects are delta bases."""
    return (object_path(root, item, object_id) / COMMIT).exists()


def record_crc(path) -> int | None:
    """CRC32 of the commit record of the object directory `path`, or None if it has none that reads back whole
    (a base checkpoint deleted or being replaced)."""
    try:
        _, raw = read_json(epath.Path(path) / COMMIT, "commit record", path)
    except (CheckpointCorruptError, OSError):
        return None
    return crc32(raw)


def _listdir(path: epath.Path) -> list[str]:
    try:
        return [p.name for p in path.iterdir()]
    except (FileNotFoundError, NotADirectoryError):
        return []


def object_names(root, item: str) -> list[str]:
    """The objects in the store of (root, item); an entry that is not an object name (a user's file) is not
    one, and nothing here touches it."""
    return [n for n in _listdir(objects_dir(root, item)) if _OBJECT_NAME.match(n) and ".." not in n]


def new_object_id(root, item: str, step: str) -> str:
    """`<step>.<n>`, n one more than any committed object of the same step name (a step saved again after
    `mngr.delete` must not overwrite data that later deltas still use). Every process computes the same id:
    objects are committed only in `finalize`, which Orbax completes on all processes before the next save."""
    used = [int(n.rsplit(".", 1)[1]) for n in object_names(root, item)
            if n.rsplit(".", 1)[0] == step and n.rsplit(".", 1)[-1].isdigit() and is_committed(root, item, n)]
    return f"{step}.{max(used) + 1 if used else 0}"


class BlobWriter:
    """Accumulates this process's segments of one object; `close` writes blob.<p> (code streams), data.<p>
    (every other segment) and index.<p>.json."""

    def __init__(self, object_path, process: int):
        self.path = epath.Path(object_path)
        self.process = process
        self.entries: list[records.Shard] = []
        self._parts: dict[str, list[bytes]] = {CODES_FILE: [], DATA_FILE: []}
        self._offset = {CODES_FILE: 0, DATA_FILE: 0}

    def add(self, leaf: str, box: list[list[int]], segments: dict[str, tuple[bytes, str, dict]],
            chained: bool = False) -> int:
        """One shard of one leaf (by key path): segments name -> (compressed bytes, codec id, extra Segment
        fields). The segment named "codes" goes to the code-stream file, the others to the data file, except
        that every segment of a `chained` shard (a closed-loop link, which later links decode through) goes to
        the code-stream file. Returns the bytes added."""
        out, added = {}, 0
        for name, (data, codec_id, extra) in segments.items():
            file = CODES_FILE if name == "codes" or chained else DATA_FILE
            out[name] = records.Segment(file, self._offset[file], len(data), crc32(data), codec_id, **extra)
            self._parts[file].append(data)
            self._offset[file] += len(data)
            added += len(data)
        self.entries.append(records.Shard(leaf, box, out))
        return added

    def close(self, figures: records.ProcessFigures) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        for file, parts in self._parts.items():
            with (self.path / blob_name(self.process, file)).open("wb") as f:
                for part in parts:
                    f.write(part)
        write_json(self.path / index_name(self.process),
                   {"process": self.process, "blob_bytes": self._offset[CODES_FILE],
                    "data_bytes": self._offset[DATA_FILE], "entries": [e.to_json() for e in self.entries],
                    "figures": figures})


def _index(path: epath.Path, p: int, directory) -> tuple[dict, bytes, list[records.Shard]]:
    """Process p's offset table in the object at `path`: (its JSON, raw bytes, shard entries), checked."""
    index, raw = read_json(path / index_name(p), "offset table", directory)
    try:
        if not isinstance(index, dict) or not isinstance(index.get("entries"), list):
            raise records.RecordError("no entries")
        index.setdefault("data_bytes", 0)  # format version 2 kept every segment in blob.<p>
        for key in ("blob_bytes", "data_bytes"):
            if not isinstance(index.get(key), int) or index[key] < 0:
                raise records.RecordError(f"no valid {key!r}")
        return index, raw, [records.Shard.from_json(e) for e in index["entries"]]
    except records.RecordError as e:
        raise CheckpointCorruptError(f"{describe(directory)}: offset table {path / index_name(p)}: {e}") from None


def finalize(directory) -> dict:
    """Commit one save (primary host, after every process wrote): check each process's blob and index, check
    that every object its deltas build on is committed, write the object's and the step's commit records, then
    collect unreferenced objects. Returns the object's commit record.

    The manifest names the object, the number of writing processes and, for a fine-tune, the base checkpoint's
    object with the CRC32 of its commit record as the save read it: that object is listed in the step's commit
    record, so a restore checks it.

    Raises CheckpointCorruptError if a process's files or a delta base are missing, or if the base is gone or
    changed: the save then fails and Orbax does not list the step.
    """
    manifest, manifest_crc = read_manifest(directory)
    object_id, base = manifest.object, manifest.base
    root, item, _ = locate(directory)
    path = object_path(root, item, object_id)
    record: dict = {"processes": [], "bases": []}
    bases = set()
    for p in range(manifest.process_count):
        index, raw, shards = _index(path, p, directory)
        for file, key in ((CODES_FILE, "blob_bytes"), (DATA_FILE, "data_bytes")):
            blob = path / blob_name(p, file)
            if not blob.exists() or blob.stat().length != index[key]:
                raise CheckpointCorruptError(f"{describe(directory)}: {blob_name(p, file)} of process {p} in {path} "
                                             "is missing or has the wrong size; the save did not complete")
        record["processes"].append({"index_crc32": crc32(raw), "blob_bytes": index["blob_bytes"],
                                    "data_bytes": index["data_bytes"], "figures": index["figures"]})
        bases.update(b for e in shards for s in e.segments.values() for b in (s.base, s.prior) if b is not None)
    closure: dict[str, int] = {}
    for b in sorted(bases):
        base_record, raw = read_json(object_path(root, item, b) / COMMIT, f"commit record of delta base {b}",
                                     directory)
        closure[b] = crc32(raw)
        closure.update(base_record["closure"])
    record["bases"] = sorted(bases)
    record["closure"] = closure
    outside: dict[str, int] = {}
    if base is not None:
        ref, expected = base["object"], base["commit_crc32"]
        if record_crc(object_path(root, item, ref)) != expected:
            raise CheckpointCorruptError(f"{describe(directory)}: the base checkpoint object {ref} was deleted or "
                                         "changed while this step was saved against it; the save did not complete")
        outside[ref] = expected
    raw = write_json(path / COMMIT, record)
    write_json(epath.Path(directory) / COMMIT, {"object": object_id, "manifest_crc32": manifest_crc,
                                                "objects": {object_id: crc32(raw), **closure, **outside}})
    if item == STANDALONE:  # its one save's objects, all referenced: nothing to collect
        return record
    try:  # the save is complete: collecting garbage is housekeeping that must not fail it
        collect_garbage(root, item, current=directory)
    except OSError as e:
        warnings.warn(f"{describe(directory)}: collecting unreferenced objects failed ({e}); the next save or "
                      "`inshrink-jax gc` collects them", stacklevel=2)
    return record


def referenced_objects(root, item: str, current=None) -> tuple[set[str], set[str], set[str]] | None:
    """(objects referenced by the committed steps under `root` and the step being finalized at `current`, the
    subset that is some such step's own object, the step names of saves in flight: Orbax's temporary step
    directories). None if some step's records cannot be read: then nothing may be deleted."""
    refs: set[str] = set()
    own: set[str] = set()
    in_flight: set[str] = set()
    dirs = []
    for d in epath.Path(root).iterdir():
        if d.name == OBJECTS:
            continue
        if TMP_SUFFIX in d.name:
            in_flight.add(_base(d.name))
        else:
            dirs.append(d / item)
    for d in dirs + ([epath.Path(current)] if current is not None else []):
        try:
            commit, _ = read_json(d / COMMIT, "commit record", d)
        except (CheckpointCorruptError, OSError):
            if (d / MANIFEST).exists():
                return None  # a step we cannot read: keep everything rather than guess
            continue
        if not isinstance(commit, dict) or not isinstance(commit.get("objects"), dict) or \
                not isinstance(commit.get("object"), str):
            return None  # a record we cannot read: keep everything rather than guess
        refs.update(commit["objects"])
        own.add(commit["object"])
    return refs, own, in_flight


def collect_garbage(root, item: str, current=None, dry_run: bool = False, concurrent: bool = False):
    """Delete the objects no committed step references, and the data files of objects only later deltas
    reference (primary host only). Returns (ids of the objects, [(path, bytes)] of the data files) deleted, or
    that would be with `dry_run`; None when some step's records cannot be read (then nothing is deleted).

    `concurrent`: collecting outside a save (`inshrink-jax gc`), possibly while a job saves: objects without a
    commit record and the objects of saves in flight (a temporary step directory of their step) are left
    alone, since a save may be between writing them and Orbax's rename of its step. Deleting what another
    collector deleted first is not an error."""
    names = object_names(root, item)  # listed before the steps: an object made later is not a candidate
    found = referenced_objects(root, item, current)
    if found is None:
        return None
    refs, own, in_flight = found
    gone = sorted(n for n in names if n not in refs and not (concurrent and (
        not is_committed(root, item, n) or n.rsplit(".", 1)[0] in in_flight)))
    files = []
    for n in sorted(r for r in refs - own if not is_external(r) and r in names):
        # a delta base whose own step is gone: its code streams are all that is read. (Objects of another root,
        # the base of fine-tunes, belong to that root: never touched here.)
        for f in sorted(_listdir(objects_dir(root, item) / n)):
            if f.startswith(DATA_FILE + "."):
                path = objects_dir(root, item) / n / f
                try:
                    files.append((path, path.stat().length))
                except FileNotFoundError:
                    continue
    if not dry_run:
        for n in gone:
            try:
                (objects_dir(root, item) / n).rmtree(missing_ok=True)
            except FileNotFoundError:  # another collector is deleting it too
                pass
        for f, _ in files:
            f.unlink(missing_ok=True)
    return gone, files


# ---------------------------------------------------------------------------------------------------- read
# A blob of at most this many bytes is read whole on its first segment and kept while its object is open (for the
# Reader's lifetime); larger ones are read segment by segment, so a restore's memory stays bounded by its leaves.
WHOLE_READ_BYTES = 1 << 20


class _Object:
    """Checked access to one object's offset tables and blobs."""

    def __init__(self, root, item: str, object_id: str, record_crc: int, directory):
        self.id = object_id
        self.directory = directory
        self.path = object_path(root, item, object_id)
        external = is_external(object_id)
        if not self.path.is_dir():
            if not epath.Path(directory).is_dir():
                raise _missing(directory, f"object {object_id}")
            if external:
                raise CheckpointCorruptError(
                    f"{describe(directory)}: is stored against a base checkpoint in another directory, and needs "
                    f"its object {self.path}, which is missing: the base was deleted or moved. Put the base "
                    "checkpoint back where it was; this step cannot be restored without it.")
            root, item, step = locate(directory)
            if not objects_dir(root, item).is_dir():
                raise CheckpointCorruptError(
                    f"{describe(directory)}: needs object {object_id}, which is not here: a step's data lives in "
                    f"its root's object store ({self.path.parent}), outside the step directory, and no store is "
                    f"beside this step (a step directory copied on its own?). Copy a step with `inshrink-jax copy "
                    f"ROOT --step {step} NEW_ROOT`, which takes the objects it needs along.")
            raise CheckpointCorruptError(
                f"{describe(directory)}: needs object {object_id} ({self.path}), which is missing; it was deleted "
                "outside inshrink_jax (or the step was copied without it: `inshrink-jax copy ROOT --step N "
                "NEW_ROOT` copies a step with its objects). This step cannot be restored; restore another step.")
        try:
            self.commit, raw = read_json(self.path / COMMIT, f"commit record of object {object_id}", directory)
        except CheckpointCorruptError:
            if external and not (self.path / COMMIT).exists():
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
        self._blobs: dict[tuple[int, str], tuple[epath.Path, int]] = {}  # (process, file) -> its path and size
        self._files: dict[tuple[int, str], bytes] = {}  # small blobs, read whole once (`segment`)
        self._files_lock = threading.Lock()
        self.entries: dict[tuple, tuple[int, records.Shard]] = {}
        self.by_leaf: dict[str, list[tuple[int, records.Shard]]] = {}
        for p, rec in enumerate(self.commit["processes"]):
            _, raw, shards = _index(self.path, p, directory)
            if crc32(raw) != rec["index_crc32"]:
                raise CheckpointCorruptError(f"{describe(directory)}: offset table of process {p} in object "
                                             f"{object_id} does not match its checksum in the commit record")
            for entry in shards:
                self.entries[(entry.leaf, box_key(entry.box))] = (p, entry)
                self.by_leaf.setdefault(entry.leaf, []).append((p, entry))

    def segment(self, leaf: str, p: int, seg: records.Segment, name: str) -> bytes:
        """The checked bytes of one segment of process p's file."""
        expect = self.commit["processes"][p]["blob_bytes" if seg.file == CODES_FILE else "data_bytes"]
        known = self._blobs.get((p, seg.file))  # each file's path and size are found once
        path, size = known if known is not None else (self.path / blob_name(p, seg.file), None)
        try:
            if size is None:
                size = path.stat().length
                self._blobs[(p, seg.file)] = (path, size)
            if size != expect or seg.offset + seg.length > size:
                raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: {path} has {size} bytes, "
                                             f"expected {expect} (truncated?)")
            if size <= WHOLE_READ_BYTES:
                data = self._whole(p, seg.file, path, size)[seg.offset:seg.offset + seg.length]
            else:
                with path.open("rb") as f:
                    f.seek(seg.offset)
                    data = f.read(seg.length)
        except FileNotFoundError:
            raise _missing(self.directory, f"{path} (read for leaf {leaf})") from None
        if len(data) != seg.length or crc32(data) != seg.crc32:
            raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: segment {name!r} in {path} "
                                         "does not match its checksum (corrupted file)")
        return data

    def _whole(self, p: int, file: str, path, size: int) -> bytes:
        """All `size` bytes of a small blob, read once: a restore reads every segment of a chain's objects, and
        opening the file for each (thousands for a deep chain of a small model) cost more than reading it."""
        with self._files_lock:
            if (p, file) not in self._files:
                with path.open("rb") as f:
                    data = f.read(size + 1)
                if len(data) != size:
                    raise CheckpointCorruptError(f"{describe(self.directory)}: {path} has {len(data)} bytes, "
                                                 f"expected {size} (changed while read?)")
                self._files[(p, file)] = data
            return self._files[(p, file)]

    def array(self, leaf: str, p: int, seg: records.Segment, name: str, dtype, shape) -> np.ndarray:
        """The one checked decode path: a segment's bytes (checksum), decompressed to exactly the size of
        `shape` x `dtype` (nothing larger is allocated), as an array of that shape."""
        dtype = np.dtype(dtype)
        size = math.prod(shape) * dtype.itemsize
        with self._decoding(leaf, name):
            raw = codec.decompress_array(self.segment(leaf, p, seg, name), seg.codec, size, dtype.itemsize)
        return raw.view(dtype).reshape(shape)

    def packed(self, leaf: str, p: int, seg: records.Segment, name: str, shape, slots: int = 0) -> tuple | None:
        """A checked code segment of `shape` left packed (`codec.packed_values`: (packed bytes with room for at
        least `slots` codes, (256, per) codes each byte holds)), or None where its codec does not pack (read it
        with `array`)."""
        if seg.codec not in codec.PACKED_CODECS:
            return None
        with self._decoding(leaf, name):
            return codec.packed_values(self.segment(leaf, p, seg, name), seg.codec, math.prod(shape), slots)

    @contextlib.contextmanager
    def _decoding(self, leaf: str, name: str):
        """A codec's error decoding a segment as the named corruption of this object's leaf and segment."""
        try:
            yield
        except codec.CodecError as e:
            raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: segment {name!r} of object "
                                         f"{self.id}: {e}") from None


def box_key(box) -> tuple:
    """A shard box ([[start, stop], ...]) as a hashable key."""
    return tuple(tuple(b) for b in box)


def box_of(index: tuple, shape: tuple) -> list[list[int]]:
    """A device's slice (a tuple of slices) of an array of `shape` as a box [[start, stop], ...]."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def box_shape(box) -> list[int]:
    return [b[1] - b[0] for b in box]


class Reader:
    """Checked access to one step's item: its manifest, its own object's shards, and codes along delta chains.

    Attributes:
      manifest: the step's `records.Manifest`; leaves: key path -> its `records.Leaf`; shards: key path ->
      [(process, `records.Shard`)] of the step's own object; codes_cache: the codes decoded so far;
      chain_depth: the longest closed-loop chain (links after its first) of the leaves whose `links` were read.
    """

    def __init__(self, directory):
        self.directory = epath.Path(directory)
        with reading(self.directory):
            self._open()

    def _open(self) -> None:
        self.root, self.item, self.step = locate(self.directory)
        self.manifest, manifest_crc = read_manifest(self.directory)
        self.commit, _ = read_json(self.directory / COMMIT, "commit record", self.directory)
        if not isinstance(self.commit, dict) or not isinstance(self.commit.get("objects"), dict) or \
                self.commit.get("object") != self.manifest.object or \
                self.commit.get("manifest_crc32", manifest_crc) != manifest_crc:
            raise CheckpointCorruptError(f"{describe(self.directory)}: the commit record and the manifest do not "
                                         f"belong together (object {self.manifest.object}): a file of another "
                                         "save was put in this step")
        self.object_id = self.commit["object"]
        base = (self.manifest.base or {}).get("object")
        for ref in self.commit["objects"]:  # plain names of this root's store, or the base checkpoint's object
            if ref != base and not is_plain_name(ref):
                raise CheckpointCorruptError(f"{describe(self.directory)}: the commit record lists object {ref!r}, "
                                             "which is neither a plain object name of this root's store nor the "
                                             "manifest's base checkpoint")
        self._base: Reader | None = None
        self._objects: dict[str, _Object] = {}
        self.own = self.object(self.object_id)
        self.leaves = {m.keystr: m for m in self.manifest.leaves}
        self.shards: dict[str, list[tuple[int, records.Shard]]] = {}
        for (leaf, _), (p, entry) in self.own.entries.items():
            self.shards.setdefault(leaf, []).append((p, entry))
        for leaf in self.shards:
            if leaf not in self.leaves:
                raise CheckpointCorruptError(f"{describe(self.directory)}: object {self.object_id} holds leaf "
                                             f"{leaf}, which the manifest does not list")
        for meta in self.manifest.leaves:
            if meta.kind in STORED_KINDS:
                self.check_tiling(meta, self.shards.get(meta.keystr, []), self.object_id)
        self.codes_cache: dict[tuple, tuple[np.ndarray, int]] = {}  # (leaf, box) -> (codes, depth)
        self.chain_depth = 0  # closed loop: the most links after a keyframe of any leaf restored so far
        # During restore.restore: (key path, sharding) -> a second moment it restored, which a first moment's
        # decode also needs (restore.restore_leaf), so it is decoded once, not twice; None between restores.
        self.scale_leaves = {m.scale_leaf for m in self.manifest.leaves if m.scale_leaf is not None}
        self.shared_values: dict[tuple, Any] | None = None
        self.decode_threads = 1  # threads a restore decodes a leaf's streams with (restore.restore sets it)

    def check_tiling(self, meta: records.Leaf, shards: list, object_id: str) -> None:
        """The stored shards of a leaf in one object lie inside the manifest's shape of it and cover it exactly
        (distinct boxes; their volumes sum to the shape's), so every allocation a restore sizes by the shape or
        a box is bounded by what the shards hold, checked before anything is decoded."""
        shape = meta.data_shape if meta.kind == "prng_key" else meta.shape
        volume = 0
        for _, e in shards:
            if len(e.box) != len(shape) or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(e.box, shape)):
                raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {meta.keystr}: object {object_id} "
                                             f"holds shard {e.box}, outside the leaf's shape {list(shape)}")
            volume += math.prod(hi - lo for lo, hi in e.box)
        if volume != math.prod(shape):
            raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {meta.keystr}: the shards of object "
                                         f"{object_id} hold {volume} elements, the manifest's shape "
                                         f"{list(shape)} has {math.prod(shape)}")

    def object(self, object_id: str) -> _Object:
        with reading(self.directory, f"object {object_id!r}"):
            return self._object(object_id)

    def _object(self, object_id: str) -> _Object:
        if object_id not in self._objects:
            if object_id not in self.commit["objects"]:
                raise CheckpointCorruptError(f"{describe(self.directory)}: object {object_id} is used but not "
                                             "listed in the step's commit record")
            base = self.manifest.base or {}
            if is_external(object_id) and object_id != base.get("object"):
                raise CheckpointCorruptError(f"{describe(self.directory)}: object {object_id} is outside the "
                                             "checkpoint root and is not the manifest's base checkpoint")
            self._objects[object_id] = _Object(self.root, self.item, object_id, self.commit["objects"][object_id],
                                               self.directory)
        return self._objects[object_id]

    def figures(self) -> records.Figures:
        """The step's per-save figures (`records.figures`)."""
        with reading(self.directory, "figures"):
            return records.figures(self.manifest, [p["figures"] for p in self.own.commit["processes"]])

    def array(self, leaf: str, p: int, seg: records.Segment, name: str, dtype, shape) -> np.ndarray:
        """A checked, decoded segment of this step's own object (`_Object.array`)."""
        with reading(self.directory, f"leaf {leaf}"):
            return self.own.array(leaf, p, seg, name, dtype, shape)

    def base(self) -> "Reader | None":
        """The base checkpoint this step's residual leaves are stored against (None if it has none), checked to
        be the one it was saved against: a clear error if it is gone, moved or saved again."""
        info = self.manifest.base
        if info is None:
            return None
        with reading(self.directory, "base checkpoint"):
            return self._open_base(info)

    def _open_base(self, info: dict) -> "Reader":
        if self._base is None:
            self.object(info["object"])  # there, and the very object the step was saved against
            try:
                reader = Reader(info["directory"])
            except (CheckpointCorruptError, OSError) as e:
                raise CheckpointCorruptError(
                    f"{describe(self.directory)}: is stored against the base checkpoint {info['directory']}, "
                    f"which cannot be read ({e}). Put the base checkpoint back where it was.") from None
            if str(object_path(reader.root, reader.item, reader.object_id)) != str(epath.Path(info["object"])):
                raise CheckpointCorruptError(
                    f"{describe(self.directory)}: the base checkpoint {info['directory']} now holds another save "
                    f"than the one this step is stored against (object {info['object']}). Put that one back.")
            self._base = reader
        return self._base

    def codes(self, leaf: str, box) -> tuple[np.ndarray, int]:
        """(uint8 codes, chain depth) of one shard of this step, walking its delta chain back to the keyframe.

        Only the step's own result is cached (a shard may overlap several target boxes), not the chain's."""
        with reading(self.directory, f"leaf {leaf}"):
            return self._codes(leaf, box)

    def _codes(self, leaf: str, box) -> tuple[np.ndarray, int]:
        key = (leaf, box_key(box))
        if key in self.codes_cache:
            return self.codes_cache[key]
        shape = box_shape(box)
        chain, object_id = [], self.object_id
        while True:  # back to the keyframe
            obj = self.object(object_id)
            found = obj.entries.get(key)
            if found is None:
                raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: object {object_id} has no "
                                             f"shard {box} (a delta chain is broken)")
            seg = found[1].segments["codes"]
            chain.append((obj, found[0], seg))
            if seg.base is None:
                break
            if len(chain) > len(self.commit["objects"]):
                raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: the delta chain loops")
            object_id = seg.base
        codes = None
        for obj, p, seg in reversed(chain):
            stream = obj.array(leaf, p, seg, "codes", np.uint8, shape)
            codes = stream if codes is None else delta.decode(codes, stream.reshape(-1), seg.modulus)
        top = quantize.protected_code(self.leaves[leaf].bins)
        if codes.size and int(codes.max()) > top:  # a code past the protected one would decode to a wrong 0.0
            raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: shard {box} holds code "
                                         f"{int(codes.max())}, above the {top} of its {self.leaves[leaf].bins} levels")
        self.codes_cache[key] = (codes, len(chain) - 1)
        return self.codes_cache[key]

    def links(self, leaf: str) -> list[tuple["_Object", list[tuple[int, records.Shard]]]]:
        """A closed-loop leaf's chain, first link (a keyframe, or the exact values of a lossless save) to this
        step's own: (object, its shards of the leaf) per link. Each link's shards must all name the same prior."""
        with reading(self.directory, f"leaf {leaf}"):
            chain, object_id = [], self.object_id
            while object_id is not None:
                if len(chain) >= len(self.commit["objects"]):
                    raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {leaf}: the closed-loop chain "
                                                 "loops")
                obj = self.object(object_id)
                shards = obj.by_leaf.get(leaf, [])
                priors = {e.segments["codes"].prior if "codes" in e.segments else None for _, e in shards}
                if not shards or len(priors) != 1 or any(
                        ("codes" in e.segments) == ("data" in e.segments) for _, e in shards):
                    raise CheckpointCorruptError(
                        f"{describe(self.directory)}: leaf {leaf}: object {object_id} does not hold a link of its "
                        "closed-loop chain (no shard, mixed priors, or neither codes nor values): the chain is "
                        "broken")
                self.check_tiling(self.leaves[leaf], shards, object_id)
                chain.append((obj, shards))
                object_id = priors.pop()
            self.chain_depth = max(self.chain_depth, len(chain) - 1)
            return chain[::-1]
