"""Configuration: one quantization configuration, and every knob of the method.

`QuantConfig` is one point of the search space of ALGORITHM.md step 5 (what the search picks at each
checkpoint). `CompressionConfig` holds the method's fixed parameters with the paper's defaults. Both are
frozen dataclasses, so they are hashable and can be static arguments of jitted functions.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

PRUNE_METRICS = ("magnitude", "sensitivity")
LAYER_TYPES = ("conv", "attention", "dense", "embedding", "other")
PROTECTED_DTYPES = ("bfloat16", "float32")
POLICIES = ("lossless", "quantize", "drop")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """One quantization configuration, applied to every compressed tensor of a checkpoint.

    Attributes:
      bins: number of quantization levels K for ordinary layers (any K in [2, 254]).
      embedding_bins: K for embedding tables (the paper searches {16, 32} for them).
      prune_fraction: fraction of the prunable weights of each layer type set to exactly 0.
      prune_metric: "magnitude" (|w|) or "sensitivity" (|g_ema * w|): which score ranks weights for pruning.
      protect_fraction: weights whose magnitude OR sensitivity is in the top `protect_fraction` of their
        tensor are kept near-exact.
      step: 0 (the paper's levels: weighted k-means with K levels), or the levels of an entropy-coded uniform
        quantizer: K cells of width `step` times the RMS of the tensor's quantized values, -M..K-1-M with
        M = (K - 1) // 2 (centred on 0 for odd K; values beyond go to the outer cells), each cell's level its
        centre (the two outer cells': the mean of their values; `quantize.uniform_levels` says why not every
        cell's mean). K then only bounds the range; the step sets the error and the bits: at the same squared error,
        its codes take about 10% fewer bits than k-means levels, whose K near-equally used levels cost about
        log2 K bits (benchmarks/results/residual_coding.md). `RESIDUAL_SPACE`, the closed-loop residuals' default
        space, is this quantizer's.
      rate: 0, or entropy-constrained levels (an entropy-constrained scalar quantizer): a zero level (code 0, as a
        pruned weight; for a closed-loop residual, the weight keeps its previous value) and `bins` others (even),
        fitted so that each value takes the level of least squared error plus `rate` times the mean square of its
        layer type's values times the level's code length in bits. Larger: fewer bits, more error. At the same
        squared error its codes have about 20% less order-0 entropy than k-means levels of a closed-loop
        residual (benchmarks/results/residual_coding.md); the prune fraction is then unused. Not with `step`.
    """

    bins: int = 16
    embedding_bins: int = 32
    prune_fraction: float = 0.0
    prune_metric: str = "magnitude"
    protect_fraction: float = 0.005
    step: float = 0.0
    rate: float = 0.0

    def __post_init__(self):
        for name in ("bins", "embedding_bins"):
            k = getattr(self, name)
            if not isinstance(k, int) or not 2 <= k <= 254:
                raise ValueError(f"QuantConfig.{name} must be an int in [2, 254] (codes are uint8), got {k!r}")
        if not 0.0 <= self.prune_fraction < 1.0:
            raise ValueError(f"QuantConfig.prune_fraction must be in [0, 1), got {self.prune_fraction!r}")
        if not 0.0 <= self.protect_fraction <= 1.0:
            raise ValueError(f"QuantConfig.protect_fraction must be in [0, 1], got {self.protect_fraction!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, numbers.Real) or not 0.0 <= self.step < math.inf:
            raise ValueError(f"QuantConfig.step must be a finite real >= 0 (0: k-means levels), got {self.step!r}")
        if isinstance(self.rate, bool) or not isinstance(self.rate, numbers.Real) or not 0.0 <= self.rate < math.inf:
            raise ValueError(f"QuantConfig.rate must be a finite real >= 0 (0: not entropy-constrained), got "
                             f"{self.rate!r}")
        if self.rate > 0 and (self.step > 0 or self.bins % 2 or self.embedding_bins % 2):
            raise ValueError(f"QuantConfig.rate > 0 (entropy-constrained levels) needs even bins and embedding_bins "
                             f"and no uniform step, got bins={self.bins}, embedding_bins={self.embedding_bins}, "
                             f"step={self.step}")
        if self.prune_metric not in PRUNE_METRICS:
            raise ValueError(f"QuantConfig.prune_metric must be one of {PRUNE_METRICS}, got {self.prune_metric!r}")

    def bins_for(self, layer_type: str) -> int:
        """The number of levels used for a tensor of `layer_type`."""
        return self.embedding_bins if layer_type == "embedding" else self.bins


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The values the configuration search may pick for each knob (ALGORITHM.md step 5; the paper's sets).

    216 configurations per embedding-bins value: 6 bin counts x 6 prune fractions x 3 protect fractions x
    2 prune metrics. The order given does not matter; the search orders each axis from most to least
    aggressive itself. `embedding_bins` is searched only when the state has embedding tables. `steps`: the
    uniform quantizer's steps (QuantConfig.step; larger is more aggressive), or (0.0,) for k-means levels.
    `rates`: the code-length weights of entropy-constrained levels (QuantConfig.rate; larger is more aggressive),
    or (0.0,).
    """

    bins: tuple[int, ...] = (4, 6, 8, 12, 16, 32)
    embedding_bins: tuple[int, ...] = (16, 32)
    prune_fractions: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
    protect_fractions: tuple[float, ...] = (0.0005, 0.005, 0.01)
    prune_metrics: tuple[str, ...] = ("magnitude", "sensitivity")
    steps: tuple[float, ...] = (0.0,)
    rates: tuple[float, ...] = (0.0,)

    def __post_init__(self):
        for name in ("bins", "embedding_bins", "prune_fractions", "protect_fractions", "prune_metrics", "steps",
                     "rates"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not values or len(set(values)) != len(values):
                raise ValueError(f"SearchSpace.{name} must be a non-empty tuple of distinct values, got {values!r}")
        # Every point of the space must be a valid QuantConfig.
        QuantConfig(bins=max(self.bins), embedding_bins=max(self.embedding_bins))
        QuantConfig(bins=min(self.bins), embedding_bins=min(self.embedding_bins))
        for f in self.prune_fractions:
            QuantConfig(prune_fraction=f)
        for f in self.protect_fractions:
            QuantConfig(protect_fraction=f)
        for m in self.prune_metrics:
            QuantConfig(prune_metric=m)
        for x in self.steps:
            QuantConfig(step=x)
        if len(self.steps) > 1 and 0.0 in self.steps:
            raise ValueError(f"SearchSpace.steps mixes k-means levels (0.0) with uniform steps: {self.steps!r}")
        if len(self.rates) > 1 and 0.0 in self.rates:
            raise ValueError(f"SearchSpace.rates mixes k-means levels (0.0) with entropy-constrained ones: "
                             f"{self.rates!r}")
        for x in self.rates:
            QuantConfig(rate=x)
        if max(self.rates) > 0:  # every bin count must suit entropy-constrained levels (even, no uniform step)
            for b in (*self.bins, *self.embedding_bins):
                QuantConfig(bins=b, embedding_bins=b, rate=max(self.rates), step=max(self.steps))


# The space of a closed-loop residual save: the residual w_t - w_hat_{t-1} is one interval's change (plus the error
# the previous save left). An entropy-coded uniform quantizer (QuantConfig.step): cells of 1 to 4 times the
# residual's RMS (larger: more aggressive), a value taking its cell and decoding to the cell's centre. Not k-means
# levels (KMEANS_RESIDUAL_SPACE): a level at its cell's mean makes a steadily drifting weight's reconstruction
# trail it (quantize.uniform_levels), so a restore moves the weights back along their update; on the character
# transformer 10 restores cost +1.02% of paired training loss with 4 k-means levels and half pruned (1.88 bits a
# parameter), +0.64% with five centred cells of 1.5 RMS (1.57 bits; benchmarks/results/restore_chain.md). 63
# cells (+-31 cells: wider than any residual's tail at these steps), not five: a value beyond the outer cell is
# clipped to it, the same lag for the weights that move most (a pretrained LSTM's fine-tune ended +1.85% with five
# cells, -0.22% with 63; benchmarks/results/fidelity_lstm_cells.md); the code codec "zstd-escape" stores the rare
# outer codes for about what five cells cost (codec.py).
RESIDUAL_SPACE = SearchSpace(bins=(63,), embedding_bins=(63,), prune_fractions=(0.0,), protect_fractions=(0.0,),
                             prune_metrics=("magnitude",), steps=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0))
# The paper's levels for the same saves: k-means with far fewer levels, and much more pruning (a pruned residual
# keeps its previous reconstruction; its error is carried to the next save), than a weight needs. Pruned by
# magnitude only: the proxy that scores residual candidates weights every element alike (see
# CompressionConfig.residual_budget). Twelve points (embedding tables take 3 levels, not an axis of their own). The
# default before RESIDUAL_SPACE; pass CompressionConfig(residual_space=KMEANS_RESIDUAL_SPACE) to use it.
KMEANS_RESIDUAL_SPACE = SearchSpace(bins=(2, 3, 4, 8), embedding_bins=(3,), prune_fractions=(0.0, 0.5, 0.8),
                                    protect_fractions=(0.0,), prune_metrics=("magnitude",))
# The same saves coded by entropy-constrained levels (QuantConfig.rate): a zero level and 14 others per tensor,
# each value taking the level of least squared error plus `rate` times its layer type's mean square times the level's
# code length; rates 1.4x apart (each step 1.4-1.5x the error). At the same squared error of the character
# transformer's residual, about 20% fewer bits than the k-means levels of KMEANS_RESIDUAL_SPACE
# (benchmarks/results/residual_coding.md).
ENTROPY_RESIDUAL_SPACE = SearchSpace(bins=(14,), embedding_bins=(14,), prune_fractions=(0.0,),
                                     protect_fractions=(0.0,), prune_metrics=("magnitude",),
                                     rates=(0.05, 0.07, 0.1, 0.14, 0.2, 0.28, 0.4, 0.56, 0.8))


# The data-free budgets per unit of epsilon, when a CompressionConfig leaves them at None (epsilon is the one
# knob). At the default epsilon 0.01: residual saves within 0.2 of the residual's squared error and first moments
# within 0.3 of the update's, the values the five fidelity workloads held with after 10 restores (docs/results.md:
# first moments within 0.3 wrote 16-21% fewer bytes than within 0.1; within 0.5 the LSTM fine-tune ended at the
# edge of its noise floor).
RESIDUAL_PER_EPSILON = 20.0
MOMENT_PER_EPSILON = 30.0


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    r"""Every parameter of the method (ALGORITHM.md), with the paper's values as defaults.

    Attributes:
      epsilon: the quality knob. The quality budget of one save: the largest accepted relative degradation of
        the eval metric against the uncompressed state at the same step (keyframes are searched under it and,
        closed loop, under `effective_proxy_budget` too; a closed-loop residual save's choice is checked
        against it). The data-free budgets left at None follow it
        (`effective_residual_budget`, `effective_moment_budget`, `effective_proxy_budget`), so one number steers
        every part of a save: larger, smaller checkpoints with a larger error. 0.01 (the default): within the
        noise of the five fidelity workloads after 10 restores (docs/results.md).
      alpha: relative accuracy of the log-bucket sketch (gamma = (1 + alpha) / (1 - alpha)).
      sigma: k-means bucket weight = sigma * normalised count + (1 - sigma) * normalised |value|.
      kmeans_iters: maximum number of weighted Lloyd iterations.
      kmeans_tol: Lloyd stops when no centre moves by more than `kmeans_tol` times the data's value range.
      kmeans_restarts: independent k-means++ initialisations (run batched); the lowest-loss one is kept.
      protected_dtype: storage of protected weights, "bfloat16" (paper) or "float32". Leaves that are already
        16-bit keep their own dtype for protected values, which is exact at no extra cost.
      min_compress_size: float parameters with fewer elements, or with fewer than 2 dimensions, are not
        quantized as weights (biases, norm scales): stored losslessly, except that in a closed-loop chain those
        of 64 or more elements (`save.MIN_RESIDUAL_SIZE`) are exact at keyframes only and quantized residuals
        at the saves after. Optimizer moments are quantized from 64 elements, 1-D ones included
        (`save.MIN_MOMENT_SIZE`: their error is relative per element, whatever the tensor's size).
      layer_type_rules: (regex, layer_type) pairs tried in order on the leaf's path before the default rule
        (see `quantize.layer_type`); e.g. (("head", "dense"),).
      seed: seed of the PRNG key used for k-means++ initialisation (results are deterministic given it).
      keyframe_every: longest chain: a save whose previous one is `keyframe_every - 1` links away from its
        keyframe is a keyframe again, so a restore decodes at most this many code streams per shard (and, closed
        loop, adds at most this many residuals). 1 stores every checkpoint whole.
      closed_loop: store the parameters closed loop (docs/how-it-works.md): a save after the first stores the
        residual w_t - w_hat_{t-1} against the previous save's *reconstruction* w_hat_{t-1} (what a restore of
        that save gives), quantized with levels of its own from `residual_space`, so w_hat_t = w_hat_{t-1} +
        Q(residual). The error of a restore is then the quantization error of one interval's change, not of
        the weights, and never accumulates: what one save leaves out, the next one's residual carries. A
        restarted job that restored a step continues its chain (it holds that reconstruction exactly). Costs
        one copy of the parameters on the device (the last reconstruction). False: every save quantizes the
        weights afresh and stores their level indices as deltas (the paper's method).
      residual_space: the values the search may pick for a closed-loop residual save; keyframes use
        `search_space`. `RESIDUAL_SPACE` (the default): 63 uniform cells, decoded to their centres, of 1 to 4
        times the residual's RMS; `KMEANS_RESIDUAL_SPACE`: the paper's k-means levels with pruning;
        `ENTROPY_RESIDUAL_SPACE`: entropy-constrained levels.
      residual_budget: a closed-loop residual save takes the most compressive configuration of
        `residual_space` whose squared error is at most this fraction of the residual's
        (`search.proxy_degradation` against the previous reconstruction, weighted by `weighted_residuals`, not by
        the gradient EMA: that is small where gradients are noisy, which Adam moves as much as any other weight).
        The error a save leaves is carried
        into the next one's residual, so in steady state it is about sqrt(b) / (1 - sqrt(b)) times one
        interval's change of the weights: the knob of the residual saves' size (smaller: narrower cells, or
        more levels or less pruning, more bytes). With an eval_fn the choice is also checked against `epsilon`
        (over it: the widest less aggressive cells the eval_fn reads within it, `search._guard`). When nothing
        in `residual_space` meets it, levels two and four times finer than its least aggressive configuration
        are tried, the first within it taken, else the finest: a residual save is never lossless. In [0, 1];
        None (the default):
        `RESIDUAL_PER_EPSILON` (20) times `epsilon`, at most 1 (0.2 at the default epsilon).
      residual_width_power: how a closed-loop residual save's total error is split between tensors, where its
        cells are uniform (`RESIDUAL_SPACE`): each tensor's cells are `step` times G^(1 - p) times its own
        residual's RMS^p (at least an eighth of `step` times its own RMS), G the RMS of the whole state's
        residual, p this power, in [0, 1]. 1: the same width relative to each tensor's own residual (every
        tensor's error in proportion to its residual's energy). 0: one width for every tensor, the split that
        takes the fewest bits for the same total error at high resolution (equal slopes: a tensor that moved
        little between saves gets no more bits a value than one that moved a lot). 0.5 (the default): half way,
        in the logarithm. `residual_budget` bounds the same total either way; on the residuals of five training
        runs 0.5 took 0.6-9.8% fewer bits than 1 at the default budget, 0 1.1-17.1%, the most where the tensors'
        residuals differ most in size (benchmarks/results/residual_bound.md).
      weighted_residuals: a residual of a tensor of 2 or more dimensions whose weight has an optimizer second
        moment of its shape in the state (Adam's `nu`) is coded as r / M with M about nu^(-1/4), stored as one
        small integer per index of each axis (weighting.py), and `residual_budget` bounds its squared error
        weighted by 1 / M^2: the error goes where the loss is flat. False (the default): every element weighted
        alike. Not the default: after 10 restores it moved along the default's frontier, not past it (on the
        character transformer the same bytes and final loss; on the LSTM fine-tune 20% fewer parameter bytes
        and a worse final loss, and at half the budget the default's bytes and loss; docs/results.md).
      search: pick the configuration at every save under the quality budget `epsilon` (ALGORITHM.md step 5,
        docs/how-it-works.md); False saves every checkpoint with `quant`.
      search_space: the values the search may pick.
      higher_is_better: direction of `eval_fn`'s scalar: False for a loss (the default), True for an accuracy.
        The relative degradation of a candidate is (q - q0) / |q0| for a loss, (q0 - q) / |q0| for an accuracy,
        where q0 is the uncompressed state's value at the same step.
      search_batch: candidates encoded and evaluated per round of the search (their device work overlaps).
      proxy_budget: without an eval_fn, a candidate is accepted when its sensitivity-weighted relative
        reconstruction error sum(g^2 (w - w_q)^2) / sum(g^2 w^2) (g = 1 without grads) is at most this
        (the data-free fallback; docs/how-it-works.md says how the default was chosen). With an eval_fn, the
        keyframe of a closed-loop chain must meet it as well as epsilon, and so must any candidate the eval_fn
        reads better than the uncompressed state by more than epsilon (`search.Evaluator.trusted`). None (the
        default): `epsilon`.
      metric_switch_margin: at a later save, the previous configuration switches its prune metric when the
        other metric's degradation is lower by more than this fraction of `epsilon`.
      quant: the configuration used when `search` is False.
      optimizer: policy for the optimizer's moments (optax `mu`, `nu`, `nu_max`, sgd momentum `trace`):
        "quantize" (the default: a second moment in log-domain levels (`moment_bins`), a first moment relative
        to the square root of its second moment as stored, within `moment_budget`; exact zeros kept; the
        first moment of a pruned weight is pruned with it; moments.py), "drop" (not stored, restored as zeros;
        an optax step counter `count` beside a dropped `nu` is dropped with it, so Adam's bias correction restarts with its
        moments) or "lossless" (bit-exact). Not "drop" by default: with the weights restored exactly, dropping
        Adam's moments at 10 restores of a character transformer ended +2.3% in loss (dropping only `mu`:
        +1.6%), a consistent loss though inside that model's three-seed noise of 3.75%
        (benchmarks/results/fault_tolerance_charlm_exact.md).
      moment_bins: log-magnitude levels of a quantized second moment (`nu`; in [2, 127]). None (the default):
        16 at the default epsilon, 16 * sqrt(0.01 / epsilon) in [4, 64] at others (`effective_moment_bins`: a
        level's share of the log range, and so a step size's error, goes as 1 / bins, its square as epsilon).
        16: a second moment scales every update for hundreds of steps; at 8 or 4 levels 1% of a trained
        transformer's step sizes move by 2.3x or 5.1x (benchmarks/results/moment_error.md).
      moment_budget: a quantized first moment (`mu`, `trace`) takes, per tensor at every save, the widest
        cells of a uniform quantizer of its ratio to the square root of its second moment whose squared error is
        at most this fraction of the update's: ||u' - u||^2 <= b ||u||^2 for u = mu / sqrt(nu) as a restore
        gives it (in [0, 1]; 0: the cells of least error); Lion's and Muon's `mu`, whose updates are
        normalized (a sign, an orthogonalized matrix), within a tenth of it (`policy.NORMALIZED_BUDGET`).
        Smaller: finer cells, more bytes. The error fades within
        ~1 / (1 - b1) steps of a restore. None (the default): `MOMENT_PER_EPSILON` (30) times `epsilon`, at
        most 1: 0.3 at the default epsilon, an update off by about 55% in norm for a few steps after a restore
        (docs/how-it-works.md, "How many levels", has the measurements; docs/results.md what 0.1, 0.3 and 0.5 did
        to the fidelity workloads).
      policy_rules: (regex, policy) pairs tried in order on each array leaf's key path (`jax.tree_util.keystr`)
        before the default rule (parameters: "quantize", i.e. the method; optimizer moments: `optimizer`;
        everything else: "lossless"); e.g. ((r"\.nu\b", "quantize"), (r"\.mu\b", "drop")) or
        ((r"head", "lossless"),). "quantize" leaves that cannot be quantized (integers, < 2 dimensions, fewer
        than `min_compress_size` elements) are stored losslessly.
    """

    epsilon: float = 0.01
    alpha: float = 0.01
    sigma: float = 0.2
    kmeans_iters: int = 20
    kmeans_tol: float = 1e-4
    kmeans_restarts: int = 3
    protected_dtype: str = "bfloat16"
    min_compress_size: int = 1024
    layer_type_rules: tuple[tuple[str, str], ...] = ()
    seed: int = 0
    keyframe_every: int = 32
    closed_loop: bool = True
    residual_space: SearchSpace = RESIDUAL_SPACE
    residual_budget: float | None = None
    residual_width_power: float = 0.5
    weighted_residuals: bool = False
    search: bool = True
    search_space: SearchSpace = SearchSpace()
    higher_is_better: bool = False
    search_batch: int = 4
    proxy_budget: float | None = None
    metric_switch_margin: float = 0.2
    quant: QuantConfig = QuantConfig()
    optimizer: str = "quantize"
    moment_bins: int | None = None
    moment_budget: float | None = None
    policy_rules: tuple[tuple[str, str], ...] = ()

    @property
    def effective_residual_budget(self) -> float:
        """What closed-loop residual saves are searched under: `residual_budget`, or `RESIDUAL_PER_EPSILON *
        epsilon` (at most 1) when it is None."""
        return _following(self.residual_budget, RESIDUAL_PER_EPSILON * self.epsilon)

    @property
    def effective_moment_budget(self) -> float:
        """What first moments are coded within: `moment_budget`, or `MOMENT_PER_EPSILON * epsilon` (at most 1)
        when it is None."""
        return _following(self.moment_budget, MOMENT_PER_EPSILON * self.epsilon)

    @property
    def effective_moment_bins(self) -> int:
        """The log-levels of second moments: `moment_bins`, or when it is None 16 * sqrt(0.01 / epsilon),
        rounded, in [4, 64] (16 at the default epsilon)."""
        if self.moment_bins is not None:
            return self.moment_bins
        if self.epsilon == 0:
            return 64
        return int(min(64, max(4, round(16 * math.sqrt(0.01 / self.epsilon)))))

    @property
    def effective_proxy_budget(self) -> float:
        """What a search without eval_fn accepts: `proxy_budget`, or `epsilon` when it is None."""
        return _following(self.proxy_budget, self.epsilon, hi=math.inf)

    @property
    def bins_capacity(self) -> int:
        """Slots of the encoder's k-means (and entropy-constrained levels): the largest bin count of this
        configuration's spaces and `quant` that is not a uniform quantizer's (that has slots of its own:
        quantize.UNIFORM_SLOTS)."""
        sizes = [b for space in (self.search_space, self.residual_space) if not any(space.steps)
                 for b in (*space.bins, *space.embedding_bins)]
        if not self.quant.step:
            sizes += [self.quant.bins, self.quant.embedding_bins]
        return max(sizes, default=2)

    def __post_init__(self):
        for name, lo, hi, closed in (("epsilon", 0.0, math.inf, True), ("alpha", 0.0, 1.0, False),
                                     ("sigma", 0.0, 1.0, True), ("kmeans_tol", 0.0, math.inf, True),
                                     ("metric_switch_margin", 0.0, math.inf, True),
                                     ("residual_width_power", 0.0, 1.0, True)):
            _real(name, getattr(self, name), lo, hi, closed)
        if self.moment_bins is not None:
            _integer("moment_bins", self.moment_bins, 2, 127)
        for name, hi in (("residual_budget", 1.0), ("moment_budget", 1.0), ("proxy_budget", math.inf)):
            if getattr(self, name) is not None:
                _real(name, getattr(self, name), 0.0, hi, True)
        for name, lo, hi in (("kmeans_iters", 0, None), ("kmeans_restarts", 1, None), ("min_compress_size", 0, None),
                             ("keyframe_every", 1, None), ("search_batch", 1, None),
                             ("seed", None, None)):
            _integer(name, getattr(self, name), lo, hi)
        for name in ("search", "higher_is_better", "closed_loop", "weighted_residuals"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CompressionConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.protected_dtype not in PROTECTED_DTYPES:
            raise ValueError(
                f"CompressionConfig.protected_dtype must be one of {PROTECTED_DTYPES}, got {self.protected_dtype!r}"
            )
        if self.optimizer not in POLICIES:
            raise ValueError(f"CompressionConfig.optimizer must be one of {POLICIES}, got {self.optimizer!r}")
        if not isinstance(self.quant, QuantConfig) or not isinstance(self.search_space, SearchSpace) or \
                not isinstance(self.residual_space, SearchSpace):
            raise TypeError("CompressionConfig.quant must be a QuantConfig, search_space and residual_space "
                            "SearchSpaces")
        _rules("policy_rules", self.policy_rules, POLICIES)
        _rules("layer_type_rules", self.layer_type_rules, LAYER_TYPES)


def _following(value: float | None, derived: float, hi: float = 1.0) -> float:
    """A budget as given, or (None) derived from epsilon, at most `hi`."""
    return value if value is not None else min(hi, derived)


def _real(name: str, value, lo: float, hi: float, closed: bool) -> None:
    """A CompressionConfig field that must be a finite (or +inf where hi is inf) real number in range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"CompressionConfig.{name} must be a real number, got {value!r}")
    if math.isnan(value):
        raise ValueError(f"CompressionConfig.{name} is NaN; give a number")
    ok = (lo <= value <= hi) if closed else (lo < value < hi)
    if not ok or (math.isinf(value) and not math.isinf(hi)):
        raise ValueError(f"CompressionConfig.{name} must be in {'[' if closed else '('}{lo}, {hi}"
                         f"{']' if closed and not math.isinf(hi) else ')'}, got {value!r}")


def _integer(name: str, value, lo: int | None, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"CompressionConfig.{name} must be an int, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"CompressionConfig.{name} must be an int in [{lo}, {hi if hi is not None else 'inf'}"
                         f"{']' if hi is not None else ')'}, got {value!r}")


def _rules(name: str, rules, allowed: tuple) -> None:
    """(regex, value) pairs: each a valid regex and an allowed value."""
    if not isinstance(rules, tuple):
        raise TypeError(f"CompressionConfig.{name} must be a tuple of (regex, value) pairs, got {rules!r}")
    for rule in rules:
        if not isinstance(rule, tuple) or len(rule) != 2 or rule[1] not in allowed:
            raise ValueError(f"{name} entries are (regex, one of {allowed}), got {rule!r}")
        try:
            re.compile(rule[0])
        except (re.error, TypeError) as e:
            raise ValueError(f"CompressionConfig.{name}: {rule[0]!r} is not a regular expression ({e})") from None
