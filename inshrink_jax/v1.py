"""The Orbax v1 adapter: `Compressed`, a checkpointable for `ocp.v1` checkpointers (`orbax.checkpoint.v1`, in
orbax-checkpoint 0.12 also `orbax.checkpoint.experimental.v1`).

    ckptr = ocp.v1.training.Checkpointer(root, preservation_policy=LatestN(3))
    ckptr.save_checkpointables(step, {"state": ij.Compressed(state, grads=ema, eval_fn=eval_fn)})
    state = ckptr.load_checkpointables(step, {"state": ij.Compressed(abstract_state)})["state"].state

`Compressed` is a v1 `StatefulCheckpointable`: Orbax calls its `save` and `load`, whatever the checkpointable's
name, without any handler registration. Both run the v0 handler's pipeline (save.py, restore.py, store.py: the
same files on disk, readable by either API and by `inshrink-jax`); only Orbax's protocol lives here.

To keep v1 call sites that save plain pytrees, `registry(config)` is v1's handler registry with Orbax's
`PyTreeHandler` replaced by ours (`PyTreeHandler` below), for a `Context`:

    ctx = ocp.v1.Context()
    ctx.checkpointables.registry = ij.v1_registry(cfg)
    with ctx:
        ckptr.save(step, state)            # compressed with cfg (no grads or eval_fn: magnitude, proxy search)
        state = ckptr.load(step, abstract_state)

`ckptr.metadata(step)`, and a load that must find the pytree's name by itself, do not work on these steps: v1
recognises a pytree by Orbax's own `_METADATA` file, which is not written; `checkpointables_metadata(step)` and
`load_checkpointables(step)` name it.

A delta chain needs the handler that wrote the last save (it holds that save's codes and reconstruction). v1
checkpointers make their handlers per call, so this module keeps one `InshrinkCheckpointHandler` per (root, item,
configuration) for the life of the process: a restarted `Checkpointer` in the same process continues the chain,
and a new process continues it after loading a step, as with the v0 handler. Retention by a v1 preservation
policy is safe for chains for the same reason as with `CheckpointManager`: delta bases live in the object store,
outside the step directories, and are collected only when no step needs them.

Single process only for now: Orbax's v1 protocol has no hook that runs once on the primary host after every
process finished writing (the v0 handler's `finalize`), which a multi-host save needs; use the v0 handler with
`CheckpointManager` there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, Callable

import jax

from orbax.checkpoint.experimental.v1 import handlers as v1_handlers

from inshrink_jax import restore, store
from inshrink_jax.config import CompressionConfig
from inshrink_jax.handler import InshrinkCheckpointHandler, InshrinkRestore, InshrinkSave

_HANDLERS: dict[tuple[str, str, CompressionConfig], InshrinkCheckpointHandler] = {}
_LOCK = threading.Lock()


def _handler(directory, config: CompressionConfig) -> InshrinkCheckpointHandler:
    """The process's handler of (root, item, config) of an Orbax item directory."""
    root, item, _ = store.locate(directory)
    key = (str(root), item, config)
    with _LOCK:
        if key not in _HANDLERS:
            _HANDLERS[key] = InshrinkCheckpointHandler(config)
        return _HANDLERS[key]


@dataclasses.dataclass
class Compressed:
    """A training state saved compressed through an Orbax v1 checkpointer, and the target it loads into.

    Attributes:
      state: to save, the pytree (as `InshrinkSave.state`); to load, the restore target (as
        `InshrinkRestore.item`: an abstract tree, or None for the saved tree as nested dicts). After a load it
        holds the restored state.
      grads, eval_fn, labels: as `InshrinkSave`'s (saving only).
      config: the compression configuration (saving; keep it the same across a run so saves chain).
      partial_restore: as `InshrinkRestore`'s (loading only).
    """

    state: Any = None
    grads: Any = None
    eval_fn: Callable[[Any], Any] | None = None
    labels: Any = None
    config: CompressionConfig = dataclasses.field(default_factory=CompressionConfig)
    partial_restore: bool = False

    async def save(self, directory):
        """Blocking part on the caller's thread (planning, the search, device work dispatched); returns the
        background write, which also commits the step's records before Orbax renames the step."""
        if jax.process_count() > 1:
            raise NotImplementedError("inshrink_jax.Compressed (Orbax v1) saves from a single process; with "
                                      "several processes use InshrinkCheckpointHandler with a CheckpointManager")
        path = directory.path
        handler = _handler(path, self.config)
        futures = await handler.async_save(path, args=InshrinkSave(self.state, self.grads, self.eval_fn,
                                                                   self.labels))

        async def commit():
            await directory.await_creation()
            for f in futures:
                await asyncio.to_thread(f.result)
            await asyncio.to_thread(handler.finalize, path)

        return commit()

    async def load(self, directory):
        """Restores the step into `state` (in the background Orbax awaits)."""
        handler = _handler(directory, self.config)
        args = InshrinkRestore(self.state, partial_restore=self.partial_restore)

        async def restore():
            self.state = await asyncio.to_thread(handler.restore, directory, args)

        return restore()


class PyTreeHandler(v1_handlers.PyTreeHandler):
    """Orbax v1's `CheckpointableHandler` for pytrees, saving and loading through inshrink_jax (the pipeline of
    `Compressed`) with the class's `config`; which pytrees it takes (`is_handleable`) is Orbax's `PyTreeHandler`'s
    decision. v1 builds handlers from their class with no arguments, so `registry(config)` makes a subclass per
    configuration."""

    config: CompressionConfig = CompressionConfig()

    async def save(self, directory, checkpointable):
        return await Compressed(checkpointable, config=self.config).save(directory)

    async def load(self, directory, abstract_checkpointable=None):
        if abstract_checkpointable is not None:
            self.validate_abstract_leaves_handleable(abstract_checkpointable)
        # v1 loads part of a pytree by giving an abstract tree of that part (Orbax's partial load): a target that
        # leaves keys out restores the leaves it names, as `InshrinkRestore(partial_restore=True)`.
        box = Compressed(abstract_checkpointable, config=self.config, partial_restore=True)
        loading = await box.load(directory)

        async def loaded():
            await loading
            return box.state

        return loaded()

    async def metadata(self, directory):
        """The saved tree with `jax.ShapeDtypeStruct` leaves in their saved shardings (a restore target); for a
        pytree Orbax's own handler wrote (a run that moved to inshrink_jax), Orbax's metadata of it."""
        try:
            reader = await asyncio.to_thread(store.Reader, directory)
        except store.OrbaxWrittenStep:
            return await super().metadata(directory)
        return await asyncio.to_thread(restore.abstract_tree, reader)


def registry(config: CompressionConfig | None = None):
    """v1's global handler registry with `PyTreeHandler` (of `config`) in place of Orbax's PyTreeHandler, under the
    same names and typestrs (so pytrees Orbax's handler wrote still load, through our Orbax-written-step path):
    for `ocp.v1.options.CheckpointablesOptions(registry=...)` in an `ocp.v1.Context`."""
    ours = type("PyTreeHandler", (PyTreeHandler,), {"config": config or CompressionConfig(),
                                                    "__module__": __name__})
    glob = v1_handlers.global_registry()
    out = v1_handlers.local_registry(include_global_registry=False)
    for handler, name in glob.get_all_entries():
        typestrs = list(glob.get_secondary_typestrs(handler) or [])
        if isinstance(handler, type) and issubclass(handler, v1_handlers.PyTreeHandler):
            typestrs.append(f"{handler.__module__}.{handler.__qualname__}")
            handler = ours
            if name is None and any(h is ours and n is None for h, n in out.get_all_entries()):
                continue
        out.add(handler, checkpointable_name=name, secondary_typestrs=typestrs or None)
    return out
