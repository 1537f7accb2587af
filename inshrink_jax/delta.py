"""Quantization-aware delta coding of code arrays (ALGORITHM.md step 6), on the host with NumPy.

A later checkpoint stores, per weight, the cyclic change of its code since the previous checkpoint,
    d = (c_new - c_prev) mod B,    B = max(K_prev, K_new) + 2,
(K levels plus the pruned and protected codes; B bounds every code of both checkpoints, so d < B and the
decoder gets c_new = (c_prev + d) mod B exactly, even when the bin count changed). The deltas are stored
*rearranged*: ordered by a stable sort of c_prev, so weights that shared a level, which tend to move together,
sit side by side and zstd sees long runs. The decoder holds c_prev, recomputes the same permutation, and
nothing extra is stored.

Both directions are vectorised NumPy on uint8 arrays (NumPy's stable sort of 8-bit keys is a radix sort, so
the rearrangement is linear time), the modular arithmetic in uint8 where it cannot wrap.
"""

from __future__ import annotations

import numpy as np


def modulus(bins_prev: int, bins_new: int) -> int:
    """B for a delta between checkpoints quantized to `bins_prev` and `bins_new` levels."""
    return max(bins_prev, bins_new) + 2


def _order(prev: np.ndarray) -> np.ndarray:
    return np.argsort(prev.reshape(-1), kind="stable")


def _check_below(top: int, b: int) -> None:
    """A stream from disk is untrusted: a code or delta the modulus cannot hold is an error."""
    if top >= b:
        raise ValueError(f"code {top} is not below the delta modulus {b}")


def _add_mod(a: np.ndarray, d: np.ndarray, b: int) -> np.ndarray:
    """(a + d) mod b for uint8 values below `b`, as uint8: in uint8 arithmetic where the sum cannot wrap (b <= 128;
    faster than widening and looking the residue up, and a deep restore decodes one delta a second moment and
    link), in wider integers beyond."""
    if b > 128:
        return ((a.astype(np.uint16) + d) % np.uint16(b)).astype(np.uint8)
    v = a + d
    v -= (v >= b).view(np.uint8) * np.uint8(b)
    return v


def _sub_mod(n: np.ndarray, p: np.ndarray, b: int) -> np.ndarray:
    """(n - p) mod b for uint8 values below `b` (<= 256), as uint8: the difference wraps modulo 256 where n < p,
    and adding b (modulo 256 too) gives n - p + b, which lies in [0, b)."""
    v = n - p
    if b < 256:
        v += (n < p).view(np.uint8) * np.uint8(b)
    return v


def encode(prev: np.ndarray, new: np.ndarray, b: int, rearrange: bool = True) -> np.ndarray:
    """The delta stream (uint8, flat) that turns codes `prev` into `new` (same shape), modulo `b`."""
    if prev.shape != new.shape:
        raise ValueError(f"delta between codes of different shapes {prev.shape} and {new.shape}")
    if not 2 <= b <= 256:
        raise ValueError(f"delta modulus {b} outside [2, 256]")
    p, n = prev.reshape(-1), new.reshape(-1)
    if p.size:
        _check_below(max(int(p.max()), int(n.max())), b)
    if rearrange:
        order = _order(p)
        p, n = p[order], n[order]
    return _sub_mod(n, p, b)


def decode(prev: np.ndarray, d: np.ndarray, b: int, rearrange: bool = True) -> np.ndarray:
    """Codes of the new checkpoint from `prev` and a stream from `encode(prev, new, b, rearrange)`."""
    flat = prev.reshape(-1)
    if d.size != flat.size:
        raise ValueError(f"delta stream has {d.size} values for {flat.size} codes")
    if not flat.size:
        return flat.reshape(prev.shape)
    _check_below(int(d.max()), b)
    if not rearrange:
        _check_below(int(flat.max()), b)
        return _add_mod(flat, d, b).reshape(prev.shape)
    order = _order(flat)
    ordered = flat[order]  # ascending: its last code is the largest
    _check_below(int(ordered[-1]), b)
    out = np.empty_like(flat)
    out[order] = _add_mod(ordered, d, b)
    return out.reshape(prev.shape)
