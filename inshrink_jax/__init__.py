"""inshrink_jax: dynamic-quantization checkpoint compression for JAX/Flax training checkpoints."""

from inshrink_jax.config import CompressionConfig, QuantConfig

__all__ = ["CompressionConfig", "QuantConfig"]
__version__ = "0.1.0"
