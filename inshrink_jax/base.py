"""A base checkpoint in another directory that saves store their deltas against: fine-tunes of one pretrained
checkpoint, each costing a fraction of it (`InshrinkCheckpointHandler(base=...)`).

A fine-tuned weight mostly stays on the level it had in the base, so its codes are stored as the (rearranged,
entropy-coded) change against the base's codes, as between two saves of one run (delta.py). The base is a
committed step of another `CheckpointManager` root, read and checked with store.Reader:

- leaves are matched by key path: the fine-tune leaf whose path ends like exactly one quantized weight of the
  base, longest tail first (a TrainState's `.params['conv']['kernel']` finds the base's
  `['params']['conv']['kernel']`); leaves with another shape (a new classifier head) start a keyframe;
- the step's commit record names the base's object by absolute path with the CRC32 of its commit record, so a
  restore without the base, or against a base saved again in its place, fails with an error that says so;
- nothing in this root's retention or garbage collection touches the base: it belongs to its own root, which
  must keep it (publish it read-only; `max_to_keep` there must not delete it).
"""

from __future__ import annotations

import os

import numpy as np

from inshrink_jax import store


def item_directory(path) -> str:
    """The inshrink_jax item directory of `path`: a step directory `<root>/<step>` with one inshrink_jax item,
    or the item directory `<root>/<step>/<item>` itself."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(os.path.join(path, store.MANIFEST)):
        return path
    items = sorted(d for d in os.listdir(path) if os.path.exists(os.path.join(path, d, store.MANIFEST))) \
        if os.path.isdir(path) else []
    if len(items) == 1:
        return os.path.join(path, items[0])
    if items:
        raise ValueError(f"base checkpoint {path} holds several inshrink_jax items {items}; pass the item's "
                         f"directory, e.g. {os.path.join(path, items[0])}")
    raise FileNotFoundError(f"base checkpoint {path}: no inshrink_jax checkpoint there (no {store.MANIFEST} in it "
                            "or in one of its item directories). Pass a step directory <root>/<step> written by a "
                            "CheckpointManager with InshrinkCheckpointHandler.")


def _names(entries) -> tuple:
    """A key path (manifest form, [[kind, key], ...]) as the tuple of its keys, kinds ignored: an attribute
    `.params` and a dict key `['params']` are the same name."""
    return tuple(str(key) for _, key in entries)


class BaseCheckpoint:
    """A committed step of another root: its quantized weights' codes, decoded on first use and cached."""

    def __init__(self, path):
        self.directory = item_directory(path)
        self.reader = store.Reader(self.directory)
        r = self.reader
        self.ref = os.path.abspath(store.object_path(r.root, r.item, r.object_id))
        self.record_crc = r.commit["objects"][r.object_id]
        self.bins = {m["keystr"]: m["bins"] for m in r.manifest["leaves"]
                     if m["kind"] == "quantized" and m.get("method") == "weights"}
        self.shapes = {m["keystr"]: tuple(m["shape"]) for m in r.manifest["leaves"] if m["keystr"] in self.bins}
        self._by_tail: dict[tuple, list[str]] = {}
        for m in r.manifest["leaves"]:
            if m["keystr"] in self.bins:
                names = _names(m["path"])
                for j in range(len(names)):
                    self._by_tail.setdefault(names[j:], []).append(m["keystr"])

    def describe(self) -> dict:
        """What a step's manifest records about its base."""
        return {"directory": self.directory, "object": self.ref, "commit_crc32": self.record_crc}

    def check(self, directory) -> None:
        """Raise CheckpointCorruptError, naming the step being saved at `directory`, if the base is gone or was
        saved again since this handler opened it."""
        try:
            _, raw = store.read_json(os.path.join(self.ref, store.COMMIT), "commit record of the base", self.directory)
            changed = store.crc32(raw) != self.record_crc
        except store.CheckpointCorruptError:
            changed = True
        if changed or not os.path.isdir(self.directory):
            raise store.CheckpointCorruptError(
                f"{store.describe(directory)}: the base checkpoint {self.directory} (object {self.ref}) was deleted "
                "or saved again since this handler opened it; a fine-tune cannot be stored against it. Restore "
                "the base, or make a new handler with the base as it is now.")

    def ref_from(self, root: str, item: str) -> str:
        """The base object's reference as a step of `root` writes it: a plain name when the base is in the
        same store (then it is an ordinary delta base, kept by that root's garbage collection)."""
        own = os.path.abspath(store.objects_dir(root, item))
        return os.path.basename(self.ref) if os.path.dirname(self.ref) == own else self.ref

    def match(self, entries, shape) -> str | None:
        """The base leaf of a leaf with key path `entries` (manifest form) and `shape`: the one quantized base
        weight with the longest common path tail, if it has that shape; None otherwise (no such weight, the
        longest tail is shared, or another shape: a new classifier head)."""
        names = _names(entries)
        for j in range(len(names)):
            hits = self._by_tail.get(names[j:], [])
            if len(hits) == 1 and self.shapes[hits[0]] == tuple(shape):
                return hits[0]
            if hits:
                return None
        return None

    def codes(self, leaf: str, box) -> tuple[np.ndarray, int, int, list] | None:
        """(codes cut to `box`, bins, chain depth, the base shard's box) of base leaf `leaf`, from the base
        shard that contains `box` (a fine-tune may be sharded more finely than its base); None if none does."""
        for _, entry in self.reader.shards.get(leaf, []):
            held = entry["box"]
            if len(held) == len(box) and all(h[0] <= b[0] and b[1] <= h[1] for b, h in zip(box, held)):
                codes, depth = self.reader.codes(leaf, held)
                cut = codes[tuple(slice(b[0] - h[0], b[1] - h[0]) for b, h in zip(box, held))]
                return cut, self.bins[leaf], depth, held
        return None
