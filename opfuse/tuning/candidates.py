"""What tuning tries: the launch configs of each kernel, around the kernel's own start config.

`candidates(k)` lists the overrides timed for kernel `k`: its template's own, from the template
registry (codegen.registry; the tables are codegen.tuning_space's, the split-K bounds
codegen.fragments', re-exported here); `fallback_configs(k)` the configs tried in order where its
start config does not compile on the device.
"""

from __future__ import annotations

from typing import Any

from opfuse.codegen.fragments import SPLIT_K_MIN_K, SPLIT_K_PROGRAMS, SPLIT_K_TILES
from opfuse.codegen.registry import TEMPLATES
from opfuse.codegen.tuning_space import (
    CANDIDATES,
    DEPTHWISE_CANDIDATES,
    ROW_TILES,
    split_k_candidates,
)
from opfuse.runtime.plan import KernelInfo
from opfuse.tuning.cache import config_key

__all__ = [
    "CANDIDATES",
    "DEPTHWISE_CANDIDATES",
    "ROW_TILES",
    "SPLIT_K_MIN_K",
    "SPLIT_K_PROGRAMS",
    "SPLIT_K_TILES",
    "candidates",
    "fallback_configs",
    "split_k_candidates",
]


def candidates(k: KernelInfo) -> list[dict[str, Any]]:
    """The configs tried for kernel `k`, each an override of its default config: those of the
    template that wrote it (none for a kind no template writes)."""
    template = TEMPLATES.get(k.kind)
    return template.candidates(k) if template is not None else []


def fallback_configs(k: KernelInfo) -> list[dict[str, Any]]:
    """The configs a kernel tries, in order, where its starting config fails to compile (on the GPU,
    a tile whose pipeline stages do not fit in the device's shared memory: a conv with a window
    prologue buffers every tap's load): one pipeline stage, then also half the K tile, then its
    tuning candidates."""
    start = dict(k.config)
    tries: list[dict[str, Any]] = []
    if int(start.get("num_stages", 1)) > 1:
        tries.append({**start, "num_stages": 1})
    if int(start.get("BLOCK_K", 0)) > 16:
        tries.append({**start, "num_stages": 1, "BLOCK_K": int(start["BLOCK_K"]) // 2})
    tries += [{**start, **c} for c in candidates(k)]
    out: list[dict[str, Any]] = []
    seen = {config_key(start)}
    for c in tries:
        if config_key(c) not in seen:
            seen.add(config_key(c))
            out.append(c)
    return out
