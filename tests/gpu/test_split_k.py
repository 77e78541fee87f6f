"""Split-K convolutions on the GPU: two plans sharing one generated kernel module, run at once on
two streams, each right (each executor keeps its own scratch and counters), and a plan's CUDA
graph replayed many times, right every time (the counters go back to 0 in each launch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import opfuse
from tests.unit.test_conv import residual_conv
from tests.unit.test_fusion import NHWC_ALWAYS, ort_run

pytestmark = pytest.mark.gpu

SHAPES = {"x": [1, 256, 7, 7], "r": [1, 256, 7, 7]}


def _split_plan() -> tuple[opfuse.CompiledModel, str]:
    cm = opfuse.compile(
        residual_conv(256, 256, 7), SHAPES, "fp16", device="cuda", tune_budget_s=0, fusion_disable=NHWC_ALWAYS
    )
    (kid,) = [kid for kid, k in cm.plan.kernels.items() if k.kind == "conv"]
    cm.executor.configs[kid] = {**cm.plan.kernels[kid].config, "BLOCK_M": 32, "BLOCK_N": 64, "SPLIT_K": 8}
    return cm, kid


def _feeds(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def _err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def test_split_k_runs_on_two_streams_at_once() -> None:
    model = residual_conv(256, 256, 7)
    plans = [_split_plan() for _ in range(2)]
    assert plans[0][0].executor.modules[plans[0][1]] is plans[1][0].executor.modules[plans[1][1]]
    feeds = [_feeds(i) for i in range(2)]
    wants = [ort_run(model, f)[0] for f in feeds]
    for (cm, _), f in zip(plans, feeds, strict=True):
        cm.executor.run(f)  # compiled, and each executor's scratch made
    on_gpu = [{k: torch.from_numpy(v).cuda() for k, v in f.items()} for f in feeds]  # torch in, torch out
    streams = [torch.cuda.Stream() for _ in plans]
    outs: list[list[torch.Tensor]] = [[], []]
    torch.cuda.synchronize()
    for _ in range(20):
        for i, ((cm, _), s) in enumerate(zip(plans, streams, strict=True)):
            with torch.cuda.stream(s):
                out = cm.executor.run(on_gpu[i])[cm.plan.outputs[0].name]  # no sync: both in flight
                outs[i].append(out.clone())
    torch.cuda.synchronize()
    assert plans[0][0].executor.scratch and plans[0][0].executor.scratch is not plans[1][0].executor.scratch
    for i in range(2):
        for out in outs[i]:
            assert _err(out.float().cpu().numpy(), wants[i]) < 2e-2


def test_a_split_k_cuda_graph_replays_right() -> None:
    model = residual_conv(256, 256, 7)
    cm, kid = _split_plan()
    feeds = _feeds(3)
    want = ort_run(model, feeds)[0]
    for _ in range(30):
        got = np.asarray(cm.run(feeds)[cm.plan.outputs[0].name], dtype=np.float32)
        assert _err(got, want) < 2e-2
    assert cm.executor.scratch and cm.executor.modules[kid].SCRATCH == {}
    for key, (_ws, lock) in cm.executor.scratch.items():
        assert int(lock.abs().sum()) == 0, key
