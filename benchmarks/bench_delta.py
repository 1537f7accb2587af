"""Delta coding on a real training trace: codes alone vs plain delta vs rearranged delta, each against the
order-0 entropy of the stream it codes, and the handler's own stored bytes, per checkpoint and overall.

Usage: python benchmarks/bench_delta.py [--steps 620] [--every 20] [--out benchmarks/results/delta.md]
(needs the `bench` extra for MNIST: pip install -e '.[bench]')

Trace: the MNIST CNN of examples/mnist.py (222k parameters), Adam 1e-3, batch 128, a checkpoint every
--every steps from step 0. Quantization: fixed 8 bins, protect 0.5%, no pruning, magnitude sensitivity, no
search. Every variant stores the same protected values, centres and lossless leaves (biases, the first conv
kernel); only the code stream differs. Ratio = float32 bytes of all parameters / bytes stored for them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import digits  # noqa: E402
import mnist  # noqa: E402

import inshrink_jax as ij  # noqa: E402
from inshrink_jax import codec, delta, quantize, save, store  # noqa: E402
import report  # noqa: E402

try:  # optional (not a dependency): an rANS coder, to see what coding each stream at its order-0 bound would gain
    import constriction
except ImportError:
    constriction = None

VARIANTS = ("codes", "delta", "rearranged")
WHY_ABOVE_H0 = (
    "What is left above H0: zstd codes literals with Huffman, which costs up to ~0.1-0.2 bit per symbol more than "
    "the entropy when one symbol is frequent, and each tensor's stream pays its own frame header and Huffman table "
    "(the smallest tensor has 640 codes, the middle one 18k). Packing several codes to a byte (ranks, from format "
    "14: the ranks of at most 16 distinct values, e.g. a delta's 0, +1 and -1 mod b, as digits of a byte, then "
    "zstd where that is smaller; zstd-radix and zstd-rank before) shares Huffman's per-symbol loss among the "
    "codes of a byte; prefix (from format 15, streams of fewer than 16,384 values) codes those packed bytes with a "
    "Huffman code that a model of a few bits per rank in the stream's header determines, instead of zstd's frame "
    "and table; and zstd-runs codes the run lengths of "
    "zeros with the non-zero values radix-packed, which is why the streams come within a few percent of H0. The "
    "last two "
    "columns are plain zstd at levels 1 and 3, without the codec choices (codec.CODE_CODECS at "
    "codec.CODE_LEVEL).")


STREAM_KINDS = ("weights, keyframe codes", "weights, closed-loop residual codes", "second moments, codes",
                "second moments, deltas", "first moments, codes")


def stream_kind(rec, extra: dict) -> str:
    """Which of STREAM_KINDS a stored code stream is, from its leaf's record and its segment's fields."""
    if rec.method == "weights":
        return STREAM_KINDS[1] if extra.get("prior") else STREAM_KINDS[0]
    if rec.scale_leaf is not None or ".trace" in rec.keystr:  # SGD's momentum: a first moment without a scale
        return STREAM_KINDS[4]
    return STREAM_KINDS[3] if extra.get("base") else STREAM_KINDS[2]


def rans_bytes(symbols: np.ndarray) -> int | None:
    """Bytes of `symbols` under constriction's rANS coder at the stream's own order-0 model, plus 3 bytes per
    distinct symbol for that model (its value and frequency); None without constriction installed."""
    if constriction is None:
        return None
    values, counts = np.unique(symbols, return_counts=True)
    if values.size == 1:
        return 3 + 4
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(np.searchsorted(values, symbols).astype(np.int32),
                         constriction.stream.model.Categorical(counts / counts.sum(), perfect=False))
    return coder.get_compressed().nbytes + 3 * values.size


def recording_streams(log: list):
    """save._encode_shard wrapped so that every code stream the handler stores is appended to `log` as
    (kind, stored bytes, its order-0 entropy in bytes, symbols, `rans_bytes` of it or None): the stream decoded
    from what is stored, so the figures are of exactly the bytes written."""
    original = save._encode_shard

    def wrapped(rec, box, payload, chain, keyframe_every, prior):
        segments, link = original(rec, box, payload, chain, keyframe_every, prior)
        if "codes" in segments:
            blob, cid, extra = segments["codes"]
            n = int(np.prod(store.box_shape(box)))
            symbols = np.frombuffer(codec.decompress(blob, cid, n), np.uint8)
            log.append((stream_kind(rec, extra), len(blob), codec.order0_entropy_bytes(symbols), n,
                        rans_bytes(symbols)))
        return segments, link
    return wrapped


def default_trace(steps: int, every: int, tx, ty) -> list:
    """The code streams the default configuration stores over the trace: the whole TrainState (Adam's moments
    included) saved every `every` steps with CompressionConfig() and no eval_fn (the data-free proxy)."""
    log: list = []
    original = save._encode_shard
    save._encode_shard = recording_streams(log)
    tmp = tempfile.mkdtemp()
    try:
        mngr = ocp.CheckpointManager(tmp, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig()))
        state = mnist.create_state(0)
        stream = digits.batches(tx, ty, 128, 0)
        for step in range(steps + 1):
            if step % every == 0:
                mngr.save(step, args=ij.InshrinkSave(state))
                mngr.wait_until_finished()
            if step < steps:
                x, y = next(stream)
                state, _, _ = digits.train_step(state, x, y)
        mngr.close()
    finally:
        save._encode_shard = original
        shutil.rmtree(tmp)
    return log


def default_lines(log: list, steps: int, every: int) -> list[str]:
    lines = ["", "## The default configuration's stored code streams against their order-0 entropy", "",
             f"The same trace, the whole TrainState (parameters and Adam's moments) saved every {every} steps "
             f"through steps 0..{steps} with CompressionConfig() (closed loop, keyframe_every=32, the search "
             "with its data-free proxy: no eval_fn) and every code stream the handler stored decoded from its "
             "bytes: stored bytes against the stream's own order-0 entropy (each stream's frame header and "
             "table included in the stored bytes).", ""]
    return lines + stream_table(log)


def stream_table(log: list) -> list[str]:
    """The table of a `recording_streams` log: per kind of stream and in all, stored bytes against H0 (and, with
    constriction installed, what its rANS coder would store: the smaller of it and the stored bytes, per
    stream)."""
    rans = all(r[4] is not None for r in log)
    lines = ["| stream | streams | symbols | H0 bytes | stored bytes | stored / H0 |" +
             (" rANS bytes | rANS / stored |" if rans else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if rans else "")]
    for kind in (*STREAM_KINDS, None):
        rows = [r for r in log if kind is None or r[0] == kind]
        if not rows:
            continue
        h0, stored = sum(r[2] for r in rows), sum(r[1] for r in rows)
        label = "**all code streams**" if kind is None else kind
        line = (f"| {label} | {len(rows):,} | {sum(r[3] for r in rows):,} | {h0:,.0f} | {stored:,} | "
                f"{stored / h0 if h0 else float('nan'):.3f} |")
        if rans:
            r = sum(min(x[4], x[1]) for x in rows)
            line += f" {r:,} | {r / stored:.3f} |"
        lines.append(line)
    if rans:
        version = importlib.metadata.version("constriction")
        lines += ["", f"(rANS columns: constriction {version}, installed beside the benchmark with `pip install "
                      f"constriction=={version}`; not a dependency of inshrink_jax.)"]
    else:
        lines += ["", "(With the optional `constriction` package installed the table adds what its rANS coder would "
                      "store.)"]
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=620)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = ij.CompressionConfig(quant=ij.QuantConfig(bins=8))
    tx, ty, vx, vy = mnist.load()
    state = mnist.create_state(0)
    stream = digits.batches(tx, ty, 128, 0)
    flat = jax.tree_util.tree_flatten_with_path(state.params)[0]
    plan = save.plan(state.params, None, None, cfg)
    metas, qidx = plan.records, plan.weights
    lossless = [i for i in range(len(flat)) if i not in qidx]
    rows, prev = [], None
    tmp = tempfile.mkdtemp()
    managers = {k: ocp.CheckpointManager(os.path.join(tmp, f"k{k}"), item_handlers=ij.InshrinkCheckpointHandler(
        ij.CompressionConfig(quant=cfg.quant, keyframe_every=k, search=False, closed_loop=False)))
        for k in (10**6, 10)}  # open loop: the paper's chain of code deltas, the subject of this table
    t_start = time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.every == 0:
            leaves = [x for _, x in jax.tree_util.tree_flatten_with_path(state.params)[0]]
            raw = sum(x.size * 4 for x in leaves)
            encs = quantize.encode_tensors([leaves[i] for i in qidx], [None] * len(qidx),
                                           [metas[i].layer_type for i in qidx], cfg.quant, cfg)
            fixed = sum(len(codec.compress_best(e.protected, codec.ZSTD_PLANES)[0]) + 4 * e.bins for e in encs)
            fixed += sum(len(codec.compress_best(np.asarray(leaves[i]), codec.ZSTD_PLANES)[0]) for i in lossless)
            row = {"step": step, "raw": raw, "fixed": fixed}
            for v in VARIANTS:
                streams = []
                for k, e in enumerate(encs):
                    if prev is None or v == "codes":
                        streams.append(e.codes.reshape(-1))
                    else:
                        b = delta.modulus(prev[k].bins, e.bins)
                        streams.append(delta.encode(prev[k].codes, e.codes, b, rearrange=(v == "rearranged")))
                row[v] = sum(len(codec.compress_best(s, codec.CODE_CODECS, codec.CODE_LEVEL)[0]) for s in streams)
                # the choices codec.py made, measured: plain zstd at level 1 (no run lengths) and at level 3
                row[v + "_zstd1"] = sum(len(codec.compress_best(s, codec.ZSTD, 1)[0]) for s in streams)
                row[v + "_zstd3"] = sum(len(codec.compress_best(s, codec.ZSTD, 3)[0]) for s in streams)
                row[v + "_h0"] = sum(codec.order0_entropy_bytes(s) for s in streams)
            for k, m in managers.items():
                m.save(step, args=ij.InshrinkSave({"params": state.params}))
                m.wait_until_finished()
                row[f"handler{k}"] = m.item_metadata(step)["stored_bytes"]["params"]
            prev = encs
            rows.append(row)
            print(step, {k: (round(v) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        if step < args.steps:
            x, y = next(stream)
            state, _, _ = digits.train_step(state, x, y)
    elapsed = time.perf_counter() - t_start
    acc = digits.accuracy(state.params, state.apply_fn, vx, vy)
    restored = managers[10].restore(args.steps)["params"]
    acc_q = digits.accuracy(restored, state.apply_fn, vx, vy)
    for m in managers.values():
        m.close()
    shutil.rmtree(tmp)

    raw_total = sum(r["raw"] for r in rows)

    def overall(key):
        return raw_total / sum(r["fixed"] + r[key] for r in rows)

    def zstd_vs_h0(v, rs):
        return sum(r[v] for r in rs) / sum(r[v + "_h0"] for r in rs)

    later = rows[1:]
    lines = ["# Delta coding on a real training trace", "",
             f"Command: `python benchmarks/bench_delta.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             f"MNIST CNN ({sum(x.size for x in jax.tree.leaves(state.params)):,} parameters), Adam 1e-3, batch "
             f"128, {len(rows)} checkpoints every {args.every} steps; fixed 8 bins, protect 0.5%, no pruning, no "
             f"search. Test accuracy at step {args.steps}: {acc:.4f} float32, {acc_q:.4f} restored from the "
             f"compressed checkpoint. Run time {elapsed:.0f} s on 2 CPU cores.", "",
             "Ratio = float32 bytes of all parameters / stored bytes (code stream + the protected values, "
             "centres and lossless leaves that every variant stores alike). H0 = order-0 entropy of the code "
             "stream, the bound of a memoryless symbol coder; 'zstd' is what the handler stores (the smallest of "
             "codec.CODE_CODECS: zstd at its code settings, zstd-runs, ranks, prefix, zstd-escape, mode); zstd/H0 < 1 would mean it found "
             "structure beyond symbol frequencies (runs).", "",
             WHY_ABOVE_H0, "",
             "## Overall", "",
             "| variant | overall ratio | ratio of checkpoints 2.. | zstd / H0 (all) | zstd / H0 (checkpoints 2..) "
             "| plain zstd level 1 / H0 (all) | plain zstd level 3 / H0 (all) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    names = {"codes": "codes, no delta", "delta": "delta, no rearrangement", "rearranged": "delta, rearranged"}
    for v in VARIANTS:
        lines.append(f"| {names[v]} | {overall(v):.2f}x | "
                     f"{sum(r['raw'] for r in later) / sum(r['fixed'] + r[v] for r in later):.2f}x | "
                     f"{zstd_vs_h0(v, rows):.3f} | {zstd_vs_h0(v, later):.3f} | "
                     f"{sum(r[v + '_zstd1'] for r in rows) / sum(r[v + '_h0'] for r in rows):.3f} | "
                     f"{sum(r[v + '_zstd3'] for r in rows) / sum(r[v + '_h0'] for r in rows):.3f} |")
    for k, label in ((10**6, "handler, open loop, one chain (keyframe_every=10^6)"),
                     (10, "handler, open loop, keyframe_every=10")):
        lines.append(f"| {label} | {raw_total / sum(r[f'handler{k}'] for r in rows):.2f}x | "
                     f"{sum(r['raw'] for r in later) / sum(r[f'handler{k}'] for r in later):.2f}x | | | | |")
    lines += ["", "## Per checkpoint", "",
              "| step | codes: zstd B (H0 B), ratio | delta: zstd B (H0 B), ratio | rearranged: zstd B (H0 B), "
              "ratio | other stored B | handler B, open loop (chain / keyframe_every=10) |",
              "|---:|---|---|---|---:|---|"]
    for r in rows:
        cells = [f"{r[v]:,} ({r[v + '_h0']:,.0f}), {r['raw'] / (r['fixed'] + r[v]):.1f}x" for v in VARIANTS]
        lines.append(f"| {r['step']} | " + " | ".join(cells) +
                     f" | {r['fixed']:,} | {r[f'handler{10**6}']:,} / {r['handler10']:,} |")
    lines += default_lines(default_trace(args.steps, args.every, tx, ty), args.steps, args.every)
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
