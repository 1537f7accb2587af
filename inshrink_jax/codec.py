"""Entropy coding of byte streams (host, NumPy + zstandard).

Two codecs, each identified by an id string that the manifest records next to every blob, so a reader picks
the decoder by id and a later format adds a codec instead of breaking old checkpoints:
  "zstd"        plain zstandard of the bytes (code streams, deltas, small metadata).
  "zstd-planes" byte-plane grouping then zstandard, for lossless float data: byte i of every element is
                stored together, so the exponent bytes (which repeat) form long runs that zstd finds.
  "raw"         the bytes as they are: chosen by `compress_best` when coding would not make them smaller
                (tiny leaves such as step counters, where zstd's frame header costs more than it saves).
"""

from __future__ import annotations

import numpy as np
import zstandard

ZSTD = "zstd"
ZSTD_PLANES = "zstd-planes"
RAW = "raw"
DEFAULT_LEVEL = 3


def compress(data: bytes | np.ndarray, codec: str = ZSTD, level: int = DEFAULT_LEVEL, threads: int = 0) -> bytes:
    """Compress a byte string or the raw bytes of an array with `codec` (see the module docstring).

    `threads` > 0 lets zstandard use that many worker threads (it releases the GIL either way).
    """
    if codec == ZSTD_PLANES:
        arr = np.ascontiguousarray(data)
        data = arr.view(np.uint8).reshape(-1, arr.dtype.itemsize).T.tobytes() if arr.size else b""
    elif codec != ZSTD:
        raise ValueError(f"unknown codec {codec!r}; known: {ZSTD!r}, {ZSTD_PLANES!r}")
    buf = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    return zstandard.ZstdCompressor(level=level, threads=threads).compress(buf)


def compress_best(data: np.ndarray, codec: str, level: int = DEFAULT_LEVEL) -> tuple[bytes, str]:
    """`compress` with `codec`, or the raw bytes if those are not larger: (bytes, codec id used)."""
    raw = np.ascontiguousarray(data).tobytes()
    packed = compress(data, codec, level)
    return (packed, codec) if len(packed) < len(raw) else (raw, RAW)


def decompress(blob: bytes, codec: str, itemsize: int = 1) -> bytes:
    """Inverse of `compress`; `itemsize` is the element size the planes were split by (zstd-planes only)."""
    if codec == RAW:
        return bytes(blob)
    raw = zstandard.ZstdDecompressor().decompress(blob)
    if codec == ZSTD:
        return raw
    if codec == ZSTD_PLANES:
        planes = np.frombuffer(raw, np.uint8).reshape(itemsize, -1)
        return planes.T.tobytes()
    raise ValueError(f"unknown codec {codec!r}; known: {ZSTD!r}, {ZSTD_PLANES!r}")


def order0_entropy_bytes(symbols: np.ndarray) -> float:
    """Order-0 (memoryless) entropy of a uint8 stream in bytes: the bound a symbol-by-symbol coder meets."""
    counts = np.bincount(np.asarray(symbols, np.uint8).reshape(-1), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum() * counts.sum() / 8.0)
