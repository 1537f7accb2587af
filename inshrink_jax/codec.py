"""Entropy coding of byte streams (host, NumPy + zstandard).

Codecs, each identified by an id string that the manifest records next to every blob, so a reader picks
the decoder by id and a later format adds a codec instead of breaking old checkpoints:
  "zstd"        plain zstandard of the bytes (code streams, deltas, small metadata; lossless data whose whole
                values repeat).
  "zstd-planes" byte-plane grouping then zstandard, for lossless float data: byte i of every element is
                stored together, so the exponent bytes (which repeat) form long runs that zstd finds.
  "zstd-rle"    for uint8 streams that are mostly 0 (deltas): the length of the run of zeros before each
                non-zero value (uint8, 255 = "255 more zeros, continue") and the non-zero values, each
                zstandard-coded: the paper's run-length + Huffman, with zstd's Huffman literals as the
                entropy coder. Plain zstd spends at least 1 bit per symbol on literals; a stream that is 97%
                zeros has an order-0 entropy near 0.25 bit per symbol, which coded run lengths approach
                (tests/test_codec.py, benchmarks/results/delta.md).
  "zstd-runs"   "zstd-rle" with its values coded by whichever of zstd, zstd-radix and zstd-rank (or raw) is
                smallest: the value count n and the run bytes' length k (little-endian uint64 each), one byte
                naming the values' codec (`_RUN_VALUE_CODECS`), the zstd run bytes, the values. The non-zero values
                of a delta stream are few distinct ones (+1, -1), which zstd's Huffman codes at over a bit each and
                radix packing at their entropy (tests/test_codec.py: within 5% of H0 on streams 60-97% zeros).
                (Written instead of "zstd-rle", which is read for checkpoints that have it.)
  "zstd-packed" for uint8 streams of small values (closed-loop residual codes: 2-4 levels): one header byte
                w (1, 2 or 4) and the value count (little-endian uint64), then zstandard of the values packed w bits each, 8 / w per byte (first value in
                the low bits). zstd's Huffman literals cost at least 1 bit per byte; packed, that floor is
                1 bit per 8 / w values, so a 2-level stream costs 1 bit per value, not 1.3-2.
  "zstd-radix"  for uint8 streams of values below b <= 16 (the code streams of few levels): one header byte b and
                the value count (little-endian uint64), then zstandard of the values packed n = floor(log_b 256)
                to a byte as digits in base b (first value least significant): 8 values to a byte for b = 2,
                5 for b = 3, 3 for b = 5 or 6, 2 up to 16. zstd's Huffman literals then code blocks of n
                values, whose redundancy over the order-0 entropy is shared by n values instead of paid by
                each (written instead of "zstd-packed", which is read for checkpoints that have it).
  "zstd-rank"   for uint8 streams of at most 16 distinct values, tried where it packs more values to a byte
                than "zstd-radix" would (open-loop deltas: 0, +1 and -1 modulo the modulus are 0, 1 and b - 1): one byte k (the number of distinct
                values), the k values ascending, then "zstd-radix" of each value's rank among them (base k, at
                least 2). Deltas of 3 distinct values then pack 5 to a byte instead of taking a byte each, and
                a closed-loop residual's codes 1..K (no zeros) K values to a base-K digit instead of base K + 1.
  "zstd-escape" for uint8 streams of more than `_ESCAPE_KEEP` distinct values most of which are a few (the codes
                of a uniform quantizer with many cells: nearly every value in the central cells, a rare tail):
                one byte k (<= `_ESCAPE_KEEP`), the k most frequent values ascending, the length of the next
                part (little-endian uint64), "zstd-radix" of each value's rank among them or k for any other
                value (base k + 1: 3 to a byte for k = 5), then zstandard of the other values in order. The
                central values then pack as five-cell codes do, and the tail costs a byte each, where one value
                to a byte leaves zstd's Huffman literals at over a bit each (plain zstd stores 63-cell codes of a
                heavy-tailed residual at over 1.4x their order-0 entropy, zstd-escape within 4% of the same codes
                clipped to five cells: tests/test_codec.py; the residual codes of the character transformer:
                1.03-1.28x at steps 1-3 x RMS, benchmarks/results/residual_coding.md). Tried only when the five
                hold at least 7/8 of the stream.
  "ranks"       for uint8 streams of at most 16 distinct values (code and delta streams of few levels; written
                instead of "zstd-radix" and "zstd-rank", which are read for checkpoints that have them): one byte
                k | F (k in [1, 16] distinct values; F = `_RANKS_ZSTD` when the packed part is a zstandard frame),
                the k values ascending, then each value's rank among them packed as "zstd-radix" packs its values
                (base max(k, 2); the last byte padded with rank 0), either as they are or as one zstandard frame
                (which states its size), whichever is smaller. No value count: the record states the stream's
                size, and a stream that holds more packed bytes, or padding that is not rank 0, is refused.
                Against "zstd-rank" it drops the radix header (a base byte and a uint64 count) and, on a small
                stream, zstd's frame: a leaf of 64 values of 3 to 5 levels packs to 13 to 22 bytes, to which a
                frame adds its own header and block (benchmarks/results/save_breakdown_vit.md: a vision
                transformer's streams, many of 64 values, at 1.134x their order-0 entropy before, 1.093x since).
  "prefix"      for uint8 streams of at most 16 distinct values and fewer than `PREFIX_BELOW` values (the code
                streams of a model of many small leaves): "ranks"' alphabet, then a model of the ranks (a
                precision p and k - 1 frequencies of p bits) and the packed ranks (the bytes "ranks" writes), each
                coded by the canonical Huffman code of the byte values' weights under that model (the products
                of their ranks' frequencies). zstd's Huffman literals ship their own table and a frame header,
                tens of bytes that a stream of a few thousand codes feels; a model of a few bits per rank costs
                a byte or two, and Huffman over bytes of several ranks loses little to the entropy (a vision
                transformer's code streams: 1.093x their order-0 entropy in format 14;
                benchmarks/results/save_breakdown_vit.md has this format's figure). Its decoder finds every
                codeword at once (`_prefix_packed`), so a stream costs NumPy passes, not a loop per value.
  "mode"        for uint8 streams of which one value (the mode) is at least half (a first moment's codes: most of
                a tensor in its central cell), offered from `_MODE_FROM` to `_PACKED_ONLY_SIZE` values: one byte m
                (the mode), one byte 16 a + b (a, b: the indices in `_MODE_MASK_CODECS` and `_MODE_REST_CODECS` of
                the two parts' codecs), the mask part's length (little-endian uint32), the mask: a stream of `size`
                values, 1 where the value is not m and 0 where it is, coded by the best of `_MODE_MASK_CODECS`
                ("ranks": 8 a byte; "zstd-runs": the gaps between the 1s, for a sparse mask), then the other
                values in order, coded by the best of `_MODE_REST_CODECS`. Packed several to a byte, a peaked
                stream's bytes still take whole bits of zstd's Huffman literals: "ranks" and "zstd-escape"
                stored a ResNet's first moments, mostly their central cell, at 1.10x their order-0 entropy;
                split into the mask (bytes of eight values, near the entropy) and the rest, 1.03x (the order-0
                entropy is the mask's plus the rest's; benchmarks/results/save_breakdown_resnet.md).
  "raw"         the bytes as they are: chosen by `compress_best` when coding would not make them smaller
                (tiny leaves such as step counters, where zstd's frame header costs more than it saves).
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import zstandard

ZSTD = "zstd"
ZSTD_PLANES = "zstd-planes"
ZSTD_RLE = "zstd-rle"
ZSTD_PACKED = "zstd-packed"
ZSTD_RADIX = "zstd-radix"
ZSTD_RANK = "zstd-rank"
ZSTD_RUNS = "zstd-runs"
ZSTD_ESCAPE = "zstd-escape"
RANKS = "ranks"
PREFIX = "prefix"
MODE = "mode"
RAW = "raw"
PACKED_CODECS = (RANKS, PREFIX, ZSTD_RADIX, ZSTD_RANK)  # streams of several codes a byte: `packed_values` reads them packed
_RANKS_ZSTD = 0x80  # flag in a "ranks" stream's first byte: its packed ranks are one zstandard frame
_ESCAPE_KEEP = 5  # values "zstd-escape" ranks (with its escape: base 6, three to a byte)
_PACK_WIDTHS = (1, 2, 4)
DEFAULT_LEVEL = 3
# Code and delta streams: whichever of these is smaller, at the zstd settings `CODE_PARAMS` (named by CODE_LEVEL
# where a level is asked for). Their bytes are near memoryless: what zstd gains on them is its Huffman coding of
# literals, and a match is worth its cost only when long. Level 3's matches cost more than they save (1.28x against
# level 1's 1.18x H0 on 8-level codes of a real training trace), and level 1's too on packed streams of few
# values: on the 440k transformer's 20 saves, level 1 stored every code stream at 1.065x their order-0 entropy
# (Adam's first moments, 5-9 cells, at 1.135x), these settings (level 1's fast strategy, 64-entry match tables,
# matches of 7 bytes or more) at 1.037x (1.079x) in format 13, 1.032x (1.072x) with format 14's "ranks"
# (benchmarks/results/save_breakdown.md has the table; the level 1 figures are the same command at commit a0e8c83,
# format 13's at 1cc8e16). The codec choice takes a real trace's rearranged deltas from
# 1.73x (plain zstd) to 1.02x H0 (benchmarks/results/delta.md). A reader needs nothing of this: the frames are plain
# zstandard.
CODE_CODECS = (ZSTD, ZSTD_RUNS, RANKS, PREFIX, ZSTD_ESCAPE, MODE)
CODE_LEVEL = "codes"
CODE_PARAMS = zstandard.ZstdCompressionParameters(window_log=17, chain_log=6, hash_log=6, search_log=1, min_match=7,
                                                  target_length=0, strategy=zstandard.STRATEGY_FAST,
                                                  write_content_size=1)
# Lossless float data: byte planes win on trained weights (their exponent bytes repeat), plain zstd (what Orbax
# stores) where whole values repeat; taking the smaller costs a second pass and is never larger than either.
LOSSLESS_CODECS = (ZSTD_PLANES, ZSTD)


def _bytes_view(data: bytes | np.ndarray) -> np.ndarray:
    """The raw bytes of `data` as a flat uint8 array, without a copy when `data` is already contiguous."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, np.uint8)


def compress(data: bytes | np.ndarray, codec: str = ZSTD, level: int | str = DEFAULT_LEVEL,
             counts: np.ndarray | None = None) -> bytes:
    """Compress a byte string or the raw bytes of an array with `codec` (see the module docstring). `counts`:
    the bytes' histogram (`byte_counts`) when the caller has it, which zstd-rank would otherwise count again."""
    if codec == ZSTD_PLANES:
        arr = np.ascontiguousarray(data)
        buf = arr.reshape(-1).view(np.uint8).reshape(-1, arr.dtype.itemsize).T.copy() if arr.size else b""
    elif codec in (ZSTD_RLE, ZSTD_RUNS):
        arr = _bytes_view(data)
        nonzero = np.flatnonzero(arr)
        gaps = np.diff(nonzero, prepend=-1) - 1
        extra = gaps // 255
        runs = np.full(gaps.size + int(extra.sum()), 255, np.uint8)
        runs[np.cumsum(extra + 1) - 1] = gaps % 255
        packed = compress(runs, ZSTD, level)
        head = np.array([arr.size, len(packed)], "<u8").tobytes()
        if codec == ZSTD_RLE:
            return head + packed + compress(arr[nonzero], ZSTD, level)
        values, used = compress_best(arr[nonzero], _RUN_VALUE_CODECS[1:], level)
        return head + bytes([_RUN_VALUE_CODECS.index(used)]) + packed + values
    elif codec == ZSTD_PACKED:
        arr = _bytes_view(data)
        top = int(arr.max()) if arr.size else 0
        width = next((w for w in _PACK_WIDTHS if top < 1 << w), None)
        if width is None:
            return b"\xff" * (arr.size + 2)  # values above 15 do not pack: never the smallest (compress_best)
        per = 8 // width
        padded = np.zeros(-(-arr.size // per) * per, np.uint8)
        padded[:arr.size] = arr
        shifts = (np.arange(per, dtype=np.uint8) * width)[None, :]
        packed = np.bitwise_or.reduce(padded.reshape(-1, per) << shifts, axis=1).astype(np.uint8)
        return bytes([width]) + np.array([arr.size], "<u8").tobytes() + compress(packed, ZSTD, level)
    elif codec == ZSTD_RADIX:
        arr = _bytes_view(data)
        base = max(int(arr.max()) + 1 if arr.size else 2, 2)
        if base > _RADIX_MAX:
            return b"\xff" * (arr.size + 2)  # one value a byte: plain zstd; never the smallest (compress_best)
        return _radix_of(arr, base, level)
    elif codec in (ZSTD_RANK, RANKS, PREFIX):
        arr = _bytes_view(data)
        if counts is None:
            counts = byte_counts(arr)
        alphabet = np.flatnonzero(counts).astype(np.uint8) if arr.size else np.zeros(1, np.uint8)
        if alphabet.size > _RADIX_MAX:
            return b"\xff" * (arr.size + 2)  # does not pack: never the smallest (compress_best)
        head = bytes([alphabet.size]) + alphabet.tobytes()
        if codec == ZSTD_RANK:
            return head + compress(_ranks(arr, alphabet, 0), ZSTD_RADIX, level)
        if codec == PREFIX and alphabet.size == 1:
            return head  # every value the one in the alphabet
        packed = _pack(arr, max(alphabet.size, 2), _rank_table(alphabet, 0))
        if codec == PREFIX:
            return head + _prefix_body(packed, counts[alphabet].tolist(), arr.size)
        framed = _compressor(level).compress(packed) if packed.size > _RANKS_FRAMED_FROM else None
        if framed is not None and len(framed) < packed.size:
            return bytes([alphabet.size | _RANKS_ZSTD]) + alphabet.tobytes() + framed
        return head + packed.tobytes()
    elif codec == MODE:
        arr = _bytes_view(data)
        if counts is None:
            counts = byte_counts(arr)
        m = int(np.argmax(counts))
        other = arr != m
        mask, mask_codec = compress_best(other.view(np.uint8), _MODE_MASK_CODECS[1:], level)
        rest, rest_codec = compress_best(arr[other], _MODE_REST_CODECS[1:], level)
        return (bytes([m, _MODE_MASK_CODECS.index(mask_codec) << 4 | _MODE_REST_CODECS.index(rest_codec)])
                + np.array([len(mask)], "<u4").tobytes() + mask + rest)
    elif codec == ZSTD_ESCAPE:
        arr = _bytes_view(data)
        if counts is None:
            counts = byte_counts(arr)
        top = np.argsort(counts, kind="stable")[::-1][:_ESCAPE_KEEP]  # the most frequent values
        kept = np.sort(top[counts[top] > 0]).astype(np.uint8) if arr.size else np.zeros(1, np.uint8)
        ranks = _ranks(arr, kept, kept.size)
        ranked = _radix_of(ranks, kept.size + 1, level)
        rest = arr[ranks == kept.size]
        return (bytes([kept.size]) + kept.tobytes() + np.array([len(ranked)], "<u8").tobytes() + ranked
                + compress(rest, ZSTD, level))
    elif codec == ZSTD:
        buf = _bytes_view(data)
    else:
        raise ValueError(f"unknown codec {codec!r}; known: {ZSTD!r}, {ZSTD_PLANES!r}, {ZSTD_RLE!r}, "
                         f"{ZSTD_RUNS!r}, {ZSTD_PACKED!r}, {ZSTD_RADIX!r}, {ZSTD_RANK!r}, {ZSTD_ESCAPE!r}, {RANKS!r}, "
                         f"{PREFIX!r}, {MODE!r}")
    return _compressor(level).compress(buf)


def _rank_table(alphabet: np.ndarray, other: int) -> np.ndarray:
    """The rank of each byte value in `alphabet` (ascending uint8 values), `other` for a value not in it."""
    rank_of = np.full(256, other, np.uint8)
    rank_of[alphabet] = np.arange(alphabet.size, dtype=np.uint8)
    return rank_of


def _ranks(arr: np.ndarray, alphabet: np.ndarray, other: int) -> np.ndarray:
    """Each byte's index in `alphabet` (ascending uint8 values), `other` for a byte not in it: a table lookup, not
    a search per byte."""
    table, out = _rank_table(alphabet, other), np.empty(arr.size, np.uint8)
    for i in range(0, arr.size, _BLOCK):  # "clip": a uint8 index is within the table; "raise" would buffer `out`
        np.take(table, arr[i:i + _BLOCK], out=out[i:i + _BLOCK], mode="clip")
    return out


def _radix_of(arr: np.ndarray, base: int, level: int | str) -> bytes:
    """"zstd-radix" of uint8 values below `base` (2..16; the header states `base`, at least 2)."""
    base = max(base, 2)
    return bytes([base]) + np.array([arr.size], "<u8").tobytes() + compress(_pack(arr, base), ZSTD, level)


def _pack(arr: np.ndarray, base: int, relabel: np.ndarray | None = None) -> np.ndarray:
    """uint8 values below `base` (2..16) packed `_radix_digits(base)` to a byte as digits in that base, the first
    value least significant; the last byte's missing values are zeros. `relabel`: a table (256 uint8) of the
    values to pack, indexed by the bytes of `arr` (a stream's ranks: `_rank_table`), applied on the way. Block
    by block (`_BLOCK`), each block's bytes written in place."""
    arr = np.ascontiguousarray(arr).reshape(-1)
    per = _radix_digits(base)
    out = np.empty(-(-arr.size // per), np.uint8)
    if per == 2 and arr.size >= _PAIR_TABLE_FROM:
        # Two values a byte: one lookup per pair of bytes (read as one 16-bit value, little-endian: the first byte
        # low) in a table of every pair's packed byte, instead of relabelling every byte, then padding, then
        # combining the digits (several passes over the stream: 2.9x as long on 25M values,
        # benchmarks/results/xla_cpu_kernels.md).
        digit = np.arange(256, dtype=np.uint8) if relabel is None else relabel
        pairs = (digit[None, :] + np.uint8(base) * digit[:, None]).reshape(-1)  # [high byte, low byte]
        even = arr.size // 2 * 2
        words = arr[:even].view("<u2")
        for i in range(0, words.size, _BLOCK):
            block = words[i:i + _BLOCK]
            np.take(pairs, block, out=out[i:i + block.size], mode="clip")  # within the 65,536 pairs
        if arr.size % 2:
            out[-1] = digit[arr[-1]]
        return out
    step = max(_BLOCK // per, 1) * per
    for i in range(0, arr.size, step):
        block = arr[i:i + step] if relabel is None else np.take(relabel, arr[i:i + step], mode="clip")
        if block.size % per:  # the last block: zeros fill its last byte
            block = np.concatenate([block, np.zeros(per - block.size % per, np.uint8)])
        digits = block.reshape(-1, per)  # least significant first; Horner's rule in uint8 (base ** per <= 256)
        packed = out[i // per:i // per + digits.shape[0]]
        packed[:] = digits[:, per - 1]
        for j in range(per - 2, -1, -1):
            packed *= np.uint8(base)
            packed += digits[:, j]
    return out


# Host passes over a long stream (byte histograms, rank lookups, packing) go block by block: a block's temporaries
# (np.take and np.bincount widen a uint8 or uint16 index to 64 bits) stay in cache and their pages are reused,
# where a whole stream's are fresh pages at every pass. On 25M-value streams, one thread: byte_counts 2.1-2.2x,
# "ranks" 1.7-2.5x and "zstd-escape" 1.7x as fast as one pass; a 100M-parameter residual save 1.18x
# (benchmarks/results/codec_blocks.md).
_BLOCK = 1 << 18


# zstandard's (de)compression contexts, one per thread (an object is not safe to share between threads) and
# level: making one costs tens of microseconds, about as much as coding a stream of a few kilobytes, and a save or
# restore codes a few streams per leaf.
_contexts = threading.local()


def _compressor(level: int | str) -> zstandard.ZstdCompressor:
    """This thread's compressor at a zstd level, or at `CODE_PARAMS` for `CODE_LEVEL`."""
    made = _contexts.__dict__.setdefault("compressors", {})
    if level not in made:
        made[level] = zstandard.ZstdCompressor(compression_params=CODE_PARAMS) if level == CODE_LEVEL else \
            zstandard.ZstdCompressor(level=level)
    return made[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_contexts, "decompressor"):
        _contexts.decompressor = zstandard.ZstdDecompressor()
    return _contexts.decompressor


_RUN_VALUE_CODECS = (RAW, ZSTD, ZSTD_RADIX, ZSTD_RANK)  # "zstd-runs": its values' codec byte indexes this
_RADIX_MAX = 16  # the largest base that still packs two values to a byte
# "mode": the low 4 bits of its codec byte index the other values' codec (a code codec but "mode" itself and
# "prefix", whose decode takes several times `ranks`' on streams of thousands of values: with it, a ResNet's warm
# restore slowed by 40% for a few tenths of a percent fewer bytes; benchmarks/results/save_breakdown_resnet_prefix.md),
# the high 4 bits the mask's. Offered to streams of `_MODE_FROM` values or more (below, "prefix" codes a stream of few
# values and its header costs less than the mask's frame) and fewer than `_PACKED_ONLY_SIZE` whose mode is at least
# half of them. Not to larger ones: gathering the other values costs several times a packing pass (ad hoc, 25M
# values: 0.1-0.2 s against 0.03 s), and a closed-loop chain's link of 1M values or more is added from its packed
# bytes on restore (quantize.takes_packed), which a "mode" stream does not have.
_MODE_REST_CODECS = (RAW, ZSTD, ZSTD_RUNS, RANKS, ZSTD_ESCAPE)
_MODE_MASK_CODECS = (RAW, RANKS, ZSTD_RUNS)  # its mask's: packed 8 to a byte, or the gaps between the other values
_MODE_FROM = 1 << 12


def _radix_digits(base: int) -> int:
    """Values of `base` (2..16) packed to one byte: the largest n with base**n <= 256."""
    n = 1
    while base ** (n + 1) <= 256:
        n += 1
    return n


def compress_best(data: np.ndarray, codecs: str | tuple[str, ...], level: int | str = DEFAULT_LEVEL,
                  counts: np.ndarray | None = None) -> tuple[bytes, str]:
    """The smallest of `compress` with each of `codecs` that can win on `data` (`_can_win`) and the raw bytes:
    (bytes, codec id used). `counts`: `data`'s byte histogram (`byte_counts`) when the caller has it."""
    raw = _bytes_view(data)
    best: tuple[bytes | None, str, int] = (None, RAW, raw.size)
    codecs = (codecs,) if isinstance(codecs, str) else codecs
    if counts is None and set(codecs) & {ZSTD_RLE, ZSTD_RUNS, ZSTD_ESCAPE, MODE, *PACKED_CODECS}:
        counts = byte_counts(raw)
    packs = counts is not None and raw.size >= _PACKED_ONLY_SIZE and any(
        c in codecs and _can_win(c, counts) for c in PACKED_CODECS)
    for c in codecs:
        if not _can_win(c, counts) or (packs and c == ZSTD):
            continue
        packed = compress(raw if c != ZSTD_PLANES else data, c, level, counts)
        if len(packed) < best[2]:
            best = (packed, c, len(packed))
    return (best[0], best[1]) if best[0] is not None else (raw.tobytes(), RAW)


# `_pack` looks pairs of values up in a 65,536-entry table from this many values on (the table costs about as
# much to make as packing this many values the other way).
_PAIR_TABLE_FROM = 1 << 16

# A "ranks" stream's packed bytes are offered to zstd only past this many: below it a frame's own header and
# block costs more than its Huffman coding of so few bytes can save.
_RANKS_FRAMED_FROM = 8

# A stream of at least this many values that radix or rank packing can code skips plain zstd: where packing
# applies, plain zstd seldom codes a code or delta stream smaller, and then by little, while on a large stream its
# pass costs as much as the packing's.
_PACKED_ONLY_SIZE = 1 << 20


def byte_counts(raw: np.ndarray) -> np.ndarray:
    """The histogram of a flat uint8 array (256 int64 counts), as np.bincount(raw, minlength=256) but faster:
    np.bincount widens every element to 64 bits, so pairs of bytes are counted as one 16-bit value (half the
    elements to widen) and the 65536 counts folded onto each byte."""
    if raw.dtype != np.uint8:
        raise TypeError(f"byte_counts counts uint8 arrays, not {raw.dtype}")
    pairs = raw.size // 2
    if pairs < 1 << 16:
        return np.bincount(raw, minlength=256)
    words, wide = raw[:2 * pairs].view(np.uint16), np.zeros(1 << 16, np.int64)
    for i in range(0, pairs, _BLOCK):
        wide += np.bincount(words[i:i + _BLOCK], minlength=1 << 16)
    wide = wide.reshape(256, 256)
    counts = wide.sum(axis=0) + wide.sum(axis=1)  # one byte of each pair indexes the columns, the other the rows
    if raw.size % 2:
        counts[raw[-1]] += 1
    return counts


def _can_win(codec: str, counts: np.ndarray | None) -> bool:
    """Whether `codec` is worth a pass over a uint8 stream with byte histogram `counts`: run lengths only when at
    least half the stream is zeros (else they store a run byte per value besides the value: on the code
    streams of benchmarks/results/delta.md they were then never the smallest, and their encoder is the slowest,
    ~100 ns per value on dense 8-level codes); of radix packing (values below `_RADIX_MAX`) and ranks (at most
    `_RADIX_MAX` distinct values), the one that packs more values to a byte (the same number: radix, whose bytes
    are then a relabelling of the ranks')."""
    if codec in (ZSTD_RLE, ZSTD_RUNS):
        return 2 * int(counts[0]) >= int(counts.sum())
    if codec == ZSTD_ESCAPE:  # more values than it ranks (else rank or radix packing codes them all), and the
        # others rare: at 1/8 of the stream their bytes alone cost a bit a value (near-uniform levels: no pass)
        kept = np.sort(counts)[::-1][:_ESCAPE_KEEP].sum()
        return np.count_nonzero(counts) > _ESCAPE_KEEP and 8 * (int(counts.sum()) - int(kept)) <= int(counts.sum())
    if codec == MODE:  # a mode of at least half: its mask then costs at most a bit a value, and the rest less
        total = int(counts.sum())
        return _MODE_FROM <= total < _PACKED_ONLY_SIZE and 2 * int(counts.max()) >= total
    if codec == RANKS:
        return 0 < np.count_nonzero(counts) <= _RADIX_MAX
    if codec == PREFIX:
        return 0 < np.count_nonzero(counts) <= _RADIX_MAX and int(counts.sum()) < PREFIX_BELOW
    if codec in (ZSTD_RADIX, ZSTD_RANK):
        present = np.flatnonzero(counts)
        radix = not counts[_RADIX_MAX:].any()
        rank = 0 < present.size <= _RADIX_MAX and (not radix or _radix_digits(max(present.size, 2)) > _radix_digits(
            max(int(present[-1]) + 1, 2)))
        return rank if codec == ZSTD_RANK else radix and not rank
    return True


class CodecError(ValueError):
    """A stream that does not decode to the size its record states (or not at all)."""


def decompress(blob: bytes, codec: str, size: int, itemsize: int = 1) -> bytes:
    """Inverse of `compress`: exactly `size` bytes, or CodecError (nothing larger is ever allocated, whatever
    the stream's own header claims); `itemsize` is the element size the planes were split by (zstd-planes)."""
    return _decode(blob, codec, size, itemsize).tobytes()


def _decode(blob, codec: str, size: int, itemsize: int = 1) -> np.ndarray:
    """`decompress` as a flat uint8 array (possibly read-only, possibly a view of the decoder's own buffer)."""
    if codec not in (RAW, ZSTD, ZSTD_PLANES, ZSTD_RLE, ZSTD_RUNS, ZSTD_PACKED, ZSTD_RADIX, ZSTD_RANK, ZSTD_ESCAPE,
                     RANKS, PREFIX, MODE):
        raise CodecError(f"unknown codec {codec!r}; known: {RAW!r}, {ZSTD!r}, {ZSTD_PLANES!r}, {ZSTD_RLE!r}, "
                         f"{ZSTD_RUNS!r}, {ZSTD_PACKED!r}, {ZSTD_RADIX!r}, {ZSTD_RANK!r}, {ZSTD_ESCAPE!r}, {RANKS!r}, "
                         f"{PREFIX!r}, {MODE!r}")
    if codec == RAW:
        out = np.frombuffer(blob, np.uint8)
    elif codec in (ZSTD_RLE, ZSTD_RUNS):
        out = _decompress_rle(blob, size, codec == ZSTD_RUNS)
    elif codec == ZSTD_PACKED:
        out = _decompress_packed(blob, size)
    elif codec == ZSTD_RADIX:
        out = _decompress_radix(blob, size)
    elif codec == ZSTD_RANK:
        out = _decompress_rank(blob, size)
    elif codec == ZSTD_ESCAPE:
        out = _decompress_escape(blob, size)
    elif codec == MODE:
        out = _decompress_mode(blob, size)
    elif codec in (RANKS, PREFIX):
        packed, base, alphabet = (_ranks_packed if codec == RANKS else _prefix_packed)(blob, size)
        out = _unpack(packed, base, size, alphabet)
    else:
        out = np.frombuffer(_zstd(blob, size), np.uint8)
    if out.size != size:
        raise CodecError(f"stream decodes to {out.size} bytes, expected {size}")
    if codec == ZSTD_PLANES and size:
        if size % itemsize:
            raise CodecError(f"{size} bytes are not whole elements of {itemsize} bytes")
        out = np.ascontiguousarray(out.reshape(itemsize, -1).T).reshape(-1)
    return out


def decompress_array(blob, codec: str, size: int, itemsize: int = 1) -> np.ndarray:
    """`decompress` as a read-only uint8 array of `size` bytes, 64-byte aligned from `ALIGNED_FROM` bytes: JAX's
    CPU client then takes it as a device buffer without a copy (a restore hands every decoded code stream to a
    kernel), and a plain zstd stream is decompressed straight into it (no intermediate bytes object, whose pages
    the kernel would fault in once more)."""
    if size < ALIGNED_FROM:  # a copy to place it costs less than the one it saves
        out = _decode(blob, codec, size, itemsize)
        out.flags.writeable = False
        return out
    try:
        declared = zstandard.get_frame_parameters(blob).content_size if codec == ZSTD else None
    except zstandard.ZstdError as e:
        raise CodecError(f"zstandard stream does not decode ({e})") from None
    if declared != size:  # another codec, or a frame without its size: decoded within `size`, then placed
        if declared is not None and declared != zstandard.CONTENTSIZE_UNKNOWN:
            raise CodecError(f"zstandard frame declares {declared} bytes, expected {size}")
        out = _decode(blob, codec, size, itemsize)
        if out.ctypes.data % _ALIGN:
            out = aligned_copy(out)
        out.flags.writeable = False
        return out
    out = aligned_empty(size)  # the frame's header states this size: nothing is allocated before that check
    _zstd_into(blob, out)
    out.flags.writeable = False
    return out


def _zstd_into(blob, out: np.ndarray) -> None:
    """Decompress a zstandard frame of exactly `out.size` bytes straight into the uint8 array `out` (no
    intermediate bytes object), or CodecError; nothing beyond `out` is allocated, whatever the frame declares."""
    size = out.size
    try:
        got, view = 0, memoryview(out)
        with _decompressor().stream_reader(blob) as reader:
            while got < size:
                n = reader.readinto(view[got:])
                if not n:
                    break
                got += n
            extra = reader.read(1)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstandard stream does not decode ({e})") from None
    if got != size or extra:
        raise CodecError(f"stream decodes to {'more than ' if extra else ''}{got} bytes, expected {size}")


_ALIGN = 64  # bytes: the alignment XLA's CPU client needs to use a host buffer in place
ALIGNED_FROM = 1 << 16  # bytes: a smaller stream is decoded as it comes (placing it would cost more than a copy)


def aligned_empty(size: int) -> np.ndarray:
    """An uninitialised uint8 array of `size` bytes starting at a multiple of 64 bytes."""
    buf = np.empty(size + _ALIGN, np.uint8)
    start = -buf.ctypes.data % _ALIGN
    return buf[start:start + size]


def aligned_copy(data) -> np.ndarray:
    """A 64-byte aligned uint8 copy of a buffer."""
    src = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    out = aligned_empty(src.size)
    out[:] = src
    return out


def decompress_bounded(blob: bytes, limit: int) -> bytes:
    """One zstandard frame of at most `limit` bytes whose size is not known in advance (records), or
    CodecError; nothing over `limit` is allocated."""
    return _zstd(blob, limit)


def _zstd(blob: bytes, limit: int) -> bytes:
    """A zstandard frame of at most `limit` bytes; its header's content size is checked before anything is
    allocated by it."""
    try:
        declared = zstandard.get_frame_parameters(blob).content_size
        if declared != zstandard.CONTENTSIZE_UNKNOWN and declared > limit:
            raise CodecError(f"zstandard frame declares {declared} bytes, at most {limit} expected")
        out = _decompressor().decompress(blob, max_output_size=max(limit, 1))
    except zstandard.ZstdError as e:
        raise CodecError(f"zstandard stream does not decode ({e})") from None
    if len(out) > limit:
        raise CodecError(f"zstandard stream decodes to {len(out)} bytes, at most {limit} expected")
    return out


def _decompress_packed(blob: bytes, size: int) -> np.ndarray:
    if len(blob) < 9 or blob[0] not in _PACK_WIDTHS:
        raise CodecError("zstd-packed stream has no valid width byte and count")
    width, count = blob[0], int(np.frombuffer(blob[1:9], "<u8")[0])
    if count != size:
        raise CodecError(f"zstd-packed header states {count} values; expected {size}")
    per = 8 // width
    nbytes = -(-size // per)
    packed = np.frombuffer(_zstd(blob[9:], nbytes), np.uint8)
    if packed.size != nbytes:
        raise CodecError(f"zstd-packed stream holds {packed.size} bytes, expected {nbytes} for {size} values")
    shifts = (np.arange(per, dtype=np.uint8) * width)[None, :]
    values = (packed[:, None] >> shifts) & np.uint8((1 << width) - 1)
    return values.reshape(-1)[:size]


def _decompress_radix(blob: bytes, size: int) -> np.ndarray:
    return _digits(*_radix_packed(blob, size), size)


def _digits(packed: np.ndarray, base: int, size: int) -> np.ndarray:
    """The first `size` digits (base `base`, least significant first) of checked packed bytes."""
    # Digit by digit with vectorised integer division: faster than a table lookup per packed byte (NumPy's
    # take with a uint8 index), except where each digit then takes a value of its own (`_unpack`).
    per = _radix_digits(base)
    digits = np.empty((packed.size, per), np.uint8)
    rest, b = packed, np.uint8(base)
    for j in range(per):
        q = rest // b
        digits[:, j] = rest - q * b
        rest = q
    return digits.reshape(-1)[:size]


def _radix_packed(blob: bytes, size: int, slots: int = 0) -> tuple[np.ndarray, int]:
    """The packed bytes of a "zstd-radix" stream of `size` values, checked (each is `_radix_digits(base)` digits
    in its base), and the base. The bytes are 64-byte aligned, decompressed straight into place, and hold at least
    `slots` values: any bytes past the stream's are zeros."""
    if len(blob) < 9 or not 2 <= blob[0] <= _RADIX_MAX:
        raise CodecError("zstd-radix stream has no valid base byte and count")
    base, count = blob[0], int(np.frombuffer(blob[1:9], "<u8")[0])
    if count != size:
        raise CodecError(f"zstd-radix header states {count} values; expected {size}")
    per = _radix_digits(base)
    nbytes = -(-size // per)
    packed = _placed(memoryview(blob)[9:], True, nbytes, -(-slots // per))
    if nbytes and int(packed[:nbytes].max()) >= base ** per:
        raise CodecError(f"zstd-radix byte {int(packed[:nbytes].max())} is not {per} digits in base {base}")
    return packed, base


def _placed(body, framed: bool, nbytes: int, room: int) -> np.ndarray:
    """A stream's `nbytes` packed bytes, from `body` (one zstandard frame of exactly that many bytes if `framed`,
    else the bytes themselves), in a 64-byte aligned array of at least `room` bytes, zeros past them."""
    packed = aligned_empty(max(nbytes, room))
    if framed:
        _zstd_into(body, packed[:nbytes])
    elif len(body) != nbytes:
        raise CodecError(f"stream holds {len(body)} packed bytes, expected {nbytes}")
    else:
        packed[:nbytes] = np.frombuffer(body, np.uint8)
    packed[nbytes:] = 0
    return packed


def _unpack(packed: np.ndarray, base: int, size: int, alphabet: bytes) -> np.ndarray:
    """`_digits` of checked packed bytes, each replaced by alphabet[digit], into a fresh 64-byte aligned array
    (`aligned_empty`: a restore hands it to a kernel without a copy): one lookup per packed byte in a table whose
    items hold all its values at once (`_digit_table`). Items of 1, 2, 4 or 8 bytes are words, looked up with
    np.take straight into the output; 3 values to a byte (bases 5 and 6) are looked up as 4-byte words whose
    padding one strided byte copy per value drops; 5 (base 3) as 5-byte items. Each the fastest of those
    measured for its case (ad hoc: a restore's residual streams decoded about 2x faster than with 3-byte items
    throughout)."""
    per, table = _radix_digits(base), _digit_table(base, alphabet)
    out = aligned_empty(packed.size * per)
    if per == 3:
        grid = out.reshape(packed.size, per)
        wide = np.take(table, packed, mode="clip").view(np.uint8).reshape(packed.size, table.itemsize)
        for j in range(per):
            grid[:, j] = wide[:, j]
    else:  # "raise" (the default mode) would buffer `out`; a uint8 index is within the 256 entries anyway
        np.take(table, packed, out=out.view(table.dtype), mode="clip")
    return out[:size]


@functools.lru_cache(maxsize=256)
def _digit_rows(base: int, alphabet: bytes) -> np.ndarray:
    """(256, per) uint8, per = `_radix_digits(base)`: for each byte b < base ** per, its per digits in base
    `base`, least significant (the first value) first, each replaced by alphabet[digit]; the bytes past
    base ** per, refused before any lookup, hold zeros. Read-only."""
    per = _radix_digits(base)
    values = np.frombuffer(alphabet, np.uint8)
    rows = np.zeros((256, per), np.uint8)
    b = np.arange(base ** per)
    for j in range(per):
        rows[:b.size, j] = values[(b // base ** j) % base]
    rows.flags.writeable = False
    return rows


@functools.lru_cache(maxsize=256)
def _digit_table(base: int, alphabet: bytes) -> np.ndarray:
    """`_digit_rows` with each row as one item of 256: an unsigned integer of per bytes for per 1, 2, 4 or 8, of
    4 bytes (the values, then a zero) for per 3, and per bytes (a NumPy void item) for per 5. `_unpack` uses each
    so."""
    rows = _digit_rows(base, alphabet)
    per = rows.shape[1]
    width = 4 if per == 3 else per
    wide = np.zeros((256, width), np.uint8)
    wide[:, :per] = rows
    table = wide.view(f"u{width}" if width in (1, 2, 4, 8) else f"V{width}").reshape(256)
    table.flags.writeable = False
    return table


def packed_values(blob: bytes, codec: str, size: int, slots: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """A stream of `size` byte values left packed: for "ranks", "zstd-radix", and "zstd-rank" whose ranks are in
    its alphabet's own base (what the encoder writes for an alphabet of 2 or more), (its checked packed bytes and
    `_digit_rows` of its base and alphabet: the `per` values each byte holds), so that value i < `size` is
    rows[packed[i // per], i % per], exactly what `decompress` gives; None for any other stream (decode it with
    `decompress_array`). The packed bytes are 64-byte aligned and hold at least `slots` values: the bytes past
    the stream's are zeros (each holds `per` of rows[0]). A restore's kernels look the values up from the packed
    bytes, where spelling out every value on the host first cost most of a deep restore's time
    (benchmarks/results/handler.md)."""
    if codec in (RANKS, PREFIX):
        packed, base, alphabet = (_ranks_packed if codec == RANKS else _prefix_packed)(blob, size, slots)
        return packed, _digit_rows(base, alphabet)
    if codec == ZSTD_RADIX:
        head, alphabet = blob, None
    elif codec == ZSTD_RANK:
        values = _alphabet(blob, _RADIX_MAX, 0, ZSTD_RANK)
        if values.size < 2 or len(blob) < 2 + values.size or blob[1 + values.size] != values.size:
            return None  # ranks in another base: each must be checked against the alphabet (`_decompress_rank`)
        head, alphabet = blob[1 + values.size:], values.tobytes()
    else:
        return None
    packed, base = _radix_packed(head, size, slots)
    return packed, _digit_rows(base, alphabet if alphabet is not None else bytes(range(base)))


def _alphabet(blob: bytes, most: int, after: int, name: str, flags: int = 0) -> np.ndarray:
    """The alphabet that heads a "zstd-rank", "zstd-escape" or "ranks" stream: a count k in [1, `most`] (its
    first byte, less the bits of `flags`), then k strictly ascending byte values, then at least `after` more
    bytes."""
    k = blob[0] & ~flags if len(blob) else 0
    if not 1 <= k <= most or len(blob) < 1 + k + after:
        raise CodecError(f"{name} stream has no valid alphabet")
    alphabet = np.frombuffer(blob[1:1 + k], np.uint8)
    if k > 1 and not np.all(alphabet[1:] > alphabet[:-1]):
        raise CodecError(f"{name} alphabet is not strictly ascending")
    return alphabet


def _decompress_rank(blob: bytes, size: int) -> np.ndarray:
    alphabet = _alphabet(blob, _RADIX_MAX, 0, ZSTD_RANK)
    k = alphabet.size
    packed, base = _radix_packed(blob[1 + k:], size)
    if base == k:  # every digit is below k: a rank (what the encoder writes for k >= 2)
        return _unpack(packed, base, size, alphabet.tobytes())
    ranks = _digits(packed, base, size)
    if ranks.size and int(ranks.max()) >= k:
        raise CodecError(f"zstd-rank stream holds rank {int(ranks.max())} of an alphabet of {k}")
    return alphabet[ranks]


def _ranks_packed(blob: bytes, size: int, slots: int = 0) -> tuple[np.ndarray, int, bytes]:
    """A "ranks" stream of `size` values: its packed ranks, checked (each byte `_radix_digits(base)` ranks below
    the alphabet's size), 64-byte aligned and holding at least `slots` values (zeros past the stream's), their
    base, and the alphabet as bytes, of `base` values (an alphabet of one value repeats it: its ranks are all
    0)."""
    alphabet = _alphabet(blob, _RADIX_MAX, 0, RANKS, _RANKS_ZSTD)
    k = alphabet.size
    base = max(k, 2)
    per = _radix_digits(base)
    nbytes = -(-size // per)
    body = memoryview(blob)[1 + k:]
    framed = bool(blob[0] & _RANKS_ZSTD)
    try:  # the stored size checked before anything of that size is allocated
        held = zstandard.get_frame_parameters(body).content_size if framed else len(body)
    except zstandard.ZstdError as e:
        raise CodecError(f"ranks stream's zstandard frame does not decode ({e})") from None
    if held != nbytes:
        raise CodecError(f"ranks stream holds {held} packed bytes, expected {nbytes} for {size} values")
    packed = _placed(body, framed, nbytes, -(-slots // per))
    if nbytes and int(packed[:nbytes].max()) >= k ** per:
        raise CodecError(f"ranks byte {int(packed[:nbytes].max())} is not {per} ranks below {k}")
    _check_padding(packed, size, k, RANKS)
    return packed, base, _rank_values(alphabet)


def _rank_values(alphabet: np.ndarray) -> bytes:
    """The values a packed stream's ranks stand for, as bytes, one per digit of its base max(k, 2): the alphabet,
    or an alphabet of one value repeated (its ranks are all 0)."""
    return alphabet.tobytes() * 2 if alphabet.size == 1 else alphabet.tobytes()


def _check_padding(packed: np.ndarray, size: int, k: int, name: str) -> None:
    """A packed rank stream of `size` values (`_radix_digits(max(k, 2))` ranks a byte) whose last byte holds more
    ranks than the stream's: those must be rank 0, as the encoder pads."""
    per = _radix_digits(max(k, 2))
    if size % per and int(packed[-(-size // per) - 1]) >= k ** (size % per):
        raise CodecError(f"{name} stream holds more than {size} values")


# "prefix": a stream's packed ranks (the bytes "ranks" writes) coded by a canonical Huffman code whose lengths
# follow from a model of a few bits per rank stated in the stream, not from a table of the bytes' own.
PREFIX_BELOW = 1 << 14  # offered to streams of fewer values: a decoder finds every codeword's start by pointer
# doubling over all bit offsets (a pass per doubling of the codewords), so its decode grows faster than the stream
# while what it saves over a zstd frame shrinks relative to it (benchmarks/results/codec_speed.md)
_PREFIX_READ_MAX = 1 << 16  # values: a reader refuses a longer "prefix" stream (its decode's arrays take up to ~25
# bytes per bit of the stream, up to `_PREFIX_LONGEST` bits a codeword, before the stream is checked)
_PREFIX_WEIGHT_BITS = 62  # a byte's weight (the product of its ranks' frequencies) stays within int64
_PREFIX_PRECISION = 16  # the most bits a rank's frequency takes
_PREFIX_LONGEST = 57  # bits: the longest codeword a 64-bit window read at any bit offset holds whole
_BIT_SHIFTS = np.arange(8, dtype=np.uint64)[None, :]


def _prefix_precisions(k: int, per: int) -> range:
    """The model precisions p a stream of `k` ranks packed `per` to a byte may state: 2**p >= k (every rank a
    frequency of at least 1) and a byte's weight within `_PREFIX_WEIGHT_BITS`."""
    return range(max((k - 1).bit_length(), 1), min(_PREFIX_PRECISION, _PREFIX_WEIGHT_BITS // per) + 1)


def _prefix_frequencies(counts: list[int], p: int) -> list[int]:
    """`counts` (every one positive) as frequencies of at least 1 summing to 2**p: proportional, rounded down,
    then the missing units given to (or surplus taken from) the ranks where a unit matters most. Plain Python:
    a stream has at most 16 ranks, and NumPy's call overhead would dominate."""
    total, n, k = 1 << p, sum(counts), len(counts)
    f = [max(c * total // n, 1) for c in counts]
    held = sum(f)
    while held > total:
        f[max(range(k), key=lambda i: f[i] if f[i] > 1 else 0)] -= 1
        held -= 1
    while held < total:
        f[max(range(k), key=lambda i: counts[i] / f[i])] += 1
        held += 1
    return f


def _huffman_lengths(weights: np.ndarray) -> np.ndarray:
    """Huffman code lengths (int64) of positive int64 `weights` (at least two), by the two-queue method on the
    weights sorted (stable) with a leaf taken before an equal internal node: the same lengths wherever they are
    computed, which the decoder relies on. Plain Python over at most 256 weights (a decoder builds one code per
    stream; NumPy's per-call overhead would dominate)."""
    order = np.argsort(weights, kind="stable")
    n = order.size
    top = 1 << 64  # above any sum of int64 weights: an exhausted queue's sentinel
    w = weights[order].tolist()
    w.append(top)
    inner = [top] * n
    up = [0] * (2 * n - 1)
    leaf = node = 0
    for made in range(n - 1):
        if w[leaf] <= inner[node]:
            a = w[leaf]
            up[leaf] = made
            leaf += 1
        else:
            a = inner[node]
            up[n + node] = made
            node += 1
        if w[leaf] <= inner[node]:
            a += w[leaf]
            up[leaf] = made
            leaf += 1
        else:
            a += inner[node]
            up[n + node] = made
            node += 1
        inner[made] = a
    # Depths from the root (internal node n - 2) down: an internal node's parent was made after it.
    depth = [0] * (n - 1)
    for made in range(n - 3, -1, -1):
        depth[made] = depth[up[n + made]] + 1
    lengths = np.empty(n, np.int64)
    lengths[order] = [depth[up[i]] + 1 for i in range(n)]
    return lengths


@functools.lru_cache(maxsize=1024)
def _prefix_code(k: int, frequencies: tuple) -> tuple[np.ndarray, ...]:
    """The canonical code of the bytes of `_radix_digits(k)` ranks below `k` whose ranks have `frequencies`
    (each byte's weight: the product of its ranks'): (each byte's code length, each byte's code (uint64, right
    aligned), and for decoding: the codewords' left-aligned 64-bit starts ascending, the byte of each and the
    length of each). Weights whose Huffman code would be longer than `_PREFIX_LONGEST` bits are halved (at least
    1) until it is not."""
    per = _radix_digits(k)
    b = np.arange(k ** per)
    weights = np.ones(b.size, np.int64)
    f = np.asarray(frequencies, np.int64)
    for j in range(per):
        weights *= f[(b // k ** j) % k]
    lengths = _huffman_lengths(weights)
    while lengths.max() > _PREFIX_LONGEST:
        weights = np.maximum(weights >> 1, 1)
        lengths = _huffman_lengths(weights)
    order = np.lexsort((b, lengths))  # canonical: by length, then byte
    steps = np.uint64(1) << (np.uint64(64) - lengths[order].astype(np.uint64))
    starts = np.concatenate([np.zeros(1, np.uint64), np.cumsum(steps[:-1], dtype=np.uint64)])
    codes = np.empty(b.size, np.uint64)
    codes[order] = starts >> (np.uint64(64) - lengths[order].astype(np.uint64))
    out = (lengths, codes, starts, order.astype(np.uint8), lengths[order])
    for a in out:
        a.flags.writeable = False
    return out


def _bits_of(values: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The bits (uint8 0/1, most significant first) of each uint64 value in its width, concatenated."""
    widths = widths.astype(np.int64)
    total = int(widths.sum())
    starts = np.cumsum(widths) - widths
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, widths)
    shift = (np.repeat(widths, widths) - 1 - within).astype(np.uint64)
    return ((np.repeat(values.astype(np.uint64), widths) >> shift) & np.uint64(1)).astype(np.uint8)


def _prefix_body(packed: np.ndarray, counts: list[int], size: int) -> bytes:
    """What follows a "prefix" stream's alphabet of k >= 2 values (`compress`): a byte p and one bit stream, most
    significant bit first, zero-padded to a byte: the first k - 1 ranks' frequencies in units of 2**-p, p bits each
    (the last rank's is the rest of 2**p), then each of the `packed` ranks' bytes (`_pack`) in the canonical
    Huffman code of the byte weights the frequencies give (`_prefix_code`). `counts`: each rank's count among the
    `size` values. The precision p is the one that minimises the model's bits plus the ranks' ideal cost under
    it."""
    k = len(counts)
    best = None
    for p in _prefix_precisions(k, _radix_digits(k))[:size.bit_length() + 1]:  # finer than the counts: model bits
        f = _prefix_frequencies(counts, p)
        cost = (k - 1) * p + sum(ci * (p - math.log2(fi)) for ci, fi in zip(counts, f))
        if best is None or cost < best[0]:
            best = (cost, p, f)
    _, p, f = best
    lengths, codes = _prefix_code(k, tuple(f))[:2]
    model = _bits_of(np.asarray(f[:-1], np.uint64), np.full(k - 1, p))
    bits = np.concatenate([model, _bits_of(codes[packed], lengths[packed])])
    return bytes([p]) + np.packbits(bits).tobytes()


def _prefix_packed(blob: bytes, size: int, slots: int = 0) -> tuple[np.ndarray, int, bytes]:
    """A "prefix" stream of `size` values as `_ranks_packed` gives a "ranks" stream: its packed ranks decoded and
    checked, 64-byte aligned with room for `slots` values (zeros past the stream's), their base and the alphabet.
    Every codeword's start is found at once: each bit offset's codeword length is read from a 64-bit window
    there, and offsets jump by doubling (round r knows the first 2**r starts and the 2**r-th next offset of
    every offset). Refused: a model that does not state k frequencies of at least 1 summing to 2**p, fewer bits
    than the values need, more than a byte of padding, padding that is not zeros, a last byte with more ranks
    than `size` leaves, more than `_PREFIX_READ_MAX` values or more bits than their longest codewords take (both
    before the decode's arrays are allocated)."""
    alphabet = _alphabet(blob, _RADIX_MAX, 0, PREFIX)
    k = alphabet.size
    base = max(k, 2)
    per = _radix_digits(base)
    count = -(-size // per)
    names = _rank_values(alphabet)
    if k == 1:
        if len(blob) != 2:
            raise CodecError(f"prefix stream of one value holds {len(blob) - 2} more bytes")
        return _placed(b"", False, 0, max(count, -(-slots // per))), base, names
    if len(blob) < 2 + k or blob[1 + k] not in _prefix_precisions(k, per):
        raise CodecError(f"prefix stream of {k} values has no valid precision byte")
    p = blob[1 + k]
    body = np.frombuffer(blob, np.uint8, offset=2 + k)
    nbits = 8 * body.size
    start = (k - 1) * p
    if size > _PREFIX_READ_MAX:
        raise CodecError(f"prefix stream of {size} values: this reader decodes at most {_PREFIX_READ_MAX:,}")
    if not start + count <= nbits <= start + count * _PREFIX_LONGEST + 7:  # 1 to 57 bits a codeword, then padding
        raise CodecError(f"prefix stream of {nbits} bits cannot hold {size} values")
    bits = int.from_bytes(blob[2 + k:2 + k + -(-start // 8)], "big") >> (-start % 8)  # the model's bits
    f = [(bits >> (p * (k - 2 - i))) & ((1 << p) - 1) for i in range(k - 1)]
    f.append((1 << p) - sum(f))
    if min(f) < 1:
        raise CodecError(f"prefix stream's model {f} is not {k} frequencies of at least 1 summing to 2**{p}")
    _, _, starts, order, widths = _prefix_code(k, tuple(f))
    padded = np.zeros(body.size + 8, np.uint8)
    padded[:body.size] = body
    # The 8 bytes from each byte offset as one big-endian word (overlapping items of stride 1, read in one pass),
    # shifted by 0..7: the 64-bit window at every bit offset, in order; from the model's end on.
    words = np.ndarray((body.size,), ">u8", padded, 0, (1,)).astype(np.uint64)
    windows = (words[:, None] << _BIT_SHIFTS).reshape(-1)[start:]
    found = np.searchsorted(starts, windows, side="right") - 1
    width = widths[found]
    rel = nbits - start  # offsets from the model's end; an offset past the end jumps to the end
    jump = np.empty(rel + 1, np.int64)
    np.minimum(np.arange(rel) + width, rel, out=jump[:rel])
    jump[rel] = rel
    first = np.zeros(1 << max(count - 1, 0).bit_length(), np.int64)  # the first 2**r codewords' offsets
    have = 1
    while have < count:
        first[have:2 * have] = jump[first[:have]]
        have *= 2
        if have < count:
            jump = jump[jump]
    first = first[:count]
    end = start + int(first[-1]) + int(width[first[-1]]) if first[-1] < rel else nbits + 1
    if not nbits - 8 < end <= nbits or int(body[-1]) & ((1 << (nbits - end)) - 1):  # padding: < 8 zero bits
        raise CodecError(f"prefix stream's codewords for {size} values do not end in its last byte")
    packed = aligned_empty(max(count, -(-slots // per)))
    np.take(order, found[first], out=packed[:count])
    packed[count:] = 0
    _check_padding(packed, size, k, PREFIX)
    return packed, base, names


def _decompress_escape(blob: bytes, size: int) -> np.ndarray:
    kept = _alphabet(blob, _ESCAPE_KEEP, 8, ZSTD_ESCAPE)
    k = kept.size
    n = int(np.frombuffer(blob[1 + k:9 + k], "<u8")[0])
    if n > len(blob) - 9 - k:
        raise CodecError(f"zstd-escape states a ranked part of {n} bytes, the stream has fewer")
    packed, base = _radix_packed(blob[9 + k:9 + k + n], size)
    if base != k + 1:
        raise CodecError(f"zstd-escape ranks are in base {base}, not {k + 1}")
    # The ranks mapped to the kept values in one lookup, the escape rank to a byte that is not one of them: the
    # escaped places are where that byte is, and take the other values in order.
    taken = set(kept.tolist())
    marker = next(v for v in range(256) if v not in taken)
    out = _unpack(packed, base, size, kept.tobytes() + bytes([marker]))
    # The other values first (at most one per value): without any, a test for the marker replaces the search for
    # its places.
    rest = np.frombuffer(_zstd(blob[9 + k + n:], size), np.uint8)
    hit = out == marker
    escaped = np.flatnonzero(hit) if rest.size else np.zeros(int(hit.any()), np.intp)
    if rest.size != escaped.size:
        raise CodecError(f"zstd-escape holds {rest.size} other values for {escaped.size if rest.size else 'some'} "
                         "escapes")
    out[escaped] = rest
    return out


def _decompress_mode(blob: bytes, size: int) -> np.ndarray:
    if len(blob) < 6 or blob[1] >> 4 >= len(_MODE_MASK_CODECS) or blob[1] & 15 >= len(_MODE_REST_CODECS):
        raise CodecError("mode stream has no valid mode, codec byte and mask length")
    m, n = blob[0], int(np.frombuffer(blob[2:6], "<u4")[0])
    if n > len(blob) - 6:
        raise CodecError(f"mode stream states a mask of {n} bytes, the stream has fewer")
    other = _decode(blob[6:6 + n], _MODE_MASK_CODECS[blob[1] >> 4], size)
    if other.size and int(other.max()) > 1:
        raise CodecError(f"mode stream's mask holds {int(other.max())}, not 0 or 1")
    other = other.view(bool)
    values = _decode(blob[6 + n:], _MODE_REST_CODECS[blob[1] & 15], int(np.count_nonzero(other)))
    out = np.full(size, m, np.uint8)
    np.place(out, other, values)  # the values in order where the mask is set (a little faster than out[other] =)
    return out


_RLE_CHUNK = 1 << 18  # run bytes summed at a time (each chunk holds a few int64 temporaries of its size)


def _decompress_rle(blob: bytes, size: int, coded_values: bool) -> np.ndarray:
    """"zstd-rle", or "zstd-runs" (`coded_values`: a byte naming the values' codec after the header)."""
    name, head = (ZSTD_RUNS, 17) if coded_values else (ZSTD_RLE, 16)
    if len(blob) < head:
        raise CodecError(f"{name} stream shorter than its header")
    n, k = (int(v) for v in np.frombuffer(blob[:16], "<u8"))
    if n != size or k > len(blob) - head:
        raise CodecError(f"{name} header states {n} symbols in {k} bytes; expected {size} symbols")
    if coded_values and blob[16] >= len(_RUN_VALUE_CODECS):
        raise CodecError(f"{name} names value codec {blob[16]}, not one of {len(_RUN_VALUE_CODECS)}")
    runs = np.frombuffer(_zstd(blob[head:head + k], n + n // 255 + 1), np.uint8)
    count = int(np.count_nonzero(runs != 255))  # each byte below 255 ends one run
    rest = blob[head + k:]
    values = _decode(rest, _RUN_VALUE_CODECS[blob[16]], count) if coded_values else np.frombuffer(
        _zstd(rest, count), np.uint8)
    if values.size != count:
        raise CodecError(f"zstd-rle stream holds {values.size} values for {count} runs")
    # A run's end is at (the sum over the bytes up to and including its last one of byte + [byte < 255]) - 1:
    # 255 * (its 255s) + its gap, plus one per run. Summed in chunks, so the temporaries stay small whatever
    # the stream holds.
    out = np.zeros(n, np.uint8)
    total, placed = 0, 0
    for lo in range(0, runs.size, _RLE_CHUNK):
        part = runs[lo:lo + _RLE_CHUNK]
        ends = part != 255
        sums = np.cumsum(part.astype(np.int64) + ends) + total
        total = int(sums[-1])
        positions = sums[ends] - 1
        if positions.size and positions[-1] >= n:
            raise CodecError("zstd-rle runs point past the end of the stream")
        out[positions] = values[placed:placed + positions.size]
        placed += positions.size
    return out


def order0_entropy_bytes(symbols: np.ndarray) -> float:
    """Order-0 (memoryless) entropy of a uint8 stream in bytes: the bound a symbol-by-symbol coder meets."""
    counts = np.bincount(np.asarray(symbols, np.uint8).reshape(-1), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum() * counts.sum() / 8.0)
