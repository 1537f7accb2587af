"""The `inshrink-jax` command: see what is on disk, check it, get a plain Orbax checkpoint out of it, collect
unreferenced data.

    inshrink-jax inspect PATH [--step N] [--item NAME] [--json]
    inshrink-jax verify  PATH [--step N] [--item NAME]
    inshrink-jax export  PATH --step N OUT [--item NAME]
    inshrink-jax copy    PATH --step N OUT [--item NAME]
    inshrink-jax plot    PATH [--out FILE.png] [--item NAME]
    inshrink-jax gc      PATH [--item NAME] [--apply]

PATH is a `CheckpointManager` root (the directory holding the step directories), local or any root Orbax accepts
(`gs://bucket/run`: every read and write goes through `etils.epath`, as the handler's do). `--item` picks the item
of a composite checkpoint; by default the one item written by inshrink_jax. `verify` exits 1 on any problem and
names it (step, item, file, leaf); `gc` only lists what it would delete unless `--apply` is given.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys

import humanize
import jax.numpy as jnp
import numpy as np
from etils import epath
from rich import box, console, table

from inshrink_jax import quantize, records, restore, store


class _Progress:
    """Progress of a long command on stderr: a rich progress bar on a terminal, otherwise a plain line per 10%."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done, self._last = what, total, 0, -1
        self._bar = None
        if sys.stderr.isatty():
            from rich import progress

            self._bar = progress.Progress(
                progress.TextColumn("{task.description}"), progress.BarColumn(), progress.MofNCompleteColumn(),
                progress.TextColumn("{task.fields[label]}"), console=console.Console(stderr=True))
            self._bar.start()
            self._task = self._bar.add_task(what, total=total, label="")

    def step(self, label: str = "") -> None:
        self.done += 1
        pct = 100 * self.done // max(self.total, 1)
        if self._bar is not None:
            self._bar.update(self._task, advance=1, label=label)
            if self.done == self.total:
                self._bar.stop()
        elif pct // 10 != self._last // 10 or self.done == self.total:
            sys.stderr.write(f"{self.what}: {self.done}/{self.total} {label}\n")
            sys.stderr.flush()
        self._last = pct


class _Out:
    """Text and rich tables on stdout: at the terminal's width, or, into a pipe or a file, 200 columns wide with
    no trailing blanks and each text line whole (a row per line, for grep and the like)."""

    def __init__(self):
        self.tty = sys.stdout.isatty()
        self.console = console.Console(highlight=False, width=None if self.tty else 200,
                                       file=None if self.tty else io.StringIO())

    def __call__(self, *things, text: bool = False) -> None:
        self.console.print(*things, markup=False, soft_wrap=text and not self.tty)
        if not self.tty:
            buf = self.console.file
            sys.stdout.write("".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines()))
            buf.seek(0)
            buf.truncate()


# ------------------------------------------------------------------------------------------------ locating
def _join(root, *parts: str) -> str:
    """`root` joined with `parts`, as a string (a local path or a URI such as gs://bucket/run)."""
    return str(epath.Path(root).joinpath(*parts))


def _names(directory) -> list[str]:
    """The names in `directory`, sorted ([] if it is not a directory)."""
    d = epath.Path(directory)
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


_STEP_NAME = re.compile(r"(?:.+_)?(\d+)")  # Orbax's step names: [<step_prefix>_]<step, zero-padded or not>


def _steps(root: str) -> dict[int, str]:
    """Step number -> step directory name of the committed steps under `root` (any `step_prefix` and
    `step_format_fixed_length` of `CheckpointManagerOptions`)."""
    if not epath.Path(root).is_dir():
        raise SystemExit(f"inshrink-jax: {root} is not a directory")
    if _standalone(root):  # a plain ocp.Checkpointer's checkpoint: one save, the directory itself
        return {0: "."}
    out: dict[int, str] = {}
    for d in _names(root):
        m = _STEP_NAME.fullmatch(d)
        if m and store.TMP_SUFFIX not in d and d != store.OBJECTS and epath.Path(_join(root, d)).is_dir():
            if int(m.group(1)) in out:
                raise SystemExit(f"inshrink-jax: {root} holds two directories of step {int(m.group(1))}: "
                                 f"{out[int(m.group(1))]} and {d}")
            out[int(m.group(1))] = d
    return dict(sorted(out.items()))


def _standalone(root: str) -> bool:
    """Whether PATH is a standalone checkpoint (written by a plain `ocp.Checkpointer`), not a manager's root."""
    return epath.Path(_join(root, store.MANIFEST)).exists() and store.is_standalone(root)


def _item(root: str, steps: dict[int, str], item: str | None) -> str:
    """The item name: `item`, or the one item of the steps whose manifest was written by inshrink_jax (without
    steps: the one item of the object store)."""
    if _standalone(root):
        return "."
    found = set() if steps else set(_names(_join(root, store.OBJECTS)))
    for name in steps.values():
        for sub in _names(_join(root, name)):
            if epath.Path(_join(root, name, sub, store.MANIFEST)).exists():
                found.add(sub)
    if item is not None:
        ours = item in found or any(epath.Path(_join(root, name, item, f)).exists() for name in steps.values()
                                    for f in (store.COMMIT, store.ORBAX_METADATA))
        if steps and not ours:  # no step holds any record of ours: another handler's item, not a damaged one
            raise SystemExit(f"inshrink-jax: item {item!r} under {root} was not written by inshrink_jax (no step "
                             f"holds its {store.MANIFEST} or {store.COMMIT}); its items written by inshrink_jax: "
                             f"{sorted(found)}")
        return item
    if len(found) == 1:
        return found.pop()
    if not found:
        raise SystemExit(f"inshrink-jax: no inshrink_jax checkpoint item under {root} (no step directory holds a "
                         f"{store.MANIFEST}); PATH must be a CheckpointManager root")
    raise SystemExit(f"inshrink-jax: several items under {root}: {sorted(found)}; pick one with --item")


def _select(steps: dict[int, str], step: int | None, root: str) -> dict[int, str]:
    if step is None:
        return steps
    if step not in steps:
        raise SystemExit(f"inshrink-jax: step {step} is not under {root}; steps there: {list(steps)}")
    return {step: steps[step]}


# ------------------------------------------------------------------------------------------------- inspect
def _summary(directory: str) -> dict:
    reader = store.Reader(directory)
    figs = reader.figures()
    leaves = [{k: v for k, v in m.to_json().items() if k in ("keystr", "kind", "part", "shape", "dtype", "method",
                                                            "bins", "layer_type", "base_leaf")}
              for m in reader.manifest.leaves]
    return {"directory": directory, "object": reader.object_id, "bases": reader.own.commit["bases"],
            "objects": sorted(reader.commit["objects"]), "leaves": leaves,
            "base_checkpoint": (reader.manifest.base or {}).get("directory"),
            "config": reader.manifest.config, **figs}


def _files(top) -> list[epath.Path]:
    """Every file under `top` (none if it is gone). `Path.walk` is not used: on a gs:// root, etils gives back
    its directories without the scheme."""
    top = epath.Path(top)
    try:
        entries = list(top.iterdir()) if top.is_dir() else []
    except FileNotFoundError:
        return []
    out = []
    for p in entries:
        out += _files(p) if p.is_dir() else [p]
    return out


def _tree_bytes(path) -> int:
    """Bytes of the files under `path` (0 if it is gone)."""
    total = 0
    for f in _files(path):
        try:
            total += f.stat().length or 0
        except FileNotFoundError:
            continue
    return total


def _disk_usage(root: str, item: str, out: dict, names: dict) -> tuple[dict, dict]:
    """(step -> bytes on disk of everything a restore of it reads: its step directory and every object of its
    chain; the root's bytes by kind: step directories, objects some listed step owns, objects kept only as delta
    bases, other files)."""
    objects = {}
    item = store.STANDALONE if _standalone(root) else item

    def object_bytes(ref):
        if ref not in objects:
            objects[ref] = _tree_bytes(str(store.object_path(root, item, ref)))
        return objects[ref]

    needs = {s: _tree_bytes(root) if _standalone(root) else
             _tree_bytes(_join(root, names[s])) + sum(object_bytes(r) for r in f["objects"])
             for s, f in out.items() if "error" not in f and f is not ORBAX_STEP}
    owned = {f["object"] for f in out.values() if "error" not in f and f is not ORBAX_STEP}
    store_dir = str(store.objects_dir(root, item))
    stored = {n: _tree_bytes(_join(store_dir, n)) for n in _names(store_dir)}
    steps = _tree_bytes(root) - _tree_bytes(_join(root, store.OBJECTS)) if _standalone(root) else \
        sum(_tree_bytes(_join(root, n)) for n in names.values())
    kinds = {"step directories": steps, "objects of listed steps": sum(v for n, v in stored.items() if n in owned),
             "objects kept as delta bases": sum(v for n, v in stored.items() if n not in owned)}
    kinds["other files"] = _tree_bytes(root) - sum(kinds.values())
    return needs, kinds


def _fmt_bytes(n: float) -> str:
    return humanize.naturalsize(n, format="%.1f")


def _ratio(r) -> str:
    return "not stored" if r is None else f"{r:.1f}x"


# inspect's entry for a step item that Orbax's own handler wrote (a run moved over in place).
ORBAX_STEP = {"written_by": "orbax"}


def _inspect_steps(root: str, steps: dict[int, str], step: int | None, item: str | None,
                   what: str) -> tuple[str, dict, dict]:
    """(item, step -> summary (or {"error": ...}, or ORBAX_STEP) with its `needs_bytes`, the root's bytes by kind) of
    the chosen steps of `steps` (`_steps(root)`), with progress."""
    item = _item(root, steps, item)
    out = {}
    chosen = _select(steps, step, root)
    progress = _Progress(what, len(chosen))
    for s, name in chosen.items():
        try:
            out[s] = _summary(_join(root, name, item))
        except store.OrbaxWrittenStep:
            out[s] = ORBAX_STEP
        except store.CheckpointCorruptError as e:
            out[s] = {"error": str(e)}
        progress.step(f"step {s}")
    needs, kinds = _disk_usage(root, item, out, steps)
    for s, n in needs.items():
        out[s]["needs_bytes"] = n
    return item, out, kinds


def describe_choice(q: dict | str, metric: bool = False) -> str:
    """A quantization configuration as a search record or manifest holds it (a QuantConfig as a dict, or
    "lossless"), in words: "6 bins" or, for a uniform quantizer (the fine keyframe), "254 cells of 0.125 RMS",
    then its pruning (with its metric if `metric`) and protection; entropy-constrained levels: "0 + 14 levels at
    rate 0.2, protect 0.00%" (their zero level is their pruning)."""
    if q == "lossless":
        return "lossless"
    if q.get("rate"):
        return f"0 + {q['bins']} levels at rate {q['rate']}, protect {q['protect_fraction']:.2%}"
    levels = f"{q['bins']} cells of {q['step']} RMS" if q.get("step") else f"{q['bins']} bins"
    prune = f"prune {q['prune_fraction']:.0%}" + (f" ({q['prune_metric']})" if metric else "")
    return f"{levels}, {prune}, protect {q['protect_fraction']:.2%}"


def _degradation(f: dict) -> float | None:
    """The eval_fn's relative change that a save measured for its chosen configuration (None: not measured)."""
    d = f["search"].get("degradation") if isinstance(f.get("search"), dict) else None
    return d if isinstance(d, (int, float)) and d == d and abs(d) != float("inf") else None


def inspect(root: str, step: int | None, item: str | None, as_json: bool) -> int:
    steps = _steps(root)
    if not steps and step is None and epath.Path(_join(root, store.OBJECTS)).is_dir():
        print("{}" if as_json else f"{root}: no steps")
        return 0
    item, out, kinds = _inspect_steps(root, steps, step, item, "inspect")
    failed = int(any("error" in f for f in out.values()))  # exit 1 when a step cannot be read, as verify does
    if as_json:
        print(json.dumps({str(k): v for k, v in out.items()}, indent=1))
        return failed
    show = _Out()
    show(f"{root}: " + ("a standalone checkpoint (ocp.Checkpointer)" if _standalone(root) else
                        f"item {item!r}, {len(steps)} step(s)"), text=True)
    t = table.Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("step", "kind", "depth", "stored", "needs", "params", "optim.", "whole", "degr.", "save s"):
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column("configuration", overflow="fold")
    for s, f in out.items():
        if "error" in f:
            t.add_row(str(s), "ERROR", *[""] * 8, f["error"], style="red")
            continue
        if f is ORBAX_STEP:
            t.add_row(str(s), "orbax", *[""] * 8, "written by Orbax's own handler (before the run moved to "
                      "inshrink_jax): restores through InshrinkCheckpointHandler; not inspected")
            continue
        conf = "lossless" if f["quant"] is None else describe_choice(f["quant"], metric=True)
        degr = "-" if _degradation(f) is None else f"{_degradation(f):+.2%}"
        t.add_row(str(s), f["kind"], str(f["chain_depth"]), _fmt_bytes(sum(f["stored_bytes"].values())),
                  _fmt_bytes(f["needs_bytes"]), _ratio(f["ratio"]["params"]), _ratio(f["ratio"]["optimizer"]),
                  f"{f['ratio']['total']:.1f}x", degr, f"{f['total_seconds']:.2f}",
                  f"{conf}; optimizer {f['config'].get('optimizer', 'lossless')}")
    show(t)
    show(f"on disk: {_fmt_bytes(sum(kinds.values()))} in all (" + ", ".join(
        f"{k} {_fmt_bytes(v)}" for k, v in kinds.items()) + "); 'stored': a save's own bytes, 'needs': what "
        "restoring it reads, its delta chain included; 'degr.': the eval_fn's change the save measured; file "
        "sizes: `du` also counts directories)", text=True)
    if step is not None and "error" not in out[step]:
        f = out[step]
        show(f"\nstep {step}: object {f['object']}, delta bases {f['bases'] or 'none (keyframe)'}; search "
             f"{f['search'].get('mode')}; sensitivity: {f['sensitivity']}", text=True)
        if f["base_checkpoint"]:
            show(f"  weights stored as residuals against the base checkpoint {f['base_checkpoint']}", text=True)
        show(f"  raw bytes {f['raw_bytes']}, stored bytes {f['stored_bytes']}", text=True)
        show(f"  blocking {f['blocking_seconds']:.3f} s, total {f['total_seconds']:.3f} s", text=True)
        leaves = table.Table(box=box.SIMPLE_HEAD, pad_edge=False)
        leaves.add_column("leaf", overflow="fold", ratio=3)  # long key paths wrap inside their column
        for name in ("stored as", "shape", "dtype"):
            leaves.add_column(name, overflow="fold", ratio=1)
        for m in f["leaves"]:
            detail = m["kind"] + (f" ({m['method']}{', residual' if 'base_leaf' in m else ''}, {m['bins']} levels)"
                                  if m["kind"] == "quantized" else "")
            leaves.add_row(m["keystr"], detail, str(m.get("shape", "")), m.get("dtype", ""))
        show(leaves)
    return failed


# ---------------------------------------------------------------------------------------------------- plot
def plot(root: str, item: str | None, out: str) -> int:
    """Draw bytes per save (its own and what restoring it reads) and the degradation each save measured, against
    the step, into the image `out` (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("inshrink-jax plot needs matplotlib: pip install 'inshrink-jax[plot]'") from None
    item, data, kinds = _inspect_steps(root, _steps(root), None, item, "plot")
    good = {s: f for s, f in data.items() if "error" not in f and f is not ORBAX_STEP}
    if not good:
        raise SystemExit(f"inshrink-jax: no step of {root} can be read; nothing to plot (run verify)")
    xs = list(good)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5))
    own = [sum(f["stored_bytes"].values()) for f in good.values()]
    raw = [sum(f["raw_bytes"].values()) for f in good.values()]
    top.plot(xs, own, "o-", label="stored by the save")
    top.plot(xs, [f["needs_bytes"] for f in good.values()], "s--", label="read by its restore (chain included)")
    top.plot(xs, raw, ":", color="grey", label="the state uncompressed")
    top.set_yscale("log")
    top.set_ylabel("bytes")
    top.set_title(f"{root} (item {item!r}): {len(good)} step(s), {_fmt_bytes(sum(kinds.values()))} on disk, "
                  f"{sum(raw) / max(sum(own), 1):.1f}x over the saves", fontsize=9)
    top.legend(fontsize=8)
    measured = [(s, _degradation(f)) for s, f in good.items() if _degradation(f) is not None]
    if measured:
        bottom.plot([s for s, _ in measured], [100 * d for _, d in measured], "o-", label="measured (eval_fn)")
        eps = list(good.values())[-1]["config"].get("epsilon")  # the latest save's
        if eps is not None:
            bottom.axhline(100 * eps, color="red", ls="--", label=f"epsilon {eps:g}")
        bottom.legend(fontsize=8)
    else:
        bottom.text(0.5, 0.5, "no save measured a degradation (saved without an eval_fn)", ha="center",
                    transform=bottom.transAxes)
    bottom.set_ylabel("degradation per save (%)")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    skipped = sorted(set(data) - set(good))
    print(f"{out}: bytes and degradation of {len(good)} step(s) of {root}"
          + (f"; step(s) {', '.join(map(str, skipped))} not drawn (unreadable or written by Orbax)" if skipped else ""))
    return int(any("error" in f for f in data.values()))


# -------------------------------------------------------------------------------------------------- verify
def _verify_step(directory: str) -> list[str]:
    """Every problem of one step's item: records, every segment's checksum and size, every delta chain."""
    try:
        reader = store.Reader(directory)
        for oid in reader.commit["objects"]:
            reader.object(oid)  # commit record and offset tables against their checksums
        reader.base()  # the base checkpoint, if any: there, and the one the step was saved against
    except store.OrbaxWrittenStep:
        raise  # not ours to check: verify lists it
    except store.CheckpointCorruptError as e:
        return [str(e)]
    problems = []
    for meta in reader.manifest.leaves:
        if meta.kind in ("scalar", "dropped"):
            continue
        shards = reader.shards.get(meta.keystr, [])
        if not shards:
            problems.append(f"{store.describe(directory)}: leaf {meta.keystr}: no stored shard")
        for p, entry in shards:
            try:
                with store.reading(directory, f"leaf {meta.keystr}"):
                    _verify_shard(reader, meta, p, entry)
            except store.CheckpointCorruptError as e:
                problems.append(str(e))
    return problems


def _verify_shard(reader: store.Reader, meta: records.Leaf, p: int, entry: records.Shard) -> None:
    """Decode one stored shard through the checked decode path; CheckpointCorruptError names what is wrong."""
    shape = store.box_shape(entry.box)
    if meta.kind != "quantized":  # a PRNG key's dtype is its key data's, uint32
        reader.array(meta.keystr, p, entry.segments["data"], "data", jnp.dtype(meta.dtype), shape)
        return
    if meta.coding == records.CLOSED_LOOP:  # every link of its chain, decoded and summed
        restore.restore_leaf(reader, meta, None)
        return
    codes, _ = reader.codes(meta.keystr, entry.box)
    seg = entry.segments["protected"]
    n = int(np.count_nonzero(codes == quantize.protected_code(meta.bins)))
    if seg.count != n:
        raise store.CheckpointCorruptError(f"{store.describe(reader.directory)}: leaf {meta.keystr}: {n} protected "
                                           f"codes but {seg.count} protected values")
    reader.array(meta.keystr, p, seg, "protected", jnp.dtype(seg.dtype), [n])


def verify(root: str, step: int | None, item: str | None) -> int:
    steps = _steps(root)
    if not steps and step is None and epath.Path(_join(root, store.OBJECTS)).is_dir():
        print(f"{root}: no steps to check")
        return 0
    item = _item(root, steps, item)
    chosen = _select(steps, step, root)
    progress = _Progress("verify", len(chosen))
    problems, foreign = [], []
    for s, name in chosen.items():
        try:
            problems += _verify_step(_join(root, name, item))
        except store.OrbaxWrittenStep:
            foreign.append(s)
        progress.step(f"step {s}")
    if foreign:
        print(f"NOTE step(s) {', '.join(map(str, foreign))}: written by Orbax's own handler, not checked")
    problems = list(dict.fromkeys(problems))  # one line per distinct problem
    for p in problems:
        print(f"PROBLEM {p}")
    print(f"{root}: " + ("standalone checkpoint" if _standalone(root) else f"item {item!r}: {len(chosen)} step(s)")
          + " checked, "
          + ("all good" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


# -------------------------------------------------------------------------------------------------- export
def export(root: str, step: int, item: str | None, out: str) -> int:
    import orbax.checkpoint as ocp

    from inshrink_jax.handler import InshrinkCheckpointHandler, InshrinkRestore

    steps = _steps(root)
    item = _item(root, steps, item)
    directory = _join(root, _select(steps, step, root)[step], item)
    if epath.Path(out).exists():
        raise SystemExit(f"inshrink-jax: {out} exists; export writes a new directory")
    progress = _Progress("export", 2)
    state = InshrinkCheckpointHandler().restore(directory, InshrinkRestore())
    progress.step(f"step {step} decoded")
    reader = store.Reader(directory)
    dropped = [m.keystr for m in reader.manifest.leaves if m.kind == "dropped"]
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out if "://" in out else os.path.abspath(out), state)
    progress.step("written")
    print(f"step {step} of {root} (item {item!r}) written to {out} as a plain Orbax StandardCheckpointer "
          "checkpoint (restore it with ocp.StandardCheckpointer().restore(path)); quantized leaves hold their "
          "decoded values")
    if dropped:
        print(f"  {len(dropped)} leaves were not stored (optimizer policy 'drop') and are exported as zeros, e.g. "
              f"{dropped[0]}")
    return 0


# ---------------------------------------------------------------------------------------------------- copy
def copy(root: str, step: int, item: str | None, out: str) -> int:
    """Copy one step, with every object its restore reads (its own and its delta chain's), into a new root
    `out`: a self-contained checkpoint that restores with the original deleted and accepts further saves."""
    steps = _steps(root)
    if _standalone(root):
        raise SystemExit(f"inshrink-jax: {root} is a standalone checkpoint, self-contained already: copy the "
                         "directory as it is")
    item = _item(root, steps, item)
    name = _select(steps, step, root)[step]
    if epath.Path(out).exists():
        raise SystemExit(f"inshrink-jax: {out} exists; copy writes a new root")
    reader = store.Reader(_join(root, name, item))
    refs = [r for r in reader.commit["objects"] if not store.is_external(r)]
    for r in refs:
        reader.object(r)  # each there and matching the step's records before anything is copied
    progress = _Progress("copy", len(refs) + 1)
    tmp = epath.Path(out + ".inshrink-copy-tmp")
    if tmp.exists():
        tmp.rmtree()
    _copy_tree(_join(root, name), tmp / name)
    progress.step(f"step {step}")
    for r in refs:
        _copy_tree(store.object_path(root, item, r), store.object_path(str(tmp), item, r))
        progress.step(f"object {r}")
    tmp.rename(out)
    external = [r for r in reader.commit["objects"] if store.is_external(r)]
    print(f"step {step} of {root} copied to {out} with {len(refs)} object(s) ({_fmt_bytes(_tree_bytes(out))})"
          + (f"; it still reads its base checkpoint {external[0]}" if external else ""))
    return 0


def _copy_tree(src, dst) -> None:
    """Copy the files under `src` to the same places under `dst` (either local or remote)."""
    src = epath.Path(src)
    for f in _files(src):
        target = epath.Path(dst).joinpath(*f.relative_to(src).parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        f.copy(target)


# ------------------------------------------------------------------------------------------------------ gc
def gc(root: str, item: str | None, apply: bool) -> int:
    steps = _steps(root)
    if _standalone(root):
        print(f"{root}: a standalone checkpoint (one save, its objects inside it): nothing to collect")
        return 0
    item = _item(root, steps, item)
    plan = store.collect_garbage(root, item, dry_run=not apply, concurrent=True)
    if plan is None:
        print(f"{root}: some step's records cannot be read (run verify); nothing is collected")
        return 1
    objects, files = plan
    size = sum(_tree_bytes(store.objects_dir(root, item) / o) for o in objects) if not apply else 0
    verb = "deleted" if apply else "would delete"
    print(f"{root}: item {item!r}: {verb} {len(objects)} unreferenced object(s) and {len(files)} data file(s) of "
          "objects kept only as delta bases" + (f" ({_fmt_bytes(size + sum(s for _, s in files))})"
                                                if not apply else ""))
    for o in objects:
        print(f"  object {o}")
    for f, _ in files:
        print(f"  file {f}")
    pending = [n for n in store.object_names(root, item) if not store.is_committed(root, item, n)]
    if pending:
        print(f"  left alone: {len(pending)} uncommitted object(s) (a save in flight, or one that crashed; the next "
              f"save collects them): {', '.join(sorted(pending))}")
    if not apply and (objects or files):
        print("  (dry run: pass --apply to delete)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from inshrink_jax import __version__

    ap = argparse.ArgumentParser(prog="inshrink-jax", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"inshrink-jax {__version__} (reads checkpoint "
                                                              f"formats {store.OLDEST_READ} to {store.FORMAT_VERSION})")
    sub = ap.add_subparsers(dest="command", required=True)
    root_help = "a CheckpointManager root"
    item_help = "the item to read, when the root holds several (default: the only one)"
    p = sub.add_parser("inspect", help="steps, keyframes and deltas, bytes per part, ratios, config, timings; "
                                       "exit 1 if a step cannot be read")
    p.add_argument("path", help=root_help)
    p.add_argument("--step", type=int, help="this step only, with its leaves (default: every step)")
    p.add_argument("--item", help=item_help)
    p.add_argument("--json", action="store_true", help="every figure as JSON instead of the table")
    p = sub.add_parser("verify", help="check every record, checksum and delta chain; exit 1 on any problem")
    p.add_argument("path", help=root_help)
    p.add_argument("--step", type=int, help="this step only (default: every step)")
    p.add_argument("--item", help=item_help)
    p = sub.add_parser("export", help="write a step as a plain Orbax StandardCheckpointer checkpoint")
    p.add_argument("path", help=root_help)
    p.add_argument("--step", type=int, required=True, help="the step to export")
    p.add_argument("out", help="the directory to write (must not exist)")
    p.add_argument("--item", help=item_help)
    p = sub.add_parser("copy", help="copy a step with the objects it needs into a new root (self-contained)")
    p.add_argument("path", help=root_help)
    p.add_argument("--step", type=int, required=True, help="the step to copy")
    p.add_argument("out", help="the new root to write (must not exist)")
    p.add_argument("--item", help=item_help)
    p = sub.add_parser("plot", help="draw bytes per save and the degradation each save measured (needs matplotlib)")
    p.add_argument("path", help=root_help)
    p.add_argument("--out", default="inshrink.png", help="the image to write (default: inshrink.png)")
    p.add_argument("--item", help=item_help)
    p = sub.add_parser("gc", help="delete data no step references (dry run unless --apply)")
    p.add_argument("path", help=root_help)
    p.add_argument("--item", help=item_help)
    p.add_argument("--apply", action="store_true", help="delete (default: only list what would be deleted)")
    a = ap.parse_args(argv)
    try:
        if a.command == "inspect":
            code = inspect(a.path, a.step, a.item, a.json)
        elif a.command == "verify":
            code = verify(a.path, a.step, a.item)
        elif a.command == "export":
            code = export(a.path, a.step, a.item, a.out)
        elif a.command == "copy":
            code = copy(a.path, a.step, a.item, a.out)
        elif a.command == "plot":
            code = plot(a.path, a.item, a.out)
        else:
            code = gc(a.path, a.item, a.apply)
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at interpreter exit
        return code
    except BrokenPipeError:  # `inshrink-jax inspect ROOT | head`: the reader left; stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
