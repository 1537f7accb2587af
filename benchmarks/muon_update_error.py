"""What an error of Muon's momentum does to its update: the orthogonalized update's error after a restore,
against the momentum's own, for the library's coding of `MuonState.mu` and for Gaussian noise.

Usage: python benchmarks/muon_update_error.py [--workload charlm-muon|mlp-muon] [--saves 5 10 15] [--out FILE]
(needs the `bench` extra: pip install -e '.[bench]')

A run trained with Muon (seed 0, no checkpoints) is stopped at the given saves: `charlm-muon`, the character
transformer of bench_fidelity.py (a save every 30 steps), or `mlp-muon`, bench_optimizers.py's MLP with Muon at
1e-3 (a save every 50). There, its Muon momentum (the matrices optax's Muon updates; those with a side of 8 or less,
the transformer's (4, 32) attention biases, are left out of the figures) is replaced by a coded or perturbed copy,
and the first update after a restore (the next batch's gradient through `state.tx.update`: Nesterov blend, then
Newton-Schulz orthogonalization) is compared with the one from the exact momentum: the relative Frobenius error of
each matrix's update. Rows:

- **coded within F of the first-moment budget**: `moments.encode_first_on_device` with budget factor F (the
  default stores Muon's `mu` at `policy.NORMALIZED_BUDGET`, 0.1, of `effective_moment_budget`, 0.3); its bits
  are the order-0 entropy of the codes per value (what the stored streams cost within a few percent).
- **Gaussian noise E**: the momentum plus independent noise of E times its RMS (no cap on the precision).
- **polar factor within F** (a coding not built in the library): each matrix stored as its polar
  decomposition M = A H, A (orthonormal columns: the direction Muon's update takes) coded as a first moment within
  F of the budget and H = (M^T M)^(1/2) (of the smaller side) in bfloat16; bits are A's codes' entropy and 16 per
  value of H's upper triangle. The matrices left out of the figures are left exact in these rows.
- **its K largest singular directions** (a coding not built): each matrix restored as its best rank-K
  approximation, stored in float32 (K (m + n + 1) values); the rest of the momentum dropped. The matrices left out
  of the figures are left exact in these rows.
- **dropped**: the momentum restored as zeros (the `drop` policy).
- **next batch's gradient**: the update from the exact momentum with the gradient of the batch after (how much
  the update moves from one step to the next by itself).

An error of the momentum lasts in it (beta 0.95: about 20 steps); the next batch's change does not. So the table
also trains 20 steps from each restored state on the run's batches, against the same 20 steps from the exact one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402
from residual_bound import saved, trajectory  # noqa: E402
from residual_coding import entropy_bits  # noqa: E402

import bench_optimizers  # noqa: E402

from inshrink_jax import CompressionConfig, moments, policy  # noqa: E402

FACTORS = (1.0, policy.NORMALIZED_BUDGET, 0.03, 0.01)
NOISE = (0.1, 0.03, 0.01, 0.003)
POLAR = (1.0, 0.3)
RANKS = (4, 16)
NEXT = "next batch's gradient"
AFTER = 20  # steps trained after a restore (beta 0.95: an error of the momentum lasts about 20)


class MLPMuon:
    """bench_optimizers.py's MLP with Muon (1e-3, constant) on its synthetic teacher, as a workload of this script
    (seed 0; a save every 50 steps, as there): where dropping Muon's momentum at a restore cost most."""

    steps, every = bench_optimizers.STEPS, bench_optimizers.EVERY
    train_step = staticmethod(bench_optimizers.train_step)
    batch = staticmethod(bench_optimizers.batch)

    def describe(self, steps):
        return (f"bench_optimizers.py's MLP (83k parameters, 3 layers with LayerNorm) on its synthetic teacher, "
                f"optax.contrib.muon 1e-3 (constant), batch 256, {steps} steps")

    def create_state(self):
        return bench_optimizers.create_state("muon", 0)

    def loss(self, state, x, y):
        return bench_optimizers.loss_fn(state.params, state.apply_fn, x, y)


def _trajectory(name: str, saves: int):
    """(workload, its class, its whole state at each of the first `saves` saves) of seed 0."""
    if name != "mlp-muon":
        return trajectory(name, saves, take=lambda s: s)
    work = MLPMuon()
    return work, MLPMuon, saved(work, work.every, saves, lambda s: s)


def _muon(opt_state):
    return opt_state.inner_states["muon"].inner_state[0]


def _keyed(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def with_mu(state, mu):
    """`state` with Muon's momentum replaced by `mu`."""
    os_ = state.opt_state
    inner = os_.inner_states["muon"]
    inner = inner._replace(inner_state=(_muon(os_)._replace(mu=mu),) + tuple(inner.inner_state[1:]))
    return state.replace(opt_state=os_._replace(inner_states={**os_.inner_states, "muon": inner}))


def gradient(work, state, batch):
    """The gradient of the parameters on `batch`."""
    return jax.grad(lambda p: work.loss(state.replace(params=p), *batch))(state.params)


def update_of(state, grads, mu) -> dict:
    """The update `state.tx` makes from `grads` with Muon's momentum replaced by `mu`, by key."""
    s = with_mu(state, mu)
    out, _ = s.tx.update(grads, s.opt_state, s.params)
    return _keyed(out)


def polar_coded(m, factor: float, cfg) -> tuple[jax.Array, float]:
    """(decoded, bits) of a matrix stored as its polar decomposition M = A H (A with orthonormal columns, the
    update's direction; H = (M^T M)^(1/2), of the smaller side): A coded as a first moment within `factor` of the
    budget, H in bfloat16 (its upper triangle). Then the error of the decoded A H is A's error times H, shaped as
    M's singular values are, and its polar factor is A's: a coding of Muon's momentum not built in the library."""
    x = m.T if m.shape[0] < m.shape[1] else m
    u, sv, vt = jnp.linalg.svd(x, full_matrices=False)
    a, h = u @ vt, (vt.T * sv) @ vt
    dev = moments.encode_first_on_device([a], [None], [None], cfg, budgets=[factor])[0]
    out = dev.dequantize(a.dtype) @ h.astype(jnp.bfloat16).astype(h.dtype)
    n = h.shape[0]
    return (out.T if x is not m else out), entropy_bits(np.asarray(dev.codes)) + 16 * n * (n + 1) / 2


def losses_after(work, state, step: int) -> np.ndarray:
    """Training losses of the `AFTER` steps after `step` from `state` (the batches the run would take)."""
    out = []
    for k in range(step + 1, step + AFTER + 1):
        state, loss, _ = work.train_step(state, *work.batch(k))
        out.append(float(loss))
    return np.asarray(out)


def measure(work, state, step: int) -> tuple[list[str], dict]:
    """(matrix names, {row: (each matrix's momentum error, each one's update error, the relative change of the
    mean training loss of the `AFTER` steps after, bits per value; the last two None where not measured)}) at one
    save."""
    mu = _muon(state.opt_state).mu
    flat, tdef = jax.tree_util.tree_flatten_with_path(mu)
    keys, leaves = [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat]
    big = [i for i, x in enumerate(leaves) if x.ndim == 2 and min(x.shape) > 8]
    grads = gradient(work, state, tuple(map(jnp.asarray, work.batch(step + 1))))
    exact = update_of(state, grads, mu)

    def rel(a, b):
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    reference = losses_after(work, state, step)

    def errors(coded):
        tree = jax.tree_util.tree_unflatten(tdef, coded)
        got = update_of(state, grads, tree)
        after = float(np.mean(losses_after(work, with_mu(state, tree), step) / reference) - 1)
        return ([rel(coded[i], leaves[i]) for i in big], [rel(got[keys[i]], exact[keys[i]]) for i in big], after)

    rows = {}
    cfg = CompressionConfig()
    for f in FACTORS:
        devs = moments.encode_first_on_device(leaves, [None] * len(leaves), [None] * len(leaves), cfg,
                                              budgets=[f] * len(leaves))
        coded = [d.dequantize(x.dtype) for d, x in zip(devs, leaves)]
        bits = sum(entropy_bits(np.asarray(devs[i].codes)) for i in big) / sum(leaves[i].size for i in big)
        rows[f"coded within {f:g} of the first-moment budget"] = (*errors(coded), bits)
    for e in NOISE:
        keys_ = jax.random.split(jax.random.PRNGKey(step), len(leaves))
        noisy = [x + e * jnp.sqrt(jnp.mean(x * x)) * jax.random.normal(k, x.shape, x.dtype)
                 for x, k in zip(leaves, keys_)]
        rows[f"Gaussian noise {e:g}"] = (*errors(noisy), None)
    for f in POLAR:
        coded, bits = list(leaves), 0.0
        for i in big:
            coded[i], b = polar_coded(leaves[i], f, cfg)
            bits += b
        rows[f"polar factor within {f:g}, symmetric factor in bfloat16 (not built)"] = (
            *errors(coded), bits / sum(leaves[i].size for i in big))
    for k in RANKS:
        coded, bits = list(leaves), 0.0
        for i in big:
            u, sv, vt = jnp.linalg.svd(leaves[i], full_matrices=False)
            coded[i] = (u[:, :k] * sv[:k]) @ vt[:k]
            bits += 32 * k * (sum(leaves[i].shape) + 1)
        rows[f"its {k} largest singular directions, float32 (not built)"] = (
            *errors(coded), bits / sum(leaves[i].size for i in big))
    rows["dropped (zeros: policy 'drop')"] = (*errors([jnp.zeros_like(x) for x in leaves]), None)
    following = update_of(state, gradient(work, state, tuple(map(jnp.asarray, work.batch(step + 2)))), mu)
    rows[NEXT] = ([0.0] * len(big), [rel(following[keys[i]], exact[keys[i]]) for i in big], None, None)
    return [keys[i] for i in big], rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("charlm-muon", "mlp-muon"), default="charlm-muon")
    ap.add_argument("--saves", type=int, nargs="+", default=[5, 10, 15], help="which saves (1: the first)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    work, cls, snaps = _trajectory(args.workload, max(args.saves))
    per_save, names = [], None
    for n in args.saves:
        names, rows = measure(work, snaps[n - 1], n * cls.every)
        per_save.append(rows)
        print(f"save {n}: " + "; ".join(f"{k}: {np.mean(r[1]):.3f}, {r[2] if r[2] is None else f'{r[2]:+.2%}'}"
                                        for k, r in rows.items()), flush=True)
    lines = []
    for row in per_save[0]:
        mom = np.mean([r[row][0] for r in per_save], axis=0)
        upd = np.mean([r[row][1] for r in per_save], axis=0)
        after = [r[row][2] for r in per_save]
        bits = [r[row][3] for r in per_save]
        lines.append(" | ".join([
            f"| {row}", "" if bits[0] is None else f"{np.mean(bits):.2f}", "" if row == NEXT else f"{np.mean(mom):.3f}",
            f"{np.mean(upd):.3f}", f"{np.max(upd):.3f} ({names[int(np.argmax(upd))]})",
            "" if row == NEXT else f"{np.mean(upd / mom):.1f}x",
            "" if after[0] is None else f"{np.mean(after):+.2%} ({', '.join(f'{x:+.2%}' for x in after)})",
            *(f"{u:.3f}" for u in upd)]) + " |")
    steps = ", ".join(str(n * cls.every) for n in args.saves)
    report.emit([
        "# Muon's momentum: its error and its update's after a restore", "",
        "Command: `python benchmarks/muon_update_error.py " + " ".join(argv if argv is not None else sys.argv[1:])
        + "`", "", __doc__.split("\n\n", 2)[2].strip(), "",
        f"Workload: {work.describe(cls.steps)}. Saves at steps {steps}; figures averaged over them "
        f"({time.perf_counter() - t0:.0f} s).", "",
        "Columns: bits per value of the coded momentum; the momentum's relative error (mean over the matrices); "
        "the update's (mean, and the largest with its matrix); the update's error over the momentum's (mean over "
        f"the matrices); the mean training loss of the {AFTER} steps after the restore against the same steps' "
        "from the exact momentum (paired, on the run's batches; mean, then each save's); then each matrix's "
        "update error.", "",
        "| momentum | bits per value | momentum error | update error | largest | update / momentum | "
        f"training loss, next {AFTER} steps | " + " | ".join(names) + " |",
        "|---|---:|---:|---:|---|---:|---:|" + "---:|" * len(names), *lines], args.out)


if __name__ == "__main__":
    main()
