"""JAX's persistent compilation cache for inshrink_jax's kernels: a resumed job's first save loads the encoders
it compiled before instead of compiling them again (benchmarks/results/compile_cache.md)."""

from __future__ import annotations

import os

import jax


# Every compilation is cached. inshrink_jax's encoders compile in 0.2-0.9 s each on CPU, under JAX's default
# threshold of 1 s (a resumed charlm job's first save then compiled 34 of them again, 31 s); a restore's decode
# kernels compile in well under 0.1 s each, yet a resumed job's restore spent most of its time compiling them
# (benchmarks/results/compile_cache.md measures both thresholds side by side).
MIN_COMPILE_TIME_SECS = 0.0


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> str:
    """Turn on JAX's persistent compilation cache in `directory` and return the directory in use.

    JAX's setting is process-wide: it caches every compilation that takes longer than
    `jax_persistent_cache_min_compile_time_secs`, the training step's included, which a resumed job also gains
    from. That threshold is lowered to `MIN_COMPILE_TIME_SECS` (0: every compilation; JAX's default is 1 s), never
    raised. A cache directory configured before (`jax_compilation_cache_dir`, or the `JAX_COMPILATION_CACHE_DIR`
    environment variable) is kept and returned. `directory` None: `$XDG_CACHE_HOME/inshrink_jax/jax`, else
    `~/.cache/inshrink_jax/jax`. Call it once at startup, before the first save or restore.
    """
    if jax.config.jax_persistent_cache_min_compile_time_secs > MIN_COMPILE_TIME_SECS:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if directory is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "inshrink_jax", "jax")
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    return directory
