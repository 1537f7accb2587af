"""ij.enable_compilation_cache: JAX's persistent cache, kept when one is configured, filled by a save and a
restore, so that a resumed process's restore compiles nothing."""

import json
import os
import subprocess
import sys

CODE = r"""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
import inshrink_jax as ij
want = sys.argv[1]
got = ij.enable_compilation_cache(want)
assert got == os.environ.get("JAX_COMPILATION_CACHE_DIR", want), got
assert jax.config.jax_compilation_cache_dir == got
assert ij.enable_compilation_cache(want + "-other") == got  # a configured cache is kept
assert jax.config.jax_persistent_cache_min_compile_time_secs == ij.cache.MIN_COMPILE_TIME_SECS
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
w = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
with ocp.CheckpointManager(sys.argv[2], item_handlers=ij.InshrinkCheckpointHandler()) as m:
    if m.latest_step() is None:  # the first process: a keyframe and a closed-loop residual
        m.save(0, args=ij.InshrinkSave({"w": jnp.asarray(w)}))
        m.save(1, args=ij.InshrinkSave({"w": jnp.asarray(w + 0.01)}))
        m.wait_until_finished()
    events.clear()
    jax.block_until_ready(m.restore(1, args=ij.InshrinkRestore()))
hits = events.count("/jax/compilation_cache/cache_hits")  # compilations read from the cache
print(json.dumps({"entries": len(os.listdir(got)), "hits": hits,
                  "compiled": events.count("/jax/compilation_cache/compile_requests_use_cache") - hits}))
"""


def _run(want, ckpt, env) -> dict:
    done = subprocess.run([sys.executable, "-c", CODE, str(want), str(ckpt)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_cache_is_set_kept_filled_and_read(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    first = _run(tmp_path / "cache", tmp_path / "ckpt", env)
    assert first["entries"] > 0 and first["compiled"] > 0 and not (tmp_path / "cache-other").exists()
    # A resumed process, its cache configured through JAX's environment variable (kept: "mine" is not made),
    # restores the step the first one saved without compiling anything: every kernel comes from the cache.
    preset = dict(env, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    resumed = _run(tmp_path / "mine", tmp_path / "ckpt", preset)
    assert not (tmp_path / "mine").exists()
    assert resumed["compiled"] == 0 and resumed["hits"] > 0, resumed
