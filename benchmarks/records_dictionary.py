"""What the records of a default run would cost coded against an earlier save's records (a format not built).

Usage: python benchmarks/records_dictionary.py [--workloads vit resnet mixer] [--saves 8]
       [--out benchmarks/results/records_dictionary.md]

A step's manifest and its object's offset table repeat every leaf's key path, shape, dtype and sharding at every
save; each is written as its own zstd frame (`store.RECORD_LEVEL`). On a small model of many leaves they are a
tenth or more of a closed-loop save. This trains a workload of bench_fidelity.py with `CompressionConfig()`, a
GradientEMA and the eval_fn for `--saves` checkpoints (one every `every` steps: the first a keyframe, the others
residual saves), then codes each later save's records (the JSON a reader decodes) at the same zstd level three
ways: on their own (what is written), with the previous save's record of the same kind as a zstd raw-content
dictionary, and with the keyframe's. Bytes per residual save, averaged; and what the whole save writes on
average, to put them in proportion. Nothing is decoded back: the dictionary frames are what `zstd` writes, not a
reader of this library.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile

import orbax.checkpoint as ocp
import zstandard

import bench_fault_tolerance as ft
import bench_fidelity
import report
import save_breakdown
from inshrink_jax import store


def records_of(root: str, steps: list[int]) -> dict[str, list[bytes]]:
    """kind -> the decoded JSON of each step's record of that kind (manifest, process 0's offset table)."""
    def raw(path: str) -> bytes:
        data = open(path, "rb").read()
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 30) \
            if data[:4] == b"\x28\xb5\x2f\xfd" else data
    return {"manifest": [raw(os.path.join(root, str(s), "default", store.MANIFEST)) for s in steps],
            "offset table": [raw(glob.glob(os.path.join(root, store.OBJECTS, "default", f"{s}.*",
                                                      store.index_name(0)))[0]) for s in steps]}


def coded(record: bytes, dictionary: bytes | None = None) -> int:
    """Bytes of `record` as one zstd frame at `store.RECORD_LEVEL`, with `dictionary` as raw content if given."""
    kw = {} if dictionary is None else {"dict_data": zstandard.ZstdCompressionDict(
        dictionary, dict_type=zstandard.DICT_TYPE_RAWCONTENT)}
    return len(zstandard.ZstdCompressor(level=store.RECORD_LEVEL, **kw).compress(record))


def run(name: str, saves: int) -> dict:
    cls = bench_fidelity.WORKLOADS[name]
    work, every = (cls(0) if cls is ft.Mnist else cls(0, cls.steps)), cls.every
    root = tempfile.mkdtemp()
    mngr = ocp.CheckpointManager(root, item_handlers=ft.ij.InshrinkCheckpointHandler(ft.ij.CompressionConfig()))
    written = [sum(new.values()) for _, _, new in
               save_breakdown.train_saving(work, every, saves, ft.eval_fn_of(work, cls.metric), mngr, root)]
    mngr.close()
    steps = [every * (k + 1) for k in range(saves)]
    out = {"leaves": len(store.read_manifest(os.path.join(root, str(steps[-1]), "default"))[0].leaves),
           "save": sum(written[1:]) / (saves - 1)}
    for kind, recs in records_of(root, steps).items():
        later = range(1, saves)
        out[kind] = [sum(coded(recs[i]) for i in later) / len(later),
                     sum(coded(recs[i], recs[i - 1]) for i in later) / len(later),
                     sum(coded(recs[i], recs[0]) for i in later) / len(later)]
    shutil.rmtree(root)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["vit", "resnet", "mixer"],
                    choices=sorted(bench_fidelity.WORKLOADS))
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = {name: run(name, args.saves) for name in args.workloads}
    cmd = "python benchmarks/records_dictionary.py --workloads " + " ".join(args.workloads) + \
        f" --saves {args.saves}" + (f" --out {args.out}" if args.out else "")
    lines = ["# Records coded against an earlier save's records (a format not built)", "", f"Command: `{cmd}`", "",
             __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "",
             "| workload | leaves | bytes a residual save writes | record | as written | against the previous save's "
             "| against the keyframe's |", "|---|---:|---:|---|---:|---:|---:|"]
    for name, r in rows.items():
        for kind in ("manifest", "offset table"):
            plain, prev, key = r[kind]
            lines.append(f"| {name} | {r['leaves']} | {r['save']:,.0f} | {kind} | {plain:,.0f} | "
                         f"{prev:,.0f} ({prev / plain:.2f}x) | {key:,.0f} ({key / plain:.2f}x) |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
