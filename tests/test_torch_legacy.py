"""The legacy PyTorch state-dict reader of examples/torch_legacy.py, on files written here in that format (a fake
`torch` module provides the class and function names the format refers to), so no torch is needed."""

import collections
import io
import os
import pickle
import struct
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import torch_legacy  # noqa: E402


class _Tensor:
    def __init__(self, key, offset, shape, stride):
        self.key, self.offset, self.shape, self.stride = key, offset, shape, stride

    def __reduce__(self):
        rebuild = sys.modules["torch._utils"]._rebuild_tensor_v2
        return rebuild, (("storage", self.key), self.offset, self.shape, self.stride, False, collections.OrderedDict())


def _write(tensors: dict, storages: dict, magic=torch_legacy.MAGIC, extra_global=None) -> bytes:
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    class FloatStorage:
        pass

    FloatStorage.__module__, FloatStorage.__qualname__ = "torch", "FloatStorage"
    torch.FloatStorage = FloatStorage

    def _rebuild_tensor_v2(*args):
        raise AssertionError("never called while writing")

    _rebuild_tensor_v2.__module__, _rebuild_tensor_v2.__qualname__ = "torch._utils", "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch._utils = utils
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    sys.modules.update({"torch": torch, "torch._utils": utils})
    try:
        class P(pickle.Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "storage":
                    return ("storage", FloatStorage, obj[1], "cpu", storages[obj[1]].size)
                return None

        f = io.BytesIO()
        for header in (magic, 1001, {"little_endian": True}):
            pickle.dump(header, f, protocol=2)
        state = collections.OrderedDict(tensors)
        if extra_global is not None:
            state["bad"] = extra_global
        P(f, protocol=2).dump(state)
        pickle.dump(list(storages), f, protocol=2)
        for key, arr in storages.items():
            f.write(struct.pack("<q", arr.size))
            f.write(arr.astype("<f4").tobytes())
        return f.getvalue()
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_reads_shapes_values_offsets_and_strides(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.normal(size=24).astype(np.float32)
    b = rng.normal(size=10).astype(np.float32)
    tensors = {"conv.weight": _Tensor("0", 0, (2, 3, 4), (12, 4, 1)),
               "fc.weight.T": _Tensor("0", 0, (4, 6), (1, 4)),        # a transposed (non-contiguous) view
               "fc.bias": _Tensor("1", 2, (5,), (1,))}                 # an offset into its storage
    path = tmp_path / "m.pth"
    path.write_bytes(_write(tensors, {"0": a, "1": b}))
    sd = torch_legacy.load(str(path))
    assert list(sd) == list(tensors)
    np.testing.assert_array_equal(sd["conv.weight"], a.reshape(2, 3, 4))
    np.testing.assert_array_equal(sd["fc.weight.T"], a.reshape(6, 4).T)
    np.testing.assert_array_equal(sd["fc.bias"], b[2:7])
    assert all(v.dtype == np.float32 for v in sd.values())


def test_wrong_magic_and_truncation_are_clear_errors(tmp_path):
    a = np.zeros(4, np.float32)
    path = tmp_path / "m.pth"
    path.write_bytes(_write({"w": _Tensor("0", 0, (4,), (1,))}, {"0": a}, magic=1234))
    with pytest.raises(ValueError, match="not a legacy PyTorch file"):
        torch_legacy.load(str(path))
    data = _write({"w": _Tensor("0", 0, (4,), (1,))}, {"0": a})
    path.write_bytes(data[:-3])
    with pytest.raises(ValueError, match="truncated storage"):
        torch_legacy.load(str(path))


def test_refuses_classes_a_state_dict_does_not_need(tmp_path):
    path = tmp_path / "m.pth"
    path.write_bytes(_write({}, {}, extra_global=os.system))  # pickled as the global posix.system
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        torch_legacy.load(str(path))
