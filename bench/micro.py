"""Kernel-level targets on one GPU: memory-bound kernels against copy bandwidth, GEMM groups against
torch.matmul.

    PYTHONPATH=. python bench/micro.py                    # the device machine
    PYTHONPATH=. python bench/micro.py --device cpu --small   # a smoke run of the code (no speed)

- bandwidth: fused memory-bound groups (pointwise chain, softmax row, skip-LayerNorm row) on
  tensors of >= 64 MB, timed as the plan's one kernel step (CUDA graph of launches, CUDA events);
  achieved bytes/s against `torch`'s device-to-device copy of the same bytes.
- gemm: MatMul + bias + ReLU at zoo shapes; opfuse's template and the vendor variant (library
  GEMM + epilogue kernel), as the tuner measured them, against torch.matmul + bias + ReLU in eager
  torch and torch.matmul alone (TFLOP/s of the MatMul).
- tiles: the templates whose tile loads gather (a 3x3 depthwise conv + ReLU at the corpus's
  channels-last shapes, a batched MatMul + ReLU); opfuse's template and vendor form as the tuner
  measured them, and the plan's kernels, against torch's conv (channels-last) or bmm + ReLU
  captured in a CUDA graph. The depthwise template loaded its tile one element per lane until
  its offsets' runs were restated (codegen.source.in_bounds): this is the A/B of that.
- splits: the GEMV-shaped convs of a video network's last stages at batch 1 (r2plus1d_18 and
  r3d_18 at the corpus's input: a few output pixels, K in the thousands) + ReLU; the template at
  its start config (codegen.fragments.start_split) and at each tuning candidate, its kernel's device
  time, against torch's conv channels-first and channels-last in a CUDA graph.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.runtime.executor import Executor
from opfuse.tuning.pool import cuda_graph_ms

BANDWIDTH_CASES = {
    # name: (op chain, shape)
    "pointwise x*a+b, relu": ("pointwise", (64, 1024, 1024)),
    "softmax rows": ("softmax", (32768, 2048)),
    "residual + layernorm rows": ("skip_ln", (32768, 2048)),
}
GEMM_CASES = {  # name: (M, K, N)
    "bert-base ffn1 b32": (4096, 768, 3072),
    "vit-b/16 qkv b32": (6304, 768, 2304),
    "llama-small mlp b1": (128, 1024, 2816),
    "resnet-like 1x1 b32": (25088, 256, 1024),
}


TILE_CASES = {
    # name: (kind, NCHW input or [B, M, K], channels or N)
    "depthwise 3x3 [1, 128, 16, 16]": ("depthwise", (1, 128, 16, 16), 0),
    "depthwise 3x3 [32, 128, 16, 16]": ("depthwise", (32, 128, 16, 16), 0),
    "depthwise 3x3 [8, 96, 56, 56]": ("depthwise", (8, 96, 56, 56), 0),
    "batched matmul [64, 196, 64] x 196": ("bmm", (64, 196, 64), 196),
}


def _model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, tuple[int, ...]],
    out: tuple[int, ...],
    inits: dict[str, np.ndarray],
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "micro",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v)) for k, v in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out))],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m


def bandwidth_model(kind: str, shape: tuple[int, ...]) -> tuple[onnx.ModelProto, dict[str, tuple[int, ...]]]:
    rng = np.random.default_rng(0)
    last = shape[-1]
    if kind == "pointwise":
        nodes = [
            helper.make_node("Mul", ["x", "a"], ["m"]),
            helper.make_node("Add", ["m", "b"], ["s"]),
            helper.make_node("Relu", ["s"], ["y"]),
        ]
        return _model(
            nodes, {"x": shape}, shape, {"a": rng.standard_normal(last), "b": rng.standard_normal(last)}
        ), {"x": shape}
    if kind == "softmax":
        return _model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": shape}, shape, {}), {
            "x": shape
        }
    nodes = [
        helper.make_node("Add", ["x", "r"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1),
    ]
    inits = {"g": rng.uniform(0.5, 1.5, last), "b": rng.standard_normal(last)}
    return _model(nodes, {"x": shape, "r": shape}, shape, inits), {"x": shape, "r": shape}


def gemm_model(m: int, k: int, n: int) -> tuple[onnx.ModelProto, dict[str, tuple[int, ...]]]:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "bias"], ["z"]),
        helper.make_node("Relu", ["z"], ["y"]),
    ]
    inits = {"w": rng.standard_normal((k, n)) / k**0.5, "bias": rng.standard_normal(n) * 0.1}
    return _model(nodes, {"x": (m, k)}, (m, n), inits), {"x": (m, k)}


def tile_model(
    kind: str, shape: tuple[int, ...], n: int
) -> tuple[onnx.ModelProto, dict[str, tuple[int, ...]]]:
    """The case's model and its input shapes."""
    rng = np.random.default_rng(0)
    if kind == "depthwise":
        c = shape[1]
        nodes = [
            helper.make_node("Conv", ["x", "w"], ["h"], group=c, pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["h"], ["y"]),
        ]
        weight = {"w": rng.standard_normal((c, 1, 3, 3)) / 3}
        return _model(nodes, {"x": shape}, shape, weight), {"x": shape}
    b, m, k = shape
    nodes = [helper.make_node("MatMul", ["x", "z"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    ins = {"x": shape, "z": (b, k, n)}
    return _model(nodes, ins, (b, m, n), {}), ins


SPLIT_CASES = {
    # name: (input [N, C, D, H, W], output channels, kernel, pads at each end)
    "r2plus1d_18 layer 4 (1,3,3) 512->1152": ((1, 512, 1, 2, 2), 1152, (1, 3, 3), (0, 1, 1)),
    "r2plus1d_18 layer 4 (3,1,1) 1152->512": ((1, 1152, 1, 2, 2), 512, (3, 1, 1), (1, 0, 0)),
    "r2plus1d_18 layer 3 (1,3,3) 256->576": ((1, 256, 1, 4, 4), 576, (1, 3, 3), (0, 1, 1)),
    "r3d_18 layer 4 (3,3,3) 512->512": ((1, 512, 1, 2, 2), 512, (3, 3, 3), (1, 1, 1)),
}


def split_model(
    shape: tuple[int, ...], cout: int, kernel: tuple[int, ...], pads: tuple[int, ...]
) -> tuple[onnx.ModelProto, dict[str, tuple[int, ...]]]:
    """Relu(Conv(x) + bias), the conv unstrided; its model and input shapes."""
    rng = np.random.default_rng(0)
    cin = shape[1]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[*pads, *pads]),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    out = (shape[0], cout, *[d + 2 * p - k + 1 for d, k, p in zip(shape[2:], kernel, pads, strict=True)])
    inits = {"w": rng.standard_normal((cout, cin, *kernel)) / (cin * np.prod(kernel)) ** 0.5}
    inits["b"] = rng.standard_normal(cout) * 0.1
    return _model(nodes, {"x": shape}, out, inits), {"x": shape}


def kernel_step_ms(cm: opfuse.CompiledModel, shapes: dict[str, tuple[int, ...]]) -> tuple[float, int]:
    """Device time of the plan's generated kernels (views cost nothing) and how many there are."""
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    executor = Executor(cm.plan, cm.device)
    times = executor.time_steps(feeds)
    ks = [t for s, t in zip(cm.plan.steps, times, strict=True) if s.kind == "kernel"]
    return float(sum(ks)), len(ks)


def _measured(cm: opfuse.CompiledModel, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The plan's kernel time and count, whether it verified, and the one group's variant as
    tuning measured it (template against vendor or split form), where tuning ran."""
    ms, kernels = kernel_step_ms(cm, shapes)
    row: dict[str, Any] = {
        "opfuse_ms": ms,
        "kernels": kernels,
        "verified": cm.report["verification"]["passed"],
    }
    variants = cm.report.get("tuning", {}).get("variants", {})
    if variants:
        (v,) = variants.values()
        row.update(choice=v.get("choice"), template_ms=v.get("template_ms"), vendor_ms=v.get("vendor_ms"))
    return row


def _linear_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.matmul(x, w) + b)


def bandwidth(device: str, small: bool) -> list[dict[str, Any]]:
    rows = []
    for name, (kind, shape) in BANDWIDTH_CASES.items():
        if small:
            shape = tuple(max(1, d // 256) for d in shape)
        model, shapes = bandwidth_model(kind, shape)
        cm = opfuse.compile(model, {k: list(v) for k, v in shapes.items()}, precision="fp16", device=device)
        ms, kernels = kernel_step_ms(cm, shapes)
        nbytes = 2 * (sum(int(np.prod(v)) for v in shapes.values()) + int(np.prod(shape)))  # fp16 in + out
        row: dict[str, Any] = {
            "case": name,
            "shape": list(shape),
            "kernels": kernels,
            "ms": ms,
            "bytes": nbytes,
        }
        row["verified"] = cm.report["verification"]["passed"]
        row["tb_per_s"] = nbytes / (ms * 1e-3) / 1e12 if ms > 0 else None
        if device.startswith("cuda"):
            src = torch.empty(nbytes // 4, dtype=torch.float16, device=device)
            dst = torch.empty_like(src)  # a copy of the same bytes moved: nbytes/2 read + nbytes/2 written
            copy_ms = cuda_graph_ms(functools.partial(dst.copy_, src), reps=20)
            row["copy_tb_per_s"] = nbytes / (copy_ms * 1e-3) / 1e12
            row["fraction_of_copy"] = row["tb_per_s"] / row["copy_tb_per_s"]
        rows.append(row)
        _print_bandwidth(row)
    return rows


def gemm(device: str, small: bool, budget: float) -> list[dict[str, Any]]:
    rows = []
    for name, (m, k, n) in GEMM_CASES.items():
        if small:
            m, k, n = max(16, m // 256), max(16, k // 32), max(16, n // 64)
        model, shapes = gemm_model(m, k, n)
        cm = opfuse.compile(
            model,
            {"x": [m, k]},
            precision="fp16",
            device=device,
            tune_budget_s=budget if device.startswith("cuda") else None,
        )
        row: dict[str, Any] = {"case": name, "mkn": [m, k, n]}
        flops = 2.0 * m * n * k
        row.update(_measured(cm, shapes))
        if device.startswith("cuda"):
            x = torch.randn(m, k, device=device, dtype=torch.float16)
            w = torch.randn(k, n, device=device, dtype=torch.float16)
            b = torch.randn(n, device=device, dtype=torch.float16)
            mm_ms = cuda_graph_ms(functools.partial(torch.matmul, x, w), reps=20)
            row["torch_matmul_ms"] = mm_ms
            row["torch_eager_group_ms"] = cuda_graph_ms(functools.partial(_linear_relu, x, w, b), reps=20)
            row["torch_matmul_tflops"] = flops / (mm_ms * 1e-3) / 1e12
            if row.get("template_ms"):
                row["template_tflops"] = flops / (row["template_ms"] * 1e-3) / 1e12
                row["template_vs_matmul"] = row["template_tflops"] / row["torch_matmul_tflops"]
        rows.append(row)
        _print_gemm(row)
    return rows


def tiles(device: str, small: bool, budget: float) -> list[dict[str, Any]]:
    rows = []
    for name, (kind, shape, n) in TILE_CASES.items():
        if small:
            shape = (shape[0], max(8, shape[1] // 16), *[max(4, d // 8) for d in shape[2:]])
            n = max(8, n // 16)
        model, shapes = tile_model(kind, shape, n)
        cm = opfuse.compile(
            model,
            {k: list(v) for k, v in shapes.items()},
            precision="fp16",
            device=device,
            fusion_disable=("fp32_dense_nchw",),
            tune_budget_s=budget if device.startswith("cuda") else None,
        )
        row: dict[str, Any] = {"case": name, "shape": list(shape), **_measured(cm, shapes)}
        ms, kernels = row["opfuse_ms"], row["kernels"]
        if device.startswith("cuda"):
            if kind == "depthwise":
                x = torch.randn(*shape, device=device, dtype=torch.float16).contiguous(
                    memory_format=torch.channels_last
                )
                w = torch.randn(shape[1], 1, 3, 3, device=device, dtype=torch.float16).contiguous(
                    memory_format=torch.channels_last
                )
                fn = functools.partial(_depthwise_relu, x, w)
            else:
                a = torch.randn(*shape, device=device, dtype=torch.float16)
                z = torch.randn(shape[0], shape[2], n, device=device, dtype=torch.float16)
                fn = functools.partial(_bmm_relu, a, z)
            row["torch_ms"] = cuda_graph_ms(fn, reps=20)
            row["vs_torch"] = ms / row["torch_ms"] if row["torch_ms"] else None
        rows.append(row)
        vs = row.get("vs_torch")
        print(
            f"{name:<36} opfuse {ms:.4f} ms in {kernels} kernel(s) ({row.get('choice', '-')})"
            + (f", {vs:.2f}x torch" if vs else ""),
            flush=True,
        )
    return rows


def splits(device: str, small: bool) -> list[dict[str, Any]]:
    """Each case compiled without tuning (its start config runs), then its conv kernel timed at
    every tuning candidate (the start alone on the CPU: a smoke run)."""
    from opfuse.tuning.candidates import candidates

    rows = []
    for name, (shape, cout, kernel, pads) in SPLIT_CASES.items():
        if small:
            shape, cout = (shape[0], shape[1] // 16, *shape[2:]), cout // 16
        model, shapes = split_model(shape, cout, kernel, pads)
        cm = opfuse.compile(model, {k: list(v) for k, v in shapes.items()}, precision="fp16", device=device)
        (k,) = [k for k in cm.plan.kernels.values() if k.kind == "conv"]
        executor = Executor(cm.plan, cm.device)
        feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
        timed: list[tuple[float, dict[str, Any]]] = []
        cands: list[dict[str, Any]] = [{}, *(candidates(k) if device.startswith("cuda") else [])]
        for cand in cands:
            config = {**k.config, **cand}
            executor.configs[k.id] = config
            times = executor.time_steps(feeds)
            ms = sum(t for s, t in zip(cm.plan.steps, times, strict=True) if s.kernel == k.id)
            timed.append(
                (ms, {c: config[c] for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K") if c in config})
            )
        best = min(timed, key=lambda t: t[0])
        row: dict[str, Any] = {
            "case": name,
            "shape": list(shape),
            "verified": cm.report["verification"]["passed"],
            "start_ms": timed[0][0],
            "start": timed[0][1],
            "best_ms": best[0],
            "best": best[1],
            "configs": [[ms, c] for ms, c in timed],
        }
        if device.startswith("cuda"):
            x = torch.randn(*shape, device=device, dtype=torch.float16)
            w = torch.randn(cout, shape[1], *kernel, device=device, dtype=torch.float16)
            b = torch.randn(cout, device=device, dtype=torch.float16)
            row["torch_ms"] = cuda_graph_ms(functools.partial(_conv3d_relu, x, w, b, pads), reps=20)
            last = torch.channels_last_3d
            xl, wl = x.contiguous(memory_format=last), w.contiguous(memory_format=last)
            row["torch_channels_last_ms"] = cuda_graph_ms(
                functools.partial(_conv3d_relu, xl, wl, b, pads), reps=20
            )
        rows.append(row)
        print(
            f"{name:<40} start {row['start_ms']:.4f} ms {row['start']}, best {row['best_ms']:.4f} ms {row['best']}"
            + (
                f"; torch {row['torch_ms']:.4f} / channels-last {row['torch_channels_last_ms']:.4f} ms"
                if "torch_ms" in row
                else ""
            ),
            flush=True,
        )
    return rows


def _conv3d_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, pads: tuple[int, ...]) -> torch.Tensor:
    return torch.relu(torch.nn.functional.conv3d(x, w, b, padding=pads))


def _depthwise_relu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.nn.functional.conv2d(x, w, None, 1, 1, 1, x.shape[1]))


def _bmm_relu(a: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.bmm(a, z))


def _print_bandwidth(r: dict[str, Any]) -> None:
    frac = r.get("fraction_of_copy")
    print(
        f"{r['case']:<28} {r['shape']!s:<20} {r['kernels']} kernel(s) {r['ms']:.4f} ms "
        f"{(r['tb_per_s'] or 0):.2f} TB/s" + (f" = {frac:.0%} of copy" if frac else ""),
        flush=True,
    )


def _print_gemm(r: dict[str, Any]) -> None:
    ratio = r.get("template_vs_matmul")
    print(
        f"{r['case']:<28} {r['mkn']!s:<20} opfuse {r['opfuse_ms']:.4f} ms ({r.get('choice', '-')})"
        + (f", template at {ratio:.0%} of torch.matmul TFLOP/s" if ratio else ""),
        flush=True,
    )


SECTIONS: dict[str, Any] = {
    "bandwidth": lambda a: bandwidth(a.device, a.small),
    "gemm": lambda a: gemm(a.device, a.small, a.tune_budget),
    "tiles": lambda a: tiles(a.device, a.small, a.tune_budget),
    "splits": lambda a: splits(a.device, a.small),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes: a smoke run of the code")
    ap.add_argument("--tune-budget", type=float, default=20.0)
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--sections",
        default="bandwidth,gemm,tiles,splits",
        help="comma-separated: bandwidth, gemm, tiles, splits (default all)",
    )
    args = ap.parse_args()
    wanted = set(args.sections.split(","))
    unknown = wanted - set(SECTIONS)
    if unknown:
        sys.exit(f"bench/micro.py: unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/micro.py needs a CUDA GPU (or --device cpu --small for a smoke run)")
    result = {name: SECTIONS[name](args) for name in SECTIONS if name in wanted}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
