"""A base checkpoint in another directory that saves store their weights against: fine-tunes of one pretrained
checkpoint, each costing a fraction of it (`InshrinkCheckpointHandler(base=...)`).

A fine-tuned weight is the base's restored weight plus the change fine-tuning made; that change (the residual)
is what is quantized and stored (quantize.py, `offsets`), by the same method as any weight: its own k-means
levels, pruning (a pruned residual restores the base's value exactly), protection, and deltas between the
fine-tune's saves. Quantizing the fine-tuned weight itself would snap most changes back to the base's levels:
fine-tuning moves weights by less than a level spacing. The base is a committed step of another
`CheckpointManager` root, read and checked with store.Reader:

- leaves are matched by key path: the fine-tune leaf whose path ends like exactly one parameter of the base
  (quantized, or a float array stored losslessly), longest tail first (a TrainState's `.params['conv']['kernel']`
  finds the base's `['params']['conv']['kernel']`); leaves with another shape (a new classifier head) are
  quantized as they are;
- the step's commit record names the base's object by absolute path with the CRC32 of its commit record, so a
  restore without the base, or against a base saved again in its place, fails with an error that says so;
- nothing in this root's retention or garbage collection touches the base: it belongs to its own root, which
  must keep it (publish it read-only; `max_to_keep` there must not delete it).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from etils import epath

from inshrink_jax import restore, store


def item_directory(path) -> str:
    """The inshrink_jax item directory of `path`: a step directory `<root>/<step>` with one inshrink_jax item,
    or the item directory `<root>/<step>/<item>` itself."""
    path = epath.Path(path)
    if not store.is_external(str(path)):
        path = epath.Path(os.path.abspath(path))
    if (path / store.MANIFEST).exists():
        return str(path)
    items = sorted(d.name for d in path.iterdir() if (d / store.MANIFEST).exists()) if path.is_dir() else []
    if len(items) == 1:
        return str(path / items[0])
    if items:
        raise ValueError(f"base checkpoint {path} holds several inshrink_jax items {items}; pass the item's "
                         f"directory, e.g. {path / items[0]}")
    raise FileNotFoundError(f"base checkpoint {path}: no inshrink_jax checkpoint there (no {store.MANIFEST} in it "
                            "or in one of its item directories). Pass a step directory <root>/<step> written by a "
                            "CheckpointManager with InshrinkCheckpointHandler.")


def _names(entries) -> tuple:
    """A key path (manifest form, [[kind, key], ...]) as the tuple of its keys, kinds ignored: an attribute
    `.params` and a dict key `['params']` are the same name."""
    return tuple(str(key) for _, key in entries)


class BaseCheckpoint:
    """A committed step of another root: which of its parameters a fine-tune's leaves are stored against."""

    def __init__(self, path):
        self.directory = item_directory(path)
        self.reader = store.Reader(self.directory)
        r = self.reader
        self.ref = str(store.object_path(r.root, r.item, r.object_id))
        self.record_crc = r.commit["objects"][r.object_id]
        self.leaves = {m.keystr: m for m in r.manifest.leaves if m.part == "params" and (
            (m.kind == "quantized" and m.method == "weights") or m.kind == "array")}
        self._values: dict = {}  # (base leaf, sharding, committed) -> its restored values
        self._by_tail: dict[tuple, list[str]] = {}
        for key, m in self.leaves.items():
            names = _names(m.path)
            for j in range(len(names)):
                self._by_tail.setdefault(names[j:], []).append(key)

    def describe(self) -> dict:
        """What a step's manifest records about its base."""
        return {"directory": self.directory, "object": self.ref, "commit_crc32": self.record_crc}

    def check(self, directory) -> None:
        """Raise CheckpointCorruptError, naming the step being saved at `directory`, if the base is gone or was
        saved again since this handler opened it."""
        if store.record_crc(self.ref) != self.record_crc or not epath.Path(self.directory).is_dir():
            raise store.CheckpointCorruptError(
                f"{store.describe(directory)}: the base checkpoint {self.directory} (object {self.ref}) was deleted "
                "or saved again since this handler opened it; a fine-tune cannot be stored against it. Restore "
                "the base, or make a new handler with the base as it is now.")

    def match(self, entries, shape) -> str | None:
        """The base leaf of a leaf with key path `entries` (manifest form) and `shape`: the one base parameter
        with the longest common path tail, if it has that shape; None otherwise (no such parameter, the longest
        tail is shared, or another shape: a new classifier head)."""
        names = _names(entries)
        for j in range(len(names)):
            hits = self._by_tail.get(names[j:], [])
            if len(hits) == 1 and tuple(self.leaves[hits[0]].shape) == tuple(shape):
                return hits[0]
            if hits:
                return None
        return None

    def values(self, leaf: str, x: jax.Array) -> jax.Array:
        """The base's restored `leaf`, laid out like `x`; restored once per layout and kept (every save of a
        fine-tune needs it: memory of one more copy of the matched weights)."""
        key = (leaf, x.sharding, x.committed)
        if key not in self._values:
            values = restore.restore_leaf(self.reader, self.leaves[leaf], x)
            # An uncommitted leaf (made by jnp without a device) may meet arrays on other devices in the encoder.
            self._values[key] = values if x.committed else jax.device_put(np.asarray(values))
        return self._values[key]
