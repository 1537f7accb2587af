"""ij.enable_compilation_cache: JAX's persistent cache, kept when one is configured, filled by a save."""

import os
import subprocess
import sys

CODE = r"""
import os, sys
import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
import inshrink_jax as ij
want = sys.argv[1]
got = ij.enable_compilation_cache(want)
assert got == os.environ.get("JAX_COMPILATION_CACHE_DIR", want), got
assert jax.config.jax_compilation_cache_dir == got
assert ij.enable_compilation_cache(want + "-other") == got  # a configured cache is kept
assert jax.config.jax_persistent_cache_min_compile_time_secs == ij.cache.MIN_COMPILE_TIME_SECS
w = jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32)
with ocp.CheckpointManager(sys.argv[2], item_handlers=ij.InshrinkCheckpointHandler()) as m:
    m.save(0, args=ij.InshrinkSave({"w": w}))
print(sorted(os.listdir(got)))
"""


def test_the_cache_is_set_kept_and_filled(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", CODE, str(tmp_path / "cache"), str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(os.listdir(tmp_path / "cache")) > 0 and not (tmp_path / "cache-other").exists()
    preset = dict(env, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "preset"))
    done = subprocess.run([sys.executable, "-c", CODE, str(tmp_path / "mine"), str(tmp_path / "ckpt2")], env=preset,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "mine").exists()
