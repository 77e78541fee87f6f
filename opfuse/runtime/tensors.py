"""numpy <-> torch conversion and dtype names, in one place."""

from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def from_numpy(arr: np.ndarray, device: str | torch.device = "cpu") -> torch.Tensor:
    if arr.dtype.name == "bfloat16":  # ml_dtypes bfloat16: torch reads it through float32
        return torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16).to(device)
    arr = np.asarray(arr)
    # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one, changing the tensor's shape.
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        arr = arr.copy(order="C")
    return torch.from_numpy(arr).to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.to(torch.float32).numpy()
    return t.numpy()
