"""The EfficientNet-Lite0 conversion of examples/efficientnet.py, on a synthetic PyTorch-named state dict (the
real weights are the `transfer` extra, not installed in CI): every Flax variable is filled, with PyTorch's OIHW
kernels transposed to Flax's HWIO, and the converted model runs."""

import os
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import efficientnet as E  # noqa: E402


def _torch_state_dict(rng):
    """A state dict with EfficientNet-PyTorch's names and shapes."""
    sd = {}

    def conv(name, cout, cin, k):
        sd[f"{name}.weight"] = rng.normal(size=(cout, cin, k, k)).astype(np.float32)

    def bn(name, c):
        for p in ("weight", "bias", "running_mean"):
            sd[f"{name}.{p}"] = rng.normal(size=c).astype(np.float32)
        sd[f"{name}.running_var"] = rng.uniform(0.5, 2, size=c).astype(np.float32)
        sd[f"{name}.num_batches_tracked"] = np.array(0, np.int64)

    conv("_conv_stem", 32, 3, 3)
    bn("_bn0", 32)
    for i, (cin, expand, k, _, cout) in enumerate(E.block_specs()):
        mid = cin * expand
        if expand != 1:
            conv(f"_blocks.{i}._expand_conv", mid, cin, 1)
            bn(f"_blocks.{i}._bn0", mid)
        conv(f"_blocks.{i}._depthwise_conv", mid, 1, k)
        bn(f"_blocks.{i}._bn1", mid)
        conv(f"_blocks.{i}._project_conv", cout, mid, 1)
        bn(f"_blocks.{i}._bn2", cout)
    conv("_conv_head", 1280, 320, 1)
    bn("_bn1", 1280)
    sd["_fc.weight"] = rng.normal(size=(1000, 1280)).astype(np.float32)
    sd["_fc.bias"] = rng.normal(size=1000).astype(np.float32)
    return sd


@pytest.mark.slow  # 23 s; .ci/run runs it
def test_conversion_fills_every_variable_with_the_right_layout():
    sd = _torch_state_dict(np.random.default_rng(0))
    # Lite0 has 4,652,008 trainable values (4,694,073 with the batch-norm statistics, as in the real file).
    assert sum(v.size for k, v in sd.items() if "num_batches" not in k and "running" not in k) == 4_652_008
    v = E.from_torch(sd)
    model = E.EfficientNetLite0()
    ref = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))  # shapes, no compile
    flat_v, flat_ref = flax.traverse_util.flatten_dict(v), flax.traverse_util.flatten_dict(ref)
    assert set(flat_v) == set(flat_ref)
    assert all(flat_v[k].shape == flat_ref[k].shape for k in flat_ref)
    np.testing.assert_array_equal(v["params"]["conv_stem"]["kernel"][1, 2, 0, 5], sd["_conv_stem.weight"][5, 0, 1, 2])
    np.testing.assert_array_equal(v["params"]["blocks_3"]["depthwise_conv"]["kernel"][0, 1, 0, 7],
                                  sd["_blocks.3._depthwise_conv.weight"][7, 0, 0, 1])
    np.testing.assert_array_equal(v["params"]["fc"]["kernel"], sd["_fc.weight"].T)
    np.testing.assert_array_equal(v["batch_stats"]["blocks_0"]["bn1"]["BatchNorm_0"]["var"],
                                  sd["_blocks.0._bn1.running_var"])
    logits = model.apply(v, jnp.zeros((2, 32, 32, 3)))
    assert logits.shape == (2, 1000) and bool(jnp.all(jnp.isfinite(logits)))
