"""Tuning on the GPU: launch configs per kernel, and template vs vendor for each anchor group.

Every candidate is timed with CUDA events on random inputs of the kernel's real shapes; a
candidate that fails to compile or run scores infinity. Results are cached by kernel signature,
GPU and versions, so compiling the same model again reuses them. A time budget bounds the work:
kernels not reached keep their default config.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any

import torch

from opfuse.runtime.executor import Executor
from opfuse.runtime.plan import KernelInfo, Plan
from opfuse.runtime.tensors import torch_dtype

# Variations tried around each kernel's own starting config (codegen picks it from the shapes).
CANDIDATES: dict[str, list[dict[str, Any]]] = {
    "gemm": [
        {},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    ],
    "conv": [
        {},
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    ],
    "attention": [
        {},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    ],
    "pointwise": [{"BLOCK": b, "num_warps": w} for b, w in [(1024, 4), (2048, 8), (4096, 8), (512, 4)]],
    "rowwise": [{"num_warps": w} for w in (2, 4, 8, 16)],
}


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
    stack = f"{torch.cuda.get_device_name()}|{torch.__version__}|{triton.__version__}"
    return hashlib.sha256(f"{stack}\n{body}".encode()).hexdigest()


class TuningCache:
    def __init__(self) -> None:
        self.path = _cache_path()
        try:
            with open(self.path) as f:
                self.data: dict[str, Any] = json.load(f)
        except (OSError, json.JSONDecodeError):
            self.data = {}
        self.hits = 0

    def get(self, key: str) -> Any:
        if key in self.data:
            self.hits += 1
        return self.data.get(key)

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value

    def save(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def _random_tensor(plan: Plan, name: str, device: torch.device) -> torch.Tensor:
    spec = plan.values[name]
    dtype = torch_dtype(spec.dtype)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, device=device).to(dtype)
    return torch.randint(0, 4, spec.shape, device=device).to(dtype)


def time_launch(fn: Any, reps: int = 10) -> float:
    """Device time of one launch: `reps` launches captured in a CUDA graph, replayed."""
    fn()  # compile and warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def tune_kernel_configs(
    plan: Plan, executor: Executor, cache: TuningCache, deadline: float
) -> dict[str, Any]:
    """Pick each kernel's fastest launch config; writes it into plan.kernels[*].config."""
    record: dict[str, Any] = {}
    for kid, k in plan.kernels.items():
        key = kernel_signature(k)
        cached = cache.get(key)
        if cached is not None:
            k.config = dict(cached["config"])
            record[kid] = {"config": k.config, "ms": cached["ms"], "cached": True}
            continue
        if time.perf_counter() > deadline:
            record[kid] = {"config": k.config, "skipped": "tuning budget spent"}
            continue
        module = executor.modules[kid]
        ins = [_random_tensor(plan, x, executor.device) for x in k.inputs]
        outs = [
            torch.empty(plan.values[o].shape, dtype=torch_dtype(plan.values[o].dtype), device=executor.device)
            for o in k.outputs
        ]
        best, best_ms = dict(k.config), float("inf")
        tried: list[dict[str, Any]] = []
        for cand in CANDIDATES.get(k.kind, []):
            config = {**k.config, **cand}
            try:
                ms = time_launch(lambda c=config, m=module, i=ins, o=outs: m.launch(*i, *o, config=c))
            except Exception as exc:  # out of resources, compile errors: this candidate loses
                tried.append({"config": cand, "error": type(exc).__name__})
                continue
            tried.append({"config": cand, "ms": round(float(ms), 5)})
            if ms < best_ms:
                best, best_ms = config, ms
        k.config = best
        executor.configs[kid] = dict(best)
        cache.put(key, {"config": best, "ms": best_ms})
        record[kid] = {"config": best, "ms": round(best_ms, 5), "candidates": len(tried)}
    return record


def step_times(executor: Executor, feeds: dict[str, Any], reps: int = 5) -> list[float]:
    """Median per-step time over a few synchronized runs."""
    runs = [executor.time_steps(feeds) for _ in range(reps)]
    return [sorted(col)[len(col) // 2] for col in zip(*runs, strict=True)]
