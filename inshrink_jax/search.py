"""The configuration search (ALGORITHM.md step 5, the paper's "Quantization Config Manager").

At each save it picks the `QuantConfig` with the highest estimated compression ratio whose measured relative
degradation is at most epsilon (with an eval_fn, a candidate must also meet the data-free bound where the
eval_fn's reading alone is not trusted: at the keyframe of a closed-loop chain, and wherever it reads better than
the uncompressed state by more than epsilon; `Evaluator.trusted`):

- The space is a cube: one axis per knob (bins, prune fraction, protect fraction, and embedding bins when the
  state has embedding tables), each ordered from most to least aggressive, so quality is assumed to rise along
  every axis, except the prune axis of a closed-loop residual's space (`Cube.ordered`: a pruned residual is a
  level at 0, so more pruning may mean less error). The prune metric is not an axis: the search runs per metric.
- First save (and fallbacks): guided exhaustive search, once per prune metric. Walk the diagonal of the cube
  (one per value of an unordered axis, walked together) from its most to its least aggressive corner to locate
  the first feasible point (a point below an
  infeasible one is infeasible, one above a feasible one is feasible: a few evaluations decide large parts of
  the cube). Then best first: evaluate the not-yet-excluded point with the highest estimated ratio, until the
  best candidate left is known feasible. The paper recurses into sub-cubes instead, skipping those whose
  ratio cannot beat the best found on the assumption that the ratio rises along every axis; measured, it does
  not along the prune axis (10-20% pruning of a 4-8 level tensor adds a symbol and costs bits;
  `estimated_ratio`), so we rank by the estimate and use monotonicity only for quality. No point is evaluated
  twice.
- Later saves: neighbourhood search. Re-check the previous configuration under both prune metrics (switch
  metric when the other is clearly better), then its neighbours one step less aggressive on each axis. The
  choice never becomes more aggressive than the previous one. When no neighbour is feasible, fall back to the
  exhaustive search over the configurations that are not more aggressive than the previous one; when nothing
  is feasible, store the parameters losslessly; later saves re-check the least aggressive configuration (one
  round) and search afresh once it is feasible again (a fallback is not permanent).
- Candidates are evaluated in rounds of `search_batch` (their device work is dispatched together) in order of
  estimated ratio, and each search stops at the first round that settles it.

This module is pure logic over an `evaluate(list[QuantConfig]) -> list[(degradation, payload)]` callback, so it
is tested with synthetic feasibility functions; `Evaluator` is the callback the handler uses (jitted encode,
dequantize on device, then `eval_fn` or the data-free proxy; a closed-loop residual's candidates on uniform cells
are scored by the proxy in one kernel without being encoded, and only the chosen one is encoded).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from inshrink_jax import quantize, weighting
from inshrink_jax.config import CompressionConfig, QuantConfig, SearchSpace

LOSSLESS = "lossless"
UNMEASURED = "unmeasured"
_PROTECTED_BITS = 16  # a bf16 protected value; only used to order candidates


# ----------------------------------------------------------------------------------------------------- cube
@dataclasses.dataclass(frozen=True)
class Cube:
    """The search space as index points: axis i holds `values[i]`, ordered from most to least aggressive."""

    names: tuple[str, ...]
    values: tuple[tuple, ...]
    base: QuantConfig  # supplies the knobs that are not axes (e.g. embedding bins without embeddings)
    # Per axis, whether quality rises along it (the search infers feasibility along those only). Not the prune
    # axis of a closed-loop residual: a pruned residual keeps the previous reconstruction, a level at 0 the
    # others do not have, so pruning half of a residual quantized to 4 levels often has less error than pruning
    # none (benchmarks/results/residual_search.md).
    ordered: tuple[bool, ...]

    @classmethod
    def build(cls, space: SearchSpace, has_embedding: bool, base: QuantConfig, residual: bool = False) -> "Cube":
        axes = [("bins", tuple(sorted(space.bins))),
                ("prune_fraction", tuple(sorted(space.prune_fractions, reverse=True))),
                ("protect_fraction", tuple(sorted(space.protect_fractions)))]
        if has_embedding:
            axes.append(("embedding_bins", tuple(sorted(space.embedding_bins))))
        else:
            base = dataclasses.replace(base, embedding_bins=max(space.embedding_bins))
        if len(space.steps) > 1:
            axes.append(("step", tuple(sorted(space.steps, reverse=True))))
        else:
            base = dataclasses.replace(base, step=space.steps[0])
        if len(space.rates) > 1:
            axes.append(("rate", tuple(sorted(space.rates, reverse=True))))
        else:
            base = dataclasses.replace(base, rate=space.rates[0])
        ordered = tuple(not (residual and n == "prune_fraction") for n, _ in axes)
        return cls(tuple(n for n, _ in axes), tuple(v for _, v in axes), base, ordered)

    def below(self, p: Sequence[int], q: Sequence[int]) -> bool:
        """Whether `p` is at most as good as `q` wherever quality is ordered (no less aggressive on any ordered
        axis) and equal on the others: p feasible implies q feasible, q infeasible implies p infeasible."""
        return all(a <= b if o else a == b for a, b, o in zip(p, q, self.ordered))

    @property
    def top(self) -> tuple[int, ...]:
        """The least aggressive point."""
        return tuple(len(v) - 1 for v in self.values)

    def config(self, point: Sequence[int], metric: str) -> QuantConfig:
        knobs = {n: v[i] for n, v, i in zip(self.names, self.values, point)}
        return dataclasses.replace(self.base, prune_metric=metric, **knobs)

    def point(self, q: QuantConfig) -> tuple[int, ...]:
        """The most aggressive point of the cube that is not more aggressive than `q` on any axis (q itself when
        it is in the space; the least aggressive value of an axis when q is beyond it)."""
        out = []
        for name, values in zip(self.names, self.values):
            v = getattr(q, name)
            if name in ("prune_fraction", "step", "rate"):  # larger is more aggressive
                ok = [i for i, x in enumerate(values) if x <= v + 1e-12]
            else:
                ok = [i for i, x in enumerate(values) if x >= v - 1e-12]
            out.append(ok[0] if ok else len(values) - 1)
        return tuple(out)


def _entropy(*ps: float) -> float:
    return -sum(p * math.log2(p) for p in ps if p > 0)


def level_bits(bins: int) -> float:
    """Estimated bits per quantized element for `bins` levels: log2(K) - 0.7 for K >= 8 (weighted k-means codes
    of trained CNN layers: 0.6-0.9 bits below log2 K for K = 8..32); for fewer levels the saving shrinks to none
    at K = 2, where two levels cost 1 bit (closed-loop residuals have balanced levels)."""
    return math.log2(bins) - 0.7 * min(1.0, (bins - 2) / 6)


def step_bits(step: float) -> float:
    """Estimated bits per element of a uniform quantizer of step `step` times the RMS: the high-resolution
    entropy of a Gaussian, 2.05 - log2(step), at least 0.05 (a closed-loop residual of a character transformer:
    2.02, 1.49, 1.14, 0.87, 0.67 bits of order-0 entropy at steps 1, 1.5, 2, 2.5, 3 with 31 cells,
    benchmarks/results/residual_coding.md). It orders candidates only."""
    return max(0.05, 2.05 - math.log2(step))


def rate_bits(rate: float) -> float:
    """Estimated bits per element of entropy-constrained levels of code-length weight `rate`: -0.04 - 0.65 *
    log2(rate), at least 0.05 (the character transformer's closed-loop residual between steps 270 and 300 took
    2.73, 2.12, 1.45, 0.82 and 0.33 bits of order-0 entropy at rates 0.05, 0.1, 0.2, 0.4 and 0.8,
    benchmarks/results/residual_coding.md). It orders candidates only."""
    return max(0.05, -0.04 - 0.65 * math.log2(rate))


def estimated_ratio(q: QuantConfig, sizes: dict[str, int], bits: dict[str, int]) -> float:
    """Estimated compression ratio of `q` as a keyframe, used to order candidates: per element, the order-0
    entropy of the pruned / protected / quantized split, plus `level_bits(K)` (or `step_bits(step)`) per
    quantized element, plus 16 bits per protected value.

    `sizes` and `bits` give the elements and the bits per element of the compressed leaves per layer type.
    More bins or more protection always cost; more pruning does not always pay (a few pruned weights add a
    symbol to the stream), so the search does not assume it does."""
    raw = stored = 0.0
    for lt, n in sizes.items():
        pp = q.protect_fraction
        pr = (1 - pp) * q.prune_fraction
        qf = 1 - pp - pr
        levels = rate_bits(q.rate) if q.rate > 0 else step_bits(q.step) if q.step > 0 else level_bits(q.bins_for(lt))
        per = _entropy(pp, pr, qf) + qf * levels + pp * _PROTECTED_BITS
        raw += n * bits[lt]
        stored += n * per
    return raw / max(stored, 1e-12)


# --------------------------------------------------------------------------------------------------- search
@dataclasses.dataclass
class Outcome:
    """What one save's search decided.

    Attributes:
      quant: the chosen configuration, or None for lossless parameters.
      degradation: its measured relative degradation (0 for lossless).
      mode: "exhaustive" (first save, or no usable previous configuration), "neighbourhood", "fallback"
        (neighbourhood found nothing, exhaustive over the not-more-aggressive part), "lossless" (the previous
        save was lossless and the least aggressive configuration still does not meet the budget), "recovered"
        (it does again: exhaustive search), UNMEASURED (eval_fn gave no finite value for the uncompressed
        state: this save is lossless, the next one searches from the previous choice); for a closed-loop
        residual save (`choose`) also "guarded" (eval_fn over epsilon: a less aggressive configuration, or a
        finer one beyond the residual space), "finer" (nothing in the residual space met residual_budget, finer
        levels beyond it did), "least aggressive" (nothing did: the finest), "ladder" (a large state's choice on
        row samples failed the budget on the whole state: the first less aggressive one within it there,
        `_measured_whole`) and "kept" (a large state's previous residual choice still within the budget on the
        whole state, the next wider cells predicted over it: `_kept_residual`); for any other save also "fine"
        (nothing in the search space met the budget, a fine uniform quantizer did: `_fine_keyframe`).
      evaluations: candidates evaluated (each one encode + one eval_fn call or proxy).
      rounds: rounds of evaluation (each a batch of at most `search_batch` candidates).
      payload: the evaluator's payload for the chosen candidate (the handler's encoded device arrays).
      decoded: the payload's leaves dequantized, where the search made them for its own proxy only (a sampled
        search's choice measured on the whole state: `_measured_whole`), else None: a closed-loop save keeps
        them as its reconstruction instead of decoding the payload again (at 100M parameters a decode is 0.17 s
        and 400 MB of fresh pages; benchmarks/results/save_pages.md).
      reference: the width reference of a closed-loop residual's uniform cells (`quantize.residual_reference`)
        the candidates were measured with, or None: an encode of the choice (where the search did not encode it)
        takes the same.
    """

    quant: QuantConfig | None
    degradation: float
    mode: str
    evaluations: int = 0
    rounds: int = 0
    payload: Any = None
    decoded: Any = None
    reference: Any = None


class _Evaluations:
    """Evaluated candidates of one save, with monotone inference per prune metric and the best feasible one."""

    def __init__(self, cube: Cube, evaluate: Callable, epsilon: float, batch: int, estimate: Callable):
        self.cube, self.evaluate, self.epsilon, self.batch, self.estimate = cube, evaluate, epsilon, batch, estimate
        self.known: dict[tuple[str, tuple], float] = {}  # (metric, point) -> degradation
        self.payloads: dict[tuple[str, tuple], Any] = {}
        self.evaluations = self.rounds = 0
        self.best: tuple[str, tuple] | None = None

    def feasible(self, metric: str, point: tuple) -> bool | None:
        """Known or implied by monotonicity (above a feasible point: feasible; below an infeasible: not)."""
        d = self.known.get((metric, point))
        if d is not None:
            return d <= self.epsilon
        for (m, q), dq in self.known.items():
            if m != metric:
                continue
            if dq <= self.epsilon and self.cube.below(q, point):
                return True
            if dq > self.epsilon and self.cube.below(point, q):
                return False
        return None

    def run(self, items: Sequence[tuple[str, tuple]], keep_all: bool = False) -> None:
        """Evaluate `items` (metric, point) not yet known, in rounds of `batch`, ordered by estimated ratio.
        The payload of the best feasible candidate is kept (of every feasible one with `keep_all`)."""
        todo = sorted({it for it in items if it not in self.known}, key=lambda it: (-self.estimate(it[1]), it))
        for start in range(0, len(todo), self.batch):
            chunk = todo[start:start + self.batch]
            results = self.evaluate([self.cube.config(p, m) for m, p in chunk])
            self.rounds += 1
            self.evaluations += len(chunk)
            for it, (d, payload) in zip(chunk, results):
                d = float(d) if d is not None and math.isfinite(float(d)) else math.inf
                self.known[it] = d
                if d <= self.epsilon and (keep_all or self._better(it)):
                    self.payloads[it] = payload
                if d <= self.epsilon and self._better(it):
                    if self.best is not None and not keep_all:
                        self.payloads.pop(self.best, None)  # only the best feasible candidate's arrays are kept
                    self.best = it

    def _better(self, it) -> bool:
        if self.best is None:
            return True
        a, b = self.estimate(it[1]), self.estimate(self.best[1])
        return a > b or (a == b and self.known[it] < self.known[self.best])

    def outcome(self, mode: str) -> Outcome:
        if self.best is None:
            return Outcome(None, 0.0, mode, self.evaluations, self.rounds)
        m, p = self.best
        return Outcome(self.cube.config(p, m), self.known[self.best], mode, self.evaluations, self.rounds,
                       self.payloads.get(self.best))


def _exhaustive(ev: _Evaluations, metric: str, floor: tuple[int, ...]) -> None:
    """Guided exhaustive search of the box [floor, top] for one prune metric; the best feasible point found
    (over all metrics searched so far) is left in `ev.best`.

    First the diagonal walk from the box's most to its least aggressive corner locates the quality boundary
    (a few evaluations that, by monotonicity, decide large parts of the box). Then best first: the point with
    the highest estimated ratio that is not known to be infeasible is evaluated (a round takes the next
    `batch` such points), until the best remaining candidate is one already evaluated as feasible, or cannot
    beat the best feasible point of another metric."""
    cube, top = ev.cube, ev.cube.top
    box = [p for p in itertools.product(*[range(f, t + 1) for f, t in zip(floor, top)])]
    order = sorted(box, key=lambda p: (-ev.estimate(p), p))
    # One diagonal (over the ordered axes) per value of the unordered ones, walked together.
    fixed = itertools.product(*[[None] if o else range(f, h + 1) for f, h, o in zip(floor, top, cube.ordered)])
    span = max([h - f for f, h, o in zip(floor, top, cube.ordered) if o] or [0])
    _first_feasible(ev, metric, [[tuple(min(f + t, h) if v is None else v for f, h, v in zip(floor, top, fix))
                                  for t in range(span + 1)] for fix in fixed])
    while True:
        open_ = [p for p in order if ev.feasible(metric, p) is not False]
        if not open_ or (metric, open_[0]) in ev.known:
            return  # nothing feasible, or the best candidate left is evaluated and feasible
        if ev.best is not None and ev.estimate(ev.best[1]) >= ev.estimate(open_[0]):
            return  # another metric's choice is at least as good as anything left here
        ev.run([(metric, p) for p in open_ if (metric, p) not in ev.known][:ev.batch])


def _first_feasible(ev: _Evaluations, metric: str, chains: list[list[tuple]]) -> None:
    """Locate the first feasible point of each monotone chain (along which the estimated ratio falls), evaluating
    per round the points spread evenly over the undecided stretches (at most `batch` a round, shared out among the
    chains that are not settled and could still beat the best feasible point found)."""
    bounds = [[-1, len(c)] for c in chains]  # c[lo] infeasible (or before the start), c[hi] feasible (or past it)
    while True:
        for b, chain in zip(bounds, chains):
            for t in range(b[0] + 1, b[1]):
                f = ev.feasible(metric, chain[t])
                if f is True:
                    b[1] = t
                    break
                if f is False:
                    b[0] = t
        # A chain whose best undecided point (its most aggressive) cannot beat the best feasible point found is
        # left undecided: its first feasible point would not be chosen.
        beat = -math.inf if ev.best is None else ev.estimate(ev.best[1])
        open_ = [(b, c) for b, c in zip(bounds, chains) if b[1] - b[0] > 1 and ev.estimate(c[b[0] + 1]) > beat]
        if not open_:
            return
        # More open chains than `batch`: this round takes the `batch` whose best undecided point is best.
        open_ = sorted(open_, key=lambda bc: -ev.estimate(bc[1][bc[0][0] + 1]))[:ev.batch]
        share = [ev.batch // len(open_) + (j < ev.batch % len(open_)) for j in range(len(open_))]
        picks = []
        for ((lo, hi), chain), m in zip(open_, share):
            gap = hi - lo - 1
            m = min(m, gap)
            picks += [(metric, chain[t]) for t in sorted({lo + 1 + (j * gap) // m + (gap // m) // 2
                                                          for j in range(m)})]
        ev.run(picks)


def search(
    evaluate: Callable[[list[QuantConfig]], list[tuple[float, Any]]],
    cube: Cube,
    metrics: Sequence[str],
    epsilon: float,
    batch: int,
    estimate: Callable[[tuple], float],
    previous: QuantConfig | str | None,
    switch_margin: float = 0.2,
    start: QuantConfig | None = None,
) -> Outcome:
    """Choose the configuration of one save (see the module docstring).

    Args:
      evaluate: maps candidates to (relative degradation, payload) each; inf or NaN is infeasible.
      cube: the space; metrics: the prune metrics to consider (one when there are no gradients).
      epsilon: largest accepted degradation; batch: candidates per round.
      estimate: estimated compression ratio of a cube point; it orders candidates only (it falls along the bins
        and protect axes, but not always along the prune axis: see the module docstring).
      previous: the previous save's configuration, LOSSLESS, or None (first save / no usable previous).
      switch_margin: the previous configuration switches prune metric when the other metric's degradation is
        lower by more than `switch_margin * epsilon`.
      start: where an exhaustive search starts (a closed-loop residual save: the previous residual save's
        choice), with `previous` None: the first round evaluates it and its neighbours one step along each
        axis, so that when the choice has not moved by more than a step, that round settles the search; the
        outcome is the exhaustive search's.
    """
    ev = _Evaluations(cube, evaluate, epsilon, batch, estimate)
    mode = "exhaustive"
    if previous == LOSSLESS:
        # A fallback is not permanent: one round checks the least aggressive configuration, and as soon as it
        # meets the budget the search starts afresh.
        ev.run([(m, cube.top) for m in metrics])
        if ev.best is None:
            return ev.outcome("lossless")
        previous, mode = None, "recovered"
    if previous is None:
        if start is not None:
            p = cube.point(start)
            near = {p} | {tuple(min(max(i + (j == axis) * d, 0), t) for j, (i, t) in enumerate(zip(p, cube.top)))
                          for axis in range(len(p)) for d in (-1, 1)}
            ev.run([(metrics[0], q) for q in sorted(near)])
        for metric in metrics:
            _exhaustive(ev, metric, tuple(0 for _ in cube.values))
        return ev.outcome(mode)

    p = cube.point(previous)
    metric = previous.prune_metric if previous.prune_metric in metrics else metrics[0]
    others = [m for m in metrics if m != metric]
    ev.run([(m, p) for m in [metric, *others]], keep_all=True)  # one round: the previous config, each metric
    for m in others:
        d_m, d_cur = ev.known[(m, p)], ev.known[(metric, p)]
        if d_m <= epsilon and (d_cur > epsilon or d_m < d_cur - switch_margin * epsilon):
            metric = m
    ev.best = (metric, p) if ev.known[(metric, p)] <= epsilon else None
    ev.payloads = {k: v for k, v in ev.payloads.items() if k == ev.best}
    if ev.best is not None:
        return ev.outcome("neighbourhood")  # the previous configuration still holds: keep it
    neighbours = [tuple(i + (j == axis) for j, i in enumerate(p)) for axis in range(len(p)) if p[axis] < cube.top[axis]]
    ev.run([(metric, q) for q in neighbours])
    if ev.best is not None:
        return ev.outcome("neighbourhood")
    for m in [metric, *others]:
        _exhaustive(ev, m, p)
    return ev.outcome("fallback")


# ---------------------------------------------------------------------------------------------- evaluation
@functools.partial(jax.jit, static_argnames=("masked",))
def _proxy_sums(xs, dequantized, gs, references, masked):
    """(numerator, denominator) of `proxy_degradation` over tensors on one device set, `masked` or plain
    (`quantize.error_sums`)."""
    num = den = jnp.float32(0)
    for x, d, g, r in zip(xs, dequantized, gs, references):
        n, m = quantize.error_sums(x, d, g, r, masked)
        num, den = num + n, den + m
    return num, den


def proxy_degradation(xs, dequantized, gs, references=None):
    """The data-free quality proxy: sum(g^2 (w - w_q)^2) / sum(g^2 (w - ref)^2) over all compressed tensors,
    with g = 1 where no gradient is given and ref = 0 where no reference is given (the weights' own energy; a
    closed-loop residual save's reference is the previous reconstruction, so the proxy is the share of the
    interval's change, plus the error carried in, that the save leaves out). g^2 weights the squared error like
    a diagonal Fisher (second-order) estimate of the loss change; non-finite weights are stored exactly and
    excluded. A float32 number, waited for: plain sums over every element, and the sums over the finite ones
    where a plain sum is not finite (`quantize.error_sums`)."""
    references = [None] * len(xs) if references is None else list(references)
    units = quantize.device_units(xs)  # one jitted call per device set

    def sums(masked: bool) -> tuple:
        parts = [_proxy_sums(*([a[i] for i in ix] for a in (xs, dequantized, gs, references)), masked=masked)
                 for ix in units]
        return tuple(np.float32(sum(float(v[k]) for v in parts)) for k in (0, 1))

    return np.float32(quantize.proxy_ratio(sums))


# Residual states of at least this many values score their uniform-cell candidates without encoding them
# (`Evaluator._uniform_residuals`). Below it the encodes are cheap and the scoring kernel's compile, once per
# process and state structure, costs more than they do (ad-hoc timings): 3.4 s for the 440k-parameter
# character transformer, whose four candidates' encodes take 0.03 s a save; a 10M-parameter state's take
# 0.35 s a save more than its scoring.
SCORED_WITHOUT_ENCODING = 1 << 22


class Evaluator:
    """The handler's `evaluate` callback for one save: encodes each candidate with the jitted encoder,
    dequantizes on device (exactly what a restore would give), and scores it with `eval_fn` on the state with
    the compressed leaves replaced, or with `proxy_degradation` when there is no eval_fn. The payload of a
    candidate is its encoder output (`quantize.DeviceCodes` per leaf), so the chosen one is saved as is. A
    closed-loop residual's candidates on uniform cells without an eval_fn (the default residual space's) are
    scored without encoding them where the state is large (`SCORED_WITHOUT_ENCODING`; `_uniform_residuals`) and
    carry no payload: at 100M parameters each encode cost about 2 s of a residual save's 11 s.

    Attributes:
      baseline: eval_fn of the uncompressed state at this step (None for the proxy).
      eval_calls: eval_fn calls made, the baseline included.
    """

    def __init__(self, leaves: list, treedef, quant_idx: Sequence[int], gs: Sequence, layer_types: Sequence[str],
                 cfg: CompressionConfig, eval_fn: Callable[[Any], Any] | None, offsets: Sequence | None = None,
                 residual: bool = False, factors: Sequence | None = None, keyframe_floor: bool = False,
                 scored: bool | None = None, reference=None):
        self.leaves, self.treedef, self.quant_idx = leaves, treedef, list(quant_idx)
        self.reference = reference  # a closed-loop residual's width reference (`quantize.residual_reference`)
        # Residual candidates on uniform cells scored without encoding them (`_uniform_residuals`): by default
        # where the state is large (`SCORED_WITHOUT_ENCODING`); a row-sampled evaluator of a large state says True.
        self.scored = sum(int(np.prod(leaves[i].shape)) for i in quant_idx) >= SCORED_WITHOUT_ENCODING \
            if scored is None else scored
        self.keyframe_floor = keyframe_floor  # every candidate must meet the data-free bound too (`trusted`)
        self.factors = factors  # a residual save's weighting (weighting.py), None: unweighted
        # The proxy's weights of a residual (scored without eval_fn): 1 / M (the squared error the weighted coding
        # spends evenly), else 1.
        self.residual_weights = None if not residual or eval_fn is not None else [None] * len(self.quant_idx) \
            if factors is None else quantize.map_by_device_set(weighting.inverse_multipliers, list(factors))
        self.xs = [leaves[i] for i in self.quant_idx]
        self.offsets = offsets
        self.references = list(offsets) if residual else None  # the proxy's reference (closed-loop residuals)
        self.gs, self.layer_types, self.cfg, self.eval_fn = list(gs), list(layer_types), cfg, eval_fn
        self.eval_calls = 0
        self.scores: dict[QuantConfig, float] = {}  # candidate -> degradation, of every call
        self.wholes: dict[QuantConfig, tuple] = {}  # candidate -> its `measure_whole`
        self.baseline: float | None = None  # measured with the first candidates
        self.values: list[float] = []  # every value eval_fn returned, the baseline first


    def _call(self, leaves):
        self.eval_calls += 1
        return self.eval_fn(jax.tree_util.tree_unflatten(self.treedef, leaves))

    def _score(self, value) -> float:
        arr = None if isinstance(value, (str, bytes, dict, list, tuple)) or value is None else np.asarray(value)
        if arr is None or arr.dtype.kind not in "iuf" or arr.size != 1:
            raise TypeError(f"eval_fn must return one real number (a loss, or an accuracy with "
                            f"CompressionConfig(higher_is_better=True)); it returned {str(value)[:80]!r} of type "
                            f"{type(value).__name__}")
        q = float(arr.reshape(()))
        self.values.append(q)
        return q

    def measure_baseline(self) -> float:
        """eval_fn of the uncompressed state at this step (once)."""
        if self.baseline is None:
            self.baseline = self._score(self._call(self.leaves))
        return self.baseline

    def degradation(self, q: float) -> float:
        """Relative degradation of quality `q` against the baseline (>0 is worse; inf for NaN)."""
        q0 = self.baseline
        if not math.isfinite(q):
            return math.inf
        worse = (q0 - q) if self.cfg.higher_is_better else (q - q0)
        if q0 == 0:
            return 0.0 if worse <= 0 else math.inf
        return worse / abs(q0)

    def __call__(self, quants: Sequence[QuantConfig]) -> list[tuple[float, list]]:
        """(degradation, payload) per candidate (each degradation also kept in `scores`)."""
        out = [(d, devs) for d, devs, _ in self._evaluate(quants, False)]
        self.scores.update((q, d) for q, (d, _) in zip(quants, out))
        return out

    def measure_whole(self, q: QuantConfig) -> tuple[float, list, list | None]:
        """One candidate encoded, even where residual candidates are otherwise scored without encoding (a sampled
        search's choice measured on the whole state: its encoding is then saved as is): (degradation, payload,
        its leaves dequantized where only the proxy saw them (no eval_fn), else None). Once per candidate: a
        second call returns the first's (`_kept_residual` measures the previous choice, which the search on row
        samples may then choose again)."""
        if q not in self.wholes:
            [self.wholes[q]] = self._evaluate([q], True)
        return self.wholes[q]

    def batched(self, quants: Sequence[QuantConfig]) -> bool:
        """Whether these candidates are scored together without encoding them (closed-loop residuals on uniform
        cells, nothing protected or pruned, in a state `scored`, no eval_fn: `_uniform_residuals`): a round of up
        to `cfg.search_batch` of them then costs what one does."""
        return self.eval_fn is None and self.references is not None and self.scored and all(
            q.step > 0 and not (q.protect_fraction or q.prune_fraction or q.rate) for q in quants)

    def _evaluate(self, quants: Sequence[QuantConfig], encode: bool) -> list[tuple[float, list | None, list | None]]:
        """(degradation, payload, dequantized leaves or None) per candidate: the dequantized leaves are kept where
        `encode` and nothing but the proxy read them."""
        if self.eval_fn is not None:
            self.measure_baseline()
        if not encode and self.batched(quants):
            return [(d, None, None) for d, _ in self._uniform_residuals(quants)]
        # Dispatch every candidate's encode first, then score them one by one (the proxy waits for its sums).
        sigma = None if self.references is None else quantize.RESIDUAL_SIGMA  # closed-loop residuals
        encoded = [quantize.encode_on_device(self.xs, self.gs, self.layer_types, q, self.cfg, offsets=self.offsets,
                                             sigma=sigma, factors=self.factors, reference=self.reference)
                   for q in quants]
        scores, proxies, kept = [], [], []
        for devs in encoded:
            deq = quantize.dequantize_all(devs, [x.dtype for x in self.xs])
            kept.append(deq if encode and self.eval_fn is None else None)
            if self.eval_fn is None:
                gs = self.gs if self.references is None else self.residual_weights
                scores.append(proxy_degradation(self.xs, deq, gs, self.references))
            else:
                leaves = list(self.leaves)
                for i, v in zip(self.quant_idx, deq):
                    leaves[i] = v
                scores.append(self._call(leaves))
                if self.references is None:  # not a closed-loop residual's check (`_guard`): one-sided, as measured
                    # The data-free proxy `trusted` may need: computed now at a keyframe (it always needs it),
                    # otherwise only for a reading better than epsilon.
                    proxies.append(proxy_degradation(self.xs, deq, self.gs) if self.keyframe_floor else
                                   functools.partial(proxy_degradation, self.xs, deq, self.gs))
        if self.eval_fn is None:
            return [(float(s), devs, deq) for s, devs, deq in zip(scores, encoded, kept)]
        out = [self.degradation(self._score(s)) for s in scores]
        if proxies:
            out = [self.trusted(d, p) for d, p in zip(out, proxies)]
        return list(zip(out, encoded, kept))

    def _uniform_residuals(self, quants: Sequence[QuantConfig]) -> list[tuple[float, None]]:
        """Closed-loop residual candidates on uniform cells (a residual space's), scored by the proxy without
        encoding them (`quantize.uniform_residual_scores`: the histograms once, then one pass per candidate);
        the chosen one is encoded when it is saved (no payload). Padded to `cfg.search_batch` candidates, so
        rounds of any size run one compiled kernel."""
        padded = list(quants) + [quants[-1]] * (self.cfg.search_batch - len(quants))
        scores = quantize.uniform_residual_scores(self.xs, self.offsets, self.factors, self.layer_types, padded,
                                                  self.cfg, self.reference)
        return [(float(s), None) for s in np.asarray(scores)[:len(quants)]]  # one transfer for the round

    def trusted(self, d: float, proxy) -> float:
        """A candidate's degradation as the search takes it: the eval_fn's `d`, unless the data-free proxy
        (`proxy_degradation`, the weights' sensitivity-weighted relative error) exceeds
        `cfg.effective_proxy_budget` where it applies; then inf (infeasible, as for a non-finite reading). It
        applies

        - to a keyframe of a closed-loop chain (`keyframe_floor`): the eval_fn may refuse what the bound allows,
          never allow more. A restore from a keyframe costs about twice what one from a residual save costs
          (benchmarks/results/fidelity_charlm_keyframes.md), keyframes are one save in `keyframe_every`, and an
          eval_fn may not see a coarse candidate's damage: the batch-normalized network's held-out loss took a
          4-level keyframe 50 steps in, and the resume from it cost 2.5% of the training loss; an accuracy moves
          far less than the loss (docs/results.md);
        - to any other save's candidate that reads better than the uncompressed state by more than epsilon:
          quantization rarely improves a model that much, and such a reading is what a coarse candidate gets from
          an eval_fn that a perturbation of the weights moves a lot (the same network's first keyframe took 4
          levels on a reading 8.97% better; benchmarks/results/fidelity_details.md)."""
        if not self.keyframe_floor and d >= -self.cfg.epsilon:
            return d
        p = float(proxy() if callable(proxy) else proxy)
        return d if p <= self.cfg.effective_proxy_budget else math.inf


def width_reference(leaves, quant_idx, offsets, factors, cfg: CompressionConfig, uniform: bool) -> np.ndarray | None:
    """The width reference (`quantize.residual_reference`) of a closed-loop residual save whose cells are uniform
    (`uniform`), else None: every candidate of its search and the encoding of its choice take this one number.
    Where the search takes row samples, `choose` passes the samples (`_row_samples`): their RMS, not one more pass
    over every value of a large state (a sampled tensor counts by its sample, so small tensors weigh more than in
    the whole state's RMS)."""
    if not uniform:
        return None
    return quantize.residual_reference([leaves[i] for i in quant_idx], offsets, factors, cfg.residual_width_power)


def choose(leaves: list, treedef, quant_idx: Sequence[int], gs: Sequence, layer_types: Sequence[str],
           cfg: CompressionConfig, eval_fn, previous: QuantConfig | str | None,
           offsets: Sequence | None = None, residual: bool = False,
           factors: Sequence | None = None, hint: dict | None = None) -> tuple[Outcome, dict]:
    """Run the search for one save; returns the outcome and its record for the manifest (chosen
    configuration, measured degradation, how it was measured, candidates, eval_fn calls, seconds).
    `offsets` (per quantized leaf, None or its base weight) are passed to the encoder: those leaves are
    encoded as residuals and scored as base + decoded residual.

    `residual`: a closed-loop residual save (`offsets` are the previous reconstruction). Its search runs over
    `cfg.residual_space` with the data-free proxy against the residual (`proxy_degradation` with the offsets
    as references, weighted by `factors`: weighting.py) under `cfg.effective_residual_budget`: no eval_fn call
    per candidate. With an eval_fn, the chosen
    candidate is then measured once; if it degrades by more than `cfg.epsilon`, the most aggressive of the less
    aggressive configurations (finer ones beyond the space included) the eval_fn reads within it is taken
    (`_guard`). A residual save is never lossless: when no configuration of the space meets the budget, finer
    levels do (mode "finer"), or the finest is taken (mode "least aggressive"; `_finer_residual`). Any
    other save whose search space has nothing within its budget tries a fine uniform quantizer before the
    parameters are stored losslessly (`_fine_keyframe`). With an eval_fn, a candidate's degradation is the
    eval_fn's reading unless the data-free bound applies and it fails it (`Evaluator.trusted`: a closed-loop
    keyframe, or a reading better than the uncompressed state by more than epsilon): the eval_fn can then refuse
    what the bound allows, never allow more.

    A large state's residual save (searched on row samples) records, in the record's "wider", how many times its
    choice's error the next wider cells' was on the samples (`_wider_ratio`) and how many saves ago it was
    measured; the next residual save passes it back as `hint` and keeps the previous choice where one
    measurement on the whole state shows the search could only come back to it (`_kept_residual`).

    An eval_fn value that is not a real number is a TypeError. A non-finite value for the uncompressed state
    gives mode UNMEASURED (nothing evaluated; the caller stores this save losslessly); one for a candidate makes
    that candidate infeasible. An eval_fn that returns the same value for every state, or that improves
    a lot under quantization (a loss with higher_is_better=True, or the reverse), gets a warning."""
    t0 = time.perf_counter()
    space = cfg.residual_space if residual else cfg.search_space
    has_grads = any(g is not None for g in gs)
    metrics = tuple(space.prune_metrics) if has_grads else (
        ("magnitude",) if "magnitude" in space.prune_metrics else tuple(space.prune_metrics[:1]))
    cube = Cube.build(space, "embedding" in layer_types, cfg.quant, residual=residual)
    sizes: dict[str, int] = {}
    bits: dict[str, int] = {}
    for i, lt in zip(quant_idx, layer_types):
        sizes[lt] = sizes.get(lt, 0) + int(np.prod(leaves[i].shape))
        bits[lt] = 8 * jnp.dtype(leaves[i].dtype).itemsize
    keyframe = cfg.closed_loop and not residual and all(o is None for o in offsets or ())  # not against a base
    samples = (residual or (eval_fn is None and previous is None)) and _takes_samples(leaves, quant_idx, factors)
    # the row samples of a large state, taken once: the width reference's and the sampled search's
    small, small_offsets = _row_samples(leaves, quant_idx, offsets) if samples else (leaves, offsets)
    reference = width_reference(small, quant_idx, small_offsets, factors, cfg, residual and any(space.steps))
    evaluator = Evaluator(leaves, treedef, quant_idx, gs, layer_types, cfg, None if residual else eval_fn,
                          offsets=offsets, residual=residual, factors=factors, keyframe_floor=keyframe,
                          reference=reference)
    budget = cfg.effective_residual_budget if residual else cfg.epsilon if eval_fn is not None \
        else cfg.effective_proxy_budget
    checker = Evaluator(leaves, treedef, quant_idx, gs, layer_types, cfg, eval_fn, offsets=offsets, residual=True,
                        factors=factors, reference=reference) \
        if residual and eval_fn is not None else evaluator
    proxy = sampled = kept = wider = None
    if eval_fn is not None and not math.isfinite(checker.measure_baseline()):
        outcome = Outcome(None, 0.0, UNMEASURED)
    else:
        def run_search(ev: Evaluator, start: QuantConfig | None) -> Outcome:
            return search(ev, cube, metrics, budget, cfg.search_batch,
                          lambda p: estimated_ratio(cube.config(p, metrics[0]), sizes, bits),
                          None if residual else previous, cfg.metric_switch_margin, start=start)

        def searched(ev: Evaluator, start: QuantConfig | None) -> Outcome:
            outcome = run_search(ev, start)
            if residual and outcome.quant is None:
                # Nothing met residual_budget: finer cells than the space holds, the first that meets it, else
                # the finest; never lossless (its error is a fraction of one interval's change and the next save
                # carries it; a lossless save costs the whole tensor, 16 times an average save of the character
                # transformer's fidelity run).
                outcome = _finer_residual(ev, outcome, budget, cube, metrics[0], cfg.bins_capacity)
            return outcome

        start = previous if residual and isinstance(previous, QuantConfig) else None
        if samples and start is not None:  # a large state's residual save: the previous choice may still be it
            kept = _kept_residual(evaluator, cube, start, metrics[0], budget, hint)
        if kept is not None:
            outcome = kept
        elif not samples:
            outcome = searched(evaluator, start)
        else:  # a large state's first search, or residual save: on row samples, then the choice measured whole
            # (a residual space of one axis: its less aggressive rungs after it, where it fails the budget)
            sampled = _sampled_evaluator(small, treedef, quant_idx, gs, layer_types, cfg, small_offsets, keyframe,
                                         residual, reference)
            ladder = functools.partial(_ladder, cube, metric=metrics[0], capacity=cfg.bins_capacity) \
                if residual and sum(len(v) > 1 for v in cube.values) <= 1 else None
            outcome = _measured_whole(evaluator, searched(sampled, start), budget, searched, ladder)
            ratio = _wider_ratio(sampled, cube, outcome.quant, metrics[0]) if residual else None
            wider = None if ratio is None else {"ratio": ratio, "saves": 0}
            if start in evaluator.wholes and outcome.quant != start:  # the previous choice's measurement, not used
                outcome = dataclasses.replace(outcome, evaluations=outcome.evaluations + 1,
                                              rounds=outcome.rounds + 1)
        top = cube.config(cube.top, metrics[0])  # the space's least aggressive configuration
        if not residual and outcome.quant is None:
            outcome = _fine_keyframe(evaluator, outcome, budget, top)
        if checker is not evaluator:
            proxy = outcome.degradation
            outcome = _guard(checker, outcome, cube, metrics[0], cfg.epsilon, cfg.bins_capacity)
        _check_eval_fn(checker, cfg.epsilon if eval_fn is not None else budget)
    outcome = dataclasses.replace(outcome, reference=reference)
    record = {
        "mode": outcome.mode,
        "quality": ("eval_fn, " + ("higher is better" if cfg.higher_is_better else "lower is better")
                    + (f", within the data-free bound {cfg.effective_proxy_budget:g} (a closed-loop keyframe)"
                       if keyframe else ""))
        if eval_fn is not None and not residual else
        "data-free proxy: sensitivity-weighted relative reconstruction error" + (
            " of the residual" + (" (weighted by the second moments)" if factors is not None else "")
            + (", the choice checked with eval_fn" if eval_fn is not None else "")
            if residual else ""),
        "budget": budget,
        "baseline": checker.baseline if checker.baseline is None or math.isfinite(checker.baseline)
        else str(checker.baseline),
        "degradation": outcome.degradation,
        "chosen": LOSSLESS if outcome.quant is None else dataclasses.asdict(outcome.quant),
        "candidates": outcome.evaluations,
        "rounds": outcome.rounds,
        "eval_fn_calls": checker.eval_calls,
        "prune_metrics": list(metrics),
        "seconds": time.perf_counter() - t0,
    }
    if proxy is not None:
        record["proxy"] = proxy
        record["epsilon"] = cfg.epsilon
    if kept is not None and hint is not None:
        wider = {"ratio": hint["ratio"], "saves": hint["saves"] + 1}
    if wider is not None:
        record["wider"] = wider
    if kept is not None:
        record["sampled"] = ("the previous choice measured on the whole state and kept: within the budget, and the "
                             "next wider cells' error, predicted from the ratio the last search on row samples "
                             "measured ('wider'), over it")
    elif sampled is not None:
        record["sampled"] = (f"candidates measured on row samples of the tensors of more than {SEARCH_SAMPLE:,} "
                             "values, the choice on the whole state")
    return outcome, record


# A search without eval_fn and without a previous choice (a first keyframe), and the search of a closed-loop
# residual save (always data-free), over a state of at least `SCORED_WITHOUT_ENCODING` values evaluates its
# candidates on row samples of the tensors of more than `SEARCH_SAMPLE` values (`_sampled_evaluator`): at 100M
# parameters each of the ~40 candidates of an exhaustive search is an encode of the whole state (about 2 s on 2
# CPU cores), and scoring a residual save's four candidates without encoding them took 1.3-1.9 s, more than
# encoding the chosen one (the kernel writes each candidate's squared error out before summing it: XLA's CPU
# backend does not fuse these reductions). The proxy is a ratio of sums over elements, which about a million
# values a tensor estimate within a fraction of a percent; the choice is then encoded and measured whole.
SEARCH_SAMPLE = 1 << 20
# A large state's residual save keeps its previous choice after one measurement on the whole state
# (`_kept_residual`) at most this many saves after a search measured how much more error the next wider cells have,
# and only where that prediction puts them over the budget by this factor. The ratio moves from one save to the
# next; a prediction that is wrong costs bytes, never quality: the save keeps cells one step finer than the search
# would have taken, within the budget, for at most this many saves.
KEPT_AT_MOST = 3
KEPT_MARGIN = 1.05


def _row_sample(x: jax.Array | None) -> jax.Array | None:
    """Every k-th row (leading index) of `x`, k the smallest that leaves at most about `SEARCH_SAMPLE` values;
    `x` itself when it has no more."""
    if x is None or x.ndim == 0 or x.size <= SEARCH_SAMPLE:
        return x
    per_row = x.size // x.shape[0]
    k = -(-x.shape[0] // max(1, SEARCH_SAMPLE // max(per_row, 1)))
    return x[::k]


def _takes_samples(leaves, quant_idx, factors) -> bool:
    """Whether a search of these leaves runs on row samples (`_sampled_evaluator`): not where the state is below
    `SCORED_WITHOUT_ENCODING` values, has no tensor to sample, is a weighted residual (its factors are per axis),
    or spans several processes (whose searches must agree: the exact search there)."""
    xs = [leaves[i] for i in quant_idx]
    return not (sum(int(np.prod(x.shape)) for x in xs) < SCORED_WITHOUT_ENCODING or
                all(int(np.prod(x.shape)) <= SEARCH_SAMPLE for x in xs) or
                (factors is not None and any(f is not None for f in factors)) or
                not all(getattr(x, "is_fully_addressable", True) for x in xs))


def _row_samples(leaves, quant_idx, offsets) -> tuple[list, list | None]:
    """(the leaves with the quantized ones row-sampled, the offsets row-sampled) (`_row_sample`)."""
    small = list(leaves)
    for i in quant_idx:
        small[i] = _row_sample(leaves[i])
    return small, None if offsets is None else [_row_sample(o) for o in offsets]


def _sampled_evaluator(small, treedef, quant_idx, gs, layer_types, cfg, small_offsets, keyframe,
                       residual: bool = False, reference=None) -> "Evaluator":
    """An `Evaluator` (data-free proxy) of row-sampled leaves and offsets (`_row_samples`), their gradients
    sampled alike (a closed-loop residual save's candidates scored without encoding them, with the whole state's
    width `reference`), for a state that `_takes_samples`."""
    return Evaluator(small, treedef, quant_idx, [_row_sample(g) for g in gs], layer_types, cfg, None,
                     offsets=small_offsets, residual=residual, keyframe_floor=keyframe,
                     scored=True if residual else None, reference=reference)


def _measured_whole(evaluator: "Evaluator", sampled: Outcome, budget: float, run_search,
                    ladder: Callable | None = None) -> Outcome:
    """The sampled search's choice encoded and measured on the whole state (the outcome carries that
    measurement and encoding); when the whole state's proxy exceeds `budget` after all, the exact search runs,
    starting from that choice (`search`'s `start`), or, given `ladder` (a configuration -> the less aggressive
    ones after it, most aggressive first: `_ladder` of a residual space of one axis, along which the exact search
    could only go), the first of its rungs within the budget on the whole state (mode "ladder"; `_first_within`,
    rounds of `search_batch` where the evaluator scores them together; where none is, the one of least error
    measured, mode "least aggressive"). Nothing feasible on the samples: the exact search decides. A residual save's finest levels (mode "least
    aggressive": nothing within the budget on the samples, not even the finest cells `_finer_residual` offers)
    are kept as measured whole: the exact search could only end at the same finest cells, after scoring the
    whole state's candidates one ladder at a time."""
    if sampled.quant is None:
        return run_search(evaluator, None)
    d, payload, decoded = evaluator.measure_whole(sampled.quant)
    if d <= budget or sampled.mode == "least aggressive":
        mode = "finer" if sampled.mode == "least aggressive" and d <= budget else sampled.mode
        return dataclasses.replace(sampled, degradation=d, mode=mode, evaluations=sampled.evaluations + 1,
                                   rounds=sampled.rounds + 1, payload=payload, decoded=decoded)
    if ladder is not None:
        rungs = ladder(sampled.quant)
        k, within, measured, rounds = _first_within(
            evaluator, rungs, budget, below=(d, payload),
            per_round=evaluator.cfg.search_batch if evaluator.batched(rungs) else 1)
        return Outcome(sampled.quant if k == -1 else rungs[k], measured[k][0],
                       "ladder" if within else "least aggressive", sampled.evaluations + len(measured),
                       sampled.rounds + 1 + rounds, measured[k][1], decoded if k == -1 else None)
    exact = run_search(evaluator, sampled.quant)
    return dataclasses.replace(exact, evaluations=exact.evaluations + sampled.evaluations + 1,
                               rounds=exact.rounds + sampled.rounds + 1)


def _step_axis(cube: Cube, q: QuantConfig, metric: str) -> int | None:
    """The axis of a residual space that varies the cells' width alone (the default's), where `q` is a point of
    it; else None."""
    varying = [a for a, v in enumerate(cube.values) if len(v) > 1]
    if [cube.names[a] for a in varying] != ["step"] or cube.config(cube.point(q), metric) != q:
        return None
    return varying[0]


def _wider_ratio(ev: "Evaluator", cube: Cube, q: QuantConfig | None, metric: str) -> float | None:
    """How many times `q`'s error the next wider cells' is, as `ev` scored both (a residual save's search on
    row samples scores a choice's neighbours in its first round), or None where it did not (or `q` has the
    widest cells of the space, or no error)."""
    axis = None if q is None else _step_axis(cube, q, metric)
    if axis is None or cube.point(q)[axis] == 0:
        return None
    wider = dataclasses.replace(q, step=cube.values[axis][cube.point(q)[axis] - 1])
    d, d_wider = ev.scores.get(q), ev.scores.get(wider)
    if d is None or d_wider is None or not 0 < d < math.inf or not math.isfinite(d_wider):
        return None
    return d_wider / d


def _kept_residual(evaluator: "Evaluator", cube: Cube, start: QuantConfig, metric: str, budget: float,
                   hint: dict | None) -> Outcome | None:
    """A large state's closed-loop residual save whose previous choice `start` may still be its choice, decided
    with one measurement on the whole state instead of a search on row samples and a measurement of its choice
    (at 10M parameters the samples are a third of the state; benchmarks/results/residual_tails_kept.md times
    both). The residual space varies the cells' width alone (the default's): `start` is kept (mode "kept") where
    it is within `budget` and its more aggressive neighbour (the next wider cells) is predicted over it by
    `KEPT_MARGIN`: `start`'s error times `hint["ratio"]`, how many times its error the wider cells' was when a
    search last scored both (`_wider_ratio`), at most `KEPT_AT_MOST` saves ago (`hint["saves"]`); the search
    would then have come back to `start`. The widest
    cells of the space are kept wherever they are within the budget. Returns that outcome, or None where the
    search is to run (which finds `start`'s measurement in the evaluator, where one was made)."""
    axis = _step_axis(cube, start, metric)
    if axis is None:
        return None  # another residual space, or finer cells than it holds
    widest = cube.point(start)[axis] == 0
    if not widest and (hint is None or hint["saves"] >= KEPT_AT_MOST):
        return None
    d, payload, decoded = evaluator.measure_whole(start)
    if not d <= budget or not (widest or d * hint["ratio"] > budget * KEPT_MARGIN):
        return None  # the search decides
    return Outcome(start, d, "kept", 1, 1, payload, decoded)


def _ladder(cube: Cube, q: QuantConfig, metric: str, capacity: int) -> list[QuantConfig]:
    """The residual configurations less aggressive than `q`, most aggressive first: the points of the residual
    space from `q`'s towards its least aggressive corner (every axis one step at a time), then finer levels than
    the space holds (`_finer` of that corner by 2 and 4, up to the encoder's `capacity`). `q` beyond the space (a
    finer one already): the finer ones after it."""
    top = cube.config(cube.top, metric)
    point, inside = cube.point(q), []
    while point != cube.top:
        point = tuple(min(i + 1, t) for i, t in zip(point, cube.top))
        inside.append(cube.config(point, metric))
    ladder = inside + [_finer(top, f) for f in (2, 4) if top.rate or top.step or top.bins * f <= capacity]
    return ladder[ladder.index(q) + 1:] if q in ladder else ladder


def _first_within(measure: Callable, ladder: Sequence[QuantConfig], budget: float,
                  below: tuple[float, Any] | None = None, per_round: int = 1) -> tuple[int, bool, dict, int]:
    """The most aggressive rung of `ladder` (ordered from most to least aggressive; its quality assumed to rise
    along it) that `measure` (configurations -> a (degradation, payload) each) finds within `budget`, by a search
    that measures `per_round` rungs a round, spread evenly over the undecided stretch (1: bisection; more where a
    round of several costs one call: `Evaluator.batched`). `below`: the (degradation, payload) of what comes
    before the ladder (measured over the budget), index -1. Returns (the index to take: that rung, or where none
    is within, the measured one of least degradation; whether it is within; index -> (degradation, payload) of
    every rung measured, `below` included; rounds). About log_(per_round + 1)(len + 1) rounds, where a walk up
    the ladder took up to its length; where the measure is not monotone (an eval_fn's reading of small
    perturbations), it ends at a rung within the budget whose more aggressive neighbour measured over it."""
    lo, hi, measured = -1, len(ladder), ({} if below is None else {-1: below})
    rounds = 0

    def chosen() -> int:
        return hi if hi < len(ladder) else min(measured, key=lambda i: (measured[i][0], -i))

    while hi - lo > 1:
        m = min(per_round, hi - lo - 1)
        picks = sorted({lo + (j + 1) * (hi - lo) // (m + 1) for j in range(m)})  # m = 1: (lo + hi) // 2
        for i, got in zip(picks, measure([ladder[i] for i in picks])):
            measured[i] = got
        rounds += 1
        within = [i for i in picks if measured[i][0] <= budget]
        hi = within[0] if within else hi
        lo = max([lo] + [i for i in picks if i < hi])  # every pick before the first within is over the budget
        # Only the payload that can still be chosen is kept (a state's encoded arrays each).
        keep = chosen()
        measured = {i: (d, p if i == keep else None) for i, (d, p) in measured.items()}
    return chosen(), hi < len(ladder), measured, rounds


def _finer_residual(evaluator: "Evaluator", outcome: Outcome, budget: float, cube: Cube, metric: str,
                    capacity: int) -> Outcome:
    """A closed-loop residual save whose space has nothing within `residual_budget` (a tight epsilon asks for less
    error than the space's finest cells give: at epsilon 0.002 the budget is 0.04 of the residual's squared
    error, cells of 1 RMS leave about 0.08): finer levels than the space holds (`_ladder`), the most aggressive
    within `budget` (mode "finer"); where none is, the one of least error (mode "least aggressive"; the space's
    least aggressive configuration where the encoder holds no finer levels)."""
    top = cube.config(cube.top, metric)  # measured by the search, over the budget
    ladder = _ladder(cube, top, metric, capacity) or [top]
    k, within, measured, rounds = _first_within(evaluator, ladder, budget,
                                                per_round=evaluator.cfg.search_batch if evaluator.batched(ladder)
                                                else 1)
    mode = "finer" if within and ladder[k] != top else "least aggressive"
    return Outcome(ladder[k], measured[k][0], mode, outcome.evaluations + len(measured),
                   outcome.rounds + rounds, measured[k][1])


def _guard(checker: "Evaluator", outcome: Outcome, cube: Cube, metric: str, epsilon: float,
           capacity: int) -> Outcome:
    """A residual save's choice measured with the eval_fn (its `degradation` becomes the measured one); over
    `epsilon`, the most aggressive of the less aggressive residual configurations (`_ladder`: the space's, then
    finer levels beyond it) that the eval_fn reads within `epsilon`, found by bisection (`_first_within`; mode
    "guarded"). When none is, the best measured is taken, never lossless: its error is a fraction of one
    interval's change and the next save's residual carries it, whereas a lossless save costs the whole tensor (and
    on a small loss, eval_fn differences of that size may be noise). The finer levels serve the saves where one
    interval's change is large against what the model tolerates: early in a fine-tune of a recurrent network, a
    residual at 8 levels cost 5% of the loss. Not a jump to the least aggressive configuration: an eval_fn's
    reading of a small perturbation is not monotone in its size (a ResNet's held-out loss read cells of 4 RMS
    over 5% and cells of 1 RMS 12% better than the uncompressed state), and such jumps wrote 69% of the
    parameter bytes of its loosest setting (docs/results.md)."""
    if outcome.quant is None:
        return outcome
    [first] = checker([outcome.quant])
    evaluations, rounds = outcome.evaluations + 1, outcome.rounds + 1
    if first[0] <= epsilon:
        return Outcome(outcome.quant, first[0], outcome.mode, evaluations, rounds, first[1])
    ladder = _ladder(cube, outcome.quant, metric, capacity)
    k, _, measured, more_rounds = _first_within(checker, ladder, epsilon, below=first)
    return Outcome(outcome.quant if k == -1 else ladder[k], measured[k][0], "guarded" if ladder else outcome.mode,
                   evaluations + len(measured) - 1, rounds + more_rounds, measured[k][1])


FINE_KEYFRAME_BINS = quantize.UNIFORM_SLOTS  # the most levels a uint8 code holds beside pruned and protected
FINE_KEYFRAME_STEPS = (0.125, 0.05)  # cells of the fallback's uniform quantizer, times the tensor's RMS


def _fine_keyframe(evaluate: "Evaluator", outcome: Outcome, budget: float, top: QuantConfig) -> Outcome:
    """When no configuration of the search space meets the budget, the entropy-coded uniform quantizer
    (QuantConfig.step) at `FINE_KEYFRAME_BINS` cells, first of 1/8 then of 1/20 of each tensor's RMS (range
    +-16 and +-6 RMS, the outer cells taking what lies beyond; `top`'s protect fraction keeps the largest
    weights exact), each measured like any candidate, before the parameters are stored losslessly (mode
    "fine"). A cell's uniform error is step / sqrt(12): 3.6% or 1.4% of a weight's RMS. Measured: a pretrained
    character LSTM fine-tuned under epsilon 0.01, whose first save met no configuration of the paper's space (32
    levels at most), stored it in 1.6 MB lossless (half of its run's parameter bytes) and takes 308 kB (about 5.3
    bits a parameter) at 1/8 (docs/results.md). Closed loop, the next saves' residuals refine it like any keyframe."""
    evaluations, rounds = outcome.evaluations, outcome.rounds
    for step in FINE_KEYFRAME_STEPS:
        q = dataclasses.replace(top, bins=FINE_KEYFRAME_BINS, embedding_bins=FINE_KEYFRAME_BINS, prune_fraction=0.0,
                                step=step)
        [(d, payload)] = evaluate([q])
        evaluations, rounds = evaluations + 1, rounds + 1
        if math.isfinite(d) and d <= budget:
            return Outcome(q, d, "fine", evaluations, rounds, payload)
    return dataclasses.replace(outcome, evaluations=evaluations, rounds=rounds)


def _finer(q: QuantConfig, factor: int) -> QuantConfig:
    """`q` with `factor` times its levels (its embedding tables' too, at least as many as the others); for the
    uniform quantizer a step `factor` times smaller over the same range ((bins - 1) * factor + 1 cells, odd
    stays odd: a cell centred on 0; at most `FINE_KEYFRAME_BINS`, the odd count below it); entropy-constrained
    levels keep their number and take a code-length weight `factor`^2 times smaller."""
    if q.rate:  # entropy-constrained levels: a weight `factor`^2 times smaller (about that much less error)
        return dataclasses.replace(q, rate=q.rate / factor ** 2)
    if q.step:
        bins = min((q.bins - 1) * factor + 1, FINE_KEYFRAME_BINS - 1 + FINE_KEYFRAME_BINS % 2)
        return dataclasses.replace(q, bins=bins, embedding_bins=bins, step=q.step / factor)
    bins = q.bins * factor
    return dataclasses.replace(q, bins=bins, embedding_bins=max(bins, q.embedding_bins),
                               step=q.step / factor if q.step else q.step)


def _check_eval_fn(evaluator: Evaluator, budget: float) -> None:
    """Warn about an eval_fn whose values cannot be what the search needs (see `choose`)."""
    values = evaluator.values
    if evaluator.eval_fn is None or len(values) < 3:
        return
    if all(v == values[0] for v in values):
        warnings.warn(f"eval_fn returned exactly {values[0]!r} for the uncompressed state and for all "
                      f"{len(values) - 1} candidates of this save: it does not seem to depend on the state it is "
                      "given (does it use the live parameters instead of its argument?). The search then takes "
                      "the most compressive configuration.", stacklevel=5)
        return
    best = min(evaluator.degradation(v) for v in values[1:])
    if best < -max(2 * budget, 0.1):
        warnings.warn(f"a quantized candidate measured {-best:.0%} better than the uncompressed state on "
                      f"eval_fn; quantization rarely improves quality that much. Is the direction right "
                      f"(CompressionConfig.higher_is_better={evaluator.cfg.higher_is_better})?", stacklevel=5)
