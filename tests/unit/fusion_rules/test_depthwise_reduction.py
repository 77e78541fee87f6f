"""`depthwise_reduction` (opfuse/fusion/rules/depthwise_reduction.py) on a tiny graph: a depthwise
conv, its activation, and the mean over its pixels (squeeze-excitation's squeeze); a pool before a
norm over each image (PoolFormer's token mixer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn

import opfuse
from opfuse.frontend import rule_registry as names
from tests.builders import TEST_DEVICE, assert_every_config, claimed, planned, refusals, tiny_model, weights

n = helper.make_node


def squeeze(read_outside: bool) -> object:
    nodes = [
        n("Conv", ["x", "wd", "bd"], ["d"], name="dw", group=8, pads=[1, 1, 1, 1]),
        n("Relu", ["d"], ["r"], name="relu"),
        n("ReduceMean", ["r", "axes"], ["y"], name="mean", keepdims=1),
    ]
    outputs = {"y": [1, 8, 1, 1]}
    if read_outside:
        nodes.append(n("Conv", ["d", "w"], ["z"], name="other"))
        outputs["z"] = [1, 4, 6, 6]
    return tiny_model(
        nodes,
        {"x": [1, 8, 6, 6]},
        outputs,
        {
            "wd": weights(8, 1, 3, 3),
            "bd": weights(8, seed=1),
            "w": weights(4, 8, 1, 1, seed=2),
            "axes": np.array([2, 3]),
        },
    )


def test_the_depthwise_conv_is_computed_on_the_row_kernels_tiles() -> None:
    _, plan = planned(squeeze(False))
    rule = f"{names.ROW_REDUCTION}+{names.DEPTHWISE_REDUCTION}"
    assert [(kind, r, nodes) for kind, r, nodes in claimed(plan) if kind == "rowwise"] == [
        ("rowwise", rule, ["dw", "relu", "mean"])
    ]
    assert plan.lone == []  # the lone depthwise conv is the row group's prologue now


def test_a_depthwise_output_read_outside_the_row_kernel_is_refused() -> None:
    _, plan = planned(squeeze(True))
    assert refusals(plan, names.DEPTHWISE_REDUCTION) == [
        (["dw", "mean"], "the depthwise conv's output is read outside the row kernel too")
    ]
    assert all(names.DEPTHWISE_REDUCTION not in rule for _, rule, _ in claimed(plan))


# A pool is a window op too: PoolFormer's token mixer, pool(y) - y between two norms over each
# image (GroupNorm with one group), computed on the second norm's tiles.


class PoolMixer(nn.Module):
    """x = embed(x); x + s * (pool(norm1(x)) - norm1(x)), then norm2: PoolFormer's patch
    embedding (whose conv puts the block in the channels-last region), its mixer and next norm,
    both GroupNorm(1, C) (a norm over each image); `pool` "avg" (3x3, stride 1, not counting the
    padding, as PoolFormer's), "max" or "dw" (a 3x3 depthwise conv)."""

    def __init__(self, pool: str, c: int = 8) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, c, 3, padding=1)
        self.norm1, self.norm2 = nn.GroupNorm(1, c), nn.GroupNorm(1, c)
        if pool == "avg":
            self.pool: nn.Module = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        elif pool == "max":
            self.pool = nn.MaxPool2d(3, 1, 1)
        else:  # a depthwise conv in the pool's place
            self.pool = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.scale = nn.Parameter(torch.rand(c, 1, 1) + 0.5)
        for norm in (self.norm1, self.norm2):
            nn.init.uniform_(norm.weight, 0.5, 1.5)
            nn.init.uniform_(norm.bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        y = self.norm1(x)
        return self.norm2(x + self.scale * (self.pool(y) - y))


def _pool_mixer(pool: str, dynamo: bool, tmp_path: Path) -> tuple[onnx.ModelProto, dict[str, list[int]]]:
    from tests.unit.test_default_export import export

    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 7)
    return export(PoolMixer(pool), (x,), tmp_path / "m.onnx", dynamo=dynamo), {"x": [2, 3, 6, 7]}


@pytest.mark.parametrize("dynamo", [True, False])
@pytest.mark.parametrize("pool", ["avg", "max", "dw"])
def test_a_pool_is_computed_on_the_tiles_of_a_norm_over_each_image(
    pool: str, dynamo: bool, tmp_path: Path
) -> None:
    model, _ = _pool_mixer(pool, dynamo, tmp_path)
    _, plan = planned(model)
    rule = f"{names.ROW_REDUCTION}+{names.DEPTHWISE_REDUCTION}"
    (row,) = [g for g in plan.groups if g.rule == rule]
    assert row.prologue[0].op_type.endswith("PoolNHWC" if pool != "dw" else "ConvNHWC")
    assert plan.lone == []  # the embedding's conv is computed in the first norm's kernel (gemm_reduction)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("pool", ["avg", "max", "dw"])
def test_the_pool_form_computes_what_onnxruntime_does(pool: str, precision: str, tmp_path: Path) -> None:
    """Every element against onnxruntime, at the row kernel's config and each tuning candidate's:
    two kernels: the conv with the first norm (gemm_reduction's item form), then the pool, the
    mixer's arithmetic and the second norm."""
    model, shapes = _pool_mixer(pool, True, tmp_path)
    # Untuned (the one kernel, not its split form); in fp32 on the GPU the embedding's dense conv
    # would keep the block NCHW (fp32_dense_nchw), where no pool is NHWC: off, as on the CPU.
    off = (names.FP32_DENSE_NCHW,)
    cm = opfuse.compile(
        model,
        input_shapes=shapes,
        precision=precision,
        device=TEST_DEVICE,
        tune_budget_s=0,
        fusion_disable=off,
    )
    assert cm.report["verification"]["passed"] is True
    assert sum(1 for s in cm.plan.steps if s.launches) == 2
    what = "depthwise conv" if pool == "dw" else "pool"
    (k,) = [k for k in cm.plan.kernels.values() if f"prologue: {what} on the tiles" in k.source]
    assert_every_config(cm, model, k, shapes, precision, seed=4)
