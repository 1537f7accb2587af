"""Demo: train a small Flax CNN on real digits, compress its parameters with inshrink_jax's jitted core, and
print measured sizes (against Orbax's default checkpoint of the same parameters), reconstruction error and
test accuracy before and after.

Run: python examples/demo.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402

from inshrink_jax import CompressionConfig, QuantConfig, codec, quantize  # noqa: E402


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    train_x, train_y, test_x, test_y = digits.load()
    state = digits.create_state(seed=0)
    grad_ema = jax.tree.map(jnp.zeros_like, state.params)
    stream = digits.batches(train_x, train_y, 64, seed=0)
    t0 = time.time()
    for step in range(1, 401):
        state, loss, grads = digits.train_step(state, *next(stream))
        # Gradient EMA over the last steps: the sensitivity signal (newest gradient weighs 0.9).
        grad_ema = jax.tree.map(lambda e, g: 0.9 * g + 0.1 * e, grad_ema, grads)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    acc = digits.accuracy(state.params, state.apply_fn, test_x, test_y)
    print(f"trained {n_params:,} parameters for 400 steps in {time.time() - t0:.1f}s: loss {float(loss):.3f}, "
          f"test accuracy {acc:.3f}")

    cfg = CompressionConfig()
    quant = QuantConfig(bins=16, protect_fraction=0.005, prune_fraction=0.0)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state.params)
    grad_leaves = jax.tree.leaves(grad_ema)
    chosen = [i for i, (_, x) in enumerate(leaves) if x.ndim >= 2 and x.size >= cfg.min_compress_size]
    paths = [jax.tree_util.keystr(p) for p, _ in leaves]
    t0 = time.time()
    encoded = quantize.encode_tensors([leaves[i][1] for i in chosen], [grad_leaves[i] for i in chosen],
                                      [quantize.layer_type(paths[i], leaves[i][1].shape) for i in chosen], quant, cfg)
    t_enc = time.time() - t0
    stored = 0
    restored = [x for _, x in leaves]
    for i, enc in zip(chosen, encoded):
        stored += len(codec.compress(enc.codes)) + enc.centres.nbytes
        stored += len(codec.compress(enc.protected, codec.ZSTD_PLANES))
        restored[i] = quantize.decode(enc)
    for i, (_, x) in enumerate(leaves):
        if i not in chosen:
            stored += len(codec.compress(np.asarray(x), codec.ZSTD_PLANES))
    params_c = jax.tree_util.tree_unflatten(treedef, restored)

    with tempfile.TemporaryDirectory() as tmp:
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(tmp, "params"), state.params)
        ckptr.wait_until_finished()
        orbax_bytes = dir_bytes(os.path.join(tmp, "params"))
    raw = n_params * 4
    compressed = [leaves[i][1] for i in chosen]
    err = np.sqrt(sum(float(jnp.sum((restored[i] - x) ** 2)) for i, x in zip(chosen, compressed))
                  / sum(float(jnp.sum(x**2)) for x in compressed))
    acc_c = digits.accuracy(params_c, state.apply_fn, test_x, test_y)
    print(f"compressed {len(chosen)} of {len(leaves)} leaves ({quant.bins} bins, protect "
          f"{quant.protect_fraction:.1%}) in {t_enc:.2f}s (including compilation)")
    print(f"  raw float32 parameters : {raw:>10,d} bytes")
    print(f"  Orbax default checkpoint: {orbax_bytes:>10,d} bytes (directory, incl. metadata)")
    print(f"  inshrink_jax encoded    : {stored:>10,d} bytes  ->  {raw / stored:.1f}x vs raw, "
          f"{orbax_bytes / stored:.1f}x vs Orbax")
    print(f"  relative RMS error of compressed leaves: {err:.4f}")
    print(f"  test accuracy: {acc:.3f} original, {acc_c:.3f} compressed "
          f"(relative change {(acc_c - acc) / acc:+.2%})")
    print("(encoded bytes = zstd codes + centres + protected values. The Orbax handler stores the same through "
          "CheckpointManager: see README.md; it stores later checkpoints as deltas (benchmarks/results/delta.md); the configuration search is not implemented yet)")


if __name__ == "__main__":
    main()
