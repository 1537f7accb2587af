"""The save pipeline: plan -> configure and encode on the device -> (background) device-to-host, delta, entropy
coding, write (DESIGN.md section 2).

- `plan` (caller's thread): every leaf's manifest entry from its policy (policy.py), the leaves to quantize,
  their gradients, layer types and base-checkpoint matches.
- `dispatch`: the configuration (search.py, or the fixed one), the jitted encoders of weights (quantize.py) and
  moments (moments.py) dispatched but not waited for, and host copies of the lossless leaves. On the caller's
  thread, nothing reads the caller's arrays after it returns: a training loop may donate them. Or, for a state on
  one device in one process, on Orbax's commit thread after save() returned, on the `snapshot` (a device copy of
  the plan's arrays) that save() dispatched: the search and its eval_fn calls then run while training goes on
  (the handler decides which; its `background` argument).
- `write` (Orbax's commit thread): host copies of the codes, deltas against the previous save's codes of the same
  shard (delta.py), entropy coding (codec.py), this process's blob, data file and offset table (store.py), and
  the manifest (primary host). It returns the `ItemState` the next save of the same (root, item) builds on.
  With a bound on the bytes in flight (Orbax's `save_concurrent_gb`), each shard takes its bytes from Orbax's
  byte limiter before its host copy and gives them back once it is written.

State that outlives a save is an `ItemState` value, keyed by (root, item) by its owner (the handler), never
shared between items.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time
import warnings
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from orbax.checkpoint._src.serialization import limits

from inshrink_jax import codec, delta, moments, policy, quantize, records, search, store, weighting
from inshrink_jax.config import CompressionConfig, QuantConfig

_QUANTIZABLE = {"float32", "bfloat16", "float16"}
RESIDUAL, KEYFRAME = "residual", "keyframe"  # what a closed-loop save's search record says it searched
# A moment is quantized from this many elements, 1-D ones included (norm scales' and biases' moments): its error is
# relative per element in the log domain, whatever the tensor's size, and below this the value table would cost
# about what it saves. (Weights: `CompressionConfig.min_compress_size` and >= 2 dimensions.)
MIN_MOMENT_SIZE = 64
# A float parameter too small or too flat for the weights' own coding (`CompressionConfig.min_compress_size`, < 2
# dimensions: biases, norm scales) joins a closed-loop chain from this many elements: stored exactly at its
# keyframes, then coded as a residual with the weights (a few levels of one interval's change instead of 32 bits).
# Below it, the levels and segment headers would cost about what the residual saves.
MIN_RESIDUAL_SIZE = 64
# Positions of protected values are int32 (jax without x64): a quantized shard must index within it.
MAX_SHARD_ELEMENTS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class ItemState:
    """What the saves of one (root, item) carry from one to the next.

    Attributes:
      object_id: the object whose codes `codes` holds and whose reconstruction `recon` is (None: nothing to
        build on; the next save is a keyframe). Usable only once committed (`store.is_committed`).
      codes: (leaf key path, shard box key) -> (uint8 codes, bins, chain depth) of this process's shards (open
        loop: what the next save's level-index deltas are taken against).
      quant: the search's last choice for a keyframe (a QuantConfig or search.LOSSLESS), None before the first.
      recon: closed loop: leaf key path -> the parameter as a restore of `object_id` gives it, on the device(s)
        with the leaf's sharding: what the next save's residuals are taken against.
      depth: closed loop: links of `object_id`'s chain after its keyframe (0: it is a keyframe).
      residual_quant: the last closed-loop residual save's choice, None before the first: where the next
        residual save's search starts (`search.search`'s `start`; it searches the whole space, but its first
        round settles it when the choice moved by at most one step).
      residual_hint: the last residual save's search record's "wider" (how many times its choice's error the next
        wider cells' was, and how many saves ago that was measured), or None: `search.choose`'s `hint`.
    """

    object_id: str | None = None
    codes: Mapping = dataclasses.field(default_factory=dict)
    quant: QuantConfig | str | None = None
    recon: Mapping = dataclasses.field(default_factory=dict)
    depth: int = 0
    residual_quant: QuantConfig | None = None
    residual_hint: Mapping | None = None

    def choices(self) -> "ItemState":
        """Only the search's choices (a state without anything to build on: the next save is a keyframe)."""
        return ItemState(quant=self.quant, residual_quant=self.residual_quant, residual_hint=self.residual_hint)


def state_of_restore(reader: store.Reader, recon: Mapping) -> ItemState:
    """The state a restored step leaves: its codes (those this process decoded) to continue an open-loop chain,
    `recon` (key path -> restored array, not shared with the caller's tree) to continue a closed-loop one, and
    its search choice (the search goes on from it across a resume)."""
    bins = {m.keystr: m.bins for m in reader.manifest.leaves if m.kind == "quantized"}
    codes = {key: (c, bins[key[0]], depth) for key, (c, depth) in reader.codes_cache.items()}
    rec = reader.manifest.search
    quant = None
    if isinstance(rec, dict) and rec.get("mode") not in (None, "fixed", search.UNMEASURED) and "chosen" in rec:
        chosen = rec["chosen"]
        quant = search.LOSSLESS if chosen == search.LOSSLESS else QuantConfig(**chosen)
    residual_quant = hint = None
    if isinstance(rec, dict) and rec.get("coding") == RESIDUAL:
        residual_quant = quant if isinstance(quant, QuantConfig) else None
        quant = None  # the keyframes' search starts afresh
        hint = _hint(rec.get("wider"))
    return ItemState(reader.object_id, codes, quant, dict(recon), reader.chain_depth, residual_quant, hint)


def _hint(wider) -> dict | None:
    """A search record's "wider" as `search.choose`'s hint, or None where it is not one (an older record, or a
    record that does not read as one: the next residual save then searches)."""
    if not isinstance(wider, dict) or type(wider.get("saves")) is not int or \
            type(wider.get("ratio")) not in (int, float) or not math.isfinite(wider["ratio"]) or \
            wider["ratio"] <= 0 or wider["saves"] < 0:
        return None
    return {"ratio": float(wider["ratio"]), "saves": wider["saves"]}


# ---------------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class Plan:
    """What one save stores, decided before any device work.

    Attributes:
      leaves: the flattened state's leaves; treedef: its structure.
      records: each leaf's manifest entry (quantized ones without bins / centres yet).
      weights, moments: indices of the leaves quantized by the weights' method and by the moments' method.
      owners: for each moment, the position in `weights` of the weight it mirrors, or None.
      first: for each moment, whether it is a first moment (it then takes its weight's pruning).
      budgets: for each moment, the factor of `CompressionConfig.effective_moment_budget` a first moment is coded
        within (`policy.LeafPolicy.budget`).
      scales: for each moment, the leaf index of the second moment a first moment is coded relative to, or None
        (moments.encode_first_on_device).
      grads: for each weight, its gradient EMA or None.
      base_of: weight index -> the base checkpoint's leaf it is stored against.
      small: indices of the float parameters stored exactly by size alone (`MIN_RESIDUAL_SIZE`): closed loop,
        they take part in the chain as residuals at residual saves (`with_small`).
      small_grads: for each of `small`, its gradient EMA or None.
      empty: the state's empty containers (`records.empty_containers`).
      grads_given: whether the save was given gradients at all.
      second_of: weight or small parameter leaf index -> the leaf index of the optimizer second moment of its
        shape that mirrors it (whatever that moment's policy), where there is one: what weights its residual
        (weighting.py).
    """

    leaves: list
    treedef: Any
    records: list[records.Leaf]
    weights: list[int]
    moments: list[int]
    owners: list[int | None]
    first: list[bool]
    budgets: list[float]
    scales: list[int | None]
    grads: list
    base_of: dict[int, str]
    small: list[int]
    small_grads: list
    empty: list
    grads_given: bool
    second_of: dict


def plan(state, grads, labels, cfg: CompressionConfig, base=None) -> Plan:
    """The plan of saving `state` (see `Plan`); `base` is a base.BaseCheckpoint or None."""
    flat, treedef = records.flatten(state)
    policies = policy.classify(state, cfg, labels)
    recs = [leaf_record(path, x, pol, cfg) for (path, x), pol in zip(flat, policies)]
    flat = [(path, auto_axes(x)) for path, x in flat]
    scales = _scales(flat, recs, policies)
    recs = [r if j is None else dataclasses.replace(r, scale_leaf=recs[j].keystr) for r, j in zip(recs, scales)]
    grads = None if grads is None else jax.tree.map(auto_axes, grads)
    weights = [i for i, r in enumerate(recs) if r.method == "weights"]
    moment_idx = [i for i, r in enumerate(recs) if r.method == "moments"]
    by_path = {} if grads is None else {
        jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    base_of = {} if base is None else {
        i: b for i in weights if (b := base.match(recs[i].path, recs[i].shape)) is not None}
    small = [i for i, ((_, x), r, pol) in enumerate(zip(flat, recs, policies))
             if r.kind == "array" and pol.policy == "quantize" and pol.moment is None and isinstance(x, jax.Array)
             and r.dtype in _QUANTIZABLE and x.ndim >= 1 and x.size >= MIN_RESIDUAL_SIZE
             and int(np.prod(x.sharding.shard_shape(x.shape))) <= MAX_SHARD_ELEMENTS]
    seconds = [i for i, pol in enumerate(policies) if pol.moment == policy.SECOND]
    chained = weights + small
    second_of = {chained[k]: j for j, k in zip(seconds, _owners(flat, chained, seconds, policies)) if k is not None}
    return Plan([x for _, x in flat], treedef, recs, weights, moment_idx,
                _owners(flat, weights, moment_idx, policies), [policies[i].moment == policy.FIRST for i in moment_idx],
                [policies[i].budget for i in moment_idx], [scales[i] for i in moment_idx],
                [_mirrored(flat[i][0], by_path) for i in weights], base_of,
                small, [_mirrored(flat[i][0], by_path) for i in small], records.empty_containers(state),
                grads is not None, second_of)


def with_small(p: Plan, cfg: CompressionConfig) -> Plan:
    """`p` for a closed-loop residual save: its small float parameters (`Plan.small`) quantized with the weights,
    after them, as weights of their layer type (1-D: "other", never pruned)."""
    if not p.small:
        return p
    recs = list(p.records)
    for i in p.small:
        recs[i] = dataclasses.replace(recs[i], kind="quantized", method="weights",
                                      layer_type=quantize.layer_type(recs[i].keystr, recs[i].shape,
                                                                     cfg.layer_type_rules))
    return dataclasses.replace(p, records=recs, weights=p.weights + p.small, grads=p.grads + p.small_grads,
                               small=[], small_grads=[])


def copies(xs: list) -> list:
    """`xs` with each device array copied on its devices with its sharding (one `jax.device_put` for all: no
    kernel to compile per shape, as a `jnp.copy` each would) and each NumPy array copied on the host; anything else
    as it is. Dispatched, not waited for."""
    out = list(xs)
    idx = [i for i, x in enumerate(xs) if isinstance(x, jax.Array)]
    if idx:
        copied = jax.device_put([xs[i] for i in idx], [xs[i].sharding for i in idx], may_alias=False)
        for i, c in zip(idx, copied):
            out[i] = c
    for i, x in enumerate(xs):
        if isinstance(x, np.ndarray):
            out[i] = np.array(x, copy=True)
    return out


def snapshot(p: Plan) -> Plan:
    """`p` with copies of its arrays (leaves and gradients, `copies`), so the search and the encoders can run
    after save() returns: the caller may then overwrite or donate what it passed."""
    return dataclasses.replace(p, leaves=copies(p.leaves), grads=copies(p.grads), small_grads=copies(p.small_grads))


def auto_axes(x):
    """`x` on the same devices and layout with its mesh's axes made Auto: the kernels index, scatter and reduce
    whole tensors, which JAX refuses on Explicit axes (`jax.make_mesh`'s default) without per-op shardings. The
    same buffers, not a copy; the manifest keeps the saved sharding as it was (leaf_record runs first)."""
    s = getattr(x, "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding) or not isinstance(s.mesh, jax.sharding.Mesh) or all(
            t == jax.sharding.AxisType.Auto for t in s.mesh.axis_types):
        return x
    mesh = jax.sharding.Mesh(s.mesh.devices, s.mesh.axis_names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(s.mesh.axis_names))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, s.spec, memory_kind=s.memory_kind))


def _tails(path) -> list[str]:
    """Key-path strings of every non-empty tail of `path`, longest first."""
    return [jax.tree_util.keystr(tuple(path[j:])) for j in range(len(path))]


def _mirrored(path, by_path: dict):
    """The entry of `by_path` (a mirror of part of the state, e.g. grads of a TrainState's params) for the leaf at
    `path`: the one whose key path is the longest tail of `path`."""
    return next((by_path[t] for t in _tails(path) if t in by_path), None)


def _owners(flat: list, weights: list[int], moment_idx: list[int], policies) -> list[int | None]:
    """For each moment leaf, the position in `weights` of its weight: the one weight of equal shape whose key
    path ends with the path the moment mirrors (policy.LeafPolicy.mirror); None if there is no single one."""
    by_tail: dict[str, list[int]] = {}
    for k, i in enumerate(weights):
        for tail in _tails(flat[i][0]):
            by_tail.setdefault(tail, []).append(k)
    out = []
    for i in moment_idx:
        mirror = policies[i].mirror
        hits = [k for k in by_tail.get(jax.tree_util.keystr(mirror), [])
                if tuple(flat[weights[k]][1].shape) == tuple(flat[i][1].shape)] if mirror else []
        out.append(hits[0] if len(hits) == 1 else None)
    return out


def _scales(flat: list, recs: list[records.Leaf], policies) -> list[int | None]:
    """For each leaf, the index of the second moment a quantized first moment is coded relative to: the first
    stored (quantized or lossless) second moment of the same optimizer state, mirroring the same parameter, of
    the same shape; None for every other leaf and for a first moment without one."""
    seconds: dict = {}
    for j, (pol, rec) in enumerate(zip(policies, recs)):
        if pol.moment == policy.SECOND and rec.kind in ("quantized", "array") and rec.part == "optimizer":
            seconds.setdefault((pol.group, pol.mirror, tuple(rec.shape)), j)
    return [seconds.get((pol.group, pol.mirror, tuple(rec.shape)))
            if pol.moment == policy.FIRST and rec.method == "moments" else None for pol, rec in zip(policies, recs)]


def mesh_of(x) -> dict | None:
    """records.Leaf.mesh of an array with a NamedSharding over a concrete mesh, else None."""
    s = getattr(x, "sharding", None)
    if not isinstance(s, jax.sharding.NamedSharding) or not isinstance(s.mesh, jax.sharding.Mesh):
        return None
    spec = []
    for e in s.spec:
        if e is None or isinstance(e, str):
            spec.append(e)
        elif isinstance(e, tuple) and all(isinstance(n, str) for n in e):
            spec.append(list(e))
        else:  # PartitionSpec.UNCONSTRAINED and the like: nothing a restore could rebuild
            return None
    return {"axes": [[name, int(n), t.name] for (name, n), t in zip(s.mesh.shape.items(), s.mesh.axis_types)],
            "devices": [int(d.id) for d in s.mesh.devices.flat], "spec": spec}


def leaf_record(path, x, pol: policy.LeafPolicy, cfg: CompressionConfig) -> records.Leaf:
    """The manifest entry of one leaf under its policy (quantized entries without bins / centres yet)."""
    keystr = jax.tree_util.keystr(path)
    entries = records.path_entries(path)
    if x is None or isinstance(x, (bool, int, float, str)) and not isinstance(x, np.generic):  # np.float64 is a float
        if isinstance(x, int) and not isinstance(x, bool) and not -2**63 <= x < 2**63:
            raise TypeError(f"leaf {keystr}: integer {x} does not fit in 64 bits")
        return records.Leaf(entries, keystr, "scalar", value=x, type=type(x).__name__)
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(f"leaf {keystr} has unsupported type {type(x).__name__}; inshrink_jax stores "
                        "jax/NumPy arrays, Python scalars, strings and None")
    common = dict(shape=list(x.shape), sharding=str(getattr(x, "sharding", "numpy")), mesh=mesh_of(x),
                  type=records.NUMPY_SCALAR if isinstance(x, np.generic) else None)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        if pol.policy == "drop":
            raise ValueError(f"leaf {keystr} is a PRNG key, which cannot be dropped (zeros are not a fresh key). "
                             "Narrow the policy rule or label.")
        return records.Leaf(entries, keystr, "prng_key", dtype="uint32", impl=str(jax.random.key_impl(x)),
                            data_shape=list(jax.random.key_data(x).shape), **common)
    dtype = jnp.dtype(x.dtype)
    part = pol.part if jnp.issubdtype(dtype, jnp.floating) and x.ndim >= 1 else "other"
    if pol.policy == "drop":
        return records.Leaf(entries, keystr, "dropped", dtype=dtype.name, part=part, **common)
    small = x.size < MIN_MOMENT_SIZE if pol.moment is not None else x.ndim < 2 or x.size < cfg.min_compress_size
    if not (pol.policy == "quantize" and isinstance(x, jax.Array) and dtype.name in _QUANTIZABLE and x.ndim >= 1
            and not small):
        return records.Leaf(entries, keystr, "array", dtype=dtype.name, part=part, **common)
    shard = int(np.prod(x.sharding.shard_shape(x.shape)))
    if shard > MAX_SHARD_ELEMENTS:
        raise ValueError(f"leaf {keystr}: a shard of {shard:,} elements is over the {MAX_SHARD_ELEMENTS:,} a "
                         "quantized shard can address; shard the leaf over more devices, or store it losslessly "
                         f"with policy_rules=(({re.escape(keystr)!r}, 'lossless'),)")
    if pol.moment is not None:
        return records.Leaf(entries, keystr, "quantized", dtype=dtype.name, part=part, method="moments", **common)
    return records.Leaf(entries, keystr, "quantized", dtype=dtype.name, part=part, method="weights",
                        layer_type=quantize.layer_type(keystr, x.shape, cfg.layer_type_rules), **common)


# ------------------------------------------------------------------------------------------------ dispatch
@dataclasses.dataclass(frozen=True)
class Dispatched:
    """A save after its device work was dispatched: everything the background write needs.

    Attributes:
      records: the manifest entries (quantized ones without bins / centres: those come off the device).
      quantized: indices of the quantized leaves, in the order of `devs`.
      devs: the encoder outputs on the device(s).
      shards: (leaf index, box, payload) of this process's shards: a `DeviceCodes` shard tuple or a host array.
      manifest: the manifest fields besides the leaves, the object and the raw bytes.
      started: `time.perf_counter()` when the save started; blocking: seconds the caller was blocked.
      prior: closed loop: the object whose reconstruction this save's residuals are added to (None: a keyframe).
      after: the `ItemState` fields the next save builds on once this one is committed (quant, recon, depth).
    """

    records: list[records.Leaf]
    quantized: list[int]
    devs: list
    shards: list[tuple[int, list, Any]]
    manifest: dict
    started: float
    blocking: float
    prior: str | None = None
    after: dict = dataclasses.field(default_factory=dict)


def recon_offsets(p: Plan, cfg: CompressionConfig, chain: ItemState) -> list | None:
    """Closed loop: per weight, then per small float parameter (`Plan.small`), the previous reconstruction this
    save's residual is taken against; None when this save is a keyframe (open loop, a fine-tune against a base, no
    committed previous save, the chain is `keyframe_every` long, or a leaf without a reconstruction of its shape,
    dtype and sharding)."""
    if not cfg.closed_loop or p.base_of or chain.object_id is None or chain.depth + 1 >= cfg.keyframe_every:
        return None
    out = []
    for i in p.weights + p.small:
        x, r = p.leaves[i], chain.recon.get(p.records[i].keystr)
        if r is None or r.shape != x.shape or r.dtype != x.dtype or \
                not r.sharding.is_equivalent_to(x.sharding, x.ndim):
            return None
        out.append(r)
    return out


def residual_factors(p: Plan, cfg: CompressionConfig) -> list | None:
    """Per weight of a residual save (`p` after `with_small`), its weighting factors (weighting.py), or None
    where it is not weighted: fewer than 2 dimensions, no second moment of its own shape in the state (as a
    device array), or `cfg.weighted_residuals` off. The factors go to the devices of the weight they scale. None when no weight is weighted."""
    if not cfg.weighted_residuals:
        return None
    idx = []
    for k, i in enumerate(p.weights):
        j = p.second_of.get(i)
        x, nu = p.leaves[i], None if j is None else p.leaves[j]
        if x.ndim >= 2 and isinstance(nu, jax.Array) and nu.shape == x.shape:
            idx.append((k, j))
    if not idx:
        return None
    out: list = [None] * len(p.weights)
    for (k, _), fs in zip(idx, quantize.map_by_device_set(weighting.factors, [p.leaves[j] for _, j in idx])):
        out[k] = tuple(weighting.replicated(f, p.leaves[p.weights[k]]) for f in fs)
    return out


def dispatch(p: Plan, cfg: CompressionConfig, eval_fn: Callable | None, chain: ItemState, offsets: list,
             base_info: dict | None, primary: bool, started: float) -> Dispatched:
    """Choose the configuration, dispatch the encoders (and, closed loop, the new reconstruction), copy the
    lossless leaves. `chain`: the state the save builds on; `offsets`: for each weight, the base checkpoint's
    values it is stored against, or None."""
    closed = cfg.closed_loop and not p.base_of
    recon = recon_offsets(p, cfg, chain)
    residual = recon is not None
    factors = None
    if residual:
        offsets, p = recon, with_small(p, cfg)
        factors = residual_factors(p, cfg)
    small = p.small if closed else []  # exact at a closed-loop keyframe: the first link of their chains
    xs = [p.leaves[i] for i in p.weights]
    layer_types = [p.records[i].layer_type for i in p.weights]
    previous = chain.residual_quant if residual else chain.quant
    quant, devs, decoded, search_record, choice, reference = configure(
        p, cfg, eval_fn, previous, offsets, residual, factors, chain.residual_hint if residual else None)
    if closed and isinstance(search_record, dict):
        search_record["coding"] = RESIDUAL if residual else KEYFRAME
    recs = list(p.records)
    weights = p.weights
    coding = records.CLOSED_LOOP if closed else None
    for i in small:
        recs[i] = dataclasses.replace(recs[i], coding=coding)
    if quant is None:  # lossless: no weight quantized at this save
        for i in weights:
            recs[i] = dataclasses.replace(recs[i], kind="array", method=None, layer_type=None, coding=coding)
        new_recon = copies(xs) if closed else []  # exact: the chain starts again from it
        weights, devs, residual = [], [], False
    else:
        for i in p.base_of:
            recs[i] = dataclasses.replace(recs[i], base_leaf=p.base_of[i])
        for i in weights:
            recs[i] = dataclasses.replace(recs[i], coding=coding)
        if devs is None:
            devs = quantize.encode_on_device(xs, p.grads, layer_types, quant, cfg, offsets=offsets,
                                             sigma=quantize.RESIDUAL_SIGMA if residual else None, factors=factors,
                                             reference=reference)
        new_recon = [] if not closed else decoded if decoded is not None else \
            quantize.dequantize_all(devs, [x.dtype for x in xs])
    # First moments take their weight's pruning (not that of a residual: a pruned residual is a weight kept at
    # its previous value, not a zero; its codes are passed with prunes False, so the kernels are a keyframe's).
    owners = p.owners if weights else [None] * len(p.moments)
    prune = [None if k is None else devs[k].codes for k in owners]
    prunes = [k is not None and devs[k].offset is None for k in owners]
    seconds = [k for k, f in enumerate(p.first) if not f]
    firsts = [k for k, f in enumerate(p.first) if f]
    second_devs = moments.encode_on_device([p.leaves[p.moments[k]] for k in seconds], cfg)
    # A first moment is coded relative to its second moment as a restore gives it back.
    scaling = {p.scales[f] for f in firsts}
    used = [(p.moments[k], dev) for k, dev in zip(seconds, second_devs) if p.moments[k] in scaling]
    restored = dict(zip([i for i, _ in used], quantize.dequantize_all(
        [dev for _, dev in used], [p.leaves[i].dtype for i, _ in used])))
    first_devs = moments.encode_first_on_device(
        [p.leaves[p.moments[k]] for k in firsts],
        [None if (j := p.scales[k]) is None else restored.get(j, p.leaves[j]) for k in firsts],
        [prune[k] for k in firsts], cfg, [prunes[k] for k in firsts], [p.budgets[k] for k in firsts])
    devs = list(devs) + second_devs + first_devs
    quantized = list(weights) + [p.moments[k] for k in seconds + firsts]
    shards = _device_shards(quantized, [p.leaves[i] for i in quantized], devs)
    shards += _lossless_shards(p.leaves, recs, primary)
    manifest = {"config": config_json(cfg), "quant": None if quant is None else dataclasses.asdict(quant),
                "search": search_record, "base": base_info if any(r.base_leaf for r in recs) else None,
                "empty": p.empty,
                "sensitivity": (f"gradient EMA on {sum(g is not None for g in p.grads)} of {len(p.grads)} "
                                "quantized leaves" if p.grads_given else "magnitude (no grads given)")}
    new_recon = new_recon + copies([p.leaves[i] for i in small])
    after = dict(quant=chain.quant if residual else choice,
                 residual_quant=choice if residual and isinstance(choice, QuantConfig) else chain.residual_quant,
                 residual_hint=_hint(search_record.get("wider")) if residual and isinstance(search_record, dict)
                 else chain.residual_hint,
                 recon={p.records[i].keystr: r for i, r in zip(p.weights + small, new_recon)},
                 depth=chain.depth + 1 if residual else 0)
    return Dispatched(recs, quantized, devs, shards, manifest, started, time.perf_counter() - started,
                      chain.object_id if residual else None, after)


def _device_shards(idx: list[int], xs: list, devs: list) -> list[tuple[int, list, Any]]:
    """(leaf, box, (codes, centres, protected in place, bins)) of every shard this process writes."""
    out = []
    for i, x, dev in zip(idx, xs, devs):
        in_place = {s.device: s.data for s in dev.protected_in_place.addressable_shards}
        for s in dev.codes.addressable_shards:
            if s.replica_id == 0:
                out.append((i, store.box_of(s.index, x.shape),
                             (s.data, dev.centres, in_place[s.device], dev.bins, dev.factors)))
    return out


def _lossless_shards(leaves: list, recs: list[records.Leaf], primary: bool) -> list[tuple[int, list, Any]]:
    """(leaf, box, host copy) of every lossless shard this process writes: copied now, since the caller may
    overwrite or donate its arrays once save() returns."""
    out = []
    for i, (x, r) in enumerate(zip(leaves, recs)):
        if r.kind not in ("array", "prng_key"):
            continue
        data = jax.random.key_data(x) if r.kind == "prng_key" else x
        if isinstance(data, jax.Array):
            for s in data.addressable_shards:
                if s.replica_id == 0:
                    out.append((i, store.box_of(s.index, data.shape), np.array(s.data, copy=True)))
        elif primary:
            out.append((i, [[0, n] for n in np.shape(data)], np.array(data, copy=True)))
    return out


def check_eval_fn(cfg: CompressionConfig, eval_fn) -> None:
    """Refuse an eval_fn the configuration would never call (on the caller's thread, before anything runs)."""
    if eval_fn is not None and not cfg.search:
        raise ValueError("InshrinkSave(eval_fn=...) is given but CompressionConfig(search=False): the "
                         "configuration is fixed, so eval_fn would never be called. Drop eval_fn, or "
                         "enable the search.")
    if eval_fn is not None and not callable(eval_fn):
        raise TypeError(f"InshrinkSave(eval_fn=...) must be a callable of the state, not {type(eval_fn).__name__}")


def configure(p: Plan, cfg: CompressionConfig, eval_fn, previous, offsets, residual: bool = False,
              factors: list | None = None, hint: dict | None = None):
    """(configuration or None for lossless, its encoded leaves if the search made them, those leaves dequantized
    if the search made them too (`search.Outcome.decoded`), the search's record, the choice the next save's
    search starts from, the width reference an encode of the configuration takes: `search.Outcome.reference`).
    `residual`: a closed-loop residual save (the search runs over `cfg.residual_space`), its
    weights weighted by `factors` (`residual_factors`); `hint`: `search.choose`'s."""
    if not p.weights:
        return cfg.quant, None, None, {"mode": "none (no compressed leaves)"}, previous, None
    if not cfg.search:  # a residual on uniform cells still takes the whole state's width reference
        reference = search.width_reference(p.leaves, p.weights, offsets, factors, cfg,
                                           residual and bool(cfg.quant.step))
        return cfg.quant, None, None, {"mode": "fixed", "chosen": dataclasses.asdict(cfg.quant)}, previous, reference
    layer_types = [p.records[i].layer_type for i in p.weights]
    outcome, record = search.choose(p.leaves, p.treedef, p.weights, p.grads, layer_types, cfg, eval_fn,
                                    previous, offsets, residual, factors, hint)
    if outcome.mode == search.UNMEASURED:
        warnings.warn(f"eval_fn returned {record['baseline']} for the uncompressed state at this save, so quality "
                      "cannot be measured: this save stores the parameters losslessly, and the next save "
                      "searches again from the last configuration.", stacklevel=4)
        return None, None, None, record, previous, None
    if outcome.quant is None and previous != search.LOSSLESS:
        budget = f"epsilon={cfg.epsilon}" if eval_fn is not None else f"proxy_budget={cfg.effective_proxy_budget}"
        warnings.warn(f"no quantization configuration meets {budget} (the least aggressive one degrades by "
                      f"more); this save stores the parameters losslessly. Each later save checks the least "
                      f"aggressive configuration and compresses again once it meets the budget. A larger budget, "
                      f"or an eval_fn on more held-out data (less noise), keeps them compressed.", stacklevel=4)
    return (outcome.quant, outcome.payload, outcome.decoded, record,
            search.LOSSLESS if outcome.quant is None else outcome.quant, outcome.reference)


def config_json(cfg: CompressionConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["layer_type_rules"] = [list(r) for r in cfg.layer_type_rules]
    d["policy_rules"] = [list(r) for r in cfg.policy_rules]
    return d


# --------------------------------------------------------------------------------------------------- write
def _encode_shard(rec: records.Leaf, box, payload, chain: ItemState, keyframe_every: int, prior: str | None):
    """(segments, chain link or None) of one shard: host copy; the codes or their delta against the previous
    save's, whichever codes smaller (open loop), or the link's levels and prior (closed loop); entropy coding."""
    if not isinstance(payload, tuple):
        return {"data": (*codec.compress_best(payload, codec.LOSSLESS_CODECS), {})}, None
    *coded, factors = payload
    enc = quantize.to_host(*coded, rec.dtype)
    protected = (*codec.compress_best(enc.protected, codec.ZSTD_PLANES),
                 {"dtype": enc.protected.dtype.name, "count": int(enc.protected.size)})
    if rec.coding == records.CLOSED_LOOP:
        counts = codec.byte_counts(np.ascontiguousarray(enc.codes).reshape(-1))
        centres = enc.centres
        if store.box_key(box) == store.box_key([[0, n] for n in rec.shape]):
            # The whole tensor in one shard: a level no code takes is stored as 0 (short records; never decoded).
            # The encoder zeroes the cells outside the range of the codes; a tensor split into shards keeps the
            # levels inside it, since every shard's record must hold the same levels.
            centres = np.where(counts[1:centres.size + 1] > 0, centres, np.float32(0)).astype(np.float32)
        extra = {"prior": prior, "levels16": records.table_bits(centres)}
        if factors is not None:  # this shard's part of each axis's factors
            extra["weighting"] = [np.asarray(f)[lo:hi].tolist() for f, (lo, hi) in zip(factors, box)]
        return {"codes": (*codec.compress_best(enc.codes, codec.CODE_CODECS, codec.CODE_LEVEL, counts), extra),
                "protected": protected}, None
    # The codes on their own (a keyframe shard), or their delta against the previous save's (a delta shard),
    # whichever codes smaller: a tensor whose codes change little (weights, second moments) takes the delta, one
    # that is new at every save (a first moment: Adam's mu forgets within ~10 steps) its own codes, which also
    # ends the shard's chain there.
    codes, extra, depth = codec.compress_best(enc.codes, codec.CODE_CODECS, codec.CODE_LEVEL), {}, 0
    prev = chain.codes.get((rec.keystr, store.box_key(box)))
    if prev is not None and prev[0].shape == enc.codes.shape and prev[2] + 1 < keyframe_every:
        b = delta.modulus(prev[1], enc.bins)
        stream = codec.compress_best(delta.encode(prev[0], enc.codes, b), codec.CODE_CODECS, codec.CODE_LEVEL)
        if len(stream[0]) < len(codes[0]):
            codes, extra, depth = stream, {"base": chain.object_id, "modulus": b}, prev[2] + 1
    return {"codes": (*codes, extra), "protected": protected}, (enc.codes, enc.bins, depth)


def _payload_bytes(payload) -> int:
    """Host bytes of one shard's payload: a host array, or a `DeviceCodes` shard tuple's arrays."""
    parts = payload if isinstance(payload, tuple) else (payload,)
    return sum(int(getattr(x, "nbytes", 0)) for x in parts)


async def _encode_in_order(d: Dispatched, chain: ItemState, cfg: CompressionConfig, threads: int,
                           concurrent_bytes: int | None, add: Callable) -> None:
    """Encode every shard of `d` on up to `threads` threads and hand each to `add` in shard order (the blob's
    layout does not depend on timing). With `concurrent_bytes`, a shard takes its payload's bytes from Orbax's
    byte limiter (`limits.get_byte_limiter`, as Orbax's own handlers) before its host copy and gives them back
    once `add` has written it; bytes are taken in shard order, so the earliest unwritten shard always holds
    its bytes and the pipeline cannot stall. A shard larger than the limit goes through on its own."""
    limiter = limits.get_byte_limiter(concurrent_bytes)
    ceiling = getattr(limiter, "max_bytes", None)
    threads_free = asyncio.Semaphore(threads)
    turns = [asyncio.Event() for _ in range(len(d.shards) + 1)]
    turns[0].set()

    async def one(k: int, shard, n: int) -> None:
        i, box, payload = shard
        try:
            async with threads_free:
                encoded = await asyncio.to_thread(_encode_shard, d.records[i], box, payload, chain,
                                                  cfg.keyframe_every, d.prior)
            await turns[k].wait()
            add(shard, *encoded)
        finally:
            turns[k + 1].set()
            await limiter.release_bytes(n)

    tasks = []
    try:
        for k, shard in enumerate(d.shards):
            n = _payload_bytes(shard[2])
            if ceiling is not None:
                n = min(n, ceiling - 1)  # Orbax's limiter refuses a request of its whole limit
            await limiter.wait_for_bytes(n)
            tasks.append(asyncio.ensure_future(one(k, shard, n)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:  # after a failure: nothing keeps running behind the error
            t.cancel()


async def write(d: Dispatched, directory, object_id: str, chain: ItemState, cfg: CompressionConfig,
                process: int, process_count: int, primary: bool, threads: int,
                concurrent_bytes: int | None = None) -> ItemState:
    """The background part of a save (Orbax's commit thread): entropy-code and write this process's shards
    into the object `object_id` (deltas against `chain` where it allows), and the manifest on the primary
    host. Returns the state the next save of this (root, item) builds on. `concurrent_bytes`: the most bytes of
    shards in flight (host copy to written), None for no bound."""
    if concurrent_bytes is None:
        for dev in d.devs:  # copies issued here, on the commit thread, so save() does not pay for issuing them
            dev.start_copy_to_host()
    root, item, _ = store.locate(directory)
    writer = store.BlobWriter(store.object_path(root, item, object_id), process)
    stored = {part: 0 for part in records.PARTS}
    links: dict = {}

    def add(shard, segments, link) -> None:
        i, box, _ = shard
        # A closed-loop link's segments all go with the code streams: later links are decoded through it.
        stored[d.records[i].part] += writer.add(d.records[i].keystr, box, segments,
                                                chained=d.records[i].coding == records.CLOSED_LOOP)
        if link is not None:
            links[(d.records[i].keystr, store.box_key(box))] = link

    await _encode_in_order(d, chain, cfg, threads, concurrent_bytes, add)
    depths = [depth for _, _, depth in links.values()] + [d.after["depth"] for i, _, _ in d.shards if (
        d.records[i].coding == records.CLOSED_LOOP and d.records[i].kind == "quantized")]
    writer.close(records.ProcessFigures(
        stored_bytes=stored, blocking_seconds=d.blocking, total_seconds=time.perf_counter() - d.started,
        keyframe_shards=depths.count(0), delta_shards=len(depths) - depths.count(0),
        max_depth=max(depths, default=0)))
    if primary:
        store.write_json(epath.Path(directory) / store.MANIFEST,
                         manifest(d, object_id, process_count).to_json())
    return ItemState(object_id, links, **d.after)


def manifest(d: Dispatched, object_id: str, process_count: int) -> records.Manifest:
    """The step's manifest, with the centres of the quantized leaves (replicated: every process has them): a
    second moment's symmetric table by its positive half, a closed-loop parameter's none (its link's levels are
    in the offset table; `records.Leaf.table`), as bfloat16 bit patterns (`records.table_bits`). A small model's
    records are a large share of a save: a vision transformer's 138k parameters in 216 leaves wrote 16.7 kB of
    manifest a save, 60% of it second moments' tables, of a 95 kB save."""
    recs = list(d.records)
    for i, dev in zip(d.quantized, d.devs):
        bins = int(dev.bins)
        recs[i] = dataclasses.replace(recs[i], bins=bins,
                                      centres16=recs[i].stored_centres(np.asarray(dev.centres)[:bins]))
    raw = {part: 0 for part in records.PARTS}
    for r in recs:
        raw[r.part] += r.nbytes
    return records.Manifest(store.FORMAT, store.FORMAT_VERSION, process_count, object_id, recs, raw_bytes=raw,
                            **d.manifest)
