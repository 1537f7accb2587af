"""Typed records of the on-disk format (docs/format.md): manifest entries, shard entries, per-save figures.

Each record is built once, complete, by the code that knows its values, and written with `to_json`; a reader
gets it back with `from_json`, which checks the fields it relies on and raises `RecordError` (the store turns it
into a `CheckpointCorruptError` naming the file). Fields added by later format versions have defaults, so older
checkpoints read as records too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, TypedDict

import jax
import numpy as np

from inshrink_jax import weighting

LeafKind = Literal["scalar", "array", "prng_key", "dropped", "quantized"]
STORED_KINDS = ("array", "prng_key", "quantized")  # the kinds with stored shards
LEAF_KINDS = ("scalar", "array", "prng_key", "dropped", "quantized")
Part = Literal["params", "optimizer", "other"]
PARTS = ("params", "optimizer", "other")
CODES_FILE, DATA_FILE = "blob", "data"
NUMPY_SCALAR = "numpy.generic"
CLOSED_LOOP = "closed-loop"
MAX_LEVELS = 254  # codes are uint8: 0 pruned, 1..K levels, K + 1 protected
# The dtypes a checkpoint may name (never "O" or a structured dtype: a dtype is read from an untrusted file).
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "bfloat16",
          "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")


class RecordError(ValueError):
    """A record read from a checkpoint file lacks a field or has one of the wrong type."""


@functools.cache
def _field_names(cls) -> frozenset[str]:
    """The field names of a record dataclass (what its `from_json` keeps of an entry)."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise RecordError(what)


MAX_MESH_DEVICES = 1 << 20
AXIS_TYPES = ("Auto", "Explicit", "Manual")  # jax.sharding.AxisType names


def _is_mesh(m: Any, ndim: int) -> bool:
    """Whether `m` is a well-formed Leaf.mesh for an array of `ndim` dimensions: named axes of positive sizes whose
    product is the number of (distinct, non-negative) device ids, and a spec that names each axis at most once."""
    if not (isinstance(m, dict) and set(m) == {"axes", "devices", "spec"} and isinstance(m["axes"], list) and
            isinstance(m["devices"], list) and isinstance(m["spec"], list) and len(m["spec"]) <= ndim):
        return False
    axes = m["axes"]
    if not all(isinstance(a, list) and len(a) == 3 and isinstance(a[0], str) and isinstance(a[1], int) and
               not isinstance(a[1], bool) and 0 < a[1] <= MAX_MESH_DEVICES and a[2] in AXIS_TYPES for a in axes):
        return False
    names = [a[0] for a in axes]
    size = 1
    for _, n, _ in axes:
        size *= n
    devices = m["devices"]
    if len(set(names)) != len(names) or size > MAX_MESH_DEVICES or len(devices) != size or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices) or len(set(devices)) != size:
        return False
    used = []
    for e in m["spec"]:
        if e is None:
            continue
        group = [e] if isinstance(e, str) else e
        if not isinstance(group, list) or not all(isinstance(n, str) and n in names for n in group):
            return False
        used += group
    return len(set(used)) == len(used)


def table_bits(values) -> list[int]:
    """A value table (float32 entries that are bfloat16 values: the encoders round every table so,
    `quantize.bf16_table`) as the upper 16 bits of each entry: ints of at most 5 digits, exact, where a float32's
    decimal takes up to 9 significant digits (each save's records carry every quantized leaf's table: a vision
    transformer of 216 leaves wrote 9,738 bytes of manifest a save with decimals, 5,722 with these;
    benchmarks/results/save_breakdown_vit.md). Format 16."""
    bits = np.ascontiguousarray(np.asarray(values, np.float32).ravel()).view(np.uint32)
    if np.any(bits & 0xFFFF) or np.any(bits & 0x7F800000 == 0x7F800000):
        raise ValueError("a value table to store has entries that are not finite bfloat16 values")
    return (bits >> 16).tolist()


def bits_table(bits: list) -> np.ndarray:
    """The float32 value table of `table_bits`' ints."""
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def _is_bits_table(v) -> bool:
    """Whether `v` is a list of `table_bits` ints: 16-bit, none a bfloat16 infinity or NaN."""
    return type(v) is list and set(map(type, v)) <= _INT and all(0 <= b < 1 << 16 and b & 0x7F80 != 0x7F80
                                                                 for b in v)


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Leaf:
    """The manifest entry of one leaf.

    Attributes:
      path: the key path as JSON, [["d", key] | ["a", name] | ["s", index], ...].
      keystr: `jax.tree_util.keystr` of the path: how leaves are matched.
      kind: "scalar" (a Python scalar, string or None, stored in `value`), "array" (lossless), "prng_key" (its key
        data, lossless), "dropped" (not stored, restored as zeros) or "quantized".
      shape, dtype, part, sharding: of array-like leaves (`sharding` as saved, for information).
      mesh: of a leaf saved with a `NamedSharding`: {"axes": [[name, size, axis type], ...], "devices": [device id, ...] in
        the mesh's order, "spec": the PartitionSpec's entries (null, an axis name, or a list of names)}; a
        restore without a target places the leaf that way when those devices are present.
      value, type: of scalars (`type` is the Python type's name); `type` is NUMPY_SCALAR for a NumPy scalar
        (restored as one).
      impl, data_shape: of PRNG keys (the key implementation's name, the key data's shape).
      method: of quantized leaves: "weights" (quantize.py) or "moments" (moments.py).
      layer_type: of quantized weights.
      bins, centres: of quantized leaves: the number of levels (or value-table entries) and their values
        (`table`). Since format 13 a second moment's table, symmetric by construction (moments.py), is stored
        by its positive half, and a closed-loop parameter has no centres here: each link's levels are in its
        offset table (`Segment.levels`).
      centres16: since format 16, instead of `centres`: the same values as bfloat16 bit patterns (`table_bits`).
      base_leaf: of weights stored as residuals against a base checkpoint: the base's leaf.
      coding: CLOSED_LOOP for a parameter stored in a closed-loop chain: the step restores it as the sum of its
        chain's links (each link's shards name the link before it, `Segment.prior`); a leaf of kind "array"
        with this coding is a chain's exact root. None: the leaf is decoded on its own (open-loop codes, their
        delta chain, or lossless).
      scale_leaf: of a quantized first moment coded relative to a second moment (moments.encode_first_on_device):
        that leaf's key path; its values decode to centre * sqrt(that leaf as restored).
    """

    path: list
    keystr: str
    kind: LeafKind
    shape: list | None = None
    dtype: str | None = None
    part: Part = "other"
    sharding: str | None = None
    value: Any = None
    type: str | None = None
    impl: str | None = None
    data_shape: list | None = None
    method: str | None = None
    layer_type: str | None = None
    bins: int | None = None
    centres: list | None = None
    base_leaf: str | None = None
    coding: str | None = None
    mesh: dict | None = None
    scale_leaf: str | None = None
    centres16: list | None = None

    @property
    def nbytes(self) -> int:
        """Raw bytes of the leaf's values (its key data for a PRNG key; 0 for a scalar)."""
        if self.shape is None or self.dtype is None:
            return 0
        return int(np.prod(self.data_shape or self.shape)) * jax.numpy.dtype(self.dtype).itemsize

    @property
    def stored(self) -> list | None:
        """The table as stored: `centres16` or `centres` (whichever the leaf has), or None."""
        return self.centres16 if self.centres16 is not None else self.centres

    @property
    def halved(self) -> bool:
        """Whether the stored table holds only the positive half of a second moment's value table (format 13)."""
        return self.method == "moments" and self.scale_leaf is None and self.stored is not None and \
            self.bins is not None and 2 * len(self.stored) == self.bins

    def stored_centres(self, table) -> list | None:
        """What the manifest stores of this leaf's value `table` (float32 bfloat16 values, `bins` entries; the
        inverse of `table()`) as `centres16`: nothing for a closed-loop parameter (its links' levels are in the
        offset tables), the positive half of a moment's table that is exactly symmetric (a second moment's always
        is), else the whole table."""
        t = np.asarray(table, np.float32)
        if self.coding == CLOSED_LOOP:
            return None
        if self.method == "moments" and self.scale_leaf is None and t.size % 2 == 0 and \
                np.array_equal(t[:t.size // 2], -t[t.size // 2:][::-1]):
            return table_bits(t[t.size // 2:])
        return table_bits(t)

    def table(self) -> np.ndarray:
        """The value table codes 1..bins decode through (float32): the stored one, or where only a second moment's
        positive half is stored, the negatives (the half negated, largest first) and then that half, the table
        moments.py built bit for bit."""
        c = bits_table(self.centres16) if self.centres16 is not None else np.asarray(self.centres, np.float32)
        return np.concatenate([-c[::-1], c]) if self.halved else c

    def to_json(self) -> dict:
        d = _drop_none(dataclasses.asdict(self))
        if self.kind == "scalar":
            d["value"] = self.value
        return d

    @classmethod
    def from_json(cls, d: Any) -> "Leaf":
        _check(isinstance(d, dict) and d.get("kind") in LEAF_KINDS, f"a leaf entry has no valid kind: {str(d)[:80]}")
        _check(isinstance(d.get("keystr"), str) and isinstance(d.get("path"), list) and all(
            _is_path_entry(e) for e in d["path"]), f"a leaf entry has no valid key path: {str(d)[:80]}")
        known = _field_names(cls)
        leaf = cls(**{k: v for k, v in d.items() if k in known})
        if leaf.kind != "scalar":
            _check(isinstance(leaf.shape, list) and all(isinstance(n, int) and n >= 0 for n in leaf.shape),
                   f"leaf {leaf.keystr}: invalid shape {leaf.shape!r}")
            _check(leaf.dtype in DTYPES, f"leaf {leaf.keystr}: dtype {str(leaf.dtype)[:40]!r} is not one a "
                                          "checkpoint may hold")
        _check(leaf.coding in (None, CLOSED_LOOP) and (leaf.coding is None or (
            leaf.kind in ("quantized", "array") and leaf.method in (None, "weights") and leaf.base_leaf is None)),
               f"leaf {leaf.keystr}: invalid coding {str(leaf.coding)[:40]!r}")
        _check(leaf.scale_leaf is None or (isinstance(leaf.scale_leaf, str) and leaf.kind == "quantized"
                                           and leaf.method == "moments" and leaf.scale_leaf != leaf.keystr),
               f"leaf {leaf.keystr}: invalid scale_leaf {str(leaf.scale_leaf)[:80]!r}")
        _check(leaf.mesh is None or (leaf.kind != "scalar" and _is_mesh(leaf.mesh, len(leaf.shape))),
               f"leaf {leaf.keystr}: invalid mesh {str(leaf.mesh)[:80]!r}")
        _check(leaf.centres16 is None or (leaf.centres is None and _is_bits_table(leaf.centres16)),
               f"leaf {leaf.keystr}: invalid centres16")
        if leaf.kind == "quantized":
            _check(isinstance(leaf.bins, int) and (
                leaf.stored is None and leaf.coding == CLOSED_LOOP or isinstance(leaf.stored, list) and (
                    len(leaf.stored) == leaf.bins or leaf.halved)),
                   f"leaf {leaf.keystr}: invalid bins / centres")
        return leaf


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A step item's manifest: the tree, how each leaf is stored, and the object holding its data."""

    format: str
    version: int
    process_count: int
    object: str
    leaves: list[Leaf]
    config: dict = dataclasses.field(default_factory=dict)
    quant: dict | None = None
    raw_bytes: dict = dataclasses.field(default_factory=lambda: {p: 0 for p in PARTS})
    search: dict = dataclasses.field(default_factory=dict)
    base: dict | None = None
    sensitivity: str = ""
    empty: list = dataclasses.field(default_factory=list)  # [[path, "dict" | "list"]] of empty containers

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["leaves"] = [leaf.to_json() for leaf in self.leaves]
        return d

    @classmethod
    def from_json(cls, d: Any) -> "Manifest":
        _check(isinstance(d, dict), "the manifest is not an object")
        for name, kind in (("format", str), ("version", int), ("process_count", int), ("object", str),
                           ("leaves", list)):
            _check(isinstance(d.get(name), kind), f"the manifest has no valid {name!r}")
        known = _field_names(cls)
        fields = {k: v for k, v in d.items() if k in known and (v is not None or k in ("quant", "base"))}
        fields["leaves"] = [Leaf.from_json(m) for m in d["leaves"]]
        base = fields.get("base")
        _check(base is None or (isinstance(base, dict) and isinstance(base.get("object"), str)
                                and isinstance(base.get("directory"), str)), "the manifest's base is not valid")
        _check(isinstance(fields.get("empty", []), list) and all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], list) and e[1] in ("dict", "list")
            for e in fields.get("empty", [])), "the manifest's empty containers are not valid")
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class Segment:
    """One stored byte range of a shard: where it is, its checksum, its codec, and what decoding it needs.

    Attributes:
      file: CODES_FILE (code streams: later deltas read them) or DATA_FILE (everything else).
      offset, length, crc32: the byte range in `<file>.<process>` and its CRC32.
      codec: codec id (codec.py).
      base, modulus: of a delta's code stream: the object it is a delta against, and the modulus of the delta.
      dtype, count: of protected values: their storage dtype and number.
      prior, levels: of a closed-loop link's code stream: the object whose reconstruction of the same leaf this
        link's decoded residual is added to (None: the chain's first link, decoded on its own), and the link's
        K levels (codes 1..K; K + 1 is protected); since format 16 `levels16` instead of `levels`: the same as
        bfloat16 bit patterns (`table_bits`). A closed-loop link keeps all its segments in CODES_FILE:
        later links need them.
      weighting: of a weighted closed-loop residual (weighting.py): per axis of the shard's box, the factors of
        its indices there (ints within weighting.FACTOR_LIMIT; the restore checks the lengths against the box).
    """

    file: str
    offset: int
    length: int
    crc32: int
    codec: str
    base: str | None = None
    modulus: int | None = None
    dtype: str | None = None
    count: int | None = None
    prior: str | None = None
    levels: list | None = None
    weighting: list | None = None
    levels16: list | None = None

    def table(self) -> np.ndarray | None:
        """A closed-loop link's K levels as float32 (`levels16` or `levels`), or None."""
        if self.levels16 is not None:
            return bits_table(self.levels16)
        return None if self.levels is None else np.asarray(self.levels, np.float32)

    def to_json(self) -> dict:
        return _drop_none(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, d: Any) -> "Segment":
        # (Every offset table holds one of these per stored stream, and a restore reads the table of each object
        # along its chains: the checks are written to cost little, each message made only for a failed one.)
        if type(d) is not dict:
            raise RecordError("a segment entry is not an object")
        get = d.get
        for name in ("offset", "length", "crc32"):
            v = get(name)
            if type(v) is not int or v < 0:
                raise RecordError(f"a segment has no valid {name!r}")
        file = get("file", CODES_FILE)  # format version 2 kept every segment in the code-stream file
        if file not in (CODES_FILE, DATA_FILE) or type(get("codec")) is not str:
            raise RecordError("a segment's file or codec")
        dtype = get("dtype")
        if dtype is not None and dtype not in DTYPES:
            raise RecordError(f"a segment's dtype {str(dtype)[:40]!r}")
        for name in ("count", "modulus"):
            v = get(name)
            if v is not None and (type(v) is not int or v < 0):
                raise RecordError("a segment's count or modulus")
        for name in ("base", "prior"):
            v = get(name)
            if v is not None and type(v) is not str:
                raise RecordError(f"a segment's {name}")
        levels = get("levels")
        if levels is not None and not (type(levels) is list and 1 <= len(levels) <= MAX_LEVELS and
                                       set(map(type, levels)) <= _NUMBERS):
            raise RecordError("a segment's levels")
        levels16 = get("levels16")
        if levels16 is not None and not (levels is None and 1 <= len(levels16) <= MAX_LEVELS if
                                         _is_bits_table(levels16) else False):
            raise RecordError("a segment's levels16")
        w = get("weighting")
        if w is not None and not (isinstance(w, list) and all(isinstance(f, list) and set(map(type, f)) <= _INT and (
                not f or -weighting.FACTOR_LIMIT <= min(f) and max(f) <= weighting.FACTOR_LIMIT) for f in w)):
            raise RecordError("a segment's weighting")
        return cls(file=file, **{k: v for k, v in d.items() if k in _SEGMENT_FIELDS})


_SEGMENT_FIELDS = _field_names(Segment) - {"file"}  # what `Segment.from_json` keeps of an entry, besides its file
_NUMBERS, _INT = frozenset((int, float)), frozenset((int,))  # the exact types of JSON numbers (not bool)


@dataclasses.dataclass(frozen=True)
class Shard:
    """The offset-table entry of one stored shard of one leaf: its box and its segments by name."""

    leaf: str
    box: list
    segments: dict[str, Segment]

    def to_json(self) -> dict:
        return {"leaf": self.leaf, "box": self.box, "segments": {k: s.to_json() for k, s in self.segments.items()}}

    @classmethod
    def from_json(cls, d: Any) -> "Shard":
        if not isinstance(d, dict) or not isinstance(d.get("leaf"), str):
            raise RecordError("a shard entry has no leaf")
        box = d.get("box")
        if not isinstance(box, list) or not all(_is_range(b) for b in box):
            raise RecordError(f"shard of {d['leaf']}: invalid box")
        if not isinstance(d.get("segments"), dict):
            raise RecordError(f"shard of {d['leaf']}: no segments")
        return cls(d["leaf"], box, {k: Segment.from_json(s) for k, s in d["segments"].items()})


def _is_path_entry(e) -> bool:
    return (isinstance(e, list) and len(e) == 2 and e[0] in ("d", "a", "s")
            and (isinstance(e[1], str) or (isinstance(e[1], int) and not isinstance(e[1], bool)))
            and (e[0] != "s" or (isinstance(e[1], int) and e[1] >= 0)))


def _is_range(b) -> bool:
    return isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) for x in b) and 0 <= b[0] <= b[1]


class ProcessFigures(TypedDict):
    """What one process measured of its part of a save (in its offset table)."""

    stored_bytes: dict[str, int]
    blocking_seconds: float
    total_seconds: float
    keyframe_shards: int
    delta_shards: int
    max_depth: int


class Figures(TypedDict):
    """One save's figures (`InshrinkCheckpointHandler.metadata`, `inshrink-jax inspect --json`)."""

    raw_bytes: dict[str, int]
    stored_bytes: dict[str, int]
    ratio: dict[str, float | None]
    quant: dict | None
    kind: Literal["keyframe", "delta", "mixed"]
    chain_depth: int
    object: str
    sensitivity: str
    search: dict
    blocking_seconds: float
    total_seconds: float


def figures(manifest: Manifest, processes: list[ProcessFigures]) -> Figures:
    """Per-save figures from the manifest and every process's figures: raw and stored bytes per part, ratios,
    keyframe or delta and chain depth, timings, the configuration used."""
    stored = {p: 0 for p in PARTS}
    for f in processes:
        for k, v in f["stored_bytes"].items():
            stored[k] += v
    raw = manifest.raw_bytes
    ratio: dict[str, float | None] = {k: (raw[k] / stored[k] if stored[k] else None) for k in raw}
    ratio["total"] = sum(raw.values()) / max(sum(stored.values()), 1)
    n_key, n_delta = sum(f["keyframe_shards"] for f in processes), sum(f["delta_shards"] for f in processes)
    kind = "delta" if n_delta and not n_key else "keyframe" if not n_delta else "mixed"
    return Figures(raw_bytes=raw, stored_bytes=stored, ratio=ratio, quant=manifest.quant, kind=kind,
                   chain_depth=max(f["max_depth"] for f in processes), object=manifest.object,
                   sensitivity=manifest.sensitivity, search=manifest.search,
                   blocking_seconds=max(f["blocking_seconds"] for f in processes),
                   total_seconds=max(f["total_seconds"] for f in processes))


def path_entries(path) -> list:
    """A key path as JSON (`Leaf.path`): [["d", key], ["a", name], ["s", index], ...]."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            key = k.key
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"leaf {jax.tree_util.keystr(tuple(path))}: dict key {key!r} of type "
                                f"{type(key).__name__} cannot be stored; use str or int keys")
            out.append(["d", key])
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(["a", k.name])
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(["s", k.idx])
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(["s", k.key])
        else:
            out.append(["a", str(k)])
    return out


def flatten(tree) -> tuple[list, Any]:
    """`jax.tree_util.tree_flatten_with_path(tree)` with None as a leaf. JAX orders a dict's keys, so a dict that
    mixes key types it cannot order (str and int) is a TypeError naming that dict's path, not JAX's bare sort
    error."""
    try:
        return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    except (TypeError, ValueError):
        def unordered(x):
            if not isinstance(x, dict):
                return False
            try:
                sorted(x)
            except TypeError:
                return True
            return False
        for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or unordered(x))[0]:
            if unordered(x):
                types = sorted({type(k).__name__ for k in x})
                raise TypeError(f"{jax.tree_util.keystr(tuple(p)) or 'the tree'}: a dict whose keys mix types "
                                f"{types}, which cannot be ordered; use keys of one type") from None
        raise


def empty_containers(tree) -> list:
    """[[path, "dict" | "list"]] of the containers without children in `tree` (`{}`, `[]`, `()`, an optax
    EmptyState, an empty NamedTuple or dataclass): a pytree flattens them away, so the manifest lists them for a
    restore without a target. A list or tuple is a "list"; a NamedTuple, whose fields restore as dict keys, and
    any other node are a "dict"."""
    def empty(x):
        if x is None:
            return False
        if isinstance(x, (dict, list, tuple)):
            return len(x) == 0
        return not jax.tree_util.tree_leaves(x, is_leaf=lambda y: y is not x)  # a leaf is its own one leaf

    def kind(x):
        return "list" if isinstance(x, (list, tuple)) and not hasattr(x, "_fields") else "dict"

    return [[path_entries(p), kind(x)]
            for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or empty(x))[0]
            if empty(x)]


def unflatten_plain(entries: list[list], values: list, empty: list = ()) -> Any:
    """Nested dicts (dict keys and attribute names) and lists (sequence indices) from leaf paths, with the
    empty containers `empty` (`empty_containers`) in their places."""
    entries = list(entries) + [p for p, _ in empty]
    values = list(values) + [[] if kind == "list" else {} for _, kind in empty]
    if not entries:
        return None
    if entries[0] == []:
        return values[0]
    root: dict = {}
    for path, v in zip(entries, values):
        node = root
        for kind, key in path[:-1]:
            node = node.setdefault((kind == "s", key), {})
        node[(path[-1][0] == "s", path[-1][1])] = v

    def build(node):
        if not isinstance(node, dict) or not node or not all(isinstance(k, tuple) for k in node):
            return node
        if all(is_seq for is_seq, _ in node):
            return [build(node[k]) for k in sorted(node, key=lambda k: k[1])]
        return {key: build(v) for (_, key), v in node.items()}

    return build(root)
