"""What one restore costs training, per residual coder: the paired training loss of the 10 steps after a restore
from a closed-loop reconstruction, against the uninterrupted run on the same batches.

Usage: python benchmarks/restore_damage.py [--out FILE]   (needs the `bench` extra: pip install -e '.[bench]')

Trains the character transformer of bench_fault_tolerance.py for 600 steps (seed 0) and, along that one
trajectory, keeps a closed-loop chain per coder: at every 30th step the parameters' residual against the coder's
previous reconstruction is coded and added to it (the first save exact). At steps 90, 180, ..., 540 the
parameters are replaced by each coder's reconstruction (the optimizer state exact), 10 steps are trained, and
their mean loss is compared with the uninterrupted run's: a single restore's damage, with nothing else changed
(bench_fidelity.py measures 10 restores with everything compressed). Bits: the library coders' stored code
streams (`codec.CODE_CODECS`), over every parameter of 64 or more elements; error: the squared error weighted by
1 / M^2 (weighting.py) over the residual's, what `residual_budget` bounds with `weighted_residuals`.

The library coders run the jitted encoder at fixed configurations: k-means levels with half the residual pruned
(the default residual space's usual choice), the five-cell uniform quantizer (`QuantConfig.step`), each without
and with the second-moment weighting; k-means at 3 and 8 levels for the slope of damage against error; and
"unbiased levels": the 4- and 3-level codes with their decoded residual scaled per tensor so that its regression on
the residual has slope 1 (k-means levels shrink a coarse residual, so a closed-loop reconstruction lags the
weights' consistent drift; scaled, it does not, at a larger squared error). Rows marked "NumPy" are a reference coder that is not in the library: a
uniform quantizer with unbounded cells (order-0 entropy of its integer codes as bits), unweighted, weighted by the
same separable scale as the library, and weighted per element by nu^(1/4) (a decoder would need the second moment
of the same save for that), or by the per-element scale of an earlier save kept for the saves after it (the
first residual save's, or renewed every 8 saves: what a decoder could read once per chain).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fault_tolerance as ft  # noqa: E402
import digits  # noqa: E402  (examples/, on the path through bench_fault_tolerance)
import report  # noqa: E402
from residual_coding import entropy_bits  # noqa: E402

from inshrink_jax import codec, quantize, search, weighting  # noqa: E402
from inshrink_jax.config import CompressionConfig, QuantConfig  # noqa: E402

EVERY, STEPS, RESTORES, WINDOW = 30, 600, (90, 180, 270, 360, 450, 540), 10


def k_means(bins, prune):
    return QuantConfig(bins=bins, embedding_bins=3, protect_fraction=0.0, prune_fraction=prune)


def uniform(step):
    return QuantConfig(bins=5, embedding_bins=5, protect_fraction=0.0, prune_fraction=0.0, step=step)


# The library coders: (configuration, variant): "plain", "weighted" (the second-moment weighting) or "unbiased"
# (the plain codes, their decoded residual scaled by `unbiased`).
LIBRARY = {"k-means 4 levels, half pruned": (k_means(4, 0.5), "plain"),
           "k-means 4 levels, half pruned, weighted": (k_means(4, 0.5), "weighted"),
           "k-means 4 levels, half pruned, unbiased levels": (k_means(4, 0.5), "unbiased"),
           "k-means 3 levels, half pruned": (k_means(3, 0.5), "plain"),
           "k-means 3 levels, half pruned, unbiased levels": (k_means(3, 0.5), "unbiased"),
           "k-means 8 levels, none pruned": (k_means(8, 0.0), "plain"),
           "uniform 5 cells of 1.5 RMS": (uniform(1.5), "plain"),
           "uniform 5 cells of 1.5 RMS, weighted": (uniform(1.5), "weighted"),
           "uniform 5 cells of 2 RMS, weighted": (uniform(2.0), "weighted")}
REFERENCE = {"NumPy uniform, cells of 1.5 RMS": ("none", 1.5),
             "NumPy uniform, cells of 1.5 RMS, weighted (separable, as the library)": ("separable", 1.5),
             "NumPy uniform, cells of 1.5 RMS, weighted per element": ("element", 1.5),
             "NumPy uniform, cells of 2 RMS, weighted per element": ("element", 2.0),
             "NumPy uniform, cells of 1.5 RMS, per element, the first residual save's map": ("first", 1.5),
             "NumPy uniform, cells of 1.5 RMS, per element, the map renewed every 8 saves": ("every8", 1.5)}


def unbiased(x, offset, decoded):
    """The decoded residual q scaled per tensor by sum(r^2) / sum(r q) (r = x - offset), so that its regression on
    the residual has slope 1: k-means levels are conditional means, which shrink a coarse residual (slope
    1 - error), and in a closed loop the reconstruction then lags the weights by (1 - slope) / slope of an
    interval's consistent change. Not a library coder: it tests whether that lag, rather than the squared error,
    is what a restore costs (the codes are the library's; only the levels are scaled)."""
    r = np.asarray(x, np.float64) - np.asarray(offset, np.float64)
    q = np.asarray(decoded, np.float64) - np.asarray(offset, np.float64)
    c = float((r * r).sum() / max((r * q).sum(), 1e-300))
    return jax.numpy.asarray(np.asarray(offset, np.float64) + c * q, x.dtype)


def second_moment(state):
    adam = [s for s in jax.tree_util.tree_leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "nu"))
            if hasattr(s, "nu")]
    return jax.tree.leaves(adam[0].nu)


def element_scale(nu: np.ndarray) -> np.ndarray:
    """nu^(-1/4) per element (floored at 2^-48 of the largest), normalised to geometric mean 1."""
    m = np.maximum(nu, nu.max() * 2.0 ** -48) ** -0.25
    return m / np.exp(np.mean(np.log(m)))


def reference_code(r: np.ndarray, nu: np.ndarray, fs, kind: str, step: float, kept: list | None = None,
                   levels: str = "grid", cells: int | None = None):
    """(decoded residual, bits) of the NumPy reference coder. `kept`: for a "first" or "every8" coder, the tensor's
    kept per-element scale and the saves coded with it ([scale, count], updated here; [None, 0] before its first
    save): what a decoder could store once per chain instead of needing every link's second moment. `levels`:
    "grid", each cell decodes to its centre, or "means", to the mean of its values (the library's uniform levels);
    `cells`: None, unbounded, or that many cells (odd), the values beyond the outer ones in them (the library's)."""
    if kind in ("first", "every8") and nu.max() > 0:
        if kept[0] is None or (kind == "every8" and kept[1] >= 8):
            kept[:] = [element_scale(nu), 0]
        kept[1] += 1
        m = kept[0]
    elif kind == "element" and nu.max() > 0:
        m = element_scale(nu)
    elif kind == "separable" and fs is not None:
        m = np.exp2(weighting.exponents_host([np.asarray(f) for f in fs]).astype(np.float64))
    else:
        m = np.ones_like(r)
    u = r / m
    width = step * np.sqrt(np.mean(u ** 2)) + 1e-30
    q = np.round(u / width)
    if cells is not None:
        q = np.clip(q, -(cells // 2), cells // 2)
    decoded = q * width
    if levels == "means":
        _, inv = np.unique(q, return_inverse=True)
        decoded = (np.bincount(inv.ravel(), u.ravel()) / np.bincount(inv.ravel()))[inv].reshape(u.shape)
    return decoded * m, entropy_bits(q.astype(np.int64))


def code_save(coder: tuple, flat: list, nus: list, previous: list, cfg: CompressionConfig, kept: dict):
    """One closed-loop save of the parameters (`flat`: their (path, leaf) pairs; `nus`: their second moments) by
    `coder` (a value of LIBRARY: (QuantConfig, variant), or of REFERENCE: (kind, cell width[, levels, cells]),
    `reference_code`'s arguments) against its previous
    reconstruction `previous` (every leaf): (the new reconstruction, bits a parameter, weighted error). Leaves
    under 64 elements are kept exact. `kept`: the coder's own dict, leaf -> the kept per-element scale of a
    "first" / "every8" reference coder."""
    ws = [x for _, x in flat]
    idx = [i for i, w in enumerate(ws) if w.size >= 64]
    xs, offs = [ws[i] for i in idx], [previous[i] for i in idx]
    types = [quantize.layer_type(jax.tree_util.keystr(flat[i][0]), ws[i].shape) for i in idx]
    big = [i for i in idx if ws[i].ndim >= 2]
    fs = dict(zip(big, weighting.factors([nus[i] for i in big])))
    factors = [fs.get(i) for i in idx]
    inverse = weighting.inverse_multipliers(factors)
    n = sum(x.size for x in xs)
    if isinstance(coder[0], QuantConfig):
        quant, variant = coder
        devs = quantize.encode_on_device(xs, [None] * len(xs), types, quant, cfg, offsets=offs,
                                         sigma=quantize.RESIDUAL_SIGMA,
                                         factors=factors if variant == "weighted" else None)
        new = quantize.dequantize_all(devs, [x.dtype for x in xs])
        if variant == "unbiased":
            new = [unbiased(x, o, v) for x, o, v in zip(xs, offs, new)]
        bits = sum(8 * len(codec.compress_best(np.asarray(d.codes), codec.CODE_CODECS, codec.CODE_LEVEL)[0])
                   for d in devs) / n
    else:
        kind, step_, *options = coder
        new, b = [], 0.0
        for i, x, o, f in zip(idx, xs, offs, factors):
            d, bi = reference_code(np.asarray(x, np.float64) - np.asarray(o, np.float64),
                                   np.asarray(nus[i], np.float64), f, kind, step_,
                                   kept.setdefault(i, [None, 0]), *options)
            new.append(jax.numpy.asarray(np.asarray(o, np.float64) + d, x.dtype))
            b += bi
        bits = b / n
    error = float(search.proxy_degradation(xs, new, inverse, offs))
    recon = list(ws)
    for i, v in zip(idx, new):
        recon[i] = v
    return recon, bits, error


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = CompressionConfig()
    work = ft.CharLM(0, STEPS)
    state = work.create_state()
    names = list(LIBRARY) + list(REFERENCE)
    recon = dict.fromkeys(names)
    kept: dict = {n: {} for n in names}  # per coder: leaf -> its kept per-element scale ("first" / "every8")
    bits, error, snaps, losses = {n: [] for n in names}, {n: [] for n in names}, {}, {}
    for step in range(1, STEPS + 1):
        state, loss, _ = digits.train_step(state, *work.batch(step))
        losses[step] = float(loss)
        if step % EVERY:
            continue
        flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
        ws, nus = [x for _, x in flat], second_moment(state)
        for name in names:
            if recon[name] is None:  # the first save: exact
                recon[name] = list(ws)
                continue
            coder = LIBRARY[name] if name in LIBRARY else REFERENCE[name]
            recon[name], b, e = code_save(coder, flat, nus, recon[name], cfg, kept[name])
            bits[name].append(b)
            error[name].append(e)
        if step in RESTORES:
            snaps[step] = (state, {name: list(recon[name]) for name in names}, jax.tree.structure(state.params))
        print(f"step {step}", flush=True)
    damage = {n: [] for n in names}
    for t, (st, recs, tdef) in snaps.items():
        ref = np.mean([losses[s] for s in range(t + 1, t + WINDOW + 1)])
        for name in names:
            s, got = st.replace(params=jax.tree.unflatten(tdef, recs[name])), []
            for k in range(t + 1, t + WINDOW + 1):
                s, loss, _ = digits.train_step(s, *work.batch(k))
                got.append(float(loss))
            damage[name].append(np.mean(got) / ref - 1)
    lines = ["# One restore's damage per residual coder (character transformer)", "",
             "Command: `python benchmarks/restore_damage.py" + (f" --out {args.out}`" if args.out else "`"), "",
             __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "",
             "Damage: mean training loss of the 10 steps after the restore against the uninterrupted run's, at "
             f"steps {', '.join(map(str, RESTORES))}, and their mean. Bits and error: means over the 19 residual saves.",
             "", "| coder | bits a parameter | weighted error | damage at each restore | mean damage |",
             "|---|---:|---:|---|---:|"]
    for name in names:
        per = " / ".join(f"{d:+.2%}" for d in damage[name])
        lines.append(f"| {name} | {np.mean(bits[name]):.3f} | {np.mean(error[name]):.3f} | {per} | "
                     f"{np.mean(damage[name]):+.3%} |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
