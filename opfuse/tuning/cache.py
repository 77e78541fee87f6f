"""The tuning cache: measured launch configs and variant choices by kernel signature, on disk.

Entries are keyed by what decides a kernel's best config (its code without ids or comments, the
GPU and the torch/Triton versions), so compiling the same model again reuses them. Only
measurements that ran are kept (`measured`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable
from typing import Any

import torch

from opfuse.runtime.plan import KernelInfo, Plan


def _cache_path() -> str:
    root = os.environ.get("OPFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "opfuse")
    os.makedirs(root, exist_ok=True)
    return os.path.join(root, "tuning.json")


def kernel_signature(k: KernelInfo) -> str:
    """What decides a kernel's best config: its code without ids or comments, on this GPU and stack."""
    import triton

    body = "\n".join(
        line
        for line in k.source.splitlines()
        if not line.lstrip().startswith("#") and not line.startswith(("CONFIG", "INTERPRETER_CONFIG"))
    )
    body = re.sub(r"\bk\d+_", "K_", body)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    stack = f"{gpu}|{torch.__version__}|{triton.__version__}"
    return hashlib.sha256(f"{stack}\n{body}".encode()).hexdigest()


def measured(entry: Any) -> bool:
    """Whether a cache entry holds only measurements that ran: every time in it finite. A failure
    (infinity: a config that did not compile, crashed, or a worker that could not start) belongs to
    the compile that met it, never to the cache, where it would mark the kernel bad for every later
    compile on the host."""
    if not isinstance(entry, dict):
        return False
    times = [entry[k] for k in ("ms", "template_ms", "vendor_ms") if k in entry]
    return all(isinstance(t, int | float) and math.isfinite(t) for t in times)


def _read_entries(path: str) -> dict[str, Any]:
    """The file's entries that hold measurements (`measured`); non-finite ones, written by an
    older opfuse, are ignored."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if measured(v)}


class TuningCache:
    def __init__(self) -> None:
        self.path = _cache_path()
        self.data: dict[str, Any] = _read_entries(self.path)
        self.hits = 0

    def get(self, key: str) -> Any:
        if key in self.data:
            self.hits += 1
        return self.data.get(key)

    def put(self, key: str, value: Any) -> None:
        """Keep `value` for later compiles, unless it holds a failure (see `measured`)."""
        if measured(value):
            self.data[key] = value

    def covers(self, plans: Iterable[Plan]) -> bool:
        """Every kernel of `plans` has its config here: each compiled and ran cleanly on this GPU
        before (its binary is in Triton's disk cache), and none needs tuning."""
        return all(kernel_signature(k) in self.data for p in plans for k in p.kernels.values())

    def save(self) -> None:
        """Write this session's entries into the file, merged with what other processes saved
        since it was read (GPU workers and benchmark shards on one host share the file)."""
        with open(f"{self.path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                merged = {**_read_entries(self.path), **self.data}
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(merged, f)
                os.replace(tmp, self.path)
                self.data = merged
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def config_key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)
