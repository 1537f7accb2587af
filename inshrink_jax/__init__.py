"""inshrink_jax: dynamic-quantization checkpoint compression for JAX/Flax training checkpoints.

    handler = inshrink_jax.InshrinkCheckpointHandler(inshrink_jax.CompressionConfig())
    mngr = orbax.checkpoint.CheckpointManager(path, item_handlers=handler)
    mngr.save(step, args=inshrink_jax.InshrinkSave(state, grads=grad_ema, eval_fn=eval_fn))
    state = mngr.restore(step, args=inshrink_jax.InshrinkRestore(abstract_state))
"""

from inshrink_jax.cache import enable_compilation_cache
from inshrink_jax.config import CompressionConfig, QuantConfig, SearchSpace
from inshrink_jax.handler import (InshrinkCheckpointHandler, InshrinkRestore, InshrinkSave, handler_registry,
                                  restore_latest)
from inshrink_jax.sensitivity import GradientEMA
from inshrink_jax.store import CheckpointCorruptError
from inshrink_jax.v1 import Compressed
from inshrink_jax.v1 import registry as v1_registry

__all__ = [
    "CheckpointCorruptError",
    "Compressed",
    "CompressionConfig",
    "GradientEMA",
    "InshrinkCheckpointHandler",
    "InshrinkRestore",
    "InshrinkSave",
    "QuantConfig",
    "SearchSpace",
    "enable_compilation_cache",
    "handler_registry",
    "restore_latest",
    "v1_registry",
]
__version__ = "0.1.0"
