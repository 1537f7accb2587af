"""The Orbax adapter: `InshrinkCheckpointHandler` with its `InshrinkSave` / `InshrinkRestore` args.

Thin by design: `async_save` picks the configuration (search.py: candidates encoded and scored on the device,
eval_fn called on the caller's thread; or the fixed `CompressionConfig.quant`), dispatches the jitted encoder
(quantize.py; the search's chosen candidate is reused; optimizer moments by moments.py under their policy)
and returns without waiting; the commit future starts the device-to-host copies, takes the codes to the
host, turns them into deltas against the previous save's codes (delta.py), entropy-codes (codec.py) and
writes one object per save (store.py);
`finalize` commits it and collects unreferenced objects; `restore` reads, checks, walks delta chains and
decodes. See DESIGN.md sections 1-4, docs/how-it-works.md and docs/format.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import options as options_lib
from orbax.checkpoint._src import asyncio_utils

from inshrink_jax import codec, delta, moments, quantize, search, store
from inshrink_jax.base import BaseCheckpoint
from inshrink_jax.config import CompressionConfig, QuantConfig

_OPTIMIZER_NAMES = {"opt_state", "optimizer", "mu", "nu", "trace", "momentum"}
_QUANTIZABLE = {"float32", "bfloat16", "float16"}
# Positions of protected values are int32 (jax without x64): a quantized shard must index within it.
MAX_SHARD_ELEMENTS = 2**31 - 1


# ----------------------------------------------------------------------------------------------- tree paths
def _path_entries(path) -> list:
    """A key path as JSON: [["d", key], ["a", name], ["s", index], ...]."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            key = k.key
            if not isinstance(key, (str, int)):
                raise TypeError(f"dict key {key!r} of type {type(key).__name__} cannot be stored; use str or int")
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


def _unflatten_plain(entries: list[list], values: list) -> Any:
    """Nested dicts (dict keys and attribute names) and lists (sequence indices) from leaf paths."""
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


def _part(path) -> str:
    names = {getattr(k, "name", None) or getattr(k, "key", None) for k in path}
    return "optimizer" if names & _OPTIMIZER_NAMES else "params"


def _box(index: tuple, shape: tuple) -> list[list[int]]:
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def _is_prng_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _names(path) -> list:
    return [getattr(k, "name", None) if isinstance(k, jax.tree_util.GetAttrKey) else getattr(k, "key", None)
            for k in path]


def _moment_role(path) -> str | None:
    """"first" / "second" for a leaf inside an optimizer moment (optax mu, trace / nu, nu_max), else None."""
    names = set(_names(path))
    if names & set(moments.FIRST_MOMENT_NAMES):
        return "first"
    return "second" if names & set(moments.SECOND_MOMENT_NAMES) else None


def _policy(cfg: CompressionConfig, keystr: str, part: str, path) -> tuple[str, bool]:
    """(policy, whether a user rule chose it) of an array leaf: `policy_rules` first, then the default rule."""
    for pattern, policy in cfg.policy_rules:
        if re.search(pattern, keystr):
            return policy, True
    if part == "params":
        return "quantize", False
    return (cfg.optimizer if _moment_role(path) is not None else "lossless"), False


def _couple_counts(flat: list, leaves_meta: list[dict], explicit: set[int]) -> None:
    """An optax step counter `count` beside a dropped `nu` is dropped too (restored as 0): Adam's bias
    correction then restarts with its moments. Refuse the combinations that make Adam's next updates huge."""
    by_parent: dict = {}
    for i, (path, _) in enumerate(flat):
        names = _names(path)
        for j, name in enumerate(names):
            if name in ("mu", "nu", "count"):
                by_parent.setdefault(jax.tree_util.keystr(path[:j]), {}).setdefault(name, []).append(i)
    for parent, members in by_parent.items():
        counts = [i for i in members.get("count", []) if leaves_meta[i]["kind"] in ("array", "dropped")]
        if not counts or "nu" not in members:
            continue
        nu_dropped = any(leaves_meta[i]["kind"] == "dropped" for i in members["nu"])
        for i in counts:
            if i not in explicit and nu_dropped:
                leaves_meta[i]["kind"] = "dropped"
        count_dropped = any(leaves_meta[i]["kind"] == "dropped" for i in counts)
        kept_mu = [leaves_meta[i]["keystr"] for i in members.get("mu", []) if leaves_meta[i]["kind"] != "dropped"]
        if nu_dropped and not count_dropped:
            raise ValueError(f"optimizer state {parent or '<root>'}: nu is dropped but its step counter "
                             f"{leaves_meta[counts[0]]['keystr']} is kept, so after a restore Adam's bias "
                             "correction would divide by a second moment that restarts at 0: updates up to ~30x "
                             "too large. Drop the counter too, or keep nu (policy_rules).")
        if count_dropped and kept_mu:
            why = "nu is dropped, so its step counter is reset with it," if nu_dropped else \
                "the step counter is dropped (reset to 0)"
            raise ValueError(f"optimizer state {parent or '<root>'}: {why} but the first moment {kept_mu[0]} is "
                             "kept, so Adam's bias correction would multiply it by 1 / (1 - b1) on the next step. "
                             "Drop mu too, or keep nu and the counter (policy_rules).")


def _classify(flat: list, cfg: CompressionConfig) -> tuple[list[dict], list[int]]:
    """Manifest entry of every leaf (kind, shape, dtype, part, layer type, policy) and the indices of the leaves
    quantized by the weights' method (the others of kind "quantized" have method "moments")."""
    leaves_meta, quant_idx, explicit = [], [], set()
    for i, (path, x) in enumerate(flat):
        keystr = jax.tree_util.keystr(path)
        meta = {"path": _path_entries(path), "keystr": keystr}
        if x is None or isinstance(x, (bool, int, float, str)):
            if isinstance(x, int) and not isinstance(x, bool) and abs(x) >= 2**63:
                raise TypeError(f"leaf {keystr}: integer {x} does not fit in 64 bits")
            if any(re.search(p, keystr) and pol != "lossless" for p, pol in cfg.policy_rules):
                raise ValueError(f"leaf {keystr} is a Python {type(x).__name__}, stored as is in the manifest; "
                                 "policy_rules apply to array leaves only. Narrow the rule's pattern.")
            meta.update(kind="scalar", value=x, type=type(x).__name__)
        elif isinstance(x, (jax.Array, np.ndarray, np.generic)):
            dtype = jnp.dtype(x.dtype) if not _is_prng_key(x) else None
            floating = dtype is not None and jnp.issubdtype(dtype, jnp.floating)
            part = _part(path) if floating else "other"
            policy, chosen = _policy(cfg, keystr, part, path)
            if chosen:
                explicit.add(i)
            quantizable = (policy == "quantize" and isinstance(x, jax.Array) and dtype is not None
                           and dtype.name in _QUANTIZABLE and x.ndim >= 2 and x.size >= cfg.min_compress_size)
            meta.update(shape=list(x.shape), part=part if x.ndim >= 1 else "other",
                        sharding=str(getattr(x, "sharding", "numpy")))
            if _is_prng_key(x):
                if policy == "drop":
                    raise ValueError(f"leaf {keystr} is a PRNG key, which cannot be dropped (zeros are not a "
                                     "fresh key). Narrow the policy_rules pattern.")
                meta.update(kind="prng_key", impl=str(jax.random.key_impl(x)), dtype="uint32",
                            data_shape=list(jax.random.key_data(x).shape))
            elif policy == "drop":
                meta.update(kind="dropped", dtype=dtype.name)
            elif quantizable and int(np.prod(x.sharding.shard_shape(x.shape))) > MAX_SHARD_ELEMENTS:
                raise ValueError(f"leaf {keystr}: a shard of {int(np.prod(x.sharding.shard_shape(x.shape))):,} "
                                 f"elements is over the {MAX_SHARD_ELEMENTS:,} a quantized shard can address; shard "
                                 "the leaf over more devices, or store it losslessly with policy_rules=(("
                                 f"{re.escape(keystr)!r}, 'lossless'),)")
            elif quantizable and part == "params":
                meta.update(kind="quantized", method="weights", dtype=dtype.name,
                            layer_type=quantize.layer_type(keystr, x.shape, cfg.layer_type_rules))
                quant_idx.append(i)
            elif quantizable:
                meta.update(kind="quantized", method="moments", dtype=dtype.name)
            else:
                meta.update(kind="array", dtype=dtype.name)
        else:
            raise TypeError(f"leaf {keystr} has unsupported type {type(x).__name__}; inshrink_jax stores "
                            "jax/NumPy arrays, Python scalars, strings and None")
        leaves_meta.append(meta)
    _couple_counts(flat, leaves_meta, explicit)
    return leaves_meta, quant_idx


def _tails(path) -> list[str]:
    """Key-path strings of every non-empty tail of `path`, longest first. Trees that mirror part of the state
    match its leaves by these: grads mirror the parameters, optax moments mirror them under mu/nu/trace."""
    return [jax.tree_util.keystr(tuple(path[j:])) for j in range(len(path))]


def _owners(flat: list, weight_idx: list[int], moment_idx: list[int]) -> list[int | None]:
    """For each moment leaf, the position in `weight_idx` of its weight: the one weight of equal shape whose
    key path ends with the moment's path after its moment name; None if there is no such single weight."""
    by_tail: dict[str, list[int]] = {}
    for k, i in enumerate(weight_idx):
        for tail in _tails(flat[i][0]):
            by_tail.setdefault(tail, []).append(k)
    out = []
    for i in moment_idx:
        path, x = flat[i]
        names = _names(path)
        j = max(n for n, name in enumerate(names) if name in moments.MOMENT_NAMES)
        hits = [k for k in by_tail.get(jax.tree_util.keystr(tuple(path[j + 1:])), [])
                if tuple(flat[weight_idx[k]][1].shape) == tuple(x.shape)] if j + 1 < len(path) else []
        out.append(hits[0] if len(hits) == 1 else None)
    return out


# ------------------------------------------------------------------------------------------------------ args
@dataclasses.dataclass
class _Chain:
    """Codes this process holds of one committed (or committing) object: what the next save may delta against.

    codes maps (leaf key path, shard box) -> (uint8 codes, bins, chain depth)."""

    root: str
    object_id: str
    codes: dict


class InshrinkCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Saves a training-state pytree with large float leaves quantized (ALGORITHM.md), the rest bit-exact.

    One instance serves every step of a `CheckpointManager`. Use as the manager's `item_handlers`, or as one item
    of a composite checkpoint through a handler registry. The instance remembers the codes of its last save (or
    of the last restore) so the next save stores only their change (a delta); a new instance, e.g. after a
    restart, starts with a keyframe unless it restored first.

    Args:
      config: the compression configuration (defaults: the paper's).
      base: a committed step of another root (`<root>/<step>`, or its item directory) that this handler's saves
        store their weights against: fine-tunes of a compressed pretrained checkpoint (base.py). A weight
        matched to a base parameter (by key-path tail and shape) is stored as its change against the base's
        restored value, quantized by the same method. Restoring such a step needs the base, unchanged, where it
        was: otherwise a clear error.
      multiprocessing_options: Orbax's; `primary_host` writes the manifest and commits.
    """

    def __init__(self, config: CompressionConfig | None = None, *, base=None,
                 multiprocessing_options: options_lib.MultiprocessingOptions = options_lib.MultiprocessingOptions()):
        self.config = config or CompressionConfig()
        self.base = None if base is None else BaseCheckpoint(base)
        self._offsets: dict = {}  # (base leaf, sharding, committed) -> its restored values
        self._primary_host = multiprocessing_options.primary_host or 0
        self.last_figures: dict | None = None
        # The configuration of the last save (or restore): the search never picks a more aggressive one.
        self._previous_quant: QuantConfig | str | None = None
        self._prev: _Chain | None = None  # codes of a committed object
        self._pending: _Chain | None = None  # codes of the save in flight; promoted once its object is committed
        self._threads = max(1, min(4, os.cpu_count() or 1))

    # -------------------------------------------------------------------------------------------------- save
    def _delta_base(self, root: str, item: str) -> _Chain | None:
        """The chain the next save may delta against: the codes of the last save that was committed (a failed
        save leaves the one before it), or of the last restore; None after a restart or for another root (the
        next save is a keyframe)."""
        if self._pending is not None:
            if store.is_committed(root, item, self._pending.object_id):
                self._prev = self._pending
            self._pending = None
        prev = self._prev
        if prev is None or prev.root != root or not store.is_committed(root, item, prev.object_id):
            return None
        return prev

    async def async_save(self, directory, args: "InshrinkSave" = None, **kwargs):
        if args is None or not isinstance(args, InshrinkSave):
            raise ValueError("InshrinkCheckpointHandler.save needs `args=inshrink_jax.InshrinkSave(state, ...)`")
        t0 = time.perf_counter()
        cfg = self.config
        flat, treedef = jax.tree_util.tree_flatten_with_path(args.state, is_leaf=lambda x: x is None)
        leaves_meta, quant_idx = _classify(flat, cfg)
        grads = self._grads_by_path(args.grads)
        root, item, step = store.locate(directory)
        chain = self._delta_base(root, item)
        object_id = store.new_object_id(root, item, step)
        base_of: dict[int, str] = {}  # leaf -> its parameter in the base checkpoint
        if self.base is not None:
            self.base.check(directory)
            base_of = {i: b for i in quant_idx
                       if (b := self.base.match(leaves_meta[i]["path"], leaves_meta[i]["shape"])) is not None}

        # Device work, dispatched, not waited for: choose the configuration (the search evaluates candidates on
        # the device), encode all quantized leaves (the commit thread starts the copies to the host).
        xs = [flat[i][1] for i in quant_idx]
        gs = [next((grads[t] for t in _tails(flat[i][0]) if t in grads), None) for i in quant_idx]
        layer_types = [leaves_meta[i]["layer_type"] for i in quant_idx]
        # Weights with a match in the base checkpoint are encoded as their change against its restored values.
        offsets = [self._base_values(base_of[i], x) if i in base_of else None for i, x in zip(quant_idx, xs)]
        quant, devs, record = self._configure(flat, treedef, quant_idx, gs, layer_types, args.eval_fn, offsets)
        if quant is None:  # lossless: nothing quantized at this save
            for i in quant_idx:
                leaves_meta[i]["kind"] = "array"
                del leaves_meta[i]["layer_type"], leaves_meta[i]["method"]
            quant_idx, xs, devs = [], [], []
        else:
            for i in base_of:
                leaves_meta[i]["base_leaf"] = base_of[i]
            if devs is None:
                devs = quantize.encode_on_device(xs, gs, layer_types, quant, cfg, offsets=offsets)
        # Optimizer moments under the "quantize" policy: first moments take their weight's pruning (not that of
        # a residual: a pruned residual is a weight kept at its base value, not a zero).
        moment_idx = [i for i, m in enumerate(leaves_meta) if m.get("method") == "moments"]
        owners = _owners(flat, quant_idx, moment_idx)
        devs = list(devs) + moments.encode_on_device(
            [flat[i][1] for i in moment_idx],
            [devs[k].codes if k is not None and _moment_role(flat[i][0]) == "first" and devs[k].offset is None
             else None for i, k in zip(moment_idx, owners)], cfg)
        quant_idx, xs = quant_idx + moment_idx, xs + [flat[i][1] for i in moment_idx]
        shards: list[tuple[int, list, Any]] = []  # (leaf, box, what to store)
        for i, x, dev in zip(quant_idx, xs, devs):
            in_place = {s.device: s.data for s in dev.protected_in_place.addressable_shards}
            for s in dev.codes.addressable_shards:
                if s.replica_id == 0:
                    shards.append((i, _box(s.index, x.shape), (s.data, dev.centres, in_place[s.device], dev.bins)))
        # Lossless leaves: copied now (the caller may overwrite or donate them once we return).
        for i, (path, x) in enumerate(flat):
            kind = leaves_meta[i].get("kind")
            if kind not in ("array", "prng_key"):
                continue
            data = jax.random.key_data(x) if kind == "prng_key" else x
            if isinstance(data, jax.Array):
                for s in data.addressable_shards:
                    if s.replica_id == 0:
                        shards.append((i, _box(s.index, data.shape), np.array(s.data, copy=True)))
            elif jax.process_index() == self._primary_host:
                shards.append((i, _box(tuple(slice(None) for _ in np.shape(data)), np.shape(data)),
                               np.array(data, copy=True)))
        blocking = time.perf_counter() - t0

        raw = {"params": 0, "optimizer": 0, "other": 0}
        for m in leaves_meta:
            if "shape" in m:
                raw[m["part"]] += int(np.prod(m.get("data_shape", m["shape"]))) * jnp.dtype(m["dtype"]).itemsize
        manifest = {"format": store.FORMAT, "version": store.FORMAT_VERSION, "process_count": jax.process_count(),
                    "object": object_id, "config": _config_json(cfg),
                    "quant": None if quant is None else dataclasses.asdict(quant),
                    "leaves": leaves_meta, "raw_bytes": raw, "search": record,
                    "base": self.base.describe() if any("base_leaf" in m for m in leaves_meta) else None,
                    "sensitivity": (f"gradient EMA on {sum(g is not None for g in gs)} of {len(gs)} quantized leaves"
                                    if grads else "magnitude (no grads given)")}
        process = jax.process_index()
        primary = process == self._primary_host
        object_path = os.path.join(store.objects_dir(root, item), object_id)

        def encode_shard(i, box, payload):
            """(segments, chain entry or None) of one shard: host copy, delta, entropy coding."""
            meta = leaves_meta[i]
            if not isinstance(payload, tuple):
                return {"data": (*codec.compress_best(payload, codec.LOSSLESS_CODECS), {})}, None
            enc = quantize.to_host(*payload, meta["dtype"])
            prev = chain.codes.get((meta["keystr"], store.box_key(box))) if chain is not None else None
            if prev is not None and prev[0].shape == enc.codes.shape and prev[2] + 1 < cfg.keyframe_every:
                b = delta.modulus(prev[1], enc.bins)
                stream, extra, depth = delta.encode(prev[0], enc.codes, b), {"base": chain.object_id,
                                                                             "modulus": b}, prev[2] + 1
            else:
                stream, extra, depth = enc.codes, {}, 0
            segments = {
                "codes": (*codec.compress_best(stream, codec.CODE_CODECS, codec.CODE_LEVEL), extra),
                "protected": (*codec.compress_best(enc.protected, codec.ZSTD_PLANES),
                              {"dtype": enc.protected.dtype.name, "count": int(enc.protected.size)}),
            }
            return segments, (enc.codes, enc.bins, depth)

        async def commit():
            # Device-to-host copies are issued here, on the commit thread, so save() does not pay for issuing them.
            for dev in devs:
                dev.start_copy_to_host()
            with concurrent.futures.ThreadPoolExecutor(self._threads) as pool:
                results = list(pool.map(lambda t: encode_shard(*t), shards))
            writer = store.BlobWriter(object_path, process)
            stored = {"params": 0, "optimizer": 0, "other": 0}
            chain: dict = {}
            for (i, box, _), (segments, link) in zip(shards, results):
                before = writer.nbytes
                writer.add(leaves_meta[i]["keystr"], box, segments)
                stored[leaves_meta[i].get("part", "other")] += writer.nbytes - before
                if link is not None:
                    chain[(leaves_meta[i]["keystr"], store.box_key(box))] = link
            for i, dev in zip(quant_idx, devs):  # centres are replicated: every process has them
                leaves_meta[i].update(bins=dev.bins, centres=[float(c) for c in np.asarray(dev.centres)[:dev.bins]])
            depths = [d for _, _, d in chain.values()]
            writer.close({"stored_bytes": stored, "blocking_seconds": blocking,
                          "total_seconds": time.perf_counter() - t0, "keyframe_shards": depths.count(0),
                          "delta_shards": len(depths) - depths.count(0), "max_depth": max(depths, default=0)})
            if primary:
                store.write_json(os.path.join(directory, store.MANIFEST), manifest)
            self._pending = _Chain(root, object_id, chain)

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name="inshrink_save")]

    def _base_values(self, leaf: str, x: jax.Array) -> jax.Array:
        """The base checkpoint's restored `leaf`, laid out like `x`; restored once per layout and kept (every
        save of a fine-tune needs it: memory of one more copy of the matched weights)."""
        key = (leaf, x.sharding, x.committed)
        if key not in self._offsets:
            values = _restore_leaf(self.base.reader, self.base.leaves[leaf], x)
            # An uncommitted leaf (made by jnp without a device) may meet arrays on other devices in the encoder.
            self._offsets[key] = values if x.committed else jax.device_put(np.asarray(values))
        return self._offsets[key]

    def _configure(self, flat, treedef, quant_idx, gs, layer_types, eval_fn, offsets):
        """(configuration or None for lossless, its encoded leaves if the search made them, search record)."""
        cfg = self.config
        if not quant_idx:
            return cfg.quant, None, {"mode": "none (no compressed leaves)"}
        if not cfg.search:
            if eval_fn is not None:
                raise ValueError("InshrinkSave(eval_fn=...) is given but CompressionConfig(search=False): the "
                                 "configuration is fixed, so eval_fn would never be called. Drop eval_fn, or "
                                 "enable the search.")
            return cfg.quant, None, {"mode": "fixed", "chosen": dataclasses.asdict(cfg.quant)}
        outcome, record = search.choose([x for _, x in flat], treedef, quant_idx, gs, layer_types, cfg, eval_fn,
                                        self._previous_quant, offsets)
        if outcome.quant is None and self._previous_quant != search.LOSSLESS:
            budget = (f"epsilon={cfg.epsilon}" if eval_fn is not None else f"proxy_budget={cfg.proxy_budget}")
            warnings.warn(f"no quantization configuration meets {budget} (the least aggressive one degrades by "
                          f"more); parameters are stored losslessly from this save on, as precision never "
                          f"decreases. A larger budget, or an eval_fn on more held-out data (less noise), keeps "
                          f"them compressed.", stacklevel=2)
        self._previous_quant = search.LOSSLESS if outcome.quant is None else outcome.quant
        return outcome.quant, outcome.payload, record

    def save(self, directory, args: "InshrinkSave" = None, **kwargs):
        async def run():
            for f in await self.async_save(directory, args=args) or []:
                f.result()

        asyncio_utils.run_sync(run())

    def finalize(self, directory) -> None:
        # Runs once on the primary host after every process finished writing, before Orbax's rename.
        manifest, _ = store.read_json(os.path.join(directory, store.MANIFEST), "manifest", directory)
        base = manifest.get("base")
        record = store.finalize(directory, manifest["object"], manifest["process_count"],
                                base=(base["object"], base["commit_crc32"]) if base else None)
        self.last_figures = figures_from(manifest, record)

    @staticmethod
    def _grads_by_path(grads) -> dict:
        if grads is None:
            return {}
        return {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}

    # ----------------------------------------------------------------------------------------------- restore
    def restore(self, directory, args: "InshrinkRestore" = None, **kwargs):
        reader = store.Reader(directory)
        leaves = reader.manifest["leaves"]
        target = None if args is None else args.item
        if target is None:
            self._decode_codes(reader, [(m, None) for m in leaves])
            values = [_restore_leaf(reader, m, None) for m in leaves]
            self._adopt(reader)
            return _unflatten_plain([m["path"] for m in leaves], values)
        flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=lambda x: x is None)
        by_key = {m["keystr"]: i for i, m in enumerate(leaves)}
        want = [jax.tree_util.keystr(p) for p, _ in flat]
        missing = [k for k in want if k not in by_key]
        extra = sorted(set(by_key) - set(want))
        if missing or extra:
            raise ValueError(f"{store.describe(directory)}: the restore target does not match the saved tree. "
                             f"In the target but not saved: {missing[:20]}; saved but not in the target: "
                             f"{extra[:20]}. Pass a target with the saved structure, or InshrinkRestore() to get "
                             "the saved tree as nested dicts.")
        problems = []
        for k, (_, t) in zip(want, flat):
            m = leaves[by_key[k]]
            if "shape" in m and hasattr(t, "shape") and tuple(t.shape) != tuple(m["shape"]):
                problems.append(f"{k}: saved shape {tuple(m['shape'])}, target {tuple(t.shape)}")
            elif (m["kind"] in ("array", "quantized", "dropped") and hasattr(t, "dtype")
                  and jnp.dtype(t.dtype) != jnp.dtype(m["dtype"])):
                problems.append(f"{k}: saved dtype {m['dtype']}, target {jnp.dtype(t.dtype).name}")
            elif "shape" in m and m["kind"] != "prng_key":
                try:
                    _target_sharding(t).addressable_devices_indices_map(tuple(m["shape"]))
                except ValueError as e:
                    problems.append(f"{k}: the target sharding does not fit shape {tuple(m['shape'])} ({e})")
        if problems:
            raise ValueError(f"{store.describe(directory)}: the restore target does not match the saved "
                             f"leaves: " + "; ".join(problems[:20]))
        pairs = [(leaves[by_key[k]], t) for k, (_, t) in zip(want, flat)]
        self._decode_codes(reader, pairs)
        values = [_restore_leaf(reader, m, t) for m, t in pairs]
        self._adopt(reader)
        return jax.tree_util.tree_unflatten(treedef, values)

    def _decode_codes(self, reader: store.Reader, pairs: list) -> None:
        """Decode, in parallel threads, the codes of every stored shard this process's part of the restore
        overlaps (NumPy and zstandard release the GIL): delta chains make this the bulk of a restore."""
        needed = []
        for meta, target in pairs:
            if meta["kind"] != "quantized":
                continue
            shape = tuple(meta["shape"])
            boxes = [_box(i, shape) for i in _target_sharding(target).addressable_devices_indices_map(shape).values()]
            for _, e in reader.shards.get(meta["keystr"], []):
                if any(_overlap(b, e["box"]) is not None for b in boxes):
                    needed.append((meta["keystr"], e["box"]))
        with concurrent.futures.ThreadPoolExecutor(self._threads) as pool:
            list(pool.map(lambda k: reader.codes(*k), needed))

    def _adopt(self, reader: store.Reader) -> None:
        """Continue the chain from a restored step: its codes are on disk, committed, and now held here, so the
        next save may store a delta against them (after a resume the weights sit on that grid: tiny deltas).
        Only the shards this process decoded are held; others start a keyframe."""
        bins = {m["keystr"]: m["bins"] for m in reader.manifest["leaves"] if m["kind"] == "quantized"}
        codes = {key: (c, bins[key[0]], depth) for key, (c, depth) in reader.codes_cache.items()}
        self._prev, self._pending = _Chain(reader.root, reader.object_id, codes), None
        # The search goes on from the restored step's configuration (precision never decreases across a resume).
        rec = reader.manifest.get("search")
        if isinstance(rec, dict) and rec.get("mode") not in (None, "fixed") and "chosen" in rec:
            chosen = rec["chosen"]
            self._previous_quant = search.LOSSLESS if chosen == search.LOSSLESS else QuantConfig(**chosen)

    def metadata(self, directory):
        reader = store.Reader(directory)
        return figures_from(reader.manifest, reader.own.commit)

    @classmethod
    def typestr(cls) -> str:
        return "inshrink_jax.InshrinkCheckpointHandler"


def _config_json(cfg: CompressionConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["layer_type_rules"] = [list(r) for r in cfg.layer_type_rules]
    return d


def figures_from(manifest: dict, commit: dict) -> dict:
    """Per-save figures from the manifest and the object's commit record: raw and stored bytes per part,
    ratios, keyframe or delta and chain depth, timings, the configuration used."""
    stored = {"params": 0, "optimizer": 0, "other": 0}
    for p in commit["processes"]:
        for k, v in p["figures"]["stored_bytes"].items():
            stored[k] += v
    raw = manifest["raw_bytes"]
    ratio = {k: (raw[k] / stored[k] if stored[k] else None) for k in raw}
    ratio["total"] = sum(raw.values()) / max(sum(stored.values()), 1)
    figs = [p["figures"] for p in commit["processes"]]
    n_key, n_delta = sum(f["keyframe_shards"] for f in figs), sum(f["delta_shards"] for f in figs)
    kind = "delta" if n_delta and not n_key else "keyframe" if not n_delta else "mixed"
    return {"raw_bytes": raw, "stored_bytes": stored, "ratio": ratio, "quant": manifest["quant"],
            "kind": kind, "chain_depth": max(f["max_depth"] for f in figs), "object": manifest["object"],
            "sensitivity": manifest["sensitivity"], "search": manifest["search"],
            "blocking_seconds": max(p["figures"]["blocking_seconds"] for p in commit["processes"]),
            "total_seconds": max(p["figures"]["total_seconds"] for p in commit["processes"])}


# ----------------------------------------------------------------------------------------------- restore
def _overlap(a: list[list[int]], b: list[list[int]]):
    lo = [max(x[0], y[0]) for x, y in zip(a, b)]
    hi = [min(x[1], y[1]) for x, y in zip(a, b)]
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, hi)


def _fill(out: np.ndarray, box, pieces, what: str) -> np.ndarray:
    """Copy each (stored box, host array) piece's overlap with `box` into `out`; all of `box` must be covered."""
    covered = 0
    for sbox, data in pieces:
        ov = _overlap(box, sbox)
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


def _target_sharding(target) -> jax.sharding.Sharding:
    """Where a restored leaf goes: the target's sharding, else (None, NumPy, no sharding) the default device."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or isinstance(target, np.ndarray):
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return sharding


def _restore_leaf(reader: store.Reader, meta: dict, target):
    kind, leaf = meta["kind"], meta["keystr"]
    what = f"{store.describe(reader.directory)}: leaf {meta['keystr']}"
    if kind == "scalar":
        return meta["value"]
    shape = tuple(meta["shape"])
    shards = reader.shards.get(leaf, [])
    cache: dict = {}

    def stored(p, entry, name, dtype, shape_):
        key = (p, id(entry), name)
        if key not in cache:
            seg = entry["segments"][name]
            raw = codec.decompress(reader.segment(leaf, p, seg, name), seg["codec"], np.dtype(dtype).itemsize)
            arr = np.frombuffer(raw, dtype)
            if arr.size != int(np.prod(shape_)):
                raise store.CheckpointCorruptError(f"{what}: segment {name!r} holds {arr.size} values, expected "
                                                   f"{int(np.prod(shape_))}")
            cache[key] = arr.reshape(shape_)
        return cache[key]

    sharding = _target_sharding(target)
    is_numpy_target = isinstance(target, np.ndarray) or (target is None and meta.get("sharding") == "numpy")
    full = [[0, n] for n in shape]
    if kind == "dropped":  # not stored: re-initialised as zeros (CompressionConfig.optimizer = "drop")
        dtype = jnp.dtype(meta["dtype"])
        if is_numpy_target:
            return np.zeros(shape, dtype)
        return _make_array(shape, sharding, lambda box, dev: jax.device_put(
            np.zeros([b[1] - b[0] for b in box], dtype), dev), what)
    if kind in ("array", "prng_key"):
        dtype = jnp.dtype(meta["dtype"])

        def host_box(box):
            pieces = [(e["box"], (lambda p=p, e=e: stored(p, e, "data", dtype, [b[1] - b[0] for b in e["box"]])))
                      for p, e in shards]
            return _fill(np.empty([b[1] - b[0] for b in box], dtype), box, pieces, what)

        if kind == "prng_key":  # stored as its key data, shape + (key words,)
            data = host_box([[0, n] for n in meta["data_shape"]])
            return jax.random.wrap_key_data(jnp.asarray(data), impl=meta["impl"])
        if is_numpy_target:
            return host_box(full)
        return _make_array(shape, sharding, lambda box, dev: jax.device_put(host_box(box), dev), what)

    # quantized
    bins = meta["bins"]
    centres = np.asarray(meta["centres"], np.float32)

    def protected_of(p, entry, sshape):
        # Positions of a stored shard's protected weights, scanned once however many target boxes it overlaps.
        key = (p, id(entry), "positions")
        if key not in cache:
            cache[key] = quantize.protected_positions(reader.codes(leaf, entry["box"])[0], bins)
        return cache[key]

    def enc_box(box):
        pieces = [(e["box"], (lambda e=e: reader.codes(leaf, e["box"])[0])) for _, e in shards]
        codes = _fill(np.empty([b[1] - b[0] for b in box], np.uint8), box, pieces, what)
        pos_parts, val_parts = [], []
        for p, e in shards:
            ov = _overlap(box, e["box"])
            if ov is None:
                continue
            sshape = [b[1] - b[0] for b in e["box"]]
            seg = e["segments"]["protected"]
            vals = stored(p, e, "protected", jnp.dtype(seg["dtype"]), [seg["count"]])
            local = protected_of(p, e, sshape)
            if local.size != vals.size:
                raise store.CheckpointCorruptError(f"{what}: {local.size} protected codes but {vals.size} values")
            idx = np.unravel_index(local, sshape)
            glob = [ix + b[0] for ix, b in zip(idx, e["box"])]
            inside = np.ones(local.size, bool)
            for g, (lo, hi) in zip(glob, zip(*ov)):
                inside &= (g >= lo) & (g < hi)
            rel = tuple(g[inside] - b[0] for g, b in zip(glob, box))
            pos_parts.append(np.ravel_multi_index(rel, codes.shape))
            val_parts.append(vals[inside])
        order = np.argsort(np.concatenate(pos_parts), kind="stable") if pos_parts else np.zeros(0, np.int64)
        values = np.concatenate(val_parts)[order] if val_parts else np.zeros(0, np.float32)
        return quantize.EncodedTensor(codes, centres, values, meta["dtype"])

    offsets = _base_offsets(reader, meta, sharding, what) if "base_leaf" in meta else None
    if is_numpy_target:
        return np.asarray(quantize.decode(enc_box(full), None, None if offsets is None else offsets[None]))
    return _make_array(shape, sharding, lambda box, dev: quantize.decode(
        enc_box(box), dev, None if offsets is None else offsets[dev]), what)


def _base_offsets(reader: store.Reader, meta: dict, sharding, what: str) -> dict:
    """The base checkpoint's values of a residual leaf, restored with `sharding`: device -> its shard (None ->
    the shard on the default device, for a NumPy target)."""
    base = reader.base()
    base_meta = base.leaves.get(meta["base_leaf"])
    if base_meta is None or base_meta.get("shape") != meta["shape"]:
        raise store.CheckpointCorruptError(
            f"{what}: stored against the base checkpoint's leaf {meta['base_leaf']}, which the base "
            f"{base.directory} does not hold with shape {tuple(meta['shape'])}")
    values = _restore_leaf(base, base_meta, jax.ShapeDtypeStruct(tuple(meta["shape"]), base_meta["dtype"],
                                                                 sharding=sharding))
    out = {s.device: s.data for s in values.addressable_shards}
    out[None] = out.get(jax.devices()[0])
    return out


def _make_array(shape, sharding, build, what):
    """Assemble a global array from the pieces `build(box, device)` makes on each addressable device."""
    arrays = [build(_box(index, shape), d) for d, index in sharding.addressable_devices_indices_map(shape).items()]
    try:
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    except ValueError as e:
        raise ValueError(f"{what}: cannot place the restored values into the target sharding ({e})") from None


@ocp.args.register_with_handler(InshrinkCheckpointHandler, for_save=True)
@dataclasses.dataclass
class InshrinkSave(ocp.args.CheckpointArgs):
    """Save args: the state to save, and what the compression may use.

    Attributes:
      state: any pytree (Flax TrainState, nnx.state(...), dicts) of arrays, scalars, strings and None.
      grads: gradient EMA with the structure of the parameters (matched to state leaves by key-path suffix, so
        a TrainState's `grads` matches `state.params`); None uses magnitude as sensitivity.
      eval_fn: maps a state of the saved type, with the compressed leaves replaced by their quantize-dequantize
        values, to a scalar quality (a loss by default; `CompressionConfig.higher_is_better` for accuracies),
        for the configuration search: a candidate is accepted when its relative degradation against the
        uncompressed state at the same step is at most `CompressionConfig.epsilon`. Called on the thread that
        calls `save()`, once for the uncompressed state and once per candidate. None: the search uses the
        data-free proxy (`CompressionConfig.proxy_budget`), and the figures say so.
    """

    state: Any
    grads: Any = None
    eval_fn: Callable[[Any], Any] | None = None


@ocp.args.register_with_handler(InshrinkCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class InshrinkRestore(ocp.args.CheckpointArgs):
    """Restore args.

    Attributes:
      item: None to restore the saved tree (nested dicts and lists, arrays on the default device); or a tree of
        the saved structure whose leaves are arrays or `jax.ShapeDtypeStruct`s (with `sharding=` to restore
        straight into that layout) or NumPy arrays (restored as NumPy).
    """

    item: Any = None
