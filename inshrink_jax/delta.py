"""Quantization-aware delta coding of code arrays (ALGORITHM.md step 6), on the host with NumPy.

A later checkpoint stores, per weight, the cyclic change of its code since the previous checkpoint,
    d = (c_new - c_prev) mod B,    B = max(K_prev, K_new) + 2,
(K levels plus the pruned and protected codes; B bounds every code of both checkpoints, so d < B and the
decoder gets c_new = (c_prev + d) mod B exactly, even when the bin count changed). The deltas are stored
*rearranged*: ordered by a stable sort of c_prev, so weights that shared a level, which tend to move together,
sit side by side and zstd sees long runs. The decoder holds c_prev, recomputes the same permutation, and
nothing extra is stored.

Both directions are vectorised NumPy on uint8 arrays (NumPy's stable sort of 8-bit keys is a radix sort, so
the rearrangement is linear time).
"""

from __future__ import annotations

import numpy as np

from inshrink_jax import codec


def modulus(bins_prev: int, bins_new: int) -> int:
    """B for a delta between checkpoints quantized to `bins_prev` and `bins_new` levels."""
    return max(bins_prev, bins_new) + 2


def _order(prev: np.ndarray) -> np.ndarray:
    return np.argsort(prev.reshape(-1), kind="stable")


def _sorted(flat: np.ndarray, b: int) -> np.ndarray:
    """`flat` sorted ascending (= flat[_order(flat)]), as uint16, built from its histogram without a gather."""
    counts = codec.byte_counts(flat)
    if counts[b:].any():
        raise ValueError(f"code {int(np.flatnonzero(counts)[-1])} is not below the delta modulus {b}")
    return np.repeat(np.arange(b, dtype=np.uint16), counts[:b])


def _wrap(v: np.ndarray, b: int) -> np.ndarray:
    """v mod b for v in [0, 2b) (uint16), as uint8: one lookup in a table of the 2b residues (half the time of a
    compare, subtract and cast)."""
    return (np.arange(2 * b, dtype=np.uint16) % np.uint16(b)).astype(np.uint8)[v]


def encode(prev: np.ndarray, new: np.ndarray, b: int, rearrange: bool = True) -> np.ndarray:
    """The delta stream (uint8, flat) that turns codes `prev` into `new` (same shape), modulo `b`."""
    if prev.shape != new.shape:
        raise ValueError(f"delta between codes of different shapes {prev.shape} and {new.shape}")
    if not 2 <= b <= 256:
        raise ValueError(f"delta modulus {b} outside [2, 256]")
    p, n = prev.reshape(-1), new.reshape(-1)
    if rearrange:
        p, n = _sorted(p, b), n[_order(p)]
    return _wrap(n.astype(np.uint16) + np.uint16(b) - p, b)


def decode(prev: np.ndarray, d: np.ndarray, b: int, rearrange: bool = True) -> np.ndarray:
    """Codes of the new checkpoint from `prev` and a stream from `encode(prev, new, b, rearrange)`."""
    flat = prev.reshape(-1)
    if d.size != flat.size:
        raise ValueError(f"delta stream has {d.size} values for {flat.size} codes")
    # What `_wrap`'s table holds: deltas and previous codes below b (`_sorted` checks the codes when rearranged).
    for v in (d,) if rearrange else (d, flat):
        if v.size and int(v.max()) >= b:
            raise ValueError(f"code {int(v.max())} is not below the delta modulus {b}")
    if not rearrange:
        return _wrap(flat.astype(np.uint16) + d, b).reshape(prev.shape)
    out = np.empty_like(flat)
    out[_order(flat)] = _wrap(_sorted(flat, b) + d, b)
    return out.reshape(prev.shape)
