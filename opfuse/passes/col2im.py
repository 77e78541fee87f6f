"""Col2Im of blocks that tile the image (strides equal to the block shape, no padding, no
dilation) is a permutation of its input: each pixel comes from exactly one column, so nothing is
summed. It becomes Reshape, Transpose, Reshape, views a kernel reads through, in place of the
library's scatter-add into a zeroed image (MobileViT V2 folds its patches back this way, after
each transformer block)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.rules import Rule


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "Col2Im" or len(node.inputs) < 3:
        return None
    if node.inputs[1] not in graph.constants or node.inputs[2] not in graph.constants:
        return None
    image = [int(v) for v in np.ravel(graph.constants[node.inputs[1]])]
    block = [int(v) for v in np.ravel(graph.constants[node.inputs[2]])]
    return {"nodes": [node], "image": image, "block": block}


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    image, block = m["image"], m["block"]
    nd = len(image)
    x = graph.spec(node.inputs[0]).shape
    if len(block) != nd or len(x) != 3 or any(d < 1 for d in x):
        return "not a static [N, C * prod(block_shape), L] input with one block dim per image dim"
    if any(int(v) != 1 for v in node.attrs.get("dilations", [1] * nd)):
        return "the blocks are dilated"
    if any(int(v) != 0 for v in node.attrs.get("pads", [0] * 2 * nd)):
        return "the image is padded"
    if [int(v) for v in node.attrs.get("strides", [1] * nd)] != block:
        return "the strides differ from the block shape: blocks overlap (summed) or leave gaps"
    if any(i % b for i, b in zip(image, block, strict=True)):
        return "the blocks do not tile the image"
    counts = [i // b for i, b in zip(image, block, strict=True)]
    if x[1] % math.prod(block) or x[2] != math.prod(counts):
        return "the input's shape does not match the image and block shapes"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    image, block = m["image"], m["block"]
    nd = len(image)
    n, cols, _ = graph.spec(node.inputs[0]).shape
    dtype = graph.spec(node.inputs[0]).dtype
    c = cols // math.prod(block)
    counts = [i // b for i, b in zip(image, block, strict=True)]
    split = (n, c, *block, *counts)  # each column's block taps, then the block's position
    perm = [0, 1, *(k for d in range(nd) for k in (2 + nd + d, 2 + d))]  # position, then tap, per dim
    moved = tuple(split[p] for p in perm)

    def value(suffix: str, shape: tuple[int, ...]) -> str:
        name = f"{node.id}_{suffix}"
        graph.values[name] = TensorSpec(name, dtype, shape)
        return name

    def shape_constant(suffix: str, shape: tuple[int, ...]) -> str:
        name = f"{node.id}_{suffix}_shape"
        graph.constants[name] = np.asarray(shape, dtype=np.int64)
        graph.values[name] = TensorSpec(name, "int64", (len(shape),))
        return name

    blocks, tiled = value("blocks", split), value("tiled", moved)
    i = graph.nodes.index(node)
    graph.nodes[i : i + 1] = [
        Node(
            f"{node.id}r",
            "Reshape",
            [node.inputs[0], shape_constant("blocks", split)],
            [blocks],
            {},
            node.name,
        ),
        Node(f"{node.id}t", "Transpose", [blocks], [tiled], {"perm": perm}, node.name),
        Node(
            f"{node.id}o",
            "Reshape",
            [tiled, shape_constant("image", (n, c, *image))],
            list(node.outputs),
            {},
            node.name,
        ),
    ]


col2im_to_views = Rule(names.COL2IM_TO_VIEWS, _match, _check, _rewrite)
