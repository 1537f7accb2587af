"""Restore: manifest -> checked decode (store.py) -> undo delta chains -> dequantize -> arrays placed in the target
shardings (DESIGN.md section 2, run backwards).

One function per leaf kind. A target leaf with a sharding gets its values built per addressable device from only
the stored shards that overlap that device's slice (`jax.make_array_from_single_device_arrays`), so a restore
into another layout than the one saved reads what it needs and nothing is gathered on one host.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import sys
import threading
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.serialization import limits

from inshrink_jax import quantize, records, store


def restore(reader: store.Reader, target: Any, threads: int, chained: dict | None = None,
            partial: bool = False, leaf_targets: dict | None = None, concurrent_bytes: int | None = None) -> Any:
    """The step item read by `reader`, restored into `target` (None: the saved tree as nested dicts and lists,
    arrays on the default device; else a tree of the saved structure whose leaves are arrays,
    `jax.ShapeDtypeStruct`s (with `sharding=` to restore into that layout), NumPy arrays or scalars).
    `chained`, if given, receives key path -> restored value of every leaf of a closed-loop chain. `partial`:
    the target may hold only some of the saved leaves (a subtree); only those are read. `leaf_targets`, without a
    target: key path -> the target of that saved leaf, for the leaves that are not to go where they were saved.
    `concurrent_bytes`: the most bytes of leaves held at once (Orbax's `restore_concurrent_gb`), or None."""
    if target is None:
        given, elsewhere = leaf_targets or {}, []
        flat, treedef, pairs = None, None, [(m, given[m.keystr] if m.keystr in given else saved_target(
            reader, m, elsewhere)) for m in reader.manifest.leaves]
        if elsewhere:
            warnings.warn(f"{store.describe(reader.directory)}: {len(elsewhere)} leaves ({', '.join(elsewhere[:3])}"
                          f"{', ...' if len(elsewhere) > 3 else ''}) were saved sharded over devices this process "
                          "does not all have: they are restored onto the default device. Pass a target whose "
                          "leaves carry the shardings to use (jax.ShapeDtypeStruct(shape, dtype, sharding=...)).",
                          stacklevel=3)
    else:
        nnx = sys.modules.get("flax.nnx")  # imported by whoever made an NNX object
        live = tuple(getattr(nnx, n) for n in ("Pytree", "Object", "Module") if hasattr(nnx, n))
        if live and isinstance(target, live):
            raise ValueError(f"{store.describe(reader.directory)}: the restore target is a live Flax NNX object "
                             f"({type(target).__name__}); pass nnx.state(model) (what was saved: a module's, or "
                             "an nnx.Optimizer's), then nnx.update(model, restored)")
        flat, treedef = records.flatten(target)
        try:
            pairs = match_target(reader, flat, partial)
        except ValueError as e:
            if nnx is not None and isinstance(target, getattr(nnx, "State", ())):
                raise ValueError(f"{str(e).rstrip('.')}. For Flax NNX: the target is nnx.state(...) of a model (and "
                                 "optimizer) built as the saved one was (the same modules, sizes and variable types); "
                                 "a model of another graph restores with InshrinkRestore() as nested dicts, to map "
                                 "over yourself") from None
            raise
    # A target of None (a partial restore's subtree) or ... (Orbax's PLACEHOLDER) is not read: it stays as it is.
    reader.shared_values, reader.decode_threads = {}, threads
    try:  # leaf by leaf (`LEAVES_AT_ONCE` large chains at a time): a restore's peak memory is that of its largest
        # leaves, not of all of them
        if concurrent_bytes is None:
            decode_codes(reader, pairs, threads)
            values = _restore_leaves(reader, pairs, threads)
        else:
            values = asyncio_utils.run_sync(_restore_limited(reader, pairs, concurrent_bytes))
    finally:
        reader.shared_values = None
    if chained is not None:  # as saved: the chain goes on from the exact reconstruction, before any cast
        chained.update((m.keystr, v) for (m, _), v in zip(pairs, values)
                       if m is not None and m.coding == records.CLOSED_LOOP)
    values = [v if m is None else _cast(m, t, v) for (m, t), v in zip(pairs, values)]
    if target is not None:
        return jax.tree_util.tree_unflatten(treedef, values)
    with store.reading(reader.directory, "the tree of key paths"):
        return records.unflatten_plain([m.path for m in reader.manifest.leaves], values, reader.manifest.empty)


# Closed-loop leaves of at least `_THREADED_SIZE` elements are restored this many at once (each its own chain's
# decompression, protected positions and kernels), when the restore has threads to spare: a leaf's host work is
# mostly one thread's, so one after the other they left a core idle (a keyframe of four 25M-value tensors). Peak
# memory is then that of this many leaves, not of one.
LEAVES_AT_ONCE = 2


def _restore_leaves(reader: store.Reader, pairs: list, threads: int) -> list:
    """`restore_leaf` of every pair (a target of None stays None): the large closed-loop leaves `LEAVES_AT_ONCE`
    at a time in threads, after the others, which go one after the other (their time is Python's, which threads
    only contend for)."""
    def large(m) -> bool:
        return m is not None and m.kind == "quantized" and m.coding == records.CLOSED_LOOP and \
            math.prod(m.shape) >= _THREADED_SIZE
    together = [k for k, (m, _) in enumerate(pairs) if large(m)]
    if threads < 2 or len(together) < 2:
        together = []
    values: list = [None] * len(pairs)
    later = set(together)
    for k, (m, t) in enumerate(pairs):
        if k not in later:
            values[k] = t if m is None else restore_leaf(reader, m, t)
    if not together:
        return values
    for k in together:
        reader.links(pairs[k][0].keystr)  # every object of the chains opened here, not by two threads at once
    with concurrent.futures.ThreadPoolExecutor(min(threads, LEAVES_AT_ONCE)) as pool:
        try:
            for k, v in zip(together, pool.map(lambda k: restore_leaf(reader, *pairs[k]), together)):
                values[k] = v
        finally:
            pool.shutdown(cancel_futures=True)
    return values


async def _restore_limited(reader: store.Reader, pairs: list, concurrent_bytes: int) -> list:
    """`restore_leaf` of each pair in turn, each leaf holding its bytes from Orbax's byte limiter (as Orbax's own
    handlers take them), its codes decoded with it and dropped after it."""
    limiter = limits.get_byte_limiter(concurrent_bytes)
    ceiling = getattr(limiter, "max_bytes", None)
    values = []
    for m, t in pairs:
        if m is None:
            values.append(t)
            continue
        async with limits.reserved_bytes(limiter, m.nbytes if ceiling is None else min(m.nbytes, ceiling - 1)):
            values.append(restore_leaf(reader, m, t))
            for key in [k for k in reader.codes_cache if k[0] == m.keystr]:
                del reader.codes_cache[key]
    return values


def abstract_tree(reader: store.Reader) -> Any:
    """The saved tree as a restore target, as Orbax's metadata tree serves: nested dicts and lists whose array
    leaves are `jax.ShapeDtypeStruct`s (shape, dtype, the saved NamedSharding where `saved_target` can rebuild
    it; a NumPy leaf without a sharding, so it restores as NumPy; a PRNG key with its key dtype) and whose
    scalars are their values. `InshrinkRestore(tree)` restores what `InshrinkRestore()` does."""
    values = []
    for m in reader.manifest.leaves:
        if m.kind == "scalar":
            values.append(m.value)
            continue
        with store.reading(reader.directory, f"leaf {m.keystr}"):
            if m.kind == "prng_key":
                dtype = jax.eval_shape(lambda m=m: jax.random.key(0, impl=m.impl)).dtype
                values.append(jax.ShapeDtypeStruct(tuple(m.shape), dtype))
                continue
            t = saved_target(reader, m)
            values.append(t if t is not None else jax.ShapeDtypeStruct(tuple(m.shape), jnp.dtype(m.dtype)))
    with store.reading(reader.directory, "the tree of key paths"):
        return records.unflatten_plain([m.path for m in reader.manifest.leaves], values, reader.manifest.empty)


def saved_target(reader: store.Reader, meta: records.Leaf, elsewhere: list | None = None):
    """The target a restore without one uses for a leaf: its saved NamedSharding (`records.Leaf.mesh`) when every
    device of that mesh is present, as a `jax.ShapeDtypeStruct`; else None (the default device), and a leaf
    that was saved sharded is added to `elsewhere` (the caller warns once)."""
    layout = meta.mesh
    if layout is None or meta.kind not in ("array", "quantized", "dropped"):
        return None
    mesh = _saved_mesh(tuple(layout["devices"]), tuple(map(tuple, layout["axes"])))
    if mesh is None:
        if elsewhere is not None:
            elsewhere.append(meta.keystr)
        return None
    spec = jax.sharding.PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in layout["spec"]])
    return jax.ShapeDtypeStruct(tuple(meta.shape), jnp.dtype(meta.dtype), sharding=jax.sharding.NamedSharding(mesh,
                                                                                                            spec))


@functools.lru_cache(maxsize=64)
def _saved_mesh(device_ids: tuple, axes: tuple) -> jax.sharding.Mesh | None:
    """The Mesh of a `records.Leaf.mesh` (built once for all the leaves that share it), or None when this
    process does not have all its devices."""
    by_id = {d.id: d for d in jax.devices()}
    if not all(i in by_id for i in device_ids):
        return None
    devices = np.empty(len(device_ids), dtype=object)
    devices[:] = [by_id[i] for i in device_ids]
    return jax.sharding.Mesh(devices.reshape([n for _, n, _ in axes]), [a for a, _, _ in axes],
                             axis_types=tuple(getattr(jax.sharding.AxisType, t) for _, _, t in axes))


def match_target(reader: store.Reader, flat: list, partial: bool = False) -> list[tuple[records.Leaf, Any]]:
    """(saved leaf, target leaf) pairs of a flattened target (`partial`: it may leave saved leaves out); a target
    that does not fit the saved tree is a ValueError naming the leaves and saying what to pass."""
    want = [jax.tree_util.keystr(p) for p, _ in flat]
    skipped = {k for k, (_, t) in zip(want, flat) if partial and t is None and k not in reader.leaves}
    skipped |= {k for k, (_, t) in zip(want, flat) if t is Ellipsis and k in reader.leaves}  # Orbax's PLACEHOLDER
    missing = [k for k in want if k not in reader.leaves and k not in skipped]
    extra = [] if partial else sorted(set(reader.leaves) - set(want))
    if missing or extra:
        hint = ("Pass a target with the saved structure; InshrinkRestore(target, partial_restore=True) to restore "
                "only the leaves it names; or InshrinkRestore() to get the saved tree as nested dicts.")
        raise ValueError(f"{store.describe(reader.directory)}: the restore target does not match the saved tree. "
                         f"In the target but not saved: {missing[:20]}; saved but not in the target: "
                         f"{extra[:20]}. {hint}")
    problems = [f"{k}: {p}" for k, (_, t) in zip(want, flat)
                if k not in skipped and (p := _mismatch(reader.leaves[k], t))]
    if problems:
        raise ValueError(f"{store.describe(reader.directory)}: the restore target does not match the saved "
                         f"leaves: " + "; ".join(problems[:20]))
    return [(None if k in skipped else reader.leaves.get(k), t) for k, (_, t) in zip(want, flat)]


def overlap(a: list[list[int]], b: list[list[int]]):
    """(lower, upper) corners of the intersection of two boxes, or None if they do not intersect."""
    lo = [max(x[0], y[0]) for x, y in zip(a, b)]
    hi = [min(x[1], y[1]) for x, y in zip(a, b)]
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, hi)


_X64_DTYPES = ("int64", "uint64", "float64", "complex128")  # narrowed by jax without jax_enable_x64


def _mismatch(m: records.Leaf, t) -> str | None:
    """What does not fit between a saved leaf and its restore target, or None."""
    if m.kind == "scalar":  # restored as saved; a 0-d target stands for it (a step counter)
        return f"saved a Python {m.type}, the target is an array of shape {tuple(t.shape)}" \
            if tuple(getattr(t, "shape", ())) != () else None
    if t is None:
        return None
    shape = tuple(getattr(t, "shape", ()))
    if m.kind == "prng_key":
        if jnp.issubdtype(t.dtype, jax.dtypes.prng_key) if hasattr(t, "dtype") else False:
            try:
                saved = jax.eval_shape(lambda: jax.random.key(0, impl=m.impl)).dtype
            except (ValueError, TypeError, KeyError):
                return f"saved a key of unknown implementation {m.impl!r}"
            if t.dtype != saved or shape != tuple(m.shape):
                return f"saved a {m.impl} key array of shape {tuple(m.shape)}, target {t.dtype} {shape}"
            return None
        if shape != tuple(m.data_shape) or jnp.dtype(getattr(t, "dtype", "float32")) != jnp.uint32:
            return f"saved a {m.impl} key array of shape {tuple(m.shape)}, target {shape}"
        return None  # a target for the key data (what ocp.utils.to_shape_dtype_struct makes of a key): a key
    if shape != tuple(m.shape):
        return f"saved shape {tuple(m.shape)}, target {shape}"
    dtype = cast_dtype(m, t) or jnp.dtype(m.dtype)
    if hasattr(t, "dtype") and t.dtype != dtype:  # a key, a string: nothing to cast between
        return f"saved dtype {m.dtype}, target {t.dtype}, which it cannot be cast to"
    if dtype.name in _X64_DTYPES and not jax.config.jax_enable_x64 and not _is_numpy(m, t):
        return (f"saved as {m.dtype}, which a jax array holds only with jax_enable_x64; enable it, or restore "
                "into a NumPy target (np.zeros(shape, dtype)) to get the values exactly")
    try:
        target_sharding(t).addressable_devices_indices_map(tuple(m.shape))
    except ValueError as e:
        return f"the target sharding does not fit shape {tuple(m.shape)} ({e})"
    return None


def cast_dtype(m: records.Leaf, target) -> np.dtype | None:
    """The dtype a leaf is cast to on restore, as Orbax casts: the target's, when it differs from the saved one
    and both are numbers or bools (float32 saved, a bfloat16 target); else None."""
    if target is None or not hasattr(target, "dtype") or m.kind not in ("array", "quantized", "dropped"):
        return None
    try:
        want, saved = jnp.dtype(target.dtype), jnp.dtype(m.dtype)
    except TypeError:  # a PRNG key's dtype
        return None
    numeric = all(jnp.issubdtype(d, jnp.number) or d == jnp.bool_ for d in (want, saved))
    return want if want != saved and numeric else None


def _cast(meta: records.Leaf, target, value):
    """`value` in the dtype the target asks for (`cast_dtype`)."""
    dtype = cast_dtype(meta, target)
    return value if dtype is None or value.dtype == dtype else value.astype(dtype)


def target_sharding(target) -> jax.sharding.Sharding:
    """Where a restored leaf goes: the target's sharding, else (None, NumPy, no sharding) the default device."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or isinstance(target, (np.ndarray, np.generic)):
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return sharding


def decode_codes(reader: store.Reader, pairs: list, threads: int) -> None:
    """Decode the codes of every stored shard this process's part of the restore overlaps: delta chains make this
    the bulk of a restore. Shards of at least `_THREADED_SIZE` elements are decoded in parallel threads (NumPy and
    zstandard release the GIL), after the smaller ones, which are decoded one after the other: their time is Python's
    (reading records, small calls), which threads only contend for (a small model's restore is faster so:
    benchmarks/results/save_breakdown.md)."""
    needed = []
    for meta, target in pairs:
        if meta is None or meta.kind != "quantized" or meta.coding == records.CLOSED_LOOP:
            continue
        shape = tuple(meta.shape)
        boxes = [store.box_of(i, shape) for i in target_sharding(target).addressable_devices_indices_map(shape).values()]
        for _, e in reader.shards.get(meta.keystr, []):
            if any(overlap(b, e.box) is not None for b in boxes):
                needed.append((meta.keystr, e.box))
    large = []
    for k in needed:
        if math.prod(store.box_shape(k[1])) < _THREADED_SIZE:
            reader.codes(*k)
        else:
            large.append(k)
    if len(large) > 1 and threads > 1:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda k: reader.codes(*k), large))
    else:
        for k in large:
            reader.codes(*k)


def _fill(box, dtype, pieces, what: str, writable: bool = False) -> np.ndarray:
    """The values of `box` from each (stored box, host array thunk) piece's overlap with it; all of `box` must
    be covered. A piece that is exactly `box` is returned as it is (read-only) unless `writable`."""
    if not writable:
        for sbox, data in pieces:
            if store.box_key(sbox) == store.box_key(box):
                return data()
    out = np.empty(store.box_shape(box), dtype)
    covered = 0
    for sbox, data in pieces:
        ov = overlap(box, sbox)
        if ov is None:
            continue
        lo, hi = ov
        dst = tuple(slice(l - b[0], h - b[0]) for l, h, b in zip(lo, hi, box))
        src = tuple(slice(l - s[0], h - s[0]) for l, h, s in zip(lo, hi, sbox))
        out[dst] = data()[src]
        covered += int(np.prod([h - l for l, h in zip(lo, hi)]))
    if covered != out.size:
        raise store.CheckpointCorruptError(f"{what}: stored shards cover {covered} of {out.size} elements")
    return out


def _make_array(shape, sharding, build: Callable, what: str) -> jax.Array:
    """Assemble a global array from the pieces `build(box, device)` makes on each addressable device."""
    arrays = [build(store.box_of(index, shape), d) for d, index in sharding.addressable_devices_indices_map(shape).items()]
    try:
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    except ValueError as e:
        raise ValueError(f"{what}: cannot place the restored values into the target sharding ({e})") from None


def _is_numpy(meta: records.Leaf, target) -> bool:
    """Whether a leaf restores as NumPy: a NumPy target, or a leaf saved from NumPy restored without a target or
    into a target without a sharding (what `ocp.utils.to_shape_dtype_struct` makes of a NumPy array)."""
    if isinstance(target, (np.ndarray, np.generic)):
        return True
    return meta.sharding == "numpy" and getattr(target, "sharding", None) is None


def restore_leaf(reader: store.Reader, meta: records.Leaf, target):
    """One leaf's restored value, by its kind."""
    what = f"{store.describe(reader.directory)}: leaf {meta.keystr}"
    if meta.kind == "scalar":
        return meta.value
    sharding = getattr(target, "sharding", None)
    shared = (meta.keystr, sharding) if reader.shared_values is not None and meta.keystr in reader.scale_leaves \
        and sharding is not None and not _is_numpy(meta, target) else None  # for its first moment, or itself
    if shared is not None and shared in reader.shared_values:
        return reader.shared_values[shared]
    with store.reading(reader.directory, f"leaf {meta.keystr}"):
        value = _RESTORERS[meta.kind](reader, meta, target, what)
    if shared is not None:
        reader.shared_values[shared] = value
    return value


def _dropped(reader, meta: records.Leaf, target, what: str):
    """Not stored (CompressionConfig.optimizer = "drop"): re-initialised as zeros."""
    dtype, shape = jnp.dtype(meta.dtype), tuple(meta.shape)
    if _is_numpy(meta, target):
        return np.zeros(shape, dtype)
    return _make_array(shape, target_sharding(target), lambda box, dev: jax.device_put(
        np.zeros(store.box_shape(box), dtype), dev), what)


def _host_box(reader: store.Reader, meta: records.Leaf, box, what: str, writable: bool = False) -> np.ndarray:
    """The lossless values of `box` of a leaf, from the stored shards that overlap it (read-only unless
    `writable`)."""
    dtype = np.dtype(jnp.dtype(meta.dtype))
    pieces = [(e.box, (lambda p=p, e=e: reader.array(meta.keystr, p, e.segments["data"], "data", dtype,
                                                     store.box_shape(e.box))))
              for p, e in reader.shards.get(meta.keystr, [])]
    return _fill(box, dtype, pieces, what, writable)


def _array(reader, meta: records.Leaf, target, what: str):
    """A lossless leaf, bit-exact (cast on the host to the target's dtype, if it asks for another)."""
    shape, dtype = tuple(meta.shape), cast_dtype(meta, target)

    def host(box, writable=False):
        values = _host_box(reader, meta, box, what, writable and dtype is None)
        return values if dtype is None else values.astype(dtype)

    if _is_numpy(meta, target):
        values = host([[0, n] for n in shape], writable=True)
        return values[()] if meta.type == records.NUMPY_SCALAR else values
    return _make_array(shape, target_sharding(target), lambda box, dev: jax.device_put(host(box), dev), what)


def _prng_key(reader, meta: records.Leaf, target, what: str):
    """A PRNG key, stored as its key data (shape + (key words,)), placed in the target's sharding."""
    data = _host_box(reader, meta, [[0, n] for n in meta.data_shape], what)
    key = jax.random.wrap_key_data(jnp.asarray(data), impl=meta.impl)
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        return key
    try:
        return jax.device_put(key, sharding)
    except ValueError as e:
        raise ValueError(f"{what}: cannot place the restored key into the target sharding ({e})") from None


def _encoded(box, shards: list, codes_of: Callable, protected_of: Callable, centres: np.ndarray, dtype: str,
             what: str) -> tuple[quantize.EncodedTensor, np.ndarray]:
    """The encoded tensor of `box` (codes, protected values in its row-major order) from stored `shards`
    [(process, Shard)] of one object, and the flat positions of its protected weights: `codes_of(p, e)` gives a
    shard's codes, `protected_of(p, e)` the flat positions in that shard of its protected weights and their
    values."""
    codes = _fill(box, np.uint8,
                  [(e.box, (lambda p=p, e=e: codes_of(p, e))) for p, e in shards], what)
    pos_parts, val_parts = [], []
    for p, e in shards:
        ov = overlap(box, e.box)
        if ov is None:
            continue
        local, vals = protected_of(p, e)
        if store.box_key(e.box) == store.box_key(box):  # the shard is the box: its positions are the box's
            pos_parts.append(local)
            val_parts.append(vals)
            continue
        glob = [ix + b[0] for ix, b in zip(np.unravel_index(local, store.box_shape(e.box)), e.box)]
        inside = np.ones(local.size, bool)
        for g, (lo, hi) in zip(glob, zip(*ov)):
            inside &= (g >= lo) & (g < hi)
        pos_parts.append(np.ravel_multi_index(tuple(g[inside] - b[0] for g, b in zip(glob, box)), codes.shape))
        val_parts.append(vals[inside])
    positions = np.concatenate(pos_parts) if pos_parts else np.zeros(0, np.int64)
    order = np.argsort(positions, kind="stable")
    values = np.concatenate(val_parts)[order] if val_parts else np.zeros(0, np.float32)
    return quantize.EncodedTensor(codes, centres, values, dtype), positions[order]


def _protected_reader(codes_of: Callable, array_of: Callable, bins: int, what: str,
                      top_of: Callable | None = None) -> Callable:
    """`protected_of` for `_encoded`: a shard's protected positions and values, read once per shard. `top_of(p,
    e)`: the shard's largest code where `codes_of` has it already (`_link_codes`), else it is computed here."""

    def protected_of(p, e):
        seg = e.segments["protected"]
        codes = codes_of(p, e)
        if seg.count == 0:  # none stored (a residual's usual case): no code may be the protected one
            top = top_of(p, e) if top_of is not None else int(codes.max()) if codes.size else 0
            if top >= quantize.protected_code(bins):
                raise store.CheckpointCorruptError(f"{what}: a protected code but no protected values")
            local = np.zeros(0, np.int32)
        else:
            local = quantize.protected_positions(codes, bins)
        vals = array_of(p, seg, "protected", jnp.dtype(seg.dtype), [seg.count or 0])
        if local.size != vals.size:
            raise store.CheckpointCorruptError(f"{what}: {local.size} protected codes but {vals.size} values")
        return local, vals
    return _once(protected_of)


def _quantized(reader, meta: records.Leaf, target, what: str):
    """A quantized leaf: codes along its delta chain, protected values, centres (plus the base's values for a
    residual), decoded per device."""
    if meta.coding == records.CLOSED_LOOP:
        return _closed_loop(reader, meta, target, what)
    shape, shards = tuple(meta.shape), reader.shards.get(meta.keystr, [])
    centres = meta.table()

    def codes_of(p, e):
        return reader.codes(meta.keystr, e.box)[0]

    protected_of = _protected_reader(codes_of, lambda *a: reader.array(meta.keystr, *a), meta.bins, what)

    def encoded(box):
        return _encoded(box, shards, codes_of, protected_of, centres, meta.dtype, what)

    sharding = target_sharding(target)
    offsets = _base_offsets(reader, meta, sharding, what) if meta.base_leaf is not None else None
    scales = _scales(reader, meta, sharding, what) if meta.scale_leaf is not None else None

    def decode(box, dev):
        enc, positions = encoded(box)
        return quantize.decode(enc, dev, None if offsets is None else offsets[dev],
                               None if scales is None else scales[dev], positions)

    if _is_numpy(meta, target):
        return np.asarray(decode([[0, n] for n in shape], None))
    return _make_array(shape, sharding, decode, what)


# A closed-loop leaf of at least this many elements decompresses its links' streams in parallel threads; a smaller
# one costs less than starting them.
_THREADED_SIZE = 1 << 18


def _closed_loop(reader: store.Reader, meta: records.Leaf, target, what: str):
    """A parameter of a closed-loop chain: its first link (a keyframe's codes, or exact values) and each later
    link's residual, decoded in one pass per device (`quantize.decode_chain`: the formula the save computed its
    reconstruction with, so the result is bit-identical to it). A large leaf's links are decompressed in parallel
    threads (zstandard and NumPy release the GIL), in chain order, while the device adds those that have arrived."""
    shape, dtype = tuple(meta.shape), np.dtype(jnp.dtype(meta.dtype))
    links = []
    for obj, shards in reader.links(meta.keystr):
        if "data" in shards[0][1].segments:
            links.append((shards, None, _once(lambda p, e, obj=obj: obj.array(
                meta.keystr, p, e.segments["data"], "data", dtype, store.box_shape(e.box))), obj))
            continue
        tables = [e.segments["codes"].table() for _, e in shards]
        if any(t is None for t in tables) or not 1 <= tables[0].size <= records.MAX_LEVELS or any(
                not np.array_equal(t.view(np.uint32), tables[0].view(np.uint32)) for t in tables[1:]):
            raise store.CheckpointCorruptError(f"{what}: object {obj.id} holds no single list of levels for it")
        centres = tables[0]
        codes_of, top_of = _link_codes(obj, meta.keystr, centres.size, what)
        protected_of = _protected_reader(codes_of, lambda *a, obj=obj: obj.array(meta.keystr, *a), centres.size, what,
                                         top_of)
        links.append((shards, centres, (codes_of, protected_of), obj))
    numpy = _is_numpy(meta, target)
    sharding = None if numpy else target_sharding(target)
    boxes = [[[0, n] for n in shape]] if numpy else [
        store.box_of(i, shape) for i in sharding.addressable_devices_indices_map(shape).values()]
    threaded = len(links) > 1 and int(np.prod(shape, dtype=np.int64)) >= _THREADED_SIZE and reader.decode_threads > 1

    def build(box, dev, pool):
        parts, weightings = [], []
        for k, (shards, centres, read, obj) in enumerate(links):
            if centres is None:  # exact values: the first link only
                def job(shards=shards, read=read):
                    return _fill(box, dtype, [(e.box, functools.partial(read, p, e)) for p, e in shards], what), None
            else:
                job = functools.partial(_encoded, box, shards, *read, centres, meta.dtype, what)
                whole = [(p, e) for p, e in shards if store.box_key(e.box) == store.box_key(box)]
                if k and whole and quantize.takes_packed(math.prod(store.box_shape(box))) and \
                        whole[0][1].segments["protected"].count == 0:
                    job = functools.partial(_packed_link, obj, meta.keystr, *whole[0], centres, meta.dtype, job)
            parts.append(job() if pool is None else pool.submit(job))
            w = _link_weighting(box, shards, what)
            if k == 0 and w is not None:
                raise store.CheckpointCorruptError(f"{what}: the first link of its chain carries residual weighting")
            weightings.append(w)
        return quantize.decode_chain(parts, dev, weightings[1:])

    def build_all(box, dev):
        if not threaded:
            return build(box, dev, None)
        # The links are decompressed in the pool, in chain order, while the device adds those that have arrived.
        with concurrent.futures.ThreadPoolExecutor(reader.decode_threads) as pool:
            try:
                return build(box, dev, pool)
            finally:
                pool.shutdown(cancel_futures=True)

    if numpy:
        return np.asarray(build_all(boxes[0], None))
    return _make_array(shape, sharding, build_all, what)


def _packed_link(obj, leaf: str, p: int, e: records.Shard, centres: np.ndarray, dtype: str, unpacked: Callable):
    """A residual link of one stored shard without protected values, its codes left packed
    (`quantize.PackedCodes`: `decode_chain` looks the values up from the packed bytes); `unpacked()` (`_encoded`,
    which checks every code) where its stream does not pack or may hold a code past its levels."""
    shape = store.box_shape(e.box)
    got = obj.packed(leaf, p, e.segments["codes"], "codes", shape, quantize.chain_size(math.prod(shape)))
    if got is None or int(got[1].max()) > centres.size:
        return unpacked()
    seg = e.segments["protected"]
    none = obj.array(leaf, p, seg, "protected", jnp.dtype(seg.dtype), [0])
    codes = quantize.PackedCodes(got[0], got[1], tuple(shape))
    return quantize.EncodedTensor(codes, centres, none, dtype), np.zeros(0, np.int64)


def _link_weighting(box, shards: list, what: str) -> list[np.ndarray] | None:
    """A closed-loop link's weighting factors (weighting.py) over `box`, one int32 vector per axis, from its stored
    shards' parts of them; None when the link is not weighted. A shard's part must span its box on every axis, and
    every shard must agree (they are parts of one vector per axis) and cover the box."""
    parts = [e.segments["codes"].weighting if "codes" in e.segments else None for _, e in shards]
    if all(w is None for w in parts):
        return None
    if any(w is None for w in parts):
        raise store.CheckpointCorruptError(f"{what}: some shards of a link carry residual weighting, others not")
    out = [np.zeros(hi - lo, np.int32) for lo, hi in box]
    seen = [np.zeros(hi - lo, bool) for lo, hi in box]
    for (_, e), w in zip(shards, parts):
        if len(w) != len(box) or any(len(f) != hi - lo for f, (lo, hi) in zip(w, e.box)):
            raise store.CheckpointCorruptError(
                f"{what}: a shard's weighting has lengths {[len(f) for f in w]}, its box {e.box}")
        for d, (f, (lo, hi), (blo, bhi)) in enumerate(zip(w, e.box, box)):
            a, b = max(lo, blo), min(hi, bhi)
            if a >= b:
                continue
            vals = np.asarray(f[a - lo:b - lo], np.int32)
            if np.any(seen[d][a - blo:b - blo] & (out[d][a - blo:b - blo] != vals)):
                raise store.CheckpointCorruptError(f"{what}: its shards disagree on the weighting of axis {d}")
            out[d][a - blo:b - blo] = vals
            seen[d][a - blo:b - blo] = True
    if not all(s.all() for s in seen):
        raise store.CheckpointCorruptError(f"{what}: its shards' weighting does not cover the box {box}")
    return out


def _once(read: Callable) -> Callable:
    """`read(p, e)` of a stored shard, computed once per shard, also when threads ask for it at once (one reads,
    the others wait for it; a read that fails is not kept, so each caller gets its error)."""
    cache: dict[int, Any] = {}
    lock = threading.Lock()

    def once(p, e):
        if id(e) in cache:
            return cache[id(e)]
        with lock:  # per reader of one link's streams: threads read different links
            if id(e) not in cache:
                cache[id(e)] = read(p, e)
            return cache[id(e)]
    return once


def _link_codes(obj, leaf: str, bins: int, what: str) -> tuple[Callable, Callable]:
    """(`codes_of`, `top_of`) for one closed-loop link: a shard's codes, read once and checked to be codes of
    `bins` levels, and their largest code (0 for none), found by that check (one pass over the codes, not two)."""

    def read(p, e):
        codes = obj.array(leaf, p, e.segments["codes"], "codes", np.uint8, store.box_shape(e.box))
        top = int(codes.max()) if codes.size else 0
        if top > quantize.protected_code(bins):
            raise store.CheckpointCorruptError(f"{what}: object {obj.id} holds code {top}, above "
                                               f"the {quantize.protected_code(bins)} of its {bins} levels")
        return codes, top

    once = _once(read)
    return (lambda p, e: once(p, e)[0]), (lambda p, e: once(p, e)[1])


def _scales(reader: store.Reader, meta: records.Leaf, sharding, what: str) -> dict:
    """The second moment a first moment is coded relative to, restored with `sharding`: device -> its shard
    (None -> the shard on the default device, for a NumPy target)."""
    other = reader.leaves.get(meta.scale_leaf)
    if other is None or other.shape != meta.shape or other.kind not in ("quantized", "array") or \
            other.scale_leaf is not None:
        raise store.CheckpointCorruptError(
            f"{what}: coded relative to the leaf {meta.scale_leaf}, which this step does not hold as a stored "
            f"second moment of shape {tuple(meta.shape)}")
    return _shards_of(restore_leaf(reader, other, jax.ShapeDtypeStruct(tuple(meta.shape), other.dtype,
                                                                       sharding=sharding)))


def _shards_of(values: jax.Array) -> dict:
    """device -> the array's shard there; None -> the shard on the default device."""
    out = {s.device: s.data for s in values.addressable_shards}
    out[None] = out.get(jax.devices()[0])
    return out


def _base_offsets(reader: store.Reader, meta: records.Leaf, sharding, what: str) -> dict:
    """The base checkpoint's values of a residual leaf, restored with `sharding`: device -> its shard (None ->
    the shard on the default device, for a NumPy target)."""
    base = reader.base()
    base_meta = base.leaves.get(meta.base_leaf)
    if base_meta is None or base_meta.shape != meta.shape:
        raise store.CheckpointCorruptError(
            f"{what}: stored against the base checkpoint's leaf {meta.base_leaf}, which the base "
            f"{base.directory} does not hold with shape {tuple(meta.shape)}")
    return _shards_of(restore_leaf(base, base_meta, jax.ShapeDtypeStruct(tuple(meta.shape), base_meta.dtype,
                                                                     sharding=sharding)))


_RESTORERS = {"dropped": _dropped, "array": _array, "prng_key": _prng_key, "quantized": _quantized}
