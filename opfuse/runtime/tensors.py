"""numpy <-> torch conversion and dtype names, in one place."""

from __future__ import annotations

from contextvars import ContextVar

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


# Small tables a per-op kernel computes on the host from static shapes and attributes (Resize taps
# and weights, Pad indices, Shape's values), kept on the device by value: the first run copies each
# one over, every later run reuses it, so a run after the first moves nothing from the host and can
# be captured in a CUDA graph (runtime/cudagraph.py warms the plan up first). Entries are never
# evicted, since a captured graph may read them; past the cap new tables are copied each time
# instead (the capture then fails and the report says so, rather than replaying freed memory).
_DEVICE_TABLES: dict[tuple[object, ...], torch.Tensor] = {}
# runtime/capture.py's audit runs the CPU as a GPU: tables are cached there too while it runs.
TABLES_ON_CPU: ContextVar[bool] = ContextVar("opfuse_tables_on_cpu", default=False)
_DEVICE_TABLE_CAP_BYTES = 64 << 20
_device_table_bytes = 0


def device_table(values: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` as a tensor on `device` (cast to `dtype`): a cached copy there, never on the CPU."""
    global _device_table_bytes
    arr = np.asarray(values)
    if device.type == "cpu" and not TABLES_ON_CPU.get():
        t = torch.from_numpy(arr.copy(order="C"))
        return t if dtype is None else t.to(dtype)
    key = (str(device), str(dtype), arr.dtype.str, arr.shape, arr.tobytes())
    hit = _DEVICE_TABLES.get(key)
    if hit is not None:
        return hit
    t = torch.from_numpy(arr.copy(order="C")).to(device=device, dtype=dtype)
    if _device_table_bytes + t.numel() * t.element_size() <= _DEVICE_TABLE_CAP_BYTES:
        _DEVICE_TABLES[key] = t
        _device_table_bytes += t.numel() * t.element_size()
    return t


def device_tables() -> list[torch.Tensor]:
    """Every table `device_table` keeps (runtime/capture.py counts them as device tensors)."""
    return list(_DEVICE_TABLES.values())
