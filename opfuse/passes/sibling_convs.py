"""Convolutions that read the same input with the same strides (a ResNet block's first 3x3 conv and
its 1x1 downsample shortcut) become one convolution whose output channels are theirs side by side,
then a Split back into each conv's output: one implicit GEMM over the input instead of two, and one
launch. The conv kernel writes each part of the Split as a buffer of its own, with the
activation that follows that part (fusion.rules.anchor_epilogue: `_split_epilogue`), so nothing
reads the merged tensor; where a group planned before it reads the parts as strided views of it
(attention's Q, K and V of 1x1 convs; an epilogue gathering an upsampled part, HRNet's fuse
layer), the kernel stores the merged tensor instead and the Split stays a view.

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
from opfuse.ir.support import window_pads
from opfuse.passes.concat_convs import constant_weights_reason, merged_conv, merged_window
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
    between), a re-parameterizable block's parallel kxk and 1x1 branches (RepVGG, MobileOne).
    Or Add(Conv(x, W, b), x) or Add(Conv(x, W, b), BatchNormalization(x)): the block's identity
    branch, a conv with one tap of its own (`identity`: the per-channel scale and shift; a
    BatchNormalization read by others too stays for them)."""
    if node.op_type != "Add" or len(node.inputs) != 2 or node.inputs[0] == node.inputs[1]:
        return None
    producers, consumers = graph.producers(), graph.consumers()
    outputs = {o.name for o in graph.outputs}
    found = [producers.get(x) for x in node.inputs]
    convs = [c for c in found if c is not None and c.op_type == "Conv"]
    if not convs:
        return None
    if any(c.outputs[0] in outputs or len(consumers.get(c.outputs[0], [])) != 1 for c in convs):
        return None
    if graph.spec(convs[0].outputs[0]).shape != graph.spec(node.outputs[0]).shape:
        return None  # the Add broadcasts: not one conv's output
    if len(convs) == 2:
        if convs[0].inputs[0] != convs[1].inputs[0]:
            return None
        return {"convs": convs, "nodes": [*convs, node]}
    conv = convs[0]
    other = node.inputs[1] if found[0] is conv else node.inputs[0]
    x = conv.inputs[0]
    if other == x:
        return {"convs": [conv], "identity": None, "nodes": [conv, node]}
    bn = producers.get(other)
    if bn is None or bn.op_type != "BatchNormalization" or bn.inputs[0] != x or len(bn.outputs) != 1:
        return None
    # A BatchNormalization others read too stays for them (its output computed once either way).
    shared = other in outputs or len(consumers.get(other, [])) != 1
    return {"convs": [conv], "identity": bn, "nodes": [conv, node] if shared else [conv, bn, node]}


def _sum_check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    convs: list[Node] = m["convs"]
    if len({int(c.attrs.get("group", 1)) for c in convs}) != 1:
        return "the convolutions differ in groups"
    if "identity" in m:
        return _identity_check(graph, node, m)
    # Summed weights keep the group: each sum stays within its group's block.
    layout = merged_window(graph, [(c, None) for c in convs], depthwise=True)
    if isinstance(layout, str):
        return layout
    if len({graph.constants[c.inputs[1]].shape[:2] for c in convs}) != 1:
        return "the convolutions differ in output or input channels"
    m["layout"] = layout
    return None


def _identity_check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    """The identity branch is the conv's own tap where the window reads the output pixel's input
    pixel: stride 1, as many channels out as in, input and output of one shape."""
    (conv,) = m["convs"]
    why = constant_weights_reason(graph, [conv])
    if why is not None:
        return why
    x = conv.inputs[0]
    if graph.spec(x).shape != graph.spec(node.outputs[0]).shape:
        return "the identity branch and the conv's output differ in shape"
    w = graph.constants[conv.inputs[1]]
    if w.ndim != 4 or any(int(v) != 1 for v in conv.attrs.get("strides", [1, 1])):
        return "the conv is not a 2-D conv of stride 1"
    kh, kw = w.shape[2:]
    size = tuple(graph.spec(x).shape[2:])
    (top, left), (bottom, right) = window_pads(conv, size, size, (kh, kw))
    pads = [top, left, bottom, right]
    dh, dw = (int(v) for v in conv.attrs.get("dilations", [1, 1]))
    if top % dh or left % dw or top // dh >= kh or left // dw >= kw:
        return "no tap of the window reads the output pixel's own input pixel"
    scale = np.ones(w.shape[0], dtype=np.float64)
    shift = np.zeros(w.shape[0], dtype=np.float64)
    bn = m["identity"]
    if bn is not None:
        params = [graph.constants.get(v) for v in bn.inputs[1:5]]
        if any(v is None for v in params) or bool(int(bn.attrs.get("training_mode", 0))):
            return "the identity branch's BatchNormalization is not an inference one of constants"
        gamma, beta, mean, var = (np.asarray(v, dtype=np.float64) for v in params)
        scale = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        shift = beta - mean * scale
    m["layout"] = {"kernel": (kh, kw), "pads": pads, "offsets": [(0, 0)]}
    m["tap"], m["scale"], m["shift"] = (top // dh, left // dw), scale, shift
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
    if "tap" in m:  # the identity branch: output channel o reads its own input channel there
        out = np.arange(w.shape[0])
        ty, tx = m["tap"]
        w[out, out % w.shape[1], ty, tx] += m["scale"]
        b += m["shift"]
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
