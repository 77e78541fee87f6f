"""Convolutions that read the same input with the same strides (a ResNet block's first 3x3 conv and
its 1x1 downsample shortcut) become one convolution whose output channels are theirs side by side,
then a Split back into each conv's output: one implicit GEMM over the input instead of two, and one
launch. The conv kernel writes each part of the Split as a buffer of its own, with the
activation that follows that part (fusion.rules.anchor_epilogue: `_split_epilogue`), so nothing
reads the merged tensor; where attention reads the parts as strided views of it (Q, K and V of
1x1 convs), the kernel stores the merged tensor instead and the Split stays a view.

The merged weight is the convolutions' kernels placed in one window (their bounding box, zeros
elsewhere), as for `merge_concat_convs`: the NHWC template skips the zero taps of a tile's output
channels (`codegen.conv.tap_segments`), so the 1x1 shortcut's channels run one window position.
Runs on the channels-last graph (`opfuse.ConvNHWC`), after the layout pass: only the NHWC template
writes a Split, and a region that stays NCHW keeps its convolutions apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.ops import NHWC_CONV, has_shortcut
from opfuse.passes.concat_convs import merged_conv, merged_window
from opfuse.passes.rules import NotFired, Rule, RuleLog, node_label

RULE = names.MERGE_SIBLING_CONVS


def _candidates(graph: Graph) -> list[list[Node]]:
    """Dense NHWC convolutions with constant weights, grouped by the value they read (two or more)."""
    readers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.op_type != NHWC_CONV or int(n.attrs.get("group", 1)) != 1 or has_shortcut(n):
            continue  # a conv summing a shortcut (shortcut_conv) reads a second input besides
        if n.inputs[1] not in graph.constants or (
            len(n.inputs) > 2 and n.inputs[2] and n.inputs[2] not in graph.constants
        ):
            continue
        readers.setdefault(n.inputs[0], []).append(n)
    return [convs for convs in readers.values() if len(convs) > 1]


def merge_sibling_convs(graph: Graph, log: RuleLog) -> None:
    """Each set of convolutions that read one value with the same strides and dilations and give
    outputs of one size becomes one convolution and a Split."""
    outputs = {o.name for o in graph.outputs}
    for readers in _candidates(graph):
        sets: dict[tuple[object, ...], list[Node]] = {}
        for c in readers:
            if c.outputs[0] in outputs:
                continue
            key = (
                tuple(c.attrs.get("strides", [1, 1])),
                tuple(c.attrs.get("dilations", [1, 1])),
                graph.spec(c.outputs[0]).shape[1:3],
            )
            sets.setdefault(key, []).append(c)
        if all(len(convs) < 2 for convs in sets.values()):
            why = "the convolutions differ in strides, dilations or output size"
            log.not_fired.append(NotFired(RULE, [node_label(c) for c in readers], why))
            continue
        for convs in sets.values():
            if len(convs) < 2:
                continue
            layout = merged_window(graph, [(c, None) for c in convs], nhwc=True)
            if isinstance(layout, str):
                log.not_fired.append(NotFired(RULE, [node_label(c) for c in convs], layout))
                continue
            _rewrite(graph, convs, layout)
            log.fired[RULE] = log.fired.get(RULE, 0) + 1


def _rewrite(graph: Graph, convs: list[Node], layout: dict[str, Any]) -> None:
    first = convs[0]
    weights = [graph.constants[c.inputs[1]] for c in convs]
    kh, kw = (int(v) for v in layout["kernel"])
    cin = weights[0].shape[3]
    w = np.zeros((sum(x.shape[0] for x in weights), kh, kw, cin), dtype=weights[0].dtype)
    b = np.zeros(w.shape[0], dtype=weights[0].dtype)
    row = 0
    for c, x, (oy, ox) in zip(convs, weights, layout["offsets"], strict=True):
        w[row : row + x.shape[0], oy : oy + x.shape[1], ox : ox + x.shape[2], :] = x
        if len(c.inputs) > 2 and c.inputs[2]:
            b[row : row + x.shape[0]] = graph.constants[c.inputs[2]]
        row += x.shape[0]
    operands, attrs = merged_conv(graph, first, layout, w, b, "siblings")
    sizes, merged = f"{first.id}_siblings_split", f"{first.id}_siblings"
    graph.constants[sizes] = np.array([x.shape[0] for x in weights], dtype=np.int64)
    graph.values[sizes] = TensorSpec(sizes, "int64", (len(convs),))
    out = graph.spec(first.outputs[0])
    graph.values[merged] = TensorSpec(merged, out.dtype, (*out.shape[:3], w.shape[0]))
    names = "+".join(c.name for c in convs if c.name)
    new = [
        Node(f"{first.id}m", NHWC_CONV, operands, [merged], attrs, names),
        Node(f"{first.id}s", "Split", [merged, sizes], [c.outputs[0] for c in convs], {"axis": 3}, names),
    ]
    graph.splice(graph.nodes.index(first), new, {c.id for c in convs})


SUM_RULE = names.SUM_SIBLING_CONVS


def _sum_match(graph: Graph, node: Node) -> dict[str, Any] | None:
    """Add(Conv(x, W1, b1), Conv(x, W2, b2)), each conv read only by the Add: a projection
    shortcut added to a one-conv main path (ResNet-style downsampling without an activation
    between)."""
    if node.op_type != "Add" or len(node.inputs) != 2:
        return None
    producers, consumers = graph.producers(), graph.consumers()
    outputs = {o.name for o in graph.outputs}
    convs = [producers.get(x) for x in node.inputs]
    if any(c is None or c.op_type != "Conv" for c in convs) or node.inputs[0] == node.inputs[1]:
        return None
    pair = [c for c in convs if c is not None]
    if pair[0].inputs[0] != pair[1].inputs[0]:
        return None
    if any(c.outputs[0] in outputs or len(consumers.get(c.outputs[0], [])) != 1 for c in pair):
        return None
    if graph.spec(pair[0].outputs[0]).shape != graph.spec(node.outputs[0]).shape:
        return None  # the Add broadcasts: not one conv's output
    return {"convs": pair, "nodes": [*pair, node]}


def _sum_check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    layout = merged_window(graph, [(c, None) for c in m["convs"]])
    if isinstance(layout, str):
        return layout
    if len({graph.constants[c.inputs[1]].shape[0] for c in m["convs"]}) != 1:
        return "the convolutions differ in output channels"
    m["layout"] = layout
    return None


def _sum_rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    convs: list[Node] = m["convs"]
    layout = m["layout"]
    first = convs[0]
    weights = [graph.constants[c.inputs[1]] for c in convs]
    kh, kw = (int(v) for v in layout["kernel"])
    w = np.zeros((weights[0].shape[0], weights[0].shape[1], kh, kw), dtype=np.float64)
    b = np.zeros(w.shape[0], dtype=np.float64)
    for c, x, (oy, ox) in zip(convs, weights, layout["offsets"], strict=True):
        w[:, :, oy : oy + x.shape[2], ox : ox + x.shape[3]] += x
        if len(c.inputs) > 2 and c.inputs[2]:
            b += graph.constants[c.inputs[2]]
    operands, attrs = merged_conv(graph, first, layout, w, b, "sum")
    names = "+".join(n.name for n in m["nodes"] if n.name)
    new = Node(f"{first.id}+", "Conv", operands, [node.outputs[0]], attrs, names)
    graph.splice(graph.nodes.index(node), [new], {n.id for n in m["nodes"]})


sum_sibling_convs = Rule(
    SUM_RULE,
    _sum_match,
    _sum_check,
    _sum_rewrite,
)
