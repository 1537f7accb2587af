"""The code codecs on streams of every size a save writes: bytes against the order-0 entropy, and encode and decode
time, "ranks" (the packed ranks raw or as one zstd frame) beside "prefix" (the packed ranks in the Huffman code of
a model the stream states), in one process.

Usage: python benchmarks/codec_speed.py [--out FILE]

Memoryless streams of 3 and 5 levels (a closed-loop residual's codes: the centre cell most frequent; a first
moment's: a few cells either side), of 64 values (a bias) to 65,535; each time the median of 21 calls after a
warm-up. "prefix" is offered by `codec.compress_best` only below `codec.PREFIX_BELOW` values: its decoder finds
every codeword's start by pointer doubling over every bit offset (a pass per doubling of the codewords), which
the table shows growing faster than the stream, while what it saves over a zstd frame shrinks relative to the
stream. Its decode times include building the stream's code from its model (`codec._prefix_code`, cached per
model: each call here builds it anew, as a restore does for streams of different models).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import report  # noqa: E402

from inshrink_jax import codec  # noqa: E402

LEVELS = {"3 levels": [0.7, 0.15, 0.15], "5 levels": [0.4, 0.2, 0.2, 0.1, 0.1]}
SIZES = (64, 1024, 4096, 8192, 16_384, 65_535)


def median_us(f, repeats: int = 21) -> float:
    return statistics.median(report.call_seconds(f, repeats)) * 1e6


def decode(blob, which, n):
    def run():
        codec._prefix_code.cache_clear()  # a restore's streams have models of their own
        codec.decompress(blob, which, n)
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    lines = ["# Code codecs by stream size: ranks against prefix", "",
             f"Command: `python benchmarks/codec_speed.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             f"`codec.PREFIX_BELOW` = {codec.PREFIX_BELOW:,}.", "",
             "| stream | values | H0 bytes | ranks bytes | prefix bytes | prefix / ranks | ranks encode us | "
             "prefix encode us | ranks decode us | prefix decode us | prefix / ranks decode |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in LEVELS.items():
        for n in SIZES:
            a = rng.choice(len(p), n, p=p).astype(np.uint8)
            blobs = {c: codec.compress(a, c, codec.CODE_LEVEL) for c in (codec.RANKS, codec.PREFIX)}
            for c, b in blobs.items():
                assert codec.decompress(b, c, n) == a.tobytes(), (c, n)
            enc = {c: median_us(lambda c=c: codec.compress(a, c, codec.CODE_LEVEL)) for c in blobs}
            dec = {c: median_us(decode(b, c, n)) for c, b in blobs.items()}
            r, q = len(blobs[codec.RANKS]), len(blobs[codec.PREFIX])
            lines.append(f"| {name} | {n:,} | {codec.order0_entropy_bytes(a):,.0f} | {r:,} | {q:,} | {q / r:.3f} | "
                         f"{enc[codec.RANKS]:,.0f} | {enc[codec.PREFIX]:,.0f} | {dec[codec.RANKS]:,.0f} | "
                         f"{dec[codec.PREFIX]:,.0f} | {dec[codec.PREFIX] / dec[codec.RANKS]:.1f}x |")
    report.emit(lines, args.out)


if __name__ == "__main__":
    main()
