"""Generated kernels compiled for the GPU: the same models as the CPU tests, against onnxruntime."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import opfuse
from tests.builders import conv_bn_relu, residual_mlp

pytestmark = pytest.mark.gpu


def _rel_l2(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64)))


@pytest.mark.parametrize("precision, tol", [("fp32", 1e-4), ("tf32", 2e-3), ("fp16", 2e-2), ("bf16", 2e-2)])
@pytest.mark.parametrize("which", ["mlp", "conv"])
def test_models_on_gpu(which: str, precision: str, tol: float, tmp_path: Path) -> None:
    model, shapes = (
        (residual_mlp(hidden=256, ffn=1024), {"x": [64, 256]})
        if which == "mlp"
        else (conv_bn_relu(16, 32, 32), {"x": [8, 16, 32, 32]})
    )
    cm = opfuse.compile(model, input_shapes=shapes, precision=precision, device="cuda")
    assert cm.report["device"]["kind"] == "cuda"
    assert cm.report["verification"]["passed"] is True
    assert cm.report["kernels"]["after"] < cm.report["kernels"]["before"]
    cm.save(tmp_path / "m.zip")
    loaded = opfuse.load(tmp_path / "m.zip", device="cuda")
    rng = np.random.default_rng()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        x = rng.standard_normal(shapes["x"]).astype(np.float32)
        out = loaded.run({"x": x})["y"]
        ref = sess.run(None, {"x": x})[0]
        assert np.all(np.isfinite(out))
        assert _rel_l2(out, ref) <= tol


def test_benchmark_fills_the_report() -> None:
    cm = opfuse.compile(residual_mlp(hidden=512, ffn=2048), input_shapes={"x": [256, 512]}, device="cuda")
    r = cm.benchmark(iters=20, warmup=3)
    for side in ("before", "after"):
        assert r[side]["latency_ms"]["p50"] > 0
        assert r[side]["peak_memory_bytes"] is not None
    assert r["speedup"] is not None
    # The CUDA graph is timed around its replay alone, as a peer's graph is; the rest run whole.
    assert r["after"]["cuda_graph"] and r["after"]["timed"] == "replay"
    assert r["before"]["timed"] == "run" and r["after_stepwise"]["timed"] == "run"


def test_a_staged_replay_computes_the_staged_inputs() -> None:
    """GraphRunner.stage then replay (what the benchmark times) gives each input set's own outputs."""
    import torch

    from opfuse.runtime.cudagraph import GraphRunner

    cm = opfuse.compile(residual_mlp(hidden=64, ffn=128), input_shapes={"x": [32, 64]}, device="cuda")
    rng = np.random.default_rng(4)
    sets = [
        cm.executor.prepare_inputs({"x": rng.standard_normal((32, 64)).astype(np.float32)}) for _ in range(3)
    ]
    runner = GraphRunner(cm.executor, sets[0])
    outs = []
    for env in sets[1:] + sets[:1]:
        want = {k: v.clone() for k, v in cm.executor.run_tensors(dict(env)).items()}
        runner.stage(env)
        got = runner.replay()
        # Close, not bitwise: a library GEMM captured in a graph has a workspace of its own
        # (runtime/graph_capture.py), and may pick another algorithm than the eager run's.
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=k)
        outs.append(got["y"].clone())
    # Each set its own outputs: a stale input would replay the set before it.
    assert all(not torch.allclose(a, b, rtol=1e-2, atol=1e-2) for a, b in itertools.pairwise(outs))


@pytest.mark.parametrize(
    "channels, size, kernel, stride, precision",
    [(72, 16, 3, 2, "fp32"), (72, 16, 3, 2, "fp16"), (96, 14, 7, 1, "fp32"), (240, 28, 5, 1, "fp16")],
)
def test_depthwise_conv_is_right_at_every_candidate_config(
    channels: int, size: int, kernel: int, stride: int, precision: str
) -> None:
    """The depthwise template at its default and every tuning candidate, each launched on its own
    against torch's convolution: Triton once miscompiled one form of it at some tile sizes only."""
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.candidates import candidates
    from tests.builders import depthwise_conv_relu

    torch.backends.cudnn.allow_tf32 = False
    model = depthwise_conv_relu(channels, kernel, stride)
    cm = opfuse.compile(
        model,
        input_shapes={"x": [2, channels, size, size]},
        precision=precision,
        device="cuda",
        verify=False,
        tune_budget_s=0,
    )
    (k,) = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
    assert "depthwise" in k.source
    module = load_kernel_module(k.source, interpret=False)
    dtype = torch.float32 if precision == "fp32" else torch.float16
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, channels, size, size, device="cuda", generator=gen)
    w = torch.randn(channels, 1, kernel, kernel, device="cuda", generator=gen)
    b = torch.randn(channels, device="cuda", generator=gen)
    want = torch.relu(
        torch.nn.functional.conv2d(x, w, b, stride=stride, padding=kernel // 2, groups=channels)
    )
    want = want.permute(0, 2, 3, 1).contiguous()
    xn, wn = x.permute(0, 2, 3, 1).contiguous().to(dtype), w.permute(0, 2, 3, 1).contiguous().to(dtype)
    tol = 1e-4 if precision == "fp32" else 2e-2
    bad = []
    # Beyond the tuning candidates, the tiles at which one form of this kernel once went wrong.
    tiles = [(64, 32, 4), (32, 32, 4), (64, 128, 4), (128, 128, 8), (16, 64, 4), (64, 64, 8), (32, 128, 4)]
    more = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": 3} for m, n, w in tiles]
    for cand in [{}, *candidates(k), *more]:
        config = {**k.config, **cand}
        out = torch.full(want.shape, float("nan"), device="cuda", dtype=dtype)
        module.launch(xn, wn, b.to(dtype), out, config=config)
        torch.cuda.synchronize()
        wrong = int((~torch.isclose(out.float(), want, rtol=tol, atol=tol)).sum())
        if wrong:
            bad.append((config, wrong))
    assert not bad, f"wrong outputs (of {want.numel()}) at {bad}"


def test_compile_only_compiles_and_runs_nothing() -> None:
    """The compile workers' candidate pass: a launch under `_compile_only` leaves its outputs as
    they were, yet the kernel is compiled (the next launch finds it in the JIT's cache)."""
    import torch

    from opfuse.runtime.kernels import load_kernel_module
    from opfuse.tuning.pool import _compile_only
    from tests.unit.test_tuning import HELPER_SOURCE

    module = load_kernel_module(HELPER_SOURCE.replace("add_one", "add_one_compile_only"), False)
    x = torch.randn(4096, device="cuda")
    out = torch.full((4096,), 7.0, device="cuda")
    with _compile_only(module, False):
        module.launch(x, out, config={"BLOCK": 256})
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 7.0))
    fn = module.add_one_compile_only
    caches = getattr(fn, "device_caches", None)
    if caches is not None:  # the JIT's per-device kernel cache (Triton 3)
        assert any(len(entry[0]) == 1 for entry in caches.values())
    module.launch(x, out, config={"BLOCK": 256})
    assert torch.equal(out, x + 1.0)


def test_out_of_range_indices_are_clamped_on_the_gpu_and_the_model_runs_on() -> None:
    """docs/ops.md: on a GPU an index outside [-n, n-1] is clamped (no host sync); no kernel reads
    outside the tensor, and the next run with valid indices is right (no sticky CUDA error)."""
    from onnx import TensorProto, helper, numpy_helper

    gather = helper.make_node("Gather", ["data", "ids"], ["g"], name="pick")
    mul = helper.make_node("Mul", ["g", "two"], ["y"], name="double")
    graph = helper.make_graph(
        [gather, mul],
        "g",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, [6, 5]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [3, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4, 5])],
        [numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    cm = opfuse.compile(model, input_shapes={"data": [6, 5], "ids": [3, 4]}, device="cuda")
    assert cm.report["verification"]["passed"] is True
    rng = np.random.default_rng(4)
    data = rng.standard_normal((6, 5)).astype(np.float32)
    bad = rng.integers(-40, 40, size=(3, 4)).astype(np.int64)
    bad[0, 0], bad[0, 1] = -7, 9
    wrapped = np.where(bad < 0, bad + 6, bad).clip(0, 5)
    got = np.asarray(cm.run({"data": data, "ids": bad})["y"])
    np.testing.assert_array_equal(got, 2 * data[wrapped])
    ok = rng.integers(-6, 6, size=(3, 4)).astype(np.int64)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(
        np.asarray(cm.run({"data": data, "ids": ok})["y"]), sess.run(None, {"data": data, "ids": ok})[0]
    )


def test_profiling_a_step_that_launches_nothing_warns_of_no_empty_graph() -> None:
    """A Reshape runs as a view: its profile capture holds no kernel. torch's "CUDA Graph is
    empty" warning said nothing about the plan and filled every corpus log; the step's time is
    ~0 without it."""
    import warnings

    from onnx import helper

    from tests.builders import tiny_model

    n = helper.make_node
    model = tiny_model(
        [n("Relu", ["x"], ["r"]), n("Reshape", ["r", "shape"], ["v"]), n("Sigmoid", ["v"], ["y"])],
        {"x": [8, 64]},
        {"y": [16, 32]},
        {"shape": np.array([16, 32], np.int64)},
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cm = opfuse.compile(model, input_shapes={"x": [8, 64]}, device="cuda", tune_budget_s=0)
    assert cm.report["verification"]["passed"] is True
    assert not [w for w in seen if "CUDA Graph is empty" in str(w.message)], [str(w.message) for w in seen]
