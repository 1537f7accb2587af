"""The Orbax v0 adapter: `InshrinkCheckpointHandler` with its `InshrinkSave` / `InshrinkRestore` args.

Only Orbax's protocol lives here, and how its calls run beside the training thread (`_Held`: Python's garbage
collector paused during a save or a restore, a short thread switch interval during a save's background work); the
work is in save.py (plan -> encode on the device -> background write), restore.py and store.py. State that
outlives a save (the chain a delta builds on, the search's last choice) is a `save.ItemState` per (root, item): one
handler instance serves any number of items and managers.
See DESIGN.md sections 1-5, docs/how-it-works.md and docs/format.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import os
import sys
import threading
import time
import warnings
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import options as options_lib
from orbax.checkpoint._src import asyncio_utils
from orbax.checkpoint._src.metadata import checkpoint as step_metadata

from inshrink_jax import restore, save, store
from inshrink_jax.base import BaseCheckpoint
from inshrink_jax.config import CompressionConfig


class _Held:
    """A process-wide interpreter setting held at `value` while any block of it runs (reentrant, from any
    thread), and put back as it was when the last block ends, unless something else changed it meanwhile."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None], value: Callable[[Any], Any]):
        self._get, self._put, self._value = get, put, value
        self._lock = threading.Lock()
        self._open, self._before, self._held = 0, None, None

    def __enter__(self):
        with self._lock:
            if self._open == 0:
                self._before = self._get()
                if self._value(self._before) != self._before:
                    self._put(self._value(self._before))
                self._held = self._get()  # as the interpreter keeps it (a switch interval in whole microseconds)
            self._open += 1

    def __exit__(self, *exc):
        with self._lock:
            self._open -= 1
            if self._open == 0 and self._get() == self._held != self._before:
                self._put(self._before)


# While a save or a restore runs: Python's cyclic garbage collector off. Both allocate many small containers
# (parsed records, segment entries, per-stream arrays, traced kernels) that reference counting frees; the collector,
# triggered by their count, would meanwhile scan the whole heap of a JAX and Flax process (hundreds of thousands of
# objects) again and again, holding the interpreter lock that the training thread needs.
_COLLECTOR_PAUSED = _Held(gc.isenabled, lambda on: gc.enable() if on else gc.disable(), lambda _: False)
# While a save's background work runs (its search, tracing and encoders, beside the training thread): the
# interpreter's thread switch interval at most 0.5 ms instead of its default 5 ms, so that the training thread
# (and Orbax's save() starting its threads) waits that long at most for the lock the background thread holds.
SWITCH_INTERVAL_S = 0.0005
_SHORT_SWITCHES = _Held(sys.getswitchinterval, sys.setswitchinterval, lambda now: min(now, SWITCH_INTERVAL_S))


_DISCARD_ATTEMPTS = 5
_METADATA_WAIT_S = 10.0  # Orbax's checkpointers always write it; the bound only guards a checkpointer that does not


def _discard_temporary(directory) -> None:
    """Remove the temporary directories Orbax made for a save this handler refused (bad input, a changed base):
    a refused save leaves nothing behind. Orbax may still be creating them in the background, so this waits for
    its directory-creation signal and for the step metadata file its checkpointer writes there on a thread of its
    own (removed before that write, the write fails and the manager's `close` raises), and tries again while its
    threads still add to them; only directories named as Orbax's temporary ones are touched. Best effort: a
    failure to remove is a warning, never an error that would hide the one that refused the save."""
    async def remove():
        d = epath.Path(directory)
        outer = d.parent if store.TMP_SUFFIX in d.parent.name else d if store.TMP_SUFFIX in d.name else None
        if outer is None:
            return
        deadline = time.monotonic() + _METADATA_WAIT_S
        while not step_metadata.step_metadata_file_path(outer).exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for attempt in range(_DISCARD_ATTEMPTS):
            try:
                outer.rmtree(missing_ok=True)
                return
            except OSError:  # Orbax's own threads may still add to it ("directory not empty"): try again
                if attempt == _DISCARD_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))

    try:
        ocp.future.CommitFutureAwaitingContractedSignals(remove(), name="inshrink_discard",
                                                         timeout_secs=60).result()
    except Exception as e:  # noqa: BLE001 (best effort: never hide the error that refused the save)
        warnings.warn(f"could not remove the temporary directory of a refused save under {directory}: {e}; "
                      "it holds no checkpoint and can be deleted", stacklevel=3)


class InshrinkCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Saves a training-state pytree with large float leaves quantized (ALGORITHM.md), the rest bit-exact.

    One instance may serve every step of any number of items and `CheckpointManager`s: use it as a manager's
    `item_handlers`, or for items of a composite checkpoint through a handler registry. For each (root, item) it
    remembers the codes of the last committed save (or of the last restore) so the next save of that item
    stores only their change (a delta); a new instance, e.g. after a restart, starts with a keyframe unless it
    restored first.

    Args:
      config: the compression configuration (defaults: the paper's).
      base: a committed step of another root (`<root>/<step>`, or its item directory) that this handler's saves
        store their weights against: fine-tunes of a compressed pretrained checkpoint (base.py). Restoring such
        a step needs the base, unchanged, where it was: otherwise a clear error.
      multiprocessing_options: Orbax's. `primary_host` writes the manifest and commits; `primary_host=None`
        (per-host local storage, as Orbax documents it) makes every process write a checkpoint of its own
        shards; `active_processes` are the processes that save.
      save_concurrent_gb: as Orbax's `PyTreeCheckpointHandler`'s: the most GB (10^9 bytes) of this process's
        shards in flight in a save's background write, from host copy to written (None: no bound). As with
        Orbax, what save() copies before it returns (leaves stored exactly) is not counted.
      restore_concurrent_gb: as Orbax's: the most GB of leaves a restore holds at once; with a bound it decodes
        one leaf at a time, codes included (None: no bound; the codes of every leaf are decoded up front, in
        parallel).
      background: run a save's configuration search and encoders after save() returns, in Orbax's commit
        thread, on a device copy of the state (`save.snapshot`) taken before it returns; save() then blocks
        only for planning and that copy, and the training loop goes on while the search (its eval_fn calls
        included) and the first save's compilation run. Costs one more copy of the saved state on its
        device(s) while a save is in flight. None (default): in the background when this is the only process
        and every array of the state and grads lives on one device; otherwise on the caller's thread, because
        the encoders of sharded arrays run cross-device collectives, and collectives launched from two threads
        (training's and the save's) may be queued in different orders on different devices and deadlock.
        True forces it (a single-device state only); False keeps it on the caller's thread. In the background,
        eval_fn is called from another thread while training runs (it must not share mutable state with the
        training loop, such as a data iterator), and its errors (a non-numeric value: TypeError) surface at
        the next save() or wait_until_finished(), as Orbax's background errors do; the step is then not
        committed.
    """

    def __init__(self, config: CompressionConfig | None = None, *, base=None,
                 multiprocessing_options: options_lib.MultiprocessingOptions = options_lib.MultiprocessingOptions(),
                 save_concurrent_gb: float | None = None, restore_concurrent_gb: float | None = None,
                 background: bool | None = None):
        for name, gb in (("save_concurrent_gb", save_concurrent_gb), ("restore_concurrent_gb", restore_concurrent_gb)):
            if gb is not None and not gb > 0:
                raise ValueError(f"InshrinkCheckpointHandler: {name} must be a positive number of GB or None, not "
                                 f"{gb!r}")
        self._save_bytes = None if save_concurrent_gb is None else int(save_concurrent_gb * 10**9)
        self._restore_bytes = None if restore_concurrent_gb is None else int(restore_concurrent_gb * 10**9)
        if background not in (None, True, False):
            raise TypeError(f"InshrinkCheckpointHandler: background must be None, True or False, not {background!r}")
        self._background = background
        self.config = config or CompressionConfig()
        self.base = None if base is None else BaseCheckpoint(base)
        self._multiprocessing = multiprocessing_options
        # (root, item) -> (the state of its last committed save or restore, the result of a save in flight)
        self._states: dict[tuple[str, str], tuple[save.ItemState, concurrent.futures.Future | None]] = {}
        self._threads = max(1, min(4, os.cpu_count() or 1))

    def _process(self) -> tuple[int, int, bool]:
        """(this process's writer index, number of writers, whether it is the primary host)."""
        mp, me = self._multiprocessing, jax.process_index()
        if mp.primary_host is None:
            return 0, 1, True
        active = sorted(mp.active_processes) if mp.active_processes else list(range(jax.process_count()))
        return active.index(me), len(active), me == mp.primary_host

    def _state(self, root, item: str) -> save.ItemState:
        """The state the next save of (root, item) builds on: the last save's if it was committed, else the one
        before it; with a chain only while its object is committed (else the next save is a keyframe)."""
        key = (str(root), item)
        state, pending = self._states.get(key, (save.ItemState(), None))
        if pending is not None and pending.done() and pending.exception() is None:
            new = pending.result()
            state = new if store.is_committed(root, item, new.object_id) else dataclasses.replace(state, quant=new.quant)
            self._states[key] = (state, None)
        if state.object_id is not None and not store.is_committed(root, item, state.object_id):
            state = state.choices()
        return state

    def _in_background(self, plan: save.Plan) -> bool:
        """Whether this save's search and encoders run after save() returns (see `background`)."""
        one_device = all(len(x.sharding.device_set) == 1 for x in [*plan.leaves, *plan.grads]
                         if isinstance(x, jax.Array))
        if self._background is None:
            return jax.process_count() == 1 and one_device
        if self._background and not (jax.process_count() == 1 and one_device):
            raise ValueError("InshrinkCheckpointHandler(background=True) needs a single-process job whose state "
                             "and grads are each on one device (sharded encoders run collectives, which must "
                             "not be launched from two threads); use background=None or False")
        return self._background

    async def async_save(self, directory, args: "InshrinkSave" = None, **kwargs):
        with _COLLECTOR_PAUSED:
            return await self._async_save(directory, _save_args(args))

    async def _async_save(self, directory, args: "InshrinkSave"):
        started = time.perf_counter()
        cfg = self.config
        root, item, step = store.locate(directory)
        process, count, primary = self._process()
        state = self._state(root, item)
        try:
            save.check_eval_fn(cfg, args.eval_fn)
            plan = save.plan(args.state, args.grads, args.labels, cfg, self.base)
            if self.base is not None:
                self.base.check(directory)
            offsets = [self.base.values(plan.base_of[i], plan.leaves[i]) if i in plan.base_of else None
                       for i in plan.weights]
            base_info = self.base.describe() if self.base else None
            if self._in_background(plan):
                plan, dispatched = save.snapshot(plan), None
            else:
                dispatched = save.dispatch(plan, cfg, args.eval_fn, state, offsets, base_info, primary, started)
        except Exception:
            if primary:
                _discard_temporary(directory)
            raise
        blocking = time.perf_counter() - started
        object_id = store.new_object_id(root, item, step)
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._states[(str(root), item)] = (state, result)

        async def commit():
            with _COLLECTOR_PAUSED, _SHORT_SWITCHES:
                await commit_held()

        async def commit_held():
            try:
                d = dispatched
                if d is None:  # the search and the encoders, on the snapshot, off the caller's thread
                    d = await asyncio.to_thread(save.dispatch, plan, cfg, args.eval_fn, state, offsets, base_info,
                                                primary, started)
                    d = dataclasses.replace(d, blocking=blocking)
                result.set_result(await save.write(d, directory, object_id, state, cfg, process, count,
                                                   primary, self._threads, self._save_bytes))
            except BaseException as e:
                result.set_exception(e)
                raise

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name="inshrink_save")]

    def save(self, directory, args: "InshrinkSave" = None, **kwargs):
        async def run():
            for f in await self.async_save(directory, args=args) or []:
                f.result()

        asyncio_utils.run_sync(run())

    def finalize(self, directory) -> None:
        # Runs once on the primary host after every process finished writing, before Orbax's rename.
        store.finalize(directory)

    def restore(self, directory, args: "InshrinkRestore" = None, **kwargs):
        with _COLLECTOR_PAUSED:
            return self._restore(directory, _restore_args(args))

    def _restore(self, directory, args: "InshrinkRestore | None"):
        try:
            reader = store.Reader(directory)
        except store.OrbaxWrittenStep:
            return _restore_orbax_written(directory, args)
        chained: dict = {}
        target, leaf_targets = None if args is None else args.item, None
        if args is not None and args.restore_args is not None:
            if target is None:
                leaf_targets = _leaf_targets(reader, args.restore_args)
            else:
                target = _with_restore_args(reader, target, args.restore_args)
        out = restore.restore(reader, target, self._threads, chained,
                              partial=args is not None and args.partial_restore, leaf_targets=leaf_targets,
                              concurrent_bytes=self._restore_bytes)
        # Continue the chain from the restored step (its codes and reconstruction are on disk, committed, and
        # now held here: the reconstruction as a copy, since the caller may donate what it got), and the search
        # from its configuration.
        arrays = {k: v for k, v in chained.items() if isinstance(v, jax.Array)}
        recon = {k: save.auto_axes(c) for k, c in zip(arrays, save.copies(list(arrays.values())))}
        self._states[(str(reader.root), reader.item)] = (save.state_of_restore(reader, recon), None)
        return out

    def metadata(self, directory) -> dict:
        """The figures of the step item at `directory` (`records.Figures`), and under "tree" the saved tree as a
        restore target (`restore.abstract_tree`: `jax.ShapeDtypeStruct` leaves with the saved shardings), what
        an Orbax user builds an abstract target from: `mngr.item_metadata(step)["tree"]`."""
        reader = store.Reader(directory)
        return {**reader.figures(), "tree": restore.abstract_tree(reader)}

    @classmethod
    def typestr(cls) -> str:
        return "inshrink_jax.InshrinkCheckpointHandler"


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
        uncompressed state at the same step is at most `CompressionConfig.epsilon`. Called once for the
        uncompressed state and once per candidate, on the thread that calls `save()` or, for a save in the
        background (`InshrinkCheckpointHandler(background=...)`), in Orbax's commit thread. None: the search uses the
        data-free proxy (`CompressionConfig.proxy_budget`, epsilon unless set), and the figures say so.
      labels: per-leaf policies that override the defaults (policy.py): a callable `(key path, leaf) ->
        "quantize" | "lossless" | "drop" | None`, or a tree with the structure of `state` (or a prefix of it)
        whose leaves are such policies or None.
    """

    state: Any
    grads: Any = None
    eval_fn: Callable[[Any], Any] | None = None
    labels: Any = None


@ocp.args.register_with_handler(InshrinkCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class InshrinkRestore(ocp.args.CheckpointArgs):
    """Restore args.

    Attributes:
      item: None to restore the saved tree (nested dicts and lists, arrays on the default device); or a tree of
        the saved structure whose leaves are arrays or `jax.ShapeDtypeStruct`s (with `sharding=` to restore
        straight into that layout; PRNG keys too) or NumPy arrays (restored as NumPy). A leaf whose target has
        another numeric dtype than the saved one is cast to it, as Orbax casts (float32 saved, bfloat16 target).
      partial_restore: the target may name only part of the saved tree: a dict target may leave keys out
        (`{"params": ...}` of a saved `{"params": ..., "opt_state": ...}`), and a None in the target stands for
        everything saved under it (`state.replace(opt_state=None)` of a Flax TrainState), restored as None. Only
        the named leaves are read. A leaf of `...` (Orbax's `ocp.PLACEHOLDER`) is not read and stays `...`.
      restore_args: Orbax's per-leaf `ocp.ArrayRestoreArgs` / `ocp.RestoreArgs`, matched to the target's leaves
        (or, without a target, the saved tree's) by key path: their sharding (or mesh and mesh_axes), dtype,
        global_shape and restore_type (`np.ndarray`: restored as NumPy) make that leaf's target; the target's
        leaf may then be a placeholder of any type (`object()`, 0). `ocp.checkpoint_utils.construct_restore_args`
        makes them from an abstract tree.
    """

    item: Any = None
    partial_restore: bool = False
    restore_args: Any = None


def _save_args(args) -> "InshrinkSave":
    """InshrinkSave, or Orbax's StandardSave / PyTreeSave (the state only: no gradients, no eval_fn) as one."""
    if isinstance(args, InshrinkSave):
        return args
    if isinstance(args, (ocp.args.StandardSave, ocp.args.PyTreeSave)):
        if args.save_args is not None:
            raise ValueError(f"{type(args).__name__}(save_args=...) is not supported by InshrinkCheckpointHandler "
                             "(its per-leaf dtype and aggregation options have no meaning here): pass the state "
                             "alone, or inshrink_jax.InshrinkSave(state, grads=..., eval_fn=...)")
        for name in ("custom_metadata", "ocdbt_target_data_file_size"):
            if getattr(args, name, None) is not None:
                raise ValueError(f"{type(args).__name__}({name}=...) is not supported by InshrinkCheckpointHandler: "
                                 "pass the state alone")
        return InshrinkSave(args.item)
    raise ValueError("InshrinkCheckpointHandler.save needs `args=inshrink_jax.InshrinkSave(state, ...)` (or Orbax's "
                     f"StandardSave(state) through inshrink_jax.handler_registry), got {args!r:.200}")


def _restore_args(args) -> "InshrinkRestore | None":
    """InshrinkRestore, or Orbax's StandardRestore / PyTreeRestore (their target; PyTreeRestore's
    partial_restore) as one. None stays None: the saved tree."""
    if args is None:
        return args
    if isinstance(args, InshrinkRestore):
        return args
    if isinstance(args, ocp.args.StandardRestore):
        if args.fallback_sharding is not None:
            raise ValueError("StandardRestore(fallback_sharding=...) is not supported by InshrinkCheckpointHandler: "
                             "give each leaf of the target its sharding (jax.ShapeDtypeStruct(..., sharding=...))")
        return InshrinkRestore(args.item)
    if isinstance(args, ocp.args.PyTreeRestore):
        if args.legacy_transform_fn is not None or args.transforms is not None:
            raise ValueError("PyTreeRestore(transforms=, legacy_transform_fn=) is not supported by "
                             "InshrinkCheckpointHandler: restore the saved tree and transform it yourself")
        return InshrinkRestore(args.item, partial_restore=args.partial_restore, restore_args=args.restore_args)
    raise ValueError("InshrinkCheckpointHandler.restore needs `args=inshrink_jax.InshrinkRestore(target)` (or "
                     f"Orbax's StandardRestore(target) through inshrink_jax.handler_registry), got {args!r:.200}")


def _with_restore_args(reader: store.Reader, item, restore_args):
    """The restore target that Orbax's `restore_args` (InshrinkRestore.restore_args) describe for `item`: each of
    its leaves with restore args at its keys becomes `_arg_target`."""
    by_keys = _by_keys(restore_args)

    def target(path, t):
        a, m = by_keys.get(_keys(path)), reader.leaves.get(jax.tree_util.keystr(path))
        return t if a is None or m is None or t is Ellipsis or t is None else _arg_target(a, m, t)

    return jax.tree_util.tree_map_with_path(target, item)


def _leaf_targets(reader: store.Reader, restore_args) -> dict:
    """Without a target: {saved leaf: its `_arg_target`} for the saved leaves that `restore_args` name, matched by
    their keys alone (a saved TrainState's `.params` is the `["params"]` of the nested dicts such a restore
    gives)."""
    by_keys = _by_keys(restore_args)
    return {m.keystr: _arg_target(a, m, None) for m in reader.manifest.leaves
            if (a := by_keys.get("/".join(str(key) for _, key in m.path))) is not None}


def _keys(path) -> str:
    """A key path by its keys alone, whether they are dict keys, attribute names or sequence indices."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _by_keys(restore_args) -> dict:
    """{`_keys` of its path: args} of each leaf of a tree of Orbax RestoreArgs."""
    return {_keys(p): a for p, a in jax.tree_util.tree_flatten_with_path(
        restore_args, is_leaf=lambda x: isinstance(x, ocp.RestoreArgs))[0] if isinstance(a, ocp.RestoreArgs)}


def _arg_target(a, m, t):
    """A leaf's restore target from its Orbax restore args `a`, its target leaf `t` (any placeholder, or None)
    and its saved record `m`: a `jax.ShapeDtypeStruct` (a NumPy array for `restore_type=np.ndarray`) of the
    args' shape, dtype and sharding (or mesh and mesh_axes), falling back to the leaf's, then to the saved ones."""
    if m.kind == "scalar":
        return t
    shape = tuple(getattr(a, "global_shape", None) or getattr(t, "shape", None) or m.shape)
    dtype = a.dtype or getattr(t, "dtype", None) or m.dtype
    if a.restore_type is np.ndarray:
        return np.zeros(shape, dtype)
    sharding = getattr(a, "sharding", None)
    if sharding is None and getattr(a, "mesh", None) is not None and a.mesh_axes is not None:
        axes = a.mesh_axes
        sharding = jax.sharding.NamedSharding(a.mesh, axes if isinstance(axes, jax.sharding.PartitionSpec)
                                              else jax.sharding.PartitionSpec(*axes))
    if sharding is None and not isinstance(t, np.ndarray):
        sharding = getattr(t, "sharding", None)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _restore_orbax_written(directory, args: "InshrinkRestore | None"):
    """A step that Orbax's PyTree / Standard handler wrote (a run moved over to inshrink_jax keeps its earlier
    steps in the same root): restored by Orbax's PyTreeCheckpointHandler with the target's structure, shardings
    and dtypes (`ocp.checkpoint_utils.construct_restore_args`, or the given restore_args). The chain is not
    touched: the next save of this handler goes on from its own last save, or starts with a keyframe."""
    target = None if args is None else args.item
    restore_args = None if args is None else args.restore_args
    if restore_args is None and target is not None:
        restore_args = ocp.checkpoint_utils.construct_restore_args(
            jax.tree.map(lambda x: x if isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray)) else
                         np.asarray(x), target))
    orbax_handler = ocp.PyTreeCheckpointHandler()
    try:
        return orbax_handler.restore(directory, args=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=args is not None and args.partial_restore))
    finally:
        orbax_handler.close()


def handler_registry(handler: InshrinkCheckpointHandler | None = None, item: str | None = None):
    """An Orbax handler registry that sends `item` (None: every item) to `handler` for inshrink_jax's args *and*
    Orbax's `StandardSave` / `StandardRestore` / `PyTreeSave` / `PyTreeRestore`, so code written for Orbax's
    standard handler keeps its call sites:

        mngr = ocp.CheckpointManager(root, handler_registry=ij.handler_registry(ij.InshrinkCheckpointHandler()))
        mngr.save(step, args=ocp.args.StandardSave(state))   # compressed, without gradients or an eval_fn
        mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))

    (`item_handlers=` takes one args type per handler, so it cannot do this.) Orbax's args carry no gradients
    or eval_fn: such saves use magnitude as sensitivity and the data-free proxy of the search;
    `InshrinkSave(state, grads=, eval_fn=)` through the same manager gives them."""
    from orbax.checkpoint import handlers

    handler = handler or InshrinkCheckpointHandler()
    registry = handlers.DefaultCheckpointHandlerRegistry()
    for args_type in (InshrinkSave, InshrinkRestore, ocp.args.StandardSave, ocp.args.StandardRestore,
                      ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
        registry.add(item, args_type, handler)
    return registry


def restore_latest(manager: ocp.CheckpointManager, args: "InshrinkRestore | None" = None) -> tuple[int, Any]:
    """(step, restored state) of the newest step of `manager` that restores: a resuming job's way past a latest
    step that cannot be read (a damaged or partly copied file). Each step skipped gets a warning naming it and
    why; when none restores, CheckpointCorruptError lists every step's problem. `args` as for
    `manager.restore` (None: the saved tree)."""
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(f"{manager.directory}: no steps to restore")
    problems = []
    for step in steps:
        try:
            return step, manager.restore(step, args=args or InshrinkRestore())
        except store.CheckpointCorruptError as e:
            problems.append(f"step {step}: {e}")
            warnings.warn(f"skipping step {step}, which cannot be restored: {e}", stacklevel=2)
    raise store.CheckpointCorruptError(f"{manager.directory}: no step restores. " + "; ".join(problems))
