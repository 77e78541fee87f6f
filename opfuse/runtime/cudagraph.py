"""Replay a whole plan as one CUDA graph: one launch from the host per inference."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from opfuse.runtime.capture import CaptureBlocked, describe, host_blockers
from opfuse.runtime.executor import Executor
from opfuse.runtime.graph_capture import graph_capture


class GraphRunner:
    """Captures `executor` once over static input buffers; each run copies inputs in and replays.

    A plan that needs the host mid-run (runtime/capture.py's blockers) is refused before any
    capture, with the reasons; callers fall back to running the plan step by step and say so in
    the report.
    """

    def __init__(self, executor: Executor, env: Mapping[str, torch.Tensor], warmup: int = 2) -> None:
        blockers = host_blockers(executor.plan)
        if blockers:
            raise CaptureBlocked(describe(blockers))
        self.executor = executor
        self.static_in = {k: v.clone() for k, v in env.items()}
        stream = torch.cuda.Stream(executor.device)
        stream.wait_stream(torch.cuda.current_stream(executor.device))
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(warmup):  # compiles every kernel outside the capture
                executor.run_tensors(dict(self.static_in))
        torch.cuda.current_stream(executor.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(executor.device)
        before = torch.cuda.memory_allocated(executor.device)
        with torch.no_grad(), graph_capture(self.graph):
            self.static_out = executor.run_tensors(dict(self.static_in))
        torch.cuda.synchronize(executor.device)
        # Activations live in the graph's private pool: what it holds is the plan's working memory.
        self.pool_bytes = int(torch.cuda.memory_allocated(executor.device) - before)

    def stage(self, env: Mapping[str, torch.Tensor]) -> None:
        """Copy one inference's inputs into the captured input buffers (enqueued, not waited on)."""
        for k, v in env.items():
            self.static_in[k].copy_(v, non_blocking=True)

    def replay(self) -> dict[str, torch.Tensor]:
        """Run the captured plan on what the input buffers hold."""
        self.graph.replay()
        return self.static_out

    def run_tensors(self, env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.stage(env)
        return self.replay()
