"""`col2im_to_views` (opfuse/passes/col2im.py): Col2Im of blocks that tile the image is a
permutation, computed as onnxruntime computes the Col2Im; other Col2Ims stay."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.col2im import col2im_to_views
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model

n = helper.make_node


def fold(
    image: list[int], block: list[int], strides: list[int], pads: list[int] | None = None, channels: int = 3
) -> onnx.ModelProto:
    nd = len(image)
    pads = pads or [0] * 2 * nd
    padded = [image[d] + pads[d] + pads[d + nd] for d in range(nd)]
    counts = [(padded[d] - block[d]) // strides[d] + 1 for d in range(nd)]
    x = [2, channels * int(np.prod(block)), int(np.prod(counts))]
    return tiny_model(
        [n("Col2Im", ["x", "image", "block"], ["y"], name="fold", strides=strides, pads=pads)],
        {"x": x},
        {"y": [2, channels, *image]},
        {"image": np.array(image), "block": np.array(block)},
    )


@pytest.mark.parametrize(
    ("image", "block"),
    [
        ([8, 8], [2, 2]),  # MobileViT V2's fold of 2x2 patches
        ([6, 12], [3, 4]),  # blocks of another shape than square
        ([4, 6], [1, 2]),
        ([12], [3]),  # one spatial dim
    ],
)
def test_blocks_that_tile_the_image_are_a_permutation(image: list[int], block: list[int]) -> None:
    model = fold(image, block, block)
    graph = graph_of(model)
    log = run_pass(graph, col2im_to_views)
    assert ops(graph) == ["Reshape", "Transpose", "Reshape"] and log.fired == {names.COL2IM_TO_VIEWS: 1}
    assert_computes_as_onnxruntime(model, graph)


@pytest.mark.parametrize(
    ("strides", "pads", "why"),
    [
        ([1, 1], None, "the strides differ from the block shape"),  # overlapping blocks are summed
        ([3, 3], None, "the strides differ from the block shape"),  # gaps between blocks
        ([2, 2], [1, 1, 1, 1], "the image is padded"),
    ],
)
def test_other_col2ims_stay(strides: list[int], pads: list[int] | None, why: str) -> None:
    model = fold([6, 6], [2, 2], strides, pads)
    graph = graph_of(model)
    log = run_pass(graph, col2im_to_views)
    assert ops(graph) == ["Col2Im"]
    assert [r.reason[: len(why)] for r in log.not_fired] == [why]
    assert_computes_as_onnxruntime(model, graph)


def test_a_fold_between_convolutions_compiles_to_what_onnxruntime_computes() -> None:
    """MobileViT V2's fold in context: patches from a 1x1 conv's output ([N, C * 4, L]), folded
    back into the image, then a 1x1 conv: every output element against onnxruntime."""
    from tests.builders import weights
    from tests.unit.test_fusion import check_against_ort

    model = tiny_model(
        [
            n("Conv", ["x", "w1"], ["p"], name="proj"),
            n("Reshape", ["p", "cols"], ["c"], name="to_columns"),
            n("Col2Im", ["c", "image", "block"], ["f"], name="fold", strides=[2, 2]),
            n("Conv", ["f", "w2", "b2"], ["y"], name="conv"),
        ],
        {"x": [2, 4, 4, 4]},
        {"y": [2, 6, 8, 8]},
        {
            "w1": weights(20, 4, 1, 1),
            "cols": np.array([2, 20, 16]),
            "image": np.array([8, 8]),
            "block": np.array([2, 2]),
            "w2": weights(6, 5, 1, 1, seed=1),
            "b2": weights(6, seed=2),
        },
    )
    cm = check_against_ort(model, {"x": [2, 4, 4, 4]})
    assert cm.report["fusion"]["passes"]["fired"].get(names.COL2IM_TO_VIEWS) == 1
    assert "Col2Im" not in [s.op_type for s in cm.plan.steps]
