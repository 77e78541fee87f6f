"""The worker's device choice and job limits, without a server: `--gpu N` → the device reported and
the child's CUDA_VISIBLE_DEVICES, device kinds for job targets, the memory rlimit, and the model
checks (node count, depth, cycles, tensor sizes, read time) that run in the job's child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from client.config import ConfigError
from opfuse.errors import ModelError
from service.targets import GPU_KINDS, TARGETS, device_kind, serves
from workers.config import worker_config
from workers.devices import choose_device
from workers.limits import (
    GiB,
    ModelLimits,
    check_model_limits,
    graph_depth,
    read_model_proto,
    time_limit,
)

REPO = Path(__file__).resolve().parents[2]


def _chain(length: int, shape: list[int] | None = None) -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(length)]
    nodes[0].input[0], nodes[-1].output[0] = "x", "y"
    shape = shape or [4]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


# -- devices and targets --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "kind"),
    [
        ("cuda:0 (NVIDIA H200)", "h200"),
        ("cuda:3 (NVIDIA A100-SXM4-80GB)", "a100"),
        ("cuda:0 (NVIDIA H100 80GB HBM3)", "h100"),
        ("cuda:1 (NVIDIA GH200 480GB)", "gh200"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Tesla T4", "t4"),
        ("cuda:0 (NVIDIA L40S)", "l40s"),
        ("cpu", "cpu"),
        ("cuda:1 (NVIDIA RTX A6000)", "rtxa6000"),  # not in the list: serves `any` jobs only
    ],
)
def test_device_kind(device: str, kind: str) -> None:
    assert device_kind(device) == kind


def test_serves_matches_target_or_any() -> None:
    assert serves("cuda:0 (NVIDIA H200)", "h200") and serves("cuda:0 (NVIDIA H200)", "any")
    assert serves("cpu", None)  # a job from before targets existed
    assert not serves("cuda:0 (NVIDIA H200)", "a100") and not serves("cpu", "h200")
    assert not serves("cuda:1 (NVIDIA RTX A6000)", "rtx6000")
    assert "any" in TARGETS and "cpu" in TARGETS and "h200" in GPU_KINDS and "cpu" not in GPU_KINDS


def test_choose_device_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    names = ["NVIDIA H200", "NVIDIA H200"]
    second = choose_device(1, names)
    assert second.device == "cuda:1 (NVIDIA H200)" and second.visible_devices == "1"
    env = second.child_env({"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and "TRITON_INTERPRET" not in env
    assert choose_device(None, names).visible_devices == "0"
    # Inside an already narrowed CUDA_VISIBLE_DEVICES, --gpu counts within it.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert choose_device(1, names).visible_devices == "6"
    with pytest.raises(ConfigError, match=r"--gpu 2: this machine has 2 GPU\(s\).*pick one of 0\.\.1"):
        choose_device(2, names)


def test_choose_device_without_gpus() -> None:
    cpu = choose_device(None, [])
    assert cpu.device == "cpu" and not cpu.is_cuda
    env = cpu.child_env({})
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["TRITON_INTERPRET"] == "1"
    with pytest.raises(ConfigError, match="--gpu 0: torch sees no CUDA GPU"):
        choose_device(0, [])
    with pytest.raises(ConfigError, match="0 or more"):
        choose_device(-1, ["NVIDIA H200"])


def test_worker_config_checks_its_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPFUSE_WORKER_KEY", "opf_test")
    config = worker_config("http://api:8000", None, None, "w1", None, job_memory_gb=8, max_nodes=10)
    assert config.job_memory_bytes == 8 * GiB and config.model_limits.max_nodes == 10
    assert worker_config("http://api:8000", None, None, None, None, job_memory_gb=0).job_memory_bytes is None
    with pytest.raises(ConfigError, match="too small"):
        worker_config("http://api:8000", None, None, None, None, job_memory_gb=0.5)
    with pytest.raises(ConfigError, match="--job-timeout must be a positive"):
        worker_config("http://api:8000", None, None, None, None, job_timeout_s=0)


# -- model limits --------------------------------------------------------------------------------


def test_node_count_and_depth_limits() -> None:
    limits = ModelLimits(max_nodes=100, max_depth=50)
    check_model_limits(_chain(40), {}, limits, None)
    with pytest.raises(ModelError, match="more than 100 nodes"):
        check_model_limits(_chain(150), {}, limits, None)
    with pytest.raises(ModelError, match=r"60 nodes deep.*limit of 50"):
        check_model_limits(_chain(60), {}, limits, None)
    assert graph_depth(_chain(100_000).graph) == 100_000  # iterative: no recursion limit


def test_cycle_is_refused() -> None:
    model = _chain(3)
    model.graph.node[0].input[0] = "y"  # Relu(y) → v1 → v2 → y
    with pytest.raises(ModelError, match="cycle: 3 node"):
        graph_depth(model.graph)


def test_absurd_shapes_are_refused_before_allocation() -> None:
    limits = ModelLimits()
    with pytest.raises(ModelError, match=r"input 'x' declares shape \[1000000, 1000000\].*limit of 4 GiB"):
        check_model_limits(_chain(2, [1_000_000, 1_000_000]), {}, limits, 4 * GiB)
    dynamic = _chain(2, [1])
    dynamic.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
    with pytest.raises(ModelError, match="as given in input_shapes"):
        check_model_limits(dynamic, {"x": [2**40]}, limits, 4 * GiB)
    big = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    del big.dims[:]
    big.dims.extend([2**20, 2**20])  # declared far beyond its data
    dynamic.graph.initializer.append(big)
    with pytest.raises(ModelError, match="initializer 'w'"):
        check_model_limits(dynamic, {"x": [4]}, limits, 4 * GiB)


def test_unparseable_and_oversized_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\xff\xff\xff not a protobuf")
    with pytest.raises(ModelError, match="not an ONNX model"):
        read_model_proto(garbage, ModelLimits())
    with pytest.raises(ModelError, match="more than this worker's limit of 4"):
        read_model_proto(garbage, ModelLimits(max_model_bytes=4))


def test_time_limit_interrupts_slow_python() -> None:
    started = time.monotonic()
    with pytest.raises(ModelError, match=r"took longer than 0\.2 s"), time_limit(0.2, "reading the model"):
        while time.monotonic() - started < 10:
            pass
    assert time.monotonic() - started < 2


# -- the child process --------------------------------------------------------------------------


def test_memory_limit_turns_an_oversized_allocation_into_memory_error() -> None:
    script = (
        "from workers.limits import apply_memory_limit\n"
        "print(apply_memory_limit(1 << 30, cuda=False))\n"
        "try:\n"
        "    bytearray(2 << 30)\n"
        "except MemoryError:\n"
        "    print('MemoryError')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["RLIMIT_AS", "MemoryError"], done.stderr


def test_pipeline_child_refuses_an_over_limit_model_before_compiling(tmp_path: Path) -> None:
    model = tmp_path / "deep.onnx"
    onnx.save(_chain(300), model)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable, "-m", "workers.pipeline", "--model", str(model), "--options-json", "{}",
            "--out", str(out), "--memory-limit-bytes", str(4 * GiB),
            "--limits-json", json.dumps({"max_nodes": 1000, "max_depth": 100}),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    error = json.loads((out / "error.json").read_text())
    assert error["kind"] == "model"
    assert "300 nodes deep" in error["error"] and "--max-depth" in error["error"]


def test_worker_command_refuses_a_gpu_it_does_not_have() -> None:
    opfuse = str(Path(sys.executable).with_name("opfuse"))
    done = subprocess.run(
        [opfuse, "worker", "--api", "http://127.0.0.1:9", "--key", "opf_x", "--gpu", "7"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 2, done.stderr
    assert "--gpu 7" in done.stderr and "Traceback" not in done.stderr
