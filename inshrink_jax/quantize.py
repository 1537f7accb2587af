"""Partition, encode and decode of compressed tensors (ALGORITHM.md steps 1, 2 and 4).

Every weight of a compressed tensor gets a uint8 code:
    0          pruned (decodes to exactly 0)
    1 .. K     quantized: index into the tensor's K ascending centres (ordinal, so deltas stay small)
    K + 1      protected: the next value of the tensor's protected values, stored in position order
Order of the partition: protect (top `protect_fraction` by magnitude OR by sensitivity, plus every NaN/Inf),
then prune (the `prune_fraction` least important of the remaining weights of >= 2-D tensors, one threshold per
layer type), then quantize the rest to the nearest of K centres from weighted k-means on their histogram (or,
for closed-loop residuals where a configuration asks for them, to a uniform quantizer's cells, `QuantConfig.step`,
or to entropy-constrained levels, `QuantConfig.rate`, whose zero level takes the place of pruning: code 0).

All per-weight work is one jitted function for the whole state (so XLA runs the tensors' histogram passes side
by side, and compiles the k-means once). Besides the codes it emits each tensor's protected values *in place*
(the storage-dtype value where the code is protected, 0 elsewhere; one fused elementwise output), so nothing has
to read the input after the encoder is dispatched: a training loop may donate its state the moment `save()`
returns, and the device work and the device-to-host copies finish in the background. The host compacts the
protected values with a scan of the uint8 codes it fetches anyway: a device-side prefix sum (`jnp.nonzero`) costs
10-13 ns per weight on XLA's CPU backend, the host scan 0.1 ns (benchmarks/results/stages.md).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import re
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from inshrink_jax import codec, kmeans, sketch, threshold, weighting
from inshrink_jax.config import CompressionConfig, QuantConfig

PRUNED = 0
# k-means bucket weight of a closed-loop residual: counts only (MSE-optimal levels). The paper's weighting by
# |value| (CompressionConfig.sigma) keeps a weight tensor's large values near-exact; on a residual, which is
# mostly near 0 (weights that got no gradient, or little) with long tails, it pulls every level into the tails
# and a 2-level residual of a dense layer fed by always-zero inputs came back with more error than storing no
# residual at all (tests/test_closed_loop.py::test_residual_levels_fit_a_peaked_residual checks the fix).
RESIDUAL_SIGMA = 1.0
_BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)
_ATTENTION_WORDS = {"query", "key", "value", "qkv", "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "attn",
                    "attention", "self_attn", "self_attention", "mha"}


# Level slots of the uniform quantizer's kernel (QuantConfig.step): the most levels a uint8 code holds beside the
# pruned and protected codes, so one compiled kernel serves every uniform bin count.
UNIFORM_SLOTS = 254


def protected_code(bins: int) -> int:
    """The code of protected weights in a tensor quantized to `bins` levels."""
    return bins + 1


def layer_type(path: str, shape: Sequence[int], rules: Sequence[tuple[str, str]] = ()) -> str:
    """Layer type of a leaf, which decides the prune threshold it shares and its number of bins.

    `rules` ((regex, type) pairs, first match on `path` wins) override the default rule:
    < 2 dimensions -> "other" (never pruned); a path part naming an embedding -> "embedding"; a path part naming
    attention (query/key/value/attn/...) -> "attention" (an NNX Variable's trailing `.value` attribute is not a
    part); "conv" in the path or >= 3 dimensions -> "conv";
    otherwise "dense".
    """
    for pattern, kind in rules:
        if re.search(pattern, path):
            return kind
    if len(shape) < 2:
        return "other"
    # An NNX Variable's array is reached through `.value` at the end of the key path: not a layer name.
    parts = [p for p in re.split(r"[/.\[\]'\"()\s,]+", re.sub(r"\.(raw_)?value$", "", path).lower()) if p]
    if any("embed" in p for p in parts):
        return "embedding"
    if any(p in _ATTENTION_WORDS or "attention" in p or "attn" in p for p in parts):
        return "attention"
    if any("conv" in p for p in parts) or len(shape) >= 3:
        return "conv"
    return "dense"


class EncodedTensor(NamedTuple):
    """One compressed tensor on the host.

    Attributes:
      codes: uint8 array of the tensor's shape (see the module docstring).
      centres: float32 (K,), ascending (entropy-constrained levels: the ones in use ascending, an unused one 0).
      protected: values of the protected weights in row-major position order (bfloat16, float32, or the leaf's
        own dtype when it is 16-bit).
      dtype: the leaf's dtype name, restored on decode.
    """

    codes: np.ndarray
    centres: np.ndarray
    protected: np.ndarray
    dtype: str

    @property
    def bins(self) -> int:
        return int(self.centres.shape[0])


class PackedCodes(NamedTuple):
    """The codes of a tensor left packed, several to a byte, as a restore reads a packed stream
    (`codec.packed_values`): code i is rows[packed[i // per], i % per]. `decode_chain` takes them in place of an
    array of codes and looks the values up from the packed bytes in its kernel, so no array of every code is
    made on the host (nor read again by the kernel).

    Attributes:
      packed: uint8 bytes, ceil(size / per) of them.
      rows: (256, per) uint8: the codes each byte value holds, the first position's first.
      shape: the tensor's shape.
    """

    packed: np.ndarray
    rows: np.ndarray
    shape: tuple

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def at(self, flat: np.ndarray) -> np.ndarray:
        """The codes at flat positions `flat` (below `size`)."""
        per = self.rows.shape[1]
        return self.rows[self.packed[flat // per], flat % per]

    def top(self) -> int:
        """A bound on the largest code: the largest any byte value holds (the stream's alphabet's largest)."""
        return int(self.rows.max())


class _Positions:
    """Flat positions of a tensor at which each link of a chain is looked up (`decode_chain`'s protected
    positions): with packed codes, each position's byte and place in it computed once per number of codes a
    byte, not once per link."""

    def __init__(self, flat: np.ndarray):
        self.flat = flat
        self._split: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def values(self, codes, table: np.ndarray) -> np.ndarray:
        """table[code] at each position, of `codes` (an array or `PackedCodes`): a packed link's values looked up
        from its bytes in one gather (a table of each byte value's values), not two."""
        if not isinstance(codes, PackedCodes):
            return table[codes.reshape(-1)[self.flat]]
        per = codes.rows.shape[1]
        if per not in self._split:
            self._split[per] = (self.flat // per, (self.flat % per).astype(np.intp))
        byte, place = self._split[per]
        return table[codes.rows].reshape(-1)[codes.packed[byte].astype(np.intp) * per + place]


def _top_code(codes) -> int:
    """The largest code (an array's; a `PackedCodes`' bound), 0 for none."""
    if isinstance(codes, PackedCodes):
        return codes.top()
    return int(codes.max()) if codes.size else 0


@functools.lru_cache(maxsize=64)
def seed_key(seed: int, fold: int) -> jax.Array:
    """fold_in(PRNGKey(seed), fold), made once per process: creating keys costs host dispatches, which every
    save() would otherwise pay while the training loop waits."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), fold)


def protected_storage_dtype(dtype, cfg: CompressionConfig) -> np.dtype:
    """Storage dtype of protected values: the leaf's own if it is 16-bit (exact), else the configured one."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize <= 2:
        return dtype
    return jnp.dtype(cfg.protected_dtype)


def _scores(x: jax.Array, g: jax.Array | None):
    """float32 magnitude |w| and sensitivity |g * w| (step 1), 0 where not finite, and the finite mask."""
    x32 = x.astype(jnp.float32)
    finite = jnp.isfinite(x32)
    mag = jnp.where(finite, jnp.abs(x32), 0.0)
    if g is None:
        return x32, finite, mag, mag
    sens = jnp.abs(g.astype(jnp.float32) * x32)
    return x32, finite, mag, jnp.where(jnp.isfinite(sens), sens, 0.0)


def _storage_values(x: jax.Array, out_dtype) -> jax.Array:
    """`x` cast to the protected-value storage dtype; a finite float32 beyond bfloat16's range stays finite."""
    if jnp.dtype(out_dtype) == jnp.bfloat16 and x.dtype == jnp.float32:
        x = jnp.where(jnp.isfinite(x), jnp.clip(x, -_BF16_MAX, _BF16_MAX), x)
    return x.astype(out_dtype)


def _in_place(x: jax.Array, protected: jax.Array, out_dtype) -> jax.Array:
    """The protected values in place: `x` in its storage dtype where `protected`, 0 elsewhere."""
    return jnp.where(protected, _storage_values(x, out_dtype), jnp.zeros((), out_dtype))


def _finite_offset(offset: jax.Array) -> jax.Array:
    """The offset in float32 with its non-finite values replaced by 0: a base weight that is Inf or NaN cannot be
    added to, so such a weight is stored (and restored) as the tensor's own value."""
    off = offset.astype(jnp.float32)
    return jnp.where(jnp.isfinite(off), off, 0.0)


def residual(x: jax.Array, offset: jax.Array) -> jax.Array:
    """What is encoded of a tensor stored against an offset (its base checkpoint's weight): x - offset, in
    float32 (the difference of two 16-bit values is exact there)."""
    return x.astype(jnp.float32) - _finite_offset(offset)


def plus_offset(r: jax.Array, offset: jax.Array, dtype) -> jax.Array:
    """The tensor a residual `r` (float32) decodes to: r + offset, in `dtype`. The one formula of both the
    search's candidates and the restore, so a restore gives exactly what the search scored."""
    return (r + _finite_offset(offset)).astype(dtype)


def times_scale(r: jax.Array, exact: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """The tensor a ratio `r` (float32) decodes to: r * sqrt(scale), in `dtype`, except where `exact` (stored
    values, taken as they are). `scale` is the decoded second moment a first moment is coded relative to
    (moments.encode_first_on_device); one formula for the save's and the restore's decode, so they agree
    bit for bit."""
    return jnp.where(exact, r, r * jnp.sqrt(scale.astype(jnp.float32))).astype(dtype)


class Kind(NamedTuple):
    """What the jitted encoder (`_encode`) is compiled for, of the tensors of one layer type: `buckets` (see
    `buckets`), whether each tensor may be pruned, each one's protected-value storage dtype, the number of level
    slots, `entropy_slots` (0, or the non-zero levels of entropy-constrained coding, QuantConfig.rate), and
    `own_bins`: whether the type's bin count is a field of its own (embedding tables: QuantConfig.embedding_bins),
    not the shared one (QuantConfig.bins), and per bucket the stride of the elements its histograms count
    (`sketch.sample_stride`)."""

    buckets: tuple[tuple[int, ...], ...]
    prunable: tuple[bool, ...]
    out_dtypes: tuple
    capacity: int
    entropy_slots: int
    own_bins: bool
    strides: tuple[int, ...]


@functools.partial(jax.jit, static_argnames=("kinds", "spec", "sigma", "iters", "tol", "restarts", "uniform",
                                             "protects", "prunes", "ranged"))
def _encode(xs, gs, offsets, factors, bins, use_sensitivity, protect_fraction, prune_fraction, step, rate, reference,
            keys, *, kinds, spec, sigma, iters, tol, restarts, uniform, protects, prunes, ranged=True):
    """Codes, levels (`capacity` slots, the first `bins` used) and in-place protected values of every tensor:
    `xs`, `gs`, `offsets`, `bins` and `keys` hold one entry per layer type (`kinds`); the tensors of one type
    share the prune threshold. The configuration is traced, not static, so one compiled kernel serves every
    candidate of the configuration search (`uniform`, whether `step` > 0, is static: a search space never mixes
    the two kinds of levels, and only one is compiled; `protects`, whether `protect_fraction` > 0, is static too:
    without it the per-tensor selection of the largest values (radix histograms of thousands of buckets a tensor,
    whatever its size: `threshold.kth_largest`) is not compiled; a search space's protect fractions are all
    positive (keyframes) or all 0 (closed-loop residuals), so each
    compiles one kernel; `prunes`, false for uniform levels without pruning (`encode_on_device`: the default
    residual space's every candidate), leaves the prune threshold's radix passes out of the program, which a
    configuration without pruning skips at run time anyway: the same codes, a smaller kernel to compile for the
    first closed-loop residual save of a process). A tensor with an offset is encoded as its residual
    x - offset (its prune and protect scores are then those of the change against the offset); with `factors`
    as well (weighting.py), as the weighted residual (x - offset) / M. `ranged` (static) False: uniform cells
    outside the range of the codes keep their levels (`_encode_alone` zeroes them in a call of its own).

    One kernel for the whole state: the k-means of every tensor of every type runs as one batched call (two with
    embedding tables, which have a bin count of their own), so its iteration overhead is paid once and XLA
    compiles it once, not once per layer type. Within a type, `Kind.buckets` groups the tensors of the same
    shape, dtypes, sharding and kind: each group is stacked on a leading axis, its per-tensor passes (protect
    thresholds, histograms, codes) run once, vmapped (`per_tensor_map`), and its outputs come back stacked: per
    type, per bucket, (codes, levels, protected values), which `unstack` splits. XLA's CPU backend compiles every
    output buffer as a kernel of its own, so neither the program nor its outputs grow with the number of
    tensors, only with the number of distinct shapes (a 24-layer transformer has 390 parameter tensors of a
    dozen shapes). Integer counts and thresholds make the result identical to encoding each bucket's tensors one
    by one (with the same keys).

    `Kind.entropy_slots` (0: not used): entropy-constrained levels (QuantConfig.rate): a zero level (code 0,
    as pruned) and `entropy_slots` others, fitted to each tensor's histogram with the code-length weight `rate`
    times the mean square of the type's quantized values (one slope for every tensor of the type: the bits go
    where they remove the most squared error); each value takes the level of least squared error plus that
    weight times the level's code length (`kmeans.entropy_constrained`).

    `reference` (float32 [scale, power], traced): the uniform cells' width reference (`uniform_levels`); [1, 1]
    for each tensor's own RMS."""
    parts = [_partition(xs[t], gs[t], offsets[t], factors[t], use_sensitivity, protect_fraction, prune_fraction, kind, spec,
                        protects, prunes) for t, kind in enumerate(kinds)]
    keys = [jax.random.split(keys[t], len(xs[t]))[np.asarray(part.order)] for t, part in enumerate(parts)]
    fitted = {}
    for own in (False, True):
        # One batched k-means for the tensors of every type with k-means levels and the same bin count (one
        # number of centres: k-means++ draws k of them, so a batch with several would run to the largest).
        joint = [t for t, kind in enumerate(kinds) if not uniform and not kind.entropy_slots and kind.own_bins == own]
        if not joint:
            continue
        capacity = kinds[joint[0]].capacity
        centres = jax.vmap(lambda h, kk: kmeans.histogram_kmeans(h, spec, bins[joint[0]], sigma, kk, iters=iters,
                                                                 tol=tol, restarts=restarts, capacity=capacity))(
            jnp.concatenate([parts[t].counts for t in joint]), jnp.concatenate([keys[t] for t in joint]))
        ends = np.cumsum([0] + [len(xs[t]) for t in joint])
        fitted.update({t: centres[ends[j]:ends[j + 1]] for j, t in enumerate(joint)})
    out = []
    for t, (kind, part) in enumerate(zip(kinds, parts)):
        n = len(xs[t])
        if kind.entropy_slots:
            out.append(_entropy_codes(part, kind, rate, spec, n))
            continue
        if uniform:
            centres, widths = jax.vmap(lambda h: uniform_levels(h, spec, bins[t], step, kind.capacity,
                                                                reference=reference))(part.counts)
        else:
            centres, widths = fitted[t], jnp.zeros(n, jnp.float32)
        out.append(_level_codes(part, kind, centres, widths, bins[t], uniform, prunes, ranged))
    return out


def error_sums(x, d, w, ref, masked: bool = True):
    """(sum of w (x - d)^2, sum of w (x - ref)^2) over the finite elements of `x` (float32; `w` None for 1,
    `ref` None for 0): the two sums of the search's data-free proxy (`search.proxy_degradation`), for one tensor
    or a stack of them (inside a jitted kernel). `masked` False: over every element, the same sums where every
    term is finite. The caller sums plainly first and masks only where a plain sum comes out non-finite (a
    non-finite term: a value stored exactly, an overflowing square; `proxy_ratio`): XLA's CPU backend runs a
    reduction with a select in it an element at a time, 9.9x slower than plain sums over 100M values
    (benchmarks/results/xla_cpu_kernels.md); one kernel holding both (a `lax.cond`) compiled both."""
    x32 = x.astype(jnp.float32)
    w = 1.0 if w is None else jnp.square(w.astype(jnp.float32))
    r = x32 if ref is None else x32 - ref.astype(jnp.float32)
    d32 = d.astype(jnp.float32)
    if jnp.dtype(d.dtype).itemsize < 4:  # `d` as stored: XLA may drop a float32 -> 16-bit -> float32 round trip
        # in a fused kernel (excess precision), and scored what no restore gives
        info = jnp.finfo(d.dtype)
        d32 = jax.lax.reduce_precision(d32, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    de, dr = w * jnp.square(x32 - d32), w * jnp.square(r)
    if not masked:
        return jnp.sum(de), jnp.sum(dr)
    fin = jnp.isfinite(x32)
    return jnp.sum(jnp.where(fin, de, 0.0)), jnp.sum(jnp.where(fin & jnp.isfinite(r), dr, 0.0))


@functools.partial(jax.jit, static_argnames=("kinds", "spec", "dtypes", "masked"))
def _uniform_residual_sums(xs, offsets, factors, bins, steps, reference, *, kinds, spec, dtypes, masked):
    """The proxy's sums (`error_sums`) of closed-loop residual candidates on uniform cells, without protected or
    pruned values (a residual space's candidates): what `encode_on_device` followed by `dequantize_all` gives,
    scored as `search.proxy_degradation` scores it (weights 1 / M of a weighted residual), without their codes.
    The partition and the histograms (the scatter passes) do not depend on the candidate and run once; the rest
    is vmapped over the candidates (one pass over the values each; compiled once whatever their number).
    `bins[t]` (int32, one per candidate) and `steps` (float32, one per candidate): each candidate's bin count of
    group t and cell width; `reference` the width reference (`uniform_levels`). Returns (the numerators, one per
    candidate; the denominator), `masked` or plain (`error_sums`)."""
    nums = jnp.zeros(steps.shape, jnp.float32)
    den = jnp.float32(0)
    for t, kind in enumerate(kinds):
        n = len(xs[t])
        part = _partition(xs[t], [None] * n, offsets[t], factors[t], False, 0.0, 0.0, kind, spec, False, False)
        rows = np.cumsum([0] + [len(b) for b in kind.buckets])
        for k, (b, (x32, finite, _, _)) in enumerate(zip(kind.buckets, part.scored)):
            x, off = stacked([xs[t][i] for i in b]), stacked([offsets[t][i] for i in b])
            fs = None if factors[t][b[0]] is None else [stacked([factors[t][i][d] for i in b])
                                                        for d in range(x.ndim - 1)]
            w = None if fs is None else weighting.pow2(-weighting.exponents(fs))
            den += error_sums(x, off, w, off, masked)[1]
            in_place = _in_place(part.values[k], ~finite, kind.out_dtypes[b[0]])
            counts = part.counts[rows[k]:rows[k + 1]]

            def candidate(nb, step):
                centres, widths = jax.vmap(lambda h: uniform_levels(h, spec, nb, step, kind.capacity,
                                                                    reference=reference))(counts)
                centres = jnp.where(jnp.arange(kind.capacity) < nb, bf16_table(centres, _largest(x.dtype)),
                                    0.0)  # as `_level_codes`
                code = jnp.where(finite, 1 + jax.vmap(lambda v, wd: uniform_cell(v, wd, nb))(x32, widths), nb + 1)
                d = jax.vmap(lambda cd, ce, v, o, *f: _dequantize_one(cd, ce, v, nb, o, None, f or None,
                                                                      dtypes[t][b[0]]))(
                    code, centres, in_place, off, *(fs or ()))
                return error_sums(x, d, w, off, masked)[0]

            nums += jax.vmap(candidate)(bins[t], steps)
    return nums, den


def uniform_residual_scores(xs, offsets, factors, layer_types, quants: Sequence[QuantConfig],
                            cfg: CompressionConfig, reference: np.ndarray | None = None) -> jax.Array:
    """Per candidate (`QuantConfig`s of uniform cells with nothing protected or pruned: a closed-loop residual
    space's), the data-free proxy of its closed-loop residual save against `offsets` (the previous
    reconstruction; `factors` as for `encode_on_device`): the value `search.proxy_degradation` gives the
    candidate's `encode_on_device` and `dequantize_all`, up to the order of the float32 sums, computed without
    encoding it (one pass per candidate over the tensors; the histograms once). `reference`: as for
    `encode_on_device`. A NumPy float32 array, a value per candidate (waited for: plain sums, and masked ones where
    a plain one is not finite, `error_sums`)."""
    if any(q.step <= 0 or q.protect_fraction or q.prune_fraction or q.rate for q in quants):
        raise ValueError("uniform_residual_scores takes uniform cells with nothing protected or pruned")
    offsets = list(offsets)
    factors = [None] * len(xs) if factors is None else list(factors)
    idx, kinds, _, _ = _kinds_of(xs, [None] * len(xs), layer_types, quants[0], cfg, offsets, factors)
    kinds = [k._replace(prunable=(False,) * len(k.prunable)) for k in kinds]  # nothing is pruned: no threshold
    spec = sketch.SketchSpec(cfg.alpha)

    def sums(masked: bool) -> tuple[np.ndarray, np.float32]:
        parts = [_uniform_residual_sums(
            [[xs[i] for i in idx[t]] for t in ts], [[offsets[i] for i in idx[t]] for t in ts],
            [[factors[i] for i in idx[t]] for t in ts],
            [np.array([q.bins_for(layer_types[idx[t][0]]) for q in quants], np.int32) for t in ts],
            np.array([q.step for q in quants], np.float32), _reference(reference),
            kinds=tuple(kinds[t] for t in ts), spec=spec,
            dtypes=tuple(tuple(jnp.dtype(xs[i].dtype) for i in idx[t]) for t in ts), masked=masked)
            for ts in device_units([[xs[i] for i in ix] for ix in idx])]
        if len(parts) == 1:  # the usual case
            return np.asarray(parts[0][0], np.float32), np.float32(parts[0][1])
        # device sets of their own (pipeline parallelism): added on the host
        return (np.sum([np.asarray(n) for n, _ in parts], axis=0, dtype=np.float32),
                np.float32(sum(float(d) for _, d in parts)))

    return proxy_ratio(sums)


def proxy_ratio(sums: Callable[[bool], tuple]) -> np.ndarray:
    """The data-free proxy numerators / denominator from `sums(masked)` -> (float32 numerators, denominator) on
    the host (`error_sums`' two sums, added over device sets): plain sums, and the masked ones only where a plain
    one is not finite. A float32 array of the numerators' shape; inf for error against a zero denominator, 0 for
    none."""
    nums, den = sums(False)
    if not (np.all(np.isfinite(nums)) and np.isfinite(den)):
        nums, den = sums(True)
    nums, den = np.asarray(nums, np.float32), np.float32(den)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, nums / (den if den > 0 else np.float32(1)),
                        np.where(nums > 0, np.float32(np.inf), np.float32(0))).astype(np.float32)


class _Partition(NamedTuple):
    """One layer type's tensors after the partition (inside `_encode`): per bucket the values encoded (x, or the
    residual x - offset) and their scores, protected and pruned masks; the histograms of the quantized values
    (one row per tensor, in `order`)."""

    values: list
    scored: list
    protected: list
    pruned: list
    counts: jax.Array
    order: list[int]


def _partition(xs, gs, offsets, factors, use_sensitivity, protect_fraction, prune_fraction, kind: Kind, spec,
               protects: bool, prunes: bool) -> _Partition:
    """Protect (the top `protect_fraction` of each tensor by magnitude, or by sensitivity as well, when
    `protects`; and every non-finite value), prune (the `prune_fraction` least important of the type's other
    prunable values, when `prunes`; none with entropy-constrained levels, which prune by their zero level), and
    the histograms of the rest."""
    def top(score, finite):
        return threshold.kth_largest([score], [finite], fraction=protect_fraction).select(score)

    groups = []  # per bucket: the values encoded (x, or the residual x - offset), the gradients or None
    for b in kind.buckets:
        x = stacked([xs[i] for i in b])
        off = None if offsets[b[0]] is None else stacked([offsets[i] for i in b])
        value = x if off is None else residual(x, off)
        if factors[b[0]] is not None:  # a weighted residual: (x - offset) / M, exactly (M is a power of two)
            fs = [stacked([factors[i][d] for i in b]) for d in range(x.ndim - 1)]
            value = weighting.times_multiplier(value, -weighting.exponents(fs))
        groups.append((value, None if gs[b[0]] is None else stacked([gs[i] for i in b])))
    scored = [_scores(x, g) for x, g in groups]
    protected = []
    for (x32, finite, mag, sens), (_, g) in zip(scored, groups):
        if not protects:
            protected.append(~finite)
            continue
        p = per_tensor_map(top, mag, finite)
        if g is not None:
            p = p | per_tensor_map(top, sens, finite)
        protected.append(p | ~finite)

    metric = [(jnp.where(use_sensitivity, sens, mag) if g is not None else mag)
              for (_, _, mag, sens), (_, g) in zip(scored, groups)]
    can_prune = [kind.prunable[b[0]] for b in kind.buckets]
    candidates = [~p & can for p, can in zip(protected, can_prune)]
    if prunes and any(can_prune) and not kind.entropy_slots:  # entropy-constrained levels: by their zero level
        def prune(_):
            keep, _ = threshold.kth_smallest_complement(metric, candidates, fraction=prune_fraction, stacked=True)
            return [c & ~keep.select(m) for c, m in zip(candidates, metric)]

        # A configuration without pruning skips the threshold's passes at run time (one kernel serves both).
        pruned = jax.lax.cond(prune_fraction > 0, prune, lambda _: [jnp.zeros_like(c) for c in candidates], None)
    else:
        pruned = [jnp.zeros_like(p) for p in protected]

    quantized = [~p & ~q for p, q in zip(protected, pruned)]
    counts = jnp.concatenate([per_tensor_map(functools.partial(_sampled_histogram, spec=spec, stride=s), x32, m)
                              for (x32, _, _, _), m, s in zip(scored, quantized, kind.strides)])
    return _Partition([x for x, _ in groups], scored, protected, pruned, counts, [i for b in kind.buckets for i in b])


def _sampled_histogram(x, mask, *, spec, stride):
    return sketch.histogram(x, spec, mask, stride)


def bf16_table(t: jax.Array, limit) -> jax.Array:
    """A value table's float32 entries rounded to bfloat16 values (the nearest, ties to even; toward zero where the
    nearest's magnitude exceeds `limit`, the largest value of the dtype the table decodes to): what the records
    store of every table, as 16-bit patterns (`records.table_bits`), exactly. By integer arithmetic on the bits,
    so every backend rounds alike. Tables leave every encoder so rounded and everything after (the closed loop's
    reconstruction, a restore) uses them as rounded: a level moves by at most 2^-9 of itself, far inside the gaps
    between levels, and the records of a model of many small leaves shrink by a third (a float32's decimal takes up
    to 9 significant digits)."""
    bits = jax.lax.bitcast_convert_type(t.astype(jnp.float32), jnp.uint32)
    high = jnp.uint32(0xFFFF0000)
    nearest = jax.lax.bitcast_convert_type((bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & high,
                                           jnp.float32)
    down = jax.lax.bitcast_convert_type(bits & high, jnp.float32)
    return jnp.where(jnp.abs(nearest) <= limit, nearest, down)


def _level_codes(part: _Partition, kind: Kind, centres, widths, bins, uniform: bool, prunes: bool = True,
                 ranged: bool = True):
    """Codes, levels and in-place protected values of one type's tensors quantized to k-means levels or to a
    uniform quantizer's cells (`uniform`; `widths` per tensor): per bucket of `kind.buckets`, each stacked.
    `prunes` False: no value is pruned (no code 0; `_taken_range`). `ranged` False: a uniform quantizer's cells
    outside the range of the codes keep their levels (the caller zeroes them: `_encode_alone`)."""
    used = jnp.arange(kind.capacity) < bins
    out = []
    row = 0
    for b, x, (x32, _, _, _), p, q in zip(kind.buckets, part.values, part.scored, part.protected, part.pruned):
        # The levels as stored (`bf16_table`), before assignment: a value takes the nearest of those.
        c, width = bf16_table(centres[row:row + len(b)], _largest(x.dtype)), widths[row:row + len(b)]
        # A uniform quantizer's value takes its cell (an outer cell's level is the mean of its values, not
        # necessarily the nearest level).
        level = 1 + (jax.vmap(lambda v, w: uniform_cell(v, w, bins))(x32, width) if uniform
                     else jax.vmap(kmeans.assign)(x32, c))
        code = jnp.where(p, bins + 1, jnp.where(q, PRUNED, level)).astype(jnp.uint8)
        if uniform and ranged:  # a cell outside the range the values take is never decoded: stored as 0 (the
            # records of 63 cells stay short). The range from two reductions, not a scatter of every value into
            # the cells (several times slower at 100M values on XLA's CPU backend:
            # benchmarks/results/xla_cpu_kernels.md).
            c = jnp.where(_taken_range(code, bins, kind.capacity, prunes), c, 0.0)
        out.append((code, jnp.where(used, c, 0.0), _in_place(x, p, kind.out_dtypes[b[0]])))
        row += len(b)
    return out


def _largest(dtype) -> float:
    """The largest finite value of a float dtype (float32's for any other)."""
    dtype = jnp.dtype(dtype)
    return float(jnp.finfo(dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32).max)


def _taken_range(code, bins, capacity: int, pruned: bool = True):
    """Per stacked tensor (leading axis) of uint8 `code`s, which of the `capacity` cells (codes 1..capacity) lie
    between the lowest and the highest code of a quantized value (1..`bins`: not pruned, not protected) that it
    holds: (tensors, capacity) bool, all False for a tensor with none. `pruned` False: no code is 0 (nothing
    pruned), so the lowest code of all is the lowest of a quantized value, or a protected code (bins + 1) where
    there is none.

    Reduced over the uint8 codes as they are wherever that is exact: XLA's CPU backend writes a reduction's
    elementwise input (a select) out in full before reducing it, one more pass and buffer of the codes' size for
    each bound (benchmarks/results/xla_cpu_kernels.md times both, alone and inside a residual's encode). The
    highest code is a quantized value's unless a protected one is present (a non-finite value, or protection);
    only then (a `lax.cond`: one branch runs) is it taken over the codes other than the protected one."""
    axes = tuple(range(1, code.ndim))
    top = bins.astype(jnp.uint8)
    if pruned:
        lo = jnp.min(jnp.where((code >= 1) & (code <= top), code, jnp.uint8(255)), axis=axes).astype(jnp.int32)
    else:
        lo = jnp.min(code, axis=axes).astype(jnp.int32)
    highest = jnp.max(code, axis=axes)
    hi = jax.lax.cond(jnp.all(highest <= top), lambda: highest,
                      lambda: jnp.max(jnp.where(code <= top, code, jnp.uint8(0)), axis=axes)).astype(jnp.int32)
    slot = jnp.arange(1, capacity + 1)
    return (slot >= lo[:, None]) & (slot <= hi[:, None])


def _entropy_codes(part: _Partition, kind: Kind, rate, spec, n: int):
    """`_level_codes` for entropy-constrained levels (level 0 is the zero level: the code of a pruned weight)."""
    slots = kind.entropy_slots
    # In units of the type's largest value, so no square overflows whatever the values' scale.
    hf = part.counts.astype(jnp.float32)
    reps = jnp.asarray(spec.representatives())
    unit = jnp.max(jnp.where(hf > 0, jnp.abs(reps), 0.0))
    unit = jnp.where(unit > 0, unit, 1.0)
    reps = reps / unit
    energy = jnp.where(hf > 0, hf * reps * reps, 0.0)
    lam = rate * jnp.sum(energy) / jnp.maximum(jnp.sum(hf), 1.0)
    rms = jnp.sqrt(jnp.sum(energy, axis=1) / jnp.maximum(jnp.sum(hf, axis=1), 1.0))
    penalised = jax.vmap(lambda h, r: kmeans.entropy_constrained(*kmeans.coarsen(reps, h), slots, lam, r))(hf, rms)
    # A level no value takes is stored as 0 (its text in the manifest is short and repeats).
    live = jnp.where(jnp.isfinite(penalised[1][:, 1:]), penalised[0][:, 1:] * unit, 0.0)
    centres = jnp.zeros((n, kind.capacity), jnp.float32).at[:, :slots].set(live)
    out = []
    row = 0
    for b, x, (x32, _, _, _), p in zip(kind.buckets, part.values, part.scored, part.protected):
        levels_b, lengths_b = penalised[0][row:row + len(b)], penalised[1][row:row + len(b)]
        level = jax.vmap(lambda v, lv, ln: kmeans.penalised_assign(v / unit, lv, ln, lam))(x32, levels_b, lengths_b)
        code = jnp.where(p, slots + 1, level).astype(jnp.uint8)
        out.append((code, bf16_table(centres[row:row + len(b)], _largest(x.dtype)),
                    _in_place(x, p, kind.out_dtypes[b[0]])))
        row += len(b)
    return out


def buckets(*columns: Sequence) -> tuple[tuple[int, ...], ...]:
    """Indices of the tensors a jitted encoder stacks together (`_encode`, moments' encoder): those alike
    in every column, where each column gives one entry per tensor: an array (alike: the same shape, dtype and
    sharding), None, or a hashable value (alike: equal). In order of first appearance."""
    def sig(a):
        if not isinstance(a, (jax.Array, np.ndarray)):
            return a
        try:
            sharding = a.sharding if isinstance(a, jax.Array) else None
        except Exception:  # noqa: BLE001 (a tracer without a sharding: shape and dtype decide)
            sharding = None
        return a.shape, jnp.dtype(a.dtype), sharding

    out: dict = {}
    for i, row in enumerate(zip(*columns)):
        out.setdefault(tuple(sig(a) for a in row), []).append(i)
    return tuple(tuple(b) for b in out.values())


# A stacked group's scatter passes (histograms, exact thresholds) run vmapped over its tensors below
# `threshold.MAP_MIN_SIZE` elements a tensor, and tensor by tensor (lax.map, one compiled body) from it: XLA's
# batched scatter on CPU is slower than one scatter per tensor (vmapped, the 100M-parameter save of
# benchmarks/results/handler.md, four 25M-element tensors, took 3.9-4.0 s; tensor by tensor 2.5 s).


def per_tensor_map(f, *stacked_args):
    """`f` of each tensor of a stacked group (leading axis), stacked: vmapped, or `lax.map` for large tensors
    (`threshold.MAP_MIN_SIZE`). Same results either way."""
    if stacked_args[0][0].size >= threshold.MAP_MIN_SIZE:
        return jax.lax.map(lambda a: f(*a), stacked_args)
    return jax.vmap(f)(*stacked_args)


def stacked(arrs: Sequence[jax.Array]) -> jax.Array:
    """Tensors of one bucket (`buckets`) on a new leading axis (inside a jitted encoder)."""
    return arrs[0][None] if len(arrs) == 1 else jnp.stack(arrs)


def uniform_levels(counts, spec, bins, step, capacity, centred: bool = True, reference=None):
    """Levels of the uniform quantizer (QuantConfig.step) for the values behind a histogram: `bins` cells of width
    step * RMS, -M..bins-1-M with M = (bins - 1) // 2 (centred on 0 for odd `bins`); `capacity` slots ascending,
    the unused ones at +inf; and the cells' width.

    `reference` (None, or float32 [scale, power], traced; `residual_reference`): the width is then step times
    max(scale * RMS^power, RMS / 8) (power 1 with scale 1: step * RMS exactly): a closed-loop residual's cells
    take scale = G^(1 - power), G the RMS of the whole state's residual, so a tensor whose residual is small
    against the state's gets cells wider than its own step, one whose residual is large narrower ones (at least
    an eighth of its own, so the cells still span it; `CompressionConfig.residual_width_power`).

    `centred` (the weights' levels): each inner cell's level is its centre and each of the two outer cells' the
    mean of its values (they hold everything beyond them). Not the mean of every cell: where the density falls
    (a residual is peaked at 0) a cell's mean lies on its inner side, and in a closed loop a weight that drifts
    steadily enters a cell at its inner edge and is moved by that level, less than a cell, so between crossings its
    reconstruction trails it: the error is a lag along the direction training moves the weight, not noise, and a
    restore moves the weights back along their update. With centres the jump is a whole cell and the error
    averages to 0 along the drift (tests/test_closed_loop.py's drift test, run against commit f460fce's cell
    means, finds it at 58% of the mean error). Ten
    restores of the character transformer from five cells of 1.5 RMS cost +1.85% of paired training loss with
    means, +0.64% with centres, at the same codes (benchmarks/results/restore_chain.md). Not `centred` (first
    moments, moments.py: coded afresh at each save, no chain): every level its cell's mean (an empty cell keeps
    its centre), the least squared error for the codes."""
    values = jnp.asarray(spec.representatives())
    h = counts.astype(jnp.float32)
    n = jnp.sum(h)
    # (masked: the values of empty buckets reach float32's max, whose square overflows)
    rms = jnp.sqrt(jnp.sum(jnp.where(h > 0, h * values * values, 0.0)) / jnp.maximum(n, 1.0))
    if reference is not None:
        scale, power = reference[0], reference[1]
        rms = jnp.where(power == 1, rms, jnp.maximum(scale * rms ** power, rms / 8))
    width = jnp.where(rms > 0, step * rms, 1.0)
    cell = uniform_cell(values, width, bins)
    total = jax.ops.segment_sum(jnp.where(h > 0, h * values, 0.0), cell, num_segments=capacity)
    count = jax.ops.segment_sum(h, cell, num_segments=capacity)
    slots = jnp.arange(capacity)
    grid = (slots - (bins - 1) // 2).astype(jnp.float32) * width
    means = (count > 0) if not centred else (count > 0) & ((slots == 0) | (slots == bins - 1))
    levels = jnp.where(means, total / jnp.where(count > 0, count, 1.0), grid)
    return jnp.where(slots < bins, levels, jnp.inf), width


def _reference(reference: np.ndarray | None) -> np.ndarray:
    """`uniform_levels`' reference as the encoder's traced argument: [1, 1] (each tensor's own RMS) for None."""
    return np.ones(2, np.float32) if reference is None else np.asarray(reference, np.float32)


@functools.partial(jax.jit, static_argnames=("masked",))
def _residual_energy(xs, offsets, factors, masked):
    """(sum of squares, number) of the values of the residuals (x - offset) / M of tensors on one device set:
    every value, or (`masked`) the finite ones (`error_sums`)."""
    total, count = jnp.float32(0), jnp.float32(0)
    for x, off, fs in zip(xs, offsets, factors):
        w = None if fs is None else weighting.pow2(-weighting.exponents(fs))
        total += error_sums(x, off, w, off, masked)[1]
        x32 = x.astype(jnp.float32)
        r = x32 if off is None else x32 - off.astype(jnp.float32)
        count += jnp.sum(jnp.isfinite(x32) & jnp.isfinite(r)) if masked else x.size
    return total, count


def residual_reference(xs, offsets, factors, power: float) -> np.ndarray | None:
    """The width reference of a closed-loop residual's uniform cells (`uniform_levels`): [G^(1 - power), power],
    G the RMS of the whole state's residual ((x - offset) / M of every tensor, weighting.py's M where `factors`
    are given; the finite values); None where `power` is 1 (each tensor's own RMS) or G is 0 or not finite.

    Why: the residual budget bounds the state's total squared error, and one cell width relative to each
    tensor's own RMS splits that total in proportion to the tensors' residual energies. At high resolution the
    split that takes the fewest bits for the same total gives every tensor the same width (equal slopes of error
    against bits: `power` 0); `power` between weighs the two (`CompressionConfig.residual_width_power`;
    benchmarks/results/residual_bound.md measures the bits of each on residuals of training runs)."""
    if power == 1:
        return None
    offsets = list(offsets)
    factors = [None] * len(xs) if factors is None else list(factors)

    def sums(masked: bool) -> tuple[np.float32, np.float32]:
        parts = [_residual_energy([xs[i] for i in ix], [offsets[i] for i in ix], [factors[i] for i in ix],
                                  masked=masked) for ix in device_units(list(xs))]
        return tuple(np.float32(sum(float(v[k]) for v in parts)) for k in (0, 1))

    mean_square = float(proxy_ratio(sums))  # plain sums, the finite values' where those are not finite
    if not (math.isfinite(mean_square) and mean_square > 0):
        return None
    return np.array([math.sqrt(mean_square) ** (1 - power), power], np.float32)


def uniform_cell(x, width, bins):
    """0-based cell of each value of `x` for the uniform quantizer of `bins` cells of width `width` (values
    beyond the outer cells go to them)."""
    m = (bins - 1) // 2
    return (jnp.clip(jnp.round(x / width), -m, bins - 1 - m) + m).astype(jnp.int32)


def _dequantize_one(codes, centres, protected_in_place, bins, offset, scale, factors, dtype):
    work = dtype if offset is None and scale is None else jnp.float32
    table = jnp.concatenate([jnp.zeros((1,), centres.dtype), centres, jnp.zeros((1,), centres.dtype)])
    values = table[jnp.minimum(codes, centres.shape[0] + 1)]
    exact = codes == bins.astype(jnp.int32) + 1
    r = jnp.where(exact, protected_in_place.astype(work), values.astype(work))
    if factors is not None:
        r = weighting.times_multiplier(r, weighting.exponents(factors))
    if scale is not None:
        return times_scale(r, exact, scale, dtype)
    return r if offset is None else plus_offset(r, offset, dtype)


@functools.partial(jax.jit, static_argnames=("dtypes",))
def _dequantize(codes, centres, protected_in_place, bins, offsets, scales, factors, *, dtypes):
    return [_dequantize_one(*args, dtype)
            for *args, dtype in zip(codes, centres, protected_in_place, bins, offsets, scales, factors, dtypes)]


def dequantize_all(devs: Sequence["DeviceCodes"], dtypes: Sequence) -> list[jax.Array]:
    """`DeviceCodes.dequantize` of many tensors in one jitted call (one dispatch for a whole candidate of the
    search, not one per tensor)."""
    out: list = [None] * len(devs)
    for ix in device_units([d.codes for d in devs]):
        ds = [devs[i] for i in ix]
        for i, r in zip(ix, _dequantize(
                [d.codes for d in ds], [d.centres for d in ds], [d.protected_in_place for d in ds],
                [d.bins if isinstance(d.bins, jax.Array) else np.int32(d.bins) for d in ds],
                [d.offset for d in ds], [d.scale for d in ds], [d.factors for d in ds],
                dtypes=tuple(jnp.dtype(dtypes[i]) for i in ix))):
            out[i] = r
    return out


def protected_positions(codes: np.ndarray, bins: int) -> np.ndarray:
    """Flat row-major positions of the protected weights (host, vectorised)."""
    return np.flatnonzero(codes.reshape(-1) == protected_code(bins)).astype(np.int32)


class DeviceCodes(NamedTuple):
    """Encoder output still on the device(s), every array with the input's sharding except the replicated
    centres: codes, centres (the first `bins` of its slots are used), and the protected values in place
    (storage dtype, 0 where not protected); `offset` is what the codes encode the change against (None: the
    tensor itself is encoded); `scale`, the decoded second moment whose square root the levels are relative to
    (a first moment: moments.encode_first_on_device), else None; `factors`, a weighted residual's per-axis
    factors (weighting.py: the levels are of (x - offset) / M), else None. `bins` is an int, or a device scalar
    where the encoder chose it on the device (`int(bins)` waits for it)."""

    codes: jax.Array
    centres: jax.Array
    protected_in_place: jax.Array
    bins: int | jax.Array
    offset: jax.Array | None = None
    scale: jax.Array | None = None
    factors: tuple | None = None

    def dequantize(self, dtype) -> jax.Array:
        """What a restore gives back, computed on the device(s) with the codes' sharding: pruned -> 0,
        quantized -> centre, protected -> its stored value, in `dtype` (plus the offset, if any)."""
        return dequantize_all([self], [dtype])[0]

    def start_copy_to_host(self) -> None:
        """Start the device-to-host copies of this process's shards (non-blocking)."""
        for a in (self.codes, self.centres, self.protected_in_place):
            for s in a.addressable_shards:
                s.data.copy_to_host_async()


def encode_on_device(
    xs: Sequence[jax.Array],
    gs: Sequence[jax.Array | None],
    layer_types: Sequence[str],
    quant: QuantConfig,
    cfg: CompressionConfig,
    key: jax.Array | None = None,
    offsets: Sequence[jax.Array | None] | None = None,
    sigma: float | None = None,
    factors: Sequence[tuple | None] | None = None,
    reference: np.ndarray | None = None,
) -> list[DeviceCodes]:
    """Run the jitted encoder; tensors of the same layer type share one prune threshold. The kernel is
    compiled once per state structure and kind of levels (k-means or uniform), whatever else `quant` is (its
    k-means has `cfg.bins_capacity` slots; a uniform quantizer has `UNIFORM_SLOTS`, the most a uint8 code holds).

    Args:
      xs: float arrays (float32, bfloat16, float16), any shape and sharding.
      gs: gradient EMA for each tensor (same shape), or None to use magnitude as sensitivity.
      layer_types: one of config.LAYER_TYPES per tensor (see `layer_type`).
      quant: the configuration (bins, fractions, prune metric).
      cfg: the method's parameters.
      key: PRNG key for k-means++; defaults to PRNGKey(cfg.seed).
      offsets: per tensor, None or an array of its shape and sharding (a base checkpoint's restored weight):
        the tensor is then encoded as its residual x - offset, and decodes to offset + the decoded residual.
      sigma: the k-means bucket weight, default `cfg.sigma` (`RESIDUAL_SIGMA` for closed-loop residuals).
      factors: per tensor, None or (for a tensor with an offset) its weighting factors (`weighting.factors`):
        the tensor is then encoded as its weighted residual (x - offset) / M and decodes to offset + M times the
        decoded value.
      reference: None, or the width reference of a closed-loop residual's uniform cells (`residual_reference`).

    Returns:
      One `DeviceCodes` per input, in order. Nothing is waited for: the work is dispatched, and the results
      are futures until read; nothing reads `xs` after this returns.
    """
    offsets = [None] * len(xs) if offsets is None else list(offsets)
    factors = [None] * len(xs) if factors is None else list(factors)
    if not (len(xs) == len(gs) == len(layer_types) == len(offsets) == len(factors)):
        raise ValueError("encode needs one gradient (or None), one layer type, one offset (or None) and one set "
                         "of weighting factors (or None) per tensor")
    if any(f is not None and offsets[i] is None for i, f in enumerate(factors)):
        raise ValueError("weighting factors apply to residuals only: a weighted tensor needs an offset")
    spec = sketch.SketchSpec(cfg.alpha)
    # Uniform levels without pruning or a rate treat every tensor on its own (no threshold or slope shared by a
    # type, no k-means keys): a large tensor is then encoded by a call of its own (`_encode_alone`).
    separate = quant.step > 0 and quant.prune_fraction == 0 and quant.rate == 0
    idx, kinds, bins, alone = _kinds_of(xs, gs, layer_types, quant, cfg, offsets, factors, separate)
    # One call for the layer types whose tensors are on the same devices (a state may keep, say, its
    # convolutions on one device and shard its dense layers). A host array goes wherever the others are.
    out: list[DeviceCodes | None] = [None] * len(xs)
    for unit in device_units([[xs[i] for i in ix] for ix in idx]):
        together = [t for t in unit if t < alone]
        for ts in ([together] if together else []) + [[t] for t in unit if t >= alone]:
            encode = _encode if ts[0] < alone else _encode_alone
            results = encode(
                [[xs[i] for i in idx[t]] for t in ts], [[gs[i] for i in idx[t]] for t in ts],
                [[offsets[i] for i in idx[t]] for t in ts], [[factors[i] for i in idx[t]] for t in ts],
                [np.int32(bins[t]) for t in ts],
                np.bool_(quant.prune_metric == "sensitivity"), np.float32(quant.protect_fraction),
                np.float32(quant.prune_fraction), np.float32(quant.step), np.float32(quant.rate),
                _reference(reference),
                [seed_key(cfg.seed, t) if key is None else jax.random.fold_in(key, t) for t in ts],
                kinds=tuple(kinds[t] for t in ts), spec=spec, sigma=cfg.sigma if sigma is None else sigma,
                iters=cfg.kmeans_iters, tol=cfg.kmeans_tol, restarts=cfg.kmeans_restarts, uniform=quant.step > 0,
                protects=quant.protect_fraction > 0, prunes=quant.prune_fraction > 0 or quant.step == 0)
            if encode is _encode_alone:
                [i] = idx[ts[0]]
                out[i] = DeviceCodes(*results, bins[ts[0]], offsets[i], factors=factors[i])
                continue
            for t, per_bucket in zip(ts, results):
                for b, stacks in zip(kinds[t].buckets, per_bucket):
                    for j, (c, cen, v) in enumerate(zip(*map(unstack, stacks))):
                        i = idx[t][b[j]]
                        out[i] = DeviceCodes(c, cen, v, bins[t], offsets[i], factors=factors[i])
    return out  # type: ignore[return-value]


# With `encode_on_device`'s `separate`, a tensor of at least this many values is encoded by a call of its own: in a
# stack of alike tensors its values were copied into the stack and its outputs out of it again (the stacked encode
# of a 100M-parameter residual took 1.2x as long: benchmarks/results/xla_cpu_kernels.md). A distinct shape of that
# size compiles a kernel of its own.
ALONE_FROM = threshold.MAP_MIN_SIZE


@functools.partial(jax.jit, static_argnames=("kinds", "spec", "sigma", "iters", "tol", "restarts", "uniform",
                                             "protects", "prunes"))
def _encode_one(*args, **kwargs):
    """`_encode` of one tensor, its uniform cells outside the range of the codes not zeroed: (codes, levels,
    protected values in place), not stacked."""
    [[(codes, levels, in_place)]] = _encode(*args, ranged=False, **kwargs)
    return codes[0], levels[0], in_place[0]


@functools.partial(jax.jit, static_argnames=("capacity", "pruned"))
def _outside_range_zeroed(codes, levels, bins, *, capacity: int, pruned: bool):
    """`levels` with the cells outside the range of `codes` (`_taken_range`) set to 0."""
    return jnp.where(_taken_range(codes[None], bins, capacity, pruned)[0], levels, 0.0)


def _encode_alone(xs, gs, offsets, factors, bins, *args, **kwargs):
    """`_encode` of one tensor (uniform cells: `encode_on_device`'s `separate`): its (codes, levels, protected
    values in place), not stacked. The range of its codes is reduced by a second call over the codes the first
    returns: inside one kernel, XLA's CPU backend computed the codes twice, once into the output and once more
    for the reductions (benchmarks/results/xla_cpu_kernels.md)."""
    codes, levels, in_place = _encode_one(xs, gs, offsets, factors, bins, *args, **kwargs)
    if kwargs["uniform"]:
        [kind], [b] = kwargs["kinds"], bins
        levels = _outside_range_zeroed(codes, levels, b, capacity=kind.capacity, pruned=kwargs["prunes"])
    return codes, levels, in_place


def _kinds_of(xs, gs, layer_types, quant: QuantConfig, cfg: CompressionConfig, offsets, factors,
              separate: bool = False):
    """How `encode_on_device` groups the tensors for `_encode`: per group (the tensors of one layer type on one
    device set), their indices, its `Kind` and its bin count; and the index of the first group of one tensor
    encoded alone (`separate`: each tensor of `ALONE_FROM` values or more, in groups after the others; the number
    of groups where there are none)."""
    # The tensors of one layer type share a prune threshold; a type whose tensors are on different device sets
    # (layers placed on different devices, as in pipeline parallelism) is split by device set, each part with a
    # threshold of its own: one jitted call takes arrays of one device set.
    types, idx, lone = [], [], []
    for lt in sorted(set(layer_types)):
        of_type = [i for i, t in enumerate(layer_types) if t == lt]
        for ix in device_units([xs[i] for i in of_type]):
            members = [of_type[j] for j in ix]
            big = [i for i in members if separate and int(np.prod(np.shape(xs[i]))) >= ALONE_FROM]
            lone += [(lt, [i]) for i in big]
            if len(big) < len(members):
                types.append(lt)
                idx.append([i for i in members if i not in big])
    alone = len(idx)
    for lt, ix in lone:
        types.append(lt)
        idx.append(ix)
    kinds, bins = [], []
    for kind, ix in zip(types, idx):
        b = quant.bins_for(kind)
        # A uniform quantizer's levels are its cells (no k-means): it has UNIFORM_SLOTS slots whatever its bins,
        # so every uniform configuration runs one compiled kernel (the search's guard tries several bin counts).
        capacity = UNIFORM_SLOTS if quant.step > 0 else cfg.bins_capacity
        if b > capacity:
            raise ValueError(f"{b} bins exceed CompressionConfig.bins_capacity={cfg.bins_capacity}")
        gxs, ggs, goffs = [xs[i] for i in ix], [gs[i] for i in ix], [offsets[i] for i in ix]
        weighted = [factors[i] is not None for i in ix]
        prunable = tuple(xs[i].ndim >= 2 for i in ix)
        out_dtypes = tuple(protected_storage_dtype(xs[i].dtype if offsets[i] is None else jnp.float32, cfg)
                           for i in ix)
        bs = buckets(gxs, ggs, goffs, weighted, prunable, out_dtypes)
        strides = tuple(sketch.sample_stride(np.shape(gxs[bk[0]]), len(devices_of(gxs[bk[0]])) <= 1) for bk in bs)
        kinds.append(Kind(bs, prunable, out_dtypes, capacity, b if quant.rate > 0 else 0, kind == "embedding",
                          strides))
        bins.append(b)
    return idx, kinds, bins, alone


def map_by_device_set(f, xs: Sequence, *others: Sequence) -> list:
    """[f(xs[i], others[..][i]) ...] computed as one call of `f` (a jitted function of lists, returning a list)
    per device set of `xs` (`device_units`)."""
    out: list = [None] * len(xs)
    for ix in device_units(xs):
        for i, r in zip(ix, f([xs[i] for i in ix], *([o[i] for i in ix] for o in others))):
            out[i] = r
    return out


def unstack(a: jax.Array) -> list[jax.Array]:
    """The arrays stacked on `a`'s leading axis, one per call of a kernel that takes one of them at a traced
    index: compiled once per stack shape, dtype and sharding, whatever the number of tensors (a kernel with one
    output per tensor compiles one copy per output on XLA's CPU backend; benchmarks/results/compile_scaling.md
    measures the first saves' compile time), at one dispatch per tensor."""
    return [_take(a, np.int32(j)) for j in range(a.shape[0])]


@jax.jit
def _take(a: jax.Array, j) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(a, j, keepdims=False)


def devices_of(x) -> set:
    """The devices an array (or a tuple of arrays) is on (none for a host array or None, which go wherever the
    others are)."""
    if isinstance(x, (tuple, list)):
        return set().union(*(devices_of(a) for a in x))
    return x.sharding.device_set if isinstance(x, jax.Array) else set()


def device_units(xs: Sequence) -> list[list[int]]:
    """Indices of `xs` grouped by the device set their arrays are on, in order of first appearance: one jitted
    call takes arrays of one device set, and a state may keep its layers on different devices (pipeline
    parallelism; or, say, its convolutions on one device and its dense layers sharded). Host arrays join the
    first device set (they go wherever the others are)."""
    units: dict = {}
    for i, x in enumerate(xs):
        units.setdefault(frozenset(d.id for d in devices_of(x)), []).append(i)
    host = units.pop(frozenset(), [])
    if not units:
        return [host] if host else []
    groups = list(units.values())
    groups[0] = sorted(groups[0] + host)
    return groups


def to_host(codes, centres, protected_in_place, bins: int, dtype) -> EncodedTensor:
    """One encoded tensor, or one shard of it, as host arrays: the arguments are the device arrays (or shards'
    data) of a `DeviceCodes` and its bins; `dtype` is the leaf's dtype. Blocks until they are computed and
    copied."""
    bins = int(bins)
    host_codes = np.asarray(codes)
    values = np.asarray(protected_in_place).reshape(-1)[protected_positions(host_codes, bins)]
    return EncodedTensor(host_codes, np.asarray(centres)[:bins], values, jnp.dtype(dtype).name)


def encode_tensors(
    xs: Sequence[jax.Array],
    gs: Sequence[jax.Array | None],
    layer_types: Sequence[str],
    quant: QuantConfig,
    cfg: CompressionConfig,
    key: jax.Array | None = None,
) -> list[EncodedTensor]:
    """`encode_on_device`, then each whole tensor copied to the host (single-process arrays)."""
    devs = encode_on_device(xs, gs, layer_types, quant, cfg, key)
    return [to_host(d.codes, d.centres, d.protected_in_place, d.bins, x.dtype) for x, d in zip(xs, devs)]


def _checked_positions(enc: EncodedTensor, pos: np.ndarray | None = None) -> np.ndarray:
    """The flat positions of an encoded tensor's protected weights (`pos` if the caller has them already), after
    checking that it holds one value for each and no code past the protected one (ValueError)."""
    if pos is None and isinstance(enc.codes, PackedCodes):  # none, where no byte holds the protected code
        pos = np.zeros(0, np.int32) if enc.codes.top() < protected_code(enc.bins) else protected_positions(
            enc.codes.at(np.arange(enc.codes.size)), enc.bins)
    pos = protected_positions(enc.codes, enc.bins) if pos is None else pos
    if pos.size != enc.protected.size:
        raise ValueError(
            f"corrupt encoded tensor: {pos.size} protected codes but {enc.protected.size} protected values"
        )
    if _top_code(enc.codes) > enc.centres.size + 1:
        raise ValueError(f"corrupt encoded tensor: code {_top_code(enc.codes)} is above the protected code "
                         f"{enc.centres.size + 1} of its {enc.centres.size} levels")
    return pos


# A host array of fewer bytes than this goes to a jitted kernel as it is where another argument is already on the
# device the kernel runs on (the array follows it there): JAX transfers it in its C++ dispatch, for a fraction of
# what a call of `jax.device_put` costs in Python, which a small model's restore made hundreds of times (the
# character transformer's warm restore, benchmarks/results/save_breakdown.md). Larger ones are put first: a
# 10M-parameter chain's tensors of 2.5M values restored slower passed as they are (an ad-hoc timing).
_AS_ARGUMENT_BELOW = 1 << 20

_plus_offset = jax.jit(plus_offset, static_argnames=("dtype",))
_times_scale = jax.jit(times_scale, static_argnames=("dtype",))


def decode(enc: EncodedTensor, device=None, offset: jax.Array | None = None,
           scale: jax.Array | None = None, positions: np.ndarray | None = None) -> jax.Array:
    """The dequantized tensor (pruned -> 0, quantized -> its centre, protected -> its stored value), in the
    original dtype, on `device` (default device if None); with `offset` (an array on that device), the codes
    are a residual and the result is offset + the decoded residual (`plus_offset`); with `scale` (an array on
    that device), the centres are ratios and the result is centre * sqrt(scale) (`times_scale`). `positions`:
    the protected weights' flat positions (`protected_positions` of the codes), if the caller has them."""
    pos = _checked_positions(enc, positions)
    # The table lookup and the protected values are exact (no arithmetic): done on the host, so a restore
    # compiles nothing per leaf shape or level count; only the sum with an offset (a fine-tune's base) runs on the
    # device, in the jitted formula the save computed it with (plus_offset), so the result is bit-identical to it.
    # (Closed-loop chains decode with `decode_chain`.)
    work = np.dtype(jnp.dtype(enc.dtype)) if offset is None and scale is None else np.dtype(np.float32)
    table = np.concatenate([np.zeros(1, enc.centres.dtype), enc.centres, np.zeros(1, enc.centres.dtype)]).astype(work)
    if enc.codes.size * work.itemsize < codec.ALIGNED_FROM:
        out = table[enc.codes]
    else:  # 64-byte aligned: JAX's CPU client takes it as the device buffer, not a copy of it
        out = codec.aligned_empty(enc.codes.size * work.itemsize).view(work).reshape(enc.codes.shape)
        np.take(table, enc.codes, out=out, mode="clip")  # the codes were checked to index the table
    out.reshape(-1)[pos] = enc.protected.astype(work)
    if offset is None and scale is None:
        return jax.device_put(out, device)
    # Beside `offset` or `scale`, on the device the kernel runs on, a small host array goes as it is.
    put = (lambda a: a) if out.nbytes < _AS_ARGUMENT_BELOW else functools.partial(jax.device_put, device=device)
    if scale is not None:
        exact = enc.codes == protected_code(enc.bins)
        return _times_scale(put(out), put(exact), scale, dtype=jnp.dtype(enc.dtype))
    return _plus_offset(put(out), offset, dtype=jnp.dtype(enc.dtype))


def _table(enc: EncodedTensor, work) -> np.ndarray:
    """code -> value for every uint8 code (0 pruned, 1..K the centres, the protected code and above 0), in
    `work`: one shape for any number of levels, so the chain kernels do not compile per level count."""
    table = np.zeros(256, work)
    table[1:enc.bins + 1] = enc.centres.astype(work)
    return table


# A chain's residual links are added in groups of this many per kernel call (the last group padded with links
# that change nothing): the kernels compile once per tensor size, whatever the chain's length.
CHAIN_GROUP = 4


@functools.partial(jax.jit, static_argnames=("size",))
def _chain_start(codes, table, *, size):
    """A keyframe link's values: `table` (in the leaf's dtype) looked up by its codes, `size` of them flat, or in
    the codes' own shape where `size` is None."""
    return table[codes] if size is None else _fit(table[codes], size)


def _link_values(codes, table, exps, shape: tuple) -> jax.Array:
    """A residual link's values (float32) in `shape` (the sum's: a flat padded length, or a large tensor's own
    shape): its codes (or packed bytes) looked up in its table, times its weighting's 2^K where `exps` is not
    None, the first prod(`shape`) of them (a padded tail cut inside the kernel)."""
    r = table[codes]
    if r.ndim == 2:  # packed: each byte's values, in position order
        r = r.reshape(-1)
    r = r if exps is None else weighting.times_multiplier(r, exps)
    n = math.prod(shape)
    return (r if r.shape[0] == n else r[:n]).reshape(shape)


@functools.partial(jax.jit, static_argnames=("dtype",), donate_argnums=(0,))
def _chain_sum(a, codes, tables, *, dtype):
    """`a` plus each unweighted link's residual (`codes` and `tables` as for `_chain_group`, one entry per link,
    every one used), rounded to `dtype` link by link, without the formula's replacement of a non-finite `a` by 0:
    the same values as `_chain_group` wherever every sum stays finite (`_add_links` makes sure they do)."""
    for i in range(len(codes)):
        a = (_link_values(codes[i], tables[i], None, a.shape) + a.astype(jnp.float32)).astype(dtype)
        if jnp.dtype(dtype) != jnp.float32:  # keep each link's rounding to `dtype`: no fusing of the casts away
            a = jax.lax.optimization_barrier(a)
    return a


@functools.partial(jax.jit, static_argnames=("dtype",), donate_argnums=(0,))
def _chain_group(a, codes, tables, used, exps, *, dtype):
    """`a` plus each of `CHAIN_GROUP` links' residuals where `used`, per link the formula of the save
    (`plus_offset`, after `weighting.times_multiplier` where the link is weighted): `codes` (a tuple of
    `CHAIN_GROUP` uint8 arrays: n codes, or the packed bytes of `PackedCodes`), `tables` (a tuple of `CHAIN_GROUP`
    float32 tables: (256,) code -> value, or (256, per) byte -> its per codes' values for packed bytes) and `exps`
    (None: no link of the group weighted; else a tuple of `CHAIN_GROUP` int8 arrays of n, 0 for an unweighted link)
    hold one entry per link. The codes stay separate arrays: stacking a group's links on the host would copy every
    code once more."""
    for i in range(CHAIN_GROUP):
        r = _link_values(codes[i], tables[i], None if exps is None else exps[i], a.shape)
        a = jnp.where(used[i], plus_offset(r, a, dtype), a)
        if jnp.dtype(dtype) != jnp.float32:  # keep each link's rounding to `dtype`: no fusing of the casts away
            a = jax.lax.optimization_barrier(a)
    return a


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_at(a, at, values):
    """`a` with `values` at its flat positions `at` (positions past the end are dropped), in `a`'s shape (its
    buffer updated in place)."""
    return a.reshape(-1).at[at].set(values, mode="drop").reshape(a.shape)


# A chain of a tensor below this many elements is decoded padded to the next power of two (at least
# `_CHAIN_MIN`): the kernels compile once per size, and a small model's tensors come in many sizes, so its first
# restore in a process compiled a kernel for each (0.1 s apiece on CPU); the padding costs little at that size.
_CHAIN_PADDED_BELOW = 1 << 20
_CHAIN_MIN = 1 << 10


# A chain of a tensor of at least this many elements takes its residuals' packed code streams as they are
# (`PackedCodes`), decoded padded to a multiple of `PACKED_MULTIPLE`: the codes a byte holds (2, 3, 4, 5 or 8)
# each divide it, so a packed link's values are its bytes' looked-up rows laid end to end, with no cut to the
# tensor's length inside the kernel. Below it the host spells the codes out. Each mix of codes a byte in a group
# of links is a kernel to compile: with the tensors of a 10M-parameter chain (2.5M values) packed, a new process's
# first deep restore took 0.62-0.65 s against 0.43-0.51 s in one run without JAX's persistent compilation cache
# (benchmarks/results/restore_packed.md), the same as unpacked in a later one (restore_packed_nocache.md), and with
# the cache (`enable_compilation_cache`, which a resumed job turns on) as fast or faster (restore_packed_cache.md);
# the warm restores 1.3-2.0x faster, round by round, in all three. The same size as `codec._PACKED_ONLY_SIZE`: a stream of fewer
# values may be coded "mode", which has no packed bytes.
_PACKED_FROM = 1 << 20
PACKED_MULTIPLE = 120


def chain_size(n: int) -> int:
    """The length `decode_chain`'s kernels work on for a tensor of `n` elements."""
    if takes_packed(n):
        return -(-n // PACKED_MULTIPLE) * PACKED_MULTIPLE
    return n if n >= _CHAIN_PADDED_BELOW else max(_CHAIN_MIN, 1 << max(n - 1, 0).bit_length())


def takes_packed(n: int) -> bool:
    """Whether `decode_chain` takes a residual's codes of a tensor of `n` elements as `PackedCodes` (holding
    `chain_size(n)` codes: `codec.packed_values(..., slots=chain_size(n))`)."""
    return n >= _PACKED_FROM


def _fit(x: jax.Array, size: int) -> jax.Array:
    """A flat array zero-padded to `size` in a kernel."""
    return jnp.pad(x, (0, size - x.shape[0])) if x.shape[0] < size else x


def _flat(a: np.ndarray, size: int, copy: bool = False) -> np.ndarray:
    """`a` flattened and zero-padded to `size` elements (itself, flattened, when it has that many already)."""
    flat = a.reshape(-1)
    if flat.size == size:
        return np.array(flat) if copy else flat
    out = np.zeros(size, flat.dtype)
    out[:flat.size] = flat
    return out


@functools.partial(jax.jit, static_argnames=("shape",))
def _shaped(a: jax.Array, *, shape: tuple) -> jax.Array:
    """The first prod(shape) elements of a padded chain's flat result, in `shape`."""
    return a[:int(np.prod(shape, dtype=np.int64))].reshape(shape)


def _add_links(first, upto: Callable, count: int, exps: list, shape: tuple, size_n: int, dtype,
               put: Callable) -> jax.Array:
    """`decode_chain`'s kernels: the first link's values, then each residual added, `CHAIN_GROUP` links a call
    (`upto(k)`: the first k links, waited for); the protected positions not yet put in. A tensor that
    `takes_packed` is summed in its own `shape` (each link's padded values cut inside its kernel), so the result is
    the restored array with no copy of the whole tensor to shape it after the sums; a smaller one flat, `size_n`
    long.

    The save's formula replaces a non-finite sum by 0 before the next link is added (`plus_offset`). A packed
    chain's group of unweighted links is added by plain sums instead (`_chain_sum`: with the replacement, XLA's CPU
    backend adds packed links 3-4x slower; benchmarks/results/restore_packed.md) where no sum can leave the finite
    range: where the first link's
    largest magnitude plus every link's largest level so far stays within half the dtype's largest value (less
    the most that rounding each of the chain's sums can add), the values are the formula's bit for bit.
    Otherwise (an exact first link holding an Inf, levels that could overflow, a weighted link) that group and
    the later ones use the formula (`_chain_group`)."""
    f32, n = np.dtype(np.float32), math.prod(shape)
    info = jnp.finfo(dtype)
    limit = float(info.max) / 2 / (1 + float(info.eps)) ** (count + 1)
    if not takes_packed(n):
        bound = math.inf
    elif isinstance(first, EncodedTensor):
        bound = float(np.abs(_table(first, f32)).max())
    else:
        bound = float(np.abs(np.asarray(first, f32)).max()) if np.size(first) else 0.0  # Inf or NaN: not < limit
    if isinstance(first, EncodedTensor):
        # A residual's codes are padded on the host (padded inside the residuals' kernel, they slowed it on XLA's
        # CPU backend), and cut to the tensor's length inside it where the sum is in the tensor's shape.
        if takes_packed(n):
            out = _chain_start(*put([first.codes.reshape(shape), _table(first, dtype)]), size=None)
        else:
            out = _chain_start(*put([_flat(first.codes, size_n), _table(first, dtype)]), size=size_n)
    elif takes_packed(n):
        out = put(np.array(np.asarray(first).reshape(shape)))  # a copy: the kernels below update it in place
    else:
        out = put(_flat(np.asarray(first), size_n, copy=True))
    for g in range(0, count, CHAIN_GROUP):
        group = upto(1 + min(g + CHAIN_GROUP, count))[1 + g:]
        for e in group:
            if not isinstance(e, EncodedTensor):
                raise ValueError("corrupt chain: a link after the first holds exact values, not a residual")
            if tuple(e.codes.shape) != shape:
                raise ValueError(f"corrupt chain: a link of shape {e.codes.shape} on a tensor of shape {shape}")
            if isinstance(e.codes, PackedCodes) and (not takes_packed(n) or e.codes.rows.shape[0] != 256 or
                                                     e.codes.packed.size * e.codes.rows.shape[1] != size_n):
                raise ValueError(f"packed codes of {e.codes.packed.size} bytes of {e.codes.rows.shape[1]} codes "
                                 f"for a tensor of {n} values (the chain kernels take {size_n} codes, of a tensor "
                                 f"of at least {_PACKED_FROM})")
        ks = exps[g:g + CHAIN_GROUP]
        # A short group is padded with its last link, unused. A small chain's host arrays go to the kernel as they
        # are (`_AS_ARGUMENT_BELOW`), a large one's to the device first, each distinct one once.
        tables = [_table(e, f32) for e in group]
        host = [[e.codes.packed if isinstance(e.codes, PackedCodes) else _flat(e.codes, size_n) for e in group],
                [t[e.codes.rows] if isinstance(e.codes, PackedCodes) else t for e, t in zip(group, tables)],
                np.arange(CHAIN_GROUP) < len(group)]
        weighted = any(k is not None for k in ks)
        if weighted:
            zero = np.zeros(size_n, np.int8)
            host.append([zero if k is None else _flat(k, size_n) for k in ks] + [zero])
        on_device = host if size_n < _AS_ARGUMENT_BELOW else put(host)
        pad = CHAIN_GROUP - len(group)
        exps_dev = tuple(on_device[3][:len(group)]) + (on_device[3][-1],) * pad if weighted else None
        bound = math.inf if weighted else bound + sum(float(np.abs(t).max()) for t in tables)
        if not bound < limit:
            out = _chain_group(out, tuple(on_device[0]) + (on_device[0][-1],) * pad,
                               tuple(on_device[1]) + (on_device[1][-1],) * pad, on_device[2], exps_dev,
                               dtype=jnp.dtype(dtype))
        else:
            out = _chain_sum(out, tuple(on_device[0]), tuple(on_device[1]), dtype=jnp.dtype(dtype))
    return out


def decode_chain(links: Sequence, device=None,
                 weightings: Sequence[Sequence[np.ndarray] | None] | None = None) -> jax.Array:
    """A closed-loop chain decoded: its first link (a keyframe's encoded tensor, or the exact values of a lossless
    first link) plus each residual in turn, `decode(residual, offset=the reconstruction so far)` link by link, bit
    for bit, in jitted kernels on `device` (default device if None).

    `links`: per link, (an `EncodedTensor` (a residual; or the first link) or exact values (the first link only),
    its protected weights' flat positions or None), or a `concurrent.futures.Future` of that pair: a link's
    kernels are dispatched as soon as it and the links before it have arrived, so the caller's threads
    decompress later links while the device adds earlier ones. `weightings`: per residual (links after the
    first), None or its weighting factors over the tensor (one int vector per axis, weighting.py): its decoded
    values are multiplied by 2^K before the sum.

    One pass over the tensor per `CHAIN_GROUP` links (a deep restore adds up to `keyframe_every - 1` residuals):
    the kernels read each link's codes once, and the protected weights, whose stored values replace a link's
    level at a few positions, are recomputed link by link on the host at those positions only (once every link
    has arrived) and put in at the end. The kernels compile once per tensor size (a large tensor's: per shape) and
    dtype (and power of two of the protected positions), whatever the chain's length: the residuals are added
    `CHAIN_GROUP` at a time. A residual's codes may be `PackedCodes` of `chain_size(n)` codes where
    `takes_packed(n)`: its kernel looks the values up from the packed bytes (one compile per group's mix of codes
    a byte)."""
    pending = list(links)
    if not pending:
        raise ValueError("a chain has at least one link")
    got: list = []

    def upto(k: int) -> list:
        """The first `k` links, waited for."""
        while len(got) < k:
            link = pending[len(got)]
            got.append(link.result() if isinstance(link, concurrent.futures.Future) else link)
        return [e for e, _ in got[:k]]

    first = upto(1)[0]
    dtype = np.dtype(jnp.dtype(first.dtype if isinstance(first, EncodedTensor) else first.dtype))
    shape = tuple(first.codes.shape if isinstance(first, EncodedTensor) else first.shape)
    n = int(np.prod(shape, dtype=np.int64))
    size_n = chain_size(n)  # what the kernels work on: a small tensor padded (fewer sizes to compile), a large one
    # to `PACKED_MULTIPLE`
    f32 = np.dtype(np.float32)
    count = len(pending) - 1  # residuals
    weightings = list(weightings or [None] * count)
    if len(weightings) != count:
        raise ValueError(f"{len(weightings)} weightings for {count} residual links")
    for fs in weightings:
        if fs is not None and tuple(np.size(f) for f in fs) != tuple(shape):
            raise ValueError(f"corrupt chain: weighting factors of lengths {[np.size(f) for f in fs]} on a tensor "
                             f"of shape {tuple(shape)}")
    exps = [None if fs is None else weighting.exponents_host(fs).astype(np.int8).reshape(-1) for fs in weightings]
    # At most one device_put call per kernel call, for all of its host arrays: a small tensor's restore is otherwise
    # dominated by the fixed cost of a put per array (two per link of a deep chain); a small chain's arrays after
    # its first link's go to the kernels as they are, beside the sum on the device (`_AS_ARGUMENT_BELOW`).
    put = functools.partial(jax.device_put, device=device)
    if not count and not isinstance(first, EncodedTensor):
        return put(np.asarray(first))  # a lossless first link alone: its exact values
    if isinstance(first, EncodedTensor) and isinstance(first.codes, PackedCodes):
        raise ValueError("a chain's first link takes its codes as an array, not packed")
    out = _add_links(first, upto, count, exps, shape, size_n, dtype, put)
    encoded = [(e, p) for e, p in got if isinstance(e, EncodedTensor)]
    positions = [_checked_positions(e, p) for e, p in encoded]
    # Every protected position once (`at`, ascending), and where each link's positions are in it (`where`): a
    # stable sort of the links' ascending positions merges them.
    cat = np.concatenate(positions) if positions else np.zeros(0, np.int32)
    order = np.argsort(cat, kind="stable")
    merged = cat[order]
    new = np.concatenate([merged[:1] >= 0, merged[1:] != merged[:-1]])
    at = merged[new]
    index = np.empty(cat.size, np.int64)
    index[order] = np.cumsum(new) - 1
    where = np.split(index, np.cumsum([p.size for p in positions])[:-1]) if positions else []
    # The protected positions, link by link with the save's formulas (decode, plus_offset) in NumPy.
    residuals = [e for e, _ in got[1:]]
    positions_at = _Positions(at)
    if isinstance(first, EncodedTensor):
        a = positions_at.values(first.codes, _table(first, dtype))
        a[where[0]] = first.protected.astype(dtype)
    else:
        a = np.asarray(first).reshape(-1)[at]
    for e, w, k in zip(residuals, where[len(encoded) - len(residuals):], exps):
        r = positions_at.values(e.codes, _table(e, f32))
        r[w] = e.protected.astype(f32)
        if k is not None:  # times 2^K: exact, as on the device
            r = np.ldexp(r, k[at].astype(np.int32)).astype(f32)
        off = a.astype(f32)
        a = (r + np.where(np.isfinite(off), off, f32.type(0))).astype(dtype)
    size = 1 << max(at.size - 1, 0).bit_length() if at.size else 0  # padded: few shapes to compile
    fix_at = np.full(size, size_n, np.int32)
    fix_at[:at.size] = at
    fix_values = np.zeros(size, dtype)
    fix_values[:at.size] = a
    if at.size:
        fix = [fix_at, fix_values]
        out = _put_at(out, *(fix if fix_at.nbytes < _AS_ARGUMENT_BELOW else put(fix)))
    if takes_packed(n):
        return out
    return out.reshape(shape) if size_n == n else _shaped(out, shape=tuple(shape))
