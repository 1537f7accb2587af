"""On-disk layout of one checkpoint item: manifest, one blob per process, offset tables, commit record.

    <item>/manifest.json          primary host: format version, config, tree, per-leaf kind/shape/dtype/centres
    <item>/blob.<p>               process p: concatenated compressed segments of the shards it owns
    <item>/index.<p>.json         process p: offset table: leaf, shard box, segment offsets, lengths, CRC32, codec
    <item>/commit.json            primary host, in `finalize`: CRC32 and size of every index and blob, figures

Nothing here executes code from the files (JSON only, no pickle). Every read is checked: a missing file, a
wrong size or a CRC mismatch raises `CheckpointCorruptError` naming the step, the item and the leaf.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import numpy as np

FORMAT = "inshrink_jax"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMIT = "commit.json"


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated or does not match its checksum."""


def describe(directory) -> str:
    """'step S, item I (path)' for error messages, from an Orbax item directory."""
    d = os.fspath(directory)
    item = os.path.basename(d).split(".orbax-checkpoint-tmp")[0]
    step = os.path.basename(os.path.dirname(d)).split(".orbax-checkpoint-tmp")[0]
    return f"step {step}, item {item!r} ({d})"


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def blob_name(process: int) -> str:
    return f"blob.{process}"


def index_name(process: int) -> str:
    return f"index.{process}.json"


def _canonical(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def write_json(path, obj) -> None:
    """Write `obj` as JSON with a CRC32 of its canonical form, so any changed byte is detected on read."""
    body = _canonical(obj)
    with open(path, "wb") as f:
        f.write(b'{"crc32":%d,"body":' % crc32(body) + body + b"}")


def read_json(path, what: str, directory) -> tuple[Any, bytes]:
    """(object, raw file bytes) of a file written by `write_json`, checked against its CRC32."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{describe(directory)}: {what} {os.path.basename(path)} is missing") from None
    try:
        wrapped = json.loads(raw)
        body = wrapped["body"]
        ok = crc32(_canonical(body)) == wrapped["crc32"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointCorruptError(f"{describe(directory)}: {what} {os.path.basename(path)} is truncated or "
                                     "corrupted (checksum mismatch)")
    return body, raw


class BlobWriter:
    """Accumulates this process's segments; `close` writes blob.<p> and index.<p>.json."""

    def __init__(self, directory, process: int):
        self.directory = os.fspath(directory)
        self.process = process
        self.entries: list[dict] = []
        self._parts: list[bytes] = []
        self._offset = 0

    def add(self, leaf: int, box: list[list[int]], segments: dict[str, tuple[bytes, str, dict]]) -> None:
        """One shard of one leaf: segments name -> (compressed bytes, codec id, extra JSON fields)."""
        entry = {"leaf": leaf, "box": box, "segments": {}}
        for name, (data, codec_id, extra) in segments.items():
            entry["segments"][name] = {"offset": self._offset, "length": len(data), "crc32": crc32(data),
                                       "codec": codec_id, **extra}
            self._parts.append(data)
            self._offset += len(data)
        self.entries.append(entry)

    @property
    def nbytes(self) -> int:
        return self._offset

    def close(self, figures: dict) -> None:
        with open(os.path.join(self.directory, blob_name(self.process)), "wb") as f:
            for part in self._parts:
                f.write(part)
        write_json(os.path.join(self.directory, index_name(self.process)),
                   {"process": self.process, "blob_bytes": self._offset, "entries": self.entries,
                    "figures": figures})


def finalize(directory, process_count: int) -> dict:
    """Check that every process wrote its index and blob, then record their checksums in commit.json.

    Returns the commit record. Raises CheckpointCorruptError if a process's files are missing or inconsistent.
    """
    record = {"processes": []}
    for p in range(process_count):
        index, raw = read_json(os.path.join(directory, index_name(p)), "offset table", directory)
        blob = os.path.join(directory, blob_name(p))
        if not os.path.exists(blob) or os.path.getsize(blob) != index["blob_bytes"]:
            raise CheckpointCorruptError(f"{describe(directory)}: blob of process {p} is missing or has the wrong "
                                         f"size; the save did not complete")
        record["processes"].append({"index_crc32": crc32(raw), "blob_bytes": index["blob_bytes"],
                                    "figures": index["figures"]})
    write_json(os.path.join(directory, COMMIT), record)
    return record


class Reader:
    """Checked access to one item directory's segments."""

    def __init__(self, directory):
        self.directory = os.fspath(directory)
        self.manifest, _ = read_json(os.path.join(self.directory, MANIFEST), "manifest", self.directory)
        if self.manifest.get("format") != FORMAT:
            raise CheckpointCorruptError(f"{describe(self.directory)}: not an inshrink_jax checkpoint item")
        if self.manifest.get("version", 0) > FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"{describe(self.directory)}: written by format version {self.manifest['version']}, this release "
                f"reads up to {FORMAT_VERSION}; upgrade inshrink_jax")
        self.commit, _ = read_json(os.path.join(self.directory, COMMIT), "commit record", self.directory)
        self.shards: dict[int, list[tuple[int, dict]]] = {}
        for p, rec in enumerate(self.commit["processes"]):
            index, raw = read_json(os.path.join(self.directory, index_name(p)), "offset table", self.directory)
            if crc32(raw) != rec["index_crc32"]:
                raise CheckpointCorruptError(f"{describe(self.directory)}: offset table of process {p} does not "
                                             "match its checksum in commit.json")
            for entry in index["entries"]:
                self.shards.setdefault(entry["leaf"], []).append((p, entry))
        self._blobs: dict[int, np.memmap | bytes] = {}

    def leaf_name(self, leaf: int) -> str:
        return self.manifest["leaves"][leaf]["keystr"]

    def _blob(self, p: int):
        if p not in self._blobs:
            path = os.path.join(self.directory, blob_name(p))
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise CheckpointCorruptError(f"{describe(self.directory)}: {blob_name(p)} is missing") from None
            if size != self.commit["processes"][p]["blob_bytes"]:
                raise CheckpointCorruptError(f"{describe(self.directory)}: {blob_name(p)} has {size} bytes, "
                                             f"expected {self.commit['processes'][p]['blob_bytes']} (truncated?)")
            self._blobs[p] = np.memmap(path, np.uint8, "r") if size else b""
        return self._blobs[p]

    def segment(self, leaf: int, p: int, seg: dict, name: str) -> bytes:
        data = bytes(self._blob(p)[seg["offset"]: seg["offset"] + seg["length"]])
        if len(data) != seg["length"] or crc32(data) != seg["crc32"]:
            raise CheckpointCorruptError(f"{describe(self.directory)}: leaf {self.leaf_name(leaf)}: segment "
                                         f"{name!r} in {blob_name(p)} does not match its checksum (corrupted file)")
        return data
