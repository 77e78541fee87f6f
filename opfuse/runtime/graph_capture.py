"""Every CUDA graph opfuse captures goes through `graph_capture`.

torch caches cuBLAS workspaces by (handle, stream), and captures without a named stream share one
capture stream. A graph that captures a library GEMM bakes the cached workspace's address into its
kernels; letting another graph captured on the same stream go clears that stream's cached
workspaces (pytorch/pytorch#193402), and a graph still alive then replays into freed memory: an
illegal memory access, or silently wrong results once the memory is reused. opfuse keeps graphs
of both lifetimes on one device: the compiled plan's graph (runtime/cudagraph.py) lives as long
as the compiled model, while the per-step profile and the tuning stage capture a graph per timing
and let it go at once.

So every capture clears the cached workspaces before and after, as torch's own CUDA-graph trees
do: the capture's GEMMs then get a workspace of their own from the graph's private memory pool,
which lives exactly as long as the graph, and no cache entry points into it afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def clear_library_workspaces() -> None:
    """Drop torch's cached cuBLAS workspaces (allocated again on the next GEMM)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


@contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, **kwargs: Any) -> Iterator[None]:
    """`torch.cuda.graph(graph, **kwargs)` whose library workspaces belong to `graph` alone."""
    clear_library_workspaces()
    try:
        with torch.cuda.graph(graph, **kwargs):
            yield
    finally:
        clear_library_workspaces()
