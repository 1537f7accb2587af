"""Read a PyTorch state dict saved in the legacy (pre-zip, torch < 1.6) format without torch.

The file is a sequence of pickles: a magic number, a protocol version, system info, then the state dict, whose
tensors refer to storages by key through `persistent_load`; then the list of storage keys; then each storage as an
8-byte little-endian element count followed by its raw bytes, in that order. Only the classes a state dict needs
are allowed to load (storage types, the tensor-rebuild function, OrderedDict), so a crafted file cannot run code.
"""

from __future__ import annotations

import collections
import pickle
import struct

import numpy as np

MAGIC = 0x1950A86A20F9469CFC6C
_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _Storage:
    def __init__(self, dtype):
        self.dtype = dtype


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return ("tensor", storage, offset, tuple(size), tuple(stride))


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, storages):
        super().__init__(f)
        self.storages = storages

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _Storage(_STORAGE_DTYPES[name])
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a state dict")

    def persistent_load(self, pid):
        # ('storage', storage type, key, location, element count[, view metadata])
        _, kind, key, _location, _numel = pid[:5]
        self.storages.setdefault(key, kind.dtype)
        return key


def load(path: str) -> dict[str, np.ndarray]:
    """{name: array} of the state dict in `path`, each array in its stored dtype and shape (PyTorch layout)."""
    with open(path, "rb") as f:
        if pickle.load(f) != MAGIC:
            raise ValueError(f"{path}: not a legacy PyTorch file (wrong magic number); files saved by torch >= 1.6 "
                             "are zip archives")
        pickle.load(f)  # protocol version
        pickle.load(f)  # system info
        dtypes: dict[str, type] = {}
        tree = _Unpickler(f, dtypes).load()
        keys = pickle.load(f)
        data = {}
        for key in keys:
            (count,) = struct.unpack("<q", f.read(8))
            dtype = np.dtype(dtypes[key])
            buf = f.read(count * dtype.itemsize)
            if len(buf) != count * dtype.itemsize:
                raise ValueError(f"{path}: truncated storage {key!r}")
            data[key] = np.frombuffer(buf, dtype)
    out = {}
    for name, (_, key, offset, size, stride) in tree.items():
        flat = data[key]
        out[name] = np.lib.stride_tricks.as_strided(
            flat[offset:], shape=size, strides=tuple(s * flat.itemsize for s in stride)).copy()
    return out
