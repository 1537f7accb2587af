"""The default configuration on the optimizers users train with: does a run resumed from compressed checkpoints
end where the same run without restores ends, whatever the optimizer state holds?

Usage: python benchmarks/bench_optimizers.py [--optimizers lion adafactor ...] [--seeds 3] [--budget STATE=F ...]
           [--rules REGEX=POLICY ...] [--out benchmarks/results/optimizers.md]

Task: a 3-layer MLP with LayerNorm (83k parameters) on a synthetic teacher (10 classes from a noisy linear map of
64 Gaussian inputs), batch 256, 600 steps, a checkpoint every 50 with `CompressionConfig()`, a GradientEMA and the
held-out loss (2,048 other samples) as eval_fn. Each optimizer and seed trains twice on the same batches: once
saving only, and once resuming every 100 steps (5 restores) from the checkpoint just written, by a new manager and
handler. Both runs start from the same initialisation, so their final held-out losses differ only by what the
restores changed (paired: far less noisy than a comparison across seeds, which the table gives as the scale of
run-to-run noise). Bytes: everything the resumed run wrote, against the raw state at every save.

--budget STATE=F codes the first moment `mu` of the optax state type named STATE (ScaleByLionState,
MuonState) within F of the first-moment budget instead of its default (`policy.MOMENT_BUDGETS`: Lion's
`policy.NORMALIZED_BUDGET`, others 1, the full budget Adam's `mu` takes). --rules REGEX=POLICY saves with
`CompressionConfig(policy_rules=...)` of those pairs, e.g. `'\[.muon.\].*\.mu=drop'` restores Muon's momentum as
zeros.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

import inshrink_jax as ij  # noqa: E402
from inshrink_jax import policy  # noqa: E402

STEPS, EVERY, RESUME_EVERY = 600, 50, 100


def _halves(params):
    """multi_transform's labels: the first layer one optimizer, the rest another."""
    return jax.tree_util.tree_map_with_path(lambda k, _: "a" if "Dense_0" in jax.tree_util.keystr(k) else "b",
                                            params)


OPTIMIZERS = {
    "adamw (warm-up, cosine, clipping)": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(optax.warmup_cosine_decay_schedule(0, 3e-3, 50, STEPS))),
    "adam, inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "adam, bfloat16 parameters": lambda: optax.adam(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "sgd": lambda: optax.sgd(0.1),
    "lamb": lambda: optax.lamb(1e-3),
    "adagrad": lambda: optax.adagrad(0.05),
    "multi_transform (adam + sgd momentum)": lambda: optax.multi_transform(
        {"a": optax.adam(1e-3), "b": optax.sgd(0.05, momentum=0.9)}, _halves),
    "schedule-free adamw": lambda: optax.contrib.schedule_free_adamw(1e-3),
    "muon": lambda: optax.contrib.muon(1e-3),
}


class MLP(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        kw = dict(param_dtype=self.dtype, dtype=self.dtype)
        x = nn.LayerNorm(**kw)(nn.gelu(nn.Dense(256, **kw)(x)))
        x = nn.gelu(nn.Dense(256, **kw)(x))
        return nn.Dense(10, **kw)(x)


TEACHER = np.random.default_rng(0).normal(size=(64, 10)).astype(np.float32)


def batch(i: int, n: int = 256):
    r = np.random.default_rng(i)
    x = r.normal(size=(n, 64)).astype(np.float32)
    return x, np.argmax(x @ TEACHER + 0.5 * r.normal(size=(n, 10)), -1)


def loss_fn(params, apply, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(apply({"params": params}, x).astype(jnp.float32), y).mean()


def create_state(name: str, seed: int) -> train_state.TrainState:
    """The MLP (bfloat16 parameters where `name` says so) at initialisation `seed`, trained by `OPTIMIZERS[name]`."""
    model = MLP(jnp.bfloat16 if "bfloat16" in name else jnp.float32)
    params = model.init(jax.random.key(seed), jnp.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=OPTIMIZERS[name]())


@jax.jit
def train_step(s, x, y):
    """(state after one step on the batch, its loss, the gradients)."""
    loss, g = jax.value_and_grad(loss_fn)(s.params, s.apply_fn, x, y)
    return s.apply_gradients(grads=g), loss, g


def run(name: str, seed: int, root: str, resume: bool, rules: tuple = ()) -> tuple[float, int, int]:
    """(final held-out loss, bytes written, raw state bytes summed over the saves) of one run, saved with
    `CompressionConfig(policy_rules=rules)`."""
    state = create_state(name, seed)
    ex, ey = batch(10**6, 2048)
    eval_fn = jax.jit(lambda s: loss_fn(s.params, s.apply_fn, ex, ey))

    def manager():
        return ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(
            ij.CompressionConfig(policy_rules=rules)),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=3))

    shutil.rmtree(root, ignore_errors=True)
    mngr, sens = manager(), ij.GradientEMA(every=EVERY)
    ema = sens.init(state.params)
    raw = 0
    for step in range(1, STEPS + 1):
        state, _, g = train_step(state, *batch(step))
        if sens.active(step):
            ema = sens.update(ema, g)
        if step % EVERY == 0:
            mngr.save(step, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
            raw += sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state, state.step))
                       if hasattr(x, "nbytes"))
            if resume and step % RESUME_EVERY == 0 and step < STEPS:
                mngr.wait_until_finished()
                mngr.close()
                mngr = manager()
                abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
                state = mngr.restore(mngr.latest_step(), args=ij.InshrinkRestore(abstract))
    mngr.wait_until_finished()
    mngr.close()
    return float(eval_fn(state)), report.dir_bytes(root), raw


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS), metavar="NAME")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--budget", nargs="+", default=[], metavar="STATE=F")
    ap.add_argument("--rules", nargs="+", default=[], metavar="REGEX=POLICY")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rules = tuple(tuple(item.rsplit("=", 1)) for item in args.rules)
    try:
        ij.CompressionConfig(policy_rules=rules)  # a bad rule fails here, not after the first reference run
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--rules {' '.join(args.rules)}: {e}") from None
    types = {t.__name__: t for t in policy.MOMENT_FIELDS}
    for item in args.budget:
        name, _, factor = item.partition("=")
        if name not in types or "mu" not in policy.MOMENT_FIELDS[types[name]]:
            raise SystemExit(f"--budget {item}: no optax state {name!r} with a first moment mu among {sorted(types)}")
        policy.MOMENT_BUDGETS[types[name]] = {"mu": float(factor)}
    root = tempfile.mkdtemp()
    cmd = "python benchmarks/bench_optimizers.py" + "".join(
        f" {a}" if a.startswith("--") else f" '{a}'" for a in (sys.argv[1:] if argv is None else argv))
    lines = ["# The default configuration on other optimizers: 5 restores against the same run without them", "",
             f"Command: `{cmd}`", "", __doc__.split("\n\n")[2].replace("\n", " "), "",
             "First moments coded within these fractions of the first-moment budget: " + ", ".join(
                 f"{t.__name__}.mu {f['mu']:g}" for t, f in policy.MOMENT_BUDGETS.items()) + " (every other one: 1)."
             + (" Policy rules: " + ", ".join(f"`{r}` {p}" for r, p in rules) + "." if rules else ""),
             "",
             "| optimizer | final loss, no restores (seeds) | with 5 restores: change (seeds) | mean change | "
             "largest seed-to-seed difference without restores | whole ratio | s |",
             "|---|---|---|---:|---:|---:|---:|"]
    for name in args.optimizers:
        t = time.perf_counter()
        refs, changes, written, raws = [], [], 0, 0
        for seed in range(args.seeds):
            ref, _, _ = run(name, seed, root, resume=False)
            got, w, raw = run(name, seed, root, resume=True, rules=rules)
            refs.append(ref)
            changes.append(got / ref - 1)
            written, raws = written + w, raws + raw
        spread = max(abs(r / refs[0] - 1) for r in refs)
        row = (f"| {name} | {', '.join(f'{r:.4f}' for r in refs)} | {', '.join(f'{c:+.2%}' for c in changes)} | "
               f"**{statistics.mean(changes):+.2%}** | {spread:.2%} | {raws / written:.1f}x | "
               f"{time.perf_counter() - t:.0f} |")
        print(row, flush=True)
        lines.append(row)
    shutil.rmtree(root, ignore_errors=True)
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
