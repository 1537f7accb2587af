"""Configuration: one quantization configuration, and every knob of the method.

`QuantConfig` is one point of the search space of ALGORITHM.md step 5 (what the search picks at each
checkpoint). `CompressionConfig` holds the method's fixed parameters with the paper's defaults. Both are
frozen dataclasses, so they are hashable and can be static arguments of jitted functions.
"""

from __future__ import annotations

import dataclasses
import re

PRUNE_METRICS = ("magnitude", "sensitivity")
LAYER_TYPES = ("conv", "attention", "dense", "embedding", "other")
PROTECTED_DTYPES = ("bfloat16", "float32")


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
    """

    bins: int = 16
    embedding_bins: int = 32
    prune_fraction: float = 0.0
    prune_metric: str = "magnitude"
    protect_fraction: float = 0.005

    def __post_init__(self):
        for name in ("bins", "embedding_bins"):
            k = getattr(self, name)
            if not isinstance(k, int) or not 2 <= k <= 254:
                raise ValueError(f"QuantConfig.{name} must be an int in [2, 254] (codes are uint8), got {k!r}")
        if not 0.0 <= self.prune_fraction < 1.0:
            raise ValueError(f"QuantConfig.prune_fraction must be in [0, 1), got {self.prune_fraction!r}")
        if not 0.0 <= self.protect_fraction <= 1.0:
            raise ValueError(f"QuantConfig.protect_fraction must be in [0, 1], got {self.protect_fraction!r}")
        if self.prune_metric not in PRUNE_METRICS:
            raise ValueError(f"QuantConfig.prune_metric must be one of {PRUNE_METRICS}, got {self.prune_metric!r}")

    def bins_for(self, layer_type: str) -> int:
        """The number of levels used for a tensor of `layer_type`."""
        return self.embedding_bins if layer_type == "embedding" else self.bins


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """Every parameter of the method (ALGORITHM.md), with the paper's values as defaults.

    Attributes:
      epsilon: quality budget: largest accepted relative degradation of the eval metric.
      alpha: relative accuracy of the log-bucket sketch (gamma = (1 + alpha) / (1 - alpha)).
      sigma: k-means bucket weight = sigma * normalised count + (1 - sigma) * normalised |value|.
      kmeans_iters: maximum number of weighted Lloyd iterations.
      kmeans_tol: Lloyd stops when no centre moves by more than `kmeans_tol` times the data's value range.
      kmeans_restarts: independent k-means++ initialisations (run batched); the lowest-loss one is kept.
      protected_dtype: storage of protected weights, "bfloat16" (paper) or "float32". Leaves that are already
        16-bit keep their own dtype for protected values, which is exact at no extra cost.
      min_compress_size: float leaves with fewer elements, or with fewer than 2 dimensions, are stored
        losslessly (biases, norm scales, step counters).
      layer_type_rules: (regex, layer_type) pairs tried in order on the leaf's path before the default rule
        (see `quantize.layer_type`); e.g. (("head", "dense"),).
      seed: seed of the PRNG key used for k-means++ initialisation (results are deterministic given it).
      keyframe_every: longest delta chain: a save whose previous codes are `keyframe_every - 1` deltas away
        from their keyframe stores whole codes again, so a restore decodes at most this many code streams
        per shard. 1 stores every checkpoint whole.
      quant: the configuration used when no search runs.
    """

    epsilon: float = 0.05
    alpha: float = 0.01
    sigma: float = 0.2
    kmeans_iters: int = 20
    kmeans_tol: float = 1e-4
    kmeans_restarts: int = 3
    protected_dtype: str = "bfloat16"
    min_compress_size: int = 1024
    layer_type_rules: tuple[tuple[str, str], ...] = ()
    seed: int = 0
    keyframe_every: int = 10
    quant: QuantConfig = QuantConfig()

    def __post_init__(self):
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"CompressionConfig.alpha must be in (0, 1), got {self.alpha!r}")
        if not 0.0 <= self.sigma <= 1.0:
            raise ValueError(f"CompressionConfig.sigma must be in [0, 1], got {self.sigma!r}")
        if self.epsilon < 0:
            raise ValueError(f"CompressionConfig.epsilon must be >= 0, got {self.epsilon!r}")
        if self.kmeans_iters < 0 or self.kmeans_restarts < 1:
            raise ValueError("CompressionConfig.kmeans_iters must be >= 0 and kmeans_restarts >= 1")
        if not isinstance(self.keyframe_every, int) or self.keyframe_every < 1:
            raise ValueError(f"CompressionConfig.keyframe_every must be an int >= 1, got {self.keyframe_every!r}")
        if self.protected_dtype not in PROTECTED_DTYPES:
            raise ValueError(
                f"CompressionConfig.protected_dtype must be one of {PROTECTED_DTYPES}, got {self.protected_dtype!r}"
            )
        for rule in self.layer_type_rules:
            if len(rule) != 2 or rule[1] not in LAYER_TYPES:
                raise ValueError(f"layer_type_rules entries are (regex, one of {LAYER_TYPES}), got {rule!r}")
            re.compile(rule[0])
