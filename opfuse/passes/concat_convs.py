"""Convolutions that read the same input and are concatenated along channels (SqueezeNet's fire
module: a 1x1 and a 3x3 "expand" conv side by side) become one convolution whose output is the
Concat's: one launch instead of two convs and a copy, and the concatenated tensor is written once.

The merged weight is the branches' kernels placed in one window (the bounding box of their taps,
zeros elsewhere), their output channels side by side. The NHWC template skips a tile's zero taps
(`codegen.conv.tap_segments`): a program whose output channels all belong to the 1x1 branch runs
one window position, not nine, so the merge adds no multiply-adds there. A shared activation
after each branch (Relu on both) runs once, in the merged conv's epilogue.

Depthwise convolutions of the consecutive parts of one Split along channels, concatenated in the
same order (MixNet's MixConv: 3x3, 5x5, 7x7 and 9x9 kernels on channel groups; CoaT's
convolutional position encoding), are one depthwise convolution of the Split's input in the
same way: each channel's kernel placed in the merged window, the Split, the convolutions and
the Concat one launch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.rules import Rule

RULE = names.MERGE_CONCAT_CONVS
# The template skips zero taps; the vendor convolution (a tuning choice) computes them: at most this
# many times the branches' own multiply-adds (SqueezeNet's 1x1 + 3x3: 1.8x).
MAX_PADDED_WORK = 2.0

# One-input elementwise activations that may sit between a branch's conv and the Concat.
ACTIVATIONS = ("Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Elu", "Selu", "Softplus")


def _branch(graph: Graph, value: str, graph_outputs: set[str]) -> tuple[Node, Node | None] | None:
    """(conv, activation or None) producing `value`, each output used once (by the next node)."""
    producers, consumers = graph.producers(), graph.consumers()
    node = producers.get(value)
    act = None
    if node is not None and node.op_type in ACTIVATIONS and len(node.inputs) == 1:
        act, node = node, producers.get(node.inputs[0])
        if node is None or len(consumers.get(node.outputs[0], [])) != 1 or node.outputs[0] in graph_outputs:
            return None
    if node is None or node.op_type != "Conv":
        return None
    return node, act


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "Concat" or len(node.inputs) < 2 or len(graph.spec(node.outputs[0]).shape) != 4:
        return None
    if int(node.attrs.get("axis", 0)) % 4 != 1:
        return None
    outs = {o.name for o in graph.outputs}
    consumers = graph.consumers()
    branches = []
    for x in node.inputs:
        b = _branch(graph, x, outs)
        if b is None or x in outs or len(consumers.get(x, [])) != 1 or node.inputs.count(x) != 1:
            return None
        branches.append(b)
    nodes = [n for b in branches for n in b if n is not None] + [node]
    if len({conv.inputs[0] for conv, _ in branches}) == 1:
        return {"branches": branches, "nodes": nodes, "split": None}
    split = _split_read_in_parts(graph, [conv for conv, _ in branches], consumers)
    if split is None:
        return None
    return {"branches": branches, "nodes": [split, *nodes], "split": split}


def _split_read_in_parts(graph: Graph, convs: list[Node], consumers: dict[str, list[Node]]) -> Node | None:
    """The Split along channels whose outputs, in order, the convolutions read, one each and
    nothing else (MixConv), or None."""
    split = graph.producers().get(convs[0].inputs[0])
    if split is None or split.op_type != "Split" or len(graph.spec(split.inputs[0]).shape) != 4:
        return None
    if int(split.attrs.get("axis", 0)) % 4 != 1 or [c.inputs[0] for c in convs] != list(split.outputs):
        return None
    outputs = {o.name for o in graph.outputs}
    if any(len(consumers.get(o, [])) != 1 or o in outputs for o in split.outputs):
        return None
    return split


def _depthwise_reason(graph: Graph, convs: list[Node]) -> str | None:
    """None where every convolution is depthwise (one output channel per input channel)."""
    for c in convs:
        channels = graph.spec(c.inputs[0]).shape[1]
        if int(c.attrs.get("group", 1)) != channels or graph.spec(c.outputs[0]).shape[1] != channels:
            return "a Split's part is read by a convolution that is not depthwise"
    return None


def _pads(graph: Graph, conv: Node) -> tuple[int, int, int, int] | None:
    """(top, left, bottom, right), or None where auto_pad sets them."""
    if str(conv.attrs.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
        return None
    p = [int(v) for v in conv.attrs.get("pads", [0, 0, 0, 0])]
    if str(conv.attrs.get("auto_pad", "NOTSET")) == "VALID":
        p = [0, 0, 0, 0]
    return p[0], p[1], p[2], p[3]


def constant_weights_reason(graph: Graph, convs: list[Node]) -> str | None:
    """Why the convolutions' weights cannot be merged into one constant (None if they can): every
    weight and bias a constant, the weights of one type."""
    if any(c.inputs[1] not in graph.constants for c in convs) or any(
        len(c.inputs) > 2 and c.inputs[2] and c.inputs[2] not in graph.constants for c in convs
    ):
        return "a weight or bias is not a constant"
    if len({graph.constants[c.inputs[1]].dtype for c in convs}) != 1:
        return "the weights differ in type"
    return None


def merged_window(
    graph: Graph, branches: list[tuple[Node, Node | None]], nhwc: bool = False, depthwise: bool = False
) -> dict[str, Any] | str:
    """The merged window (kernel size and pads) and each branch's tap offset in it, or why the
    branches cannot share one convolution. `nhwc`: the convolutions are `opfuse.ConvNHWC` (weights
    [Cout, KH, KW, Cin], tensors [N, H, W, C]). `depthwise`: they are depthwise, each of its own
    channels (MixConv)."""
    convs = [c for c, _ in branches]
    acts = [a for _, a in branches]
    if len({(a.op_type, repr(sorted(a.attrs.items()))) if a else None for a in acts}) != 1:
        return "the branches end in different activations"
    for key, default in (("strides", [1, 1]), ("dilations", [1, 1])):
        if len({tuple(int(v) for v in c.attrs.get(key, default)) for c in convs}) != 1:
            return f"the convolutions' {key} differ"
    if not depthwise and any(int(c.attrs.get("group", 1)) != 1 for c in convs):
        return "a grouped convolution"
    why = constant_weights_reason(graph, convs)
    if why is not None:
        return why
    pads = [_pads(graph, c) for c in convs]
    if any(p is None for p in pads):
        return "auto_pad SAME: the pads depend on the kernel"
    dh, dw = (int(v) for v in convs[0].attrs.get("dilations", [1, 1]))
    sh, sw = (int(v) for v in convs[0].attrs.get("strides", [1, 1]))
    top, left = max(p[0] for p in pads if p is not None), max(p[1] for p in pads if p is not None)
    offsets = []
    for p in pads:
        assert p is not None
        if (top - p[0]) % dh or (left - p[1]) % dw:
            return "the kernels' windows are not aligned on the dilation grid"
        offsets.append(((top - p[0]) // dh, (left - p[1]) // dw))
    # (Cout, KH, KW) of each weight, and the spatial dims of the tensors, in either layout.
    hw = slice(1, 3) if nhwc else slice(2, 4)
    shapes = [(x.shape[0], *x.shape[1:3]) if nhwc else (x.shape[0], *x.shape[2:4]) for x in
              (graph.constants[c.inputs[1]] for c in convs)]  # fmt: skip
    kh = max(o[0] + s[1] for o, s in zip(offsets, shapes, strict=True))
    kw = max(o[1] + s[2] for o, s in zip(offsets, shapes, strict=True))
    h, w = graph.spec(convs[0].inputs[0]).shape[hw]
    oh, ow = graph.spec(convs[0].outputs[0]).shape[hw]
    if any(graph.spec(c.outputs[0]).shape[hw] != (oh, ow) for c in convs):
        return "the convolutions' outputs differ in size"
    # The far pads that give the same output size with the merged window.
    bottom = max(0, (oh - 1) * sh + dh * (kh - 1) + 1 - h - top)
    right = max(0, (ow - 1) * sw + dw * (kw - 1) + 1 - w - left)
    if (h + top + bottom - dh * (kh - 1) - 1) // sh + 1 != oh or (
        w + left + right - dw * (kw - 1) - 1
    ) // sw + 1 != ow:
        return "no padding of the merged window gives the branches' output size"
    macs = sum(s[0] * s[1] * s[2] for s in shapes)
    if sum(s[0] for s in shapes) * kh * kw > MAX_PADDED_WORK * macs:
        return (
            f"the merged {kh}x{kw} window would do over {MAX_PADDED_WORK}x the branches' multiply-adds "
            "where its zero taps are not skipped (the vendor convolution)"
        )
    return {"kernel": (kh, kw), "pads": [top, left, bottom, right], "offsets": offsets}


def merged_conv(
    graph: Graph, first: Node, layout: dict[str, Any], w: np.ndarray, b: np.ndarray, tag: str
) -> tuple[list[str], dict[str, Any]]:
    """The merged convolution's operands and attributes: `w` and `b` become constants named after
    `first` (and `tag`), in the weight's type; its window is the merged one."""
    w_name, b_name = f"{first.id}_{tag}_w", f"{first.id}_{tag}_b"
    wdtype = graph.spec(first.inputs[1]).dtype
    graph.constants[w_name] = w.astype(graph.constants[first.inputs[1]].dtype)
    graph.constants[b_name] = b.astype(graph.constants[first.inputs[1]].dtype)
    graph.values[w_name] = TensorSpec(w_name, wdtype, tuple(w.shape))
    graph.values[b_name] = TensorSpec(b_name, wdtype, tuple(b.shape))
    attrs = {k: v for k, v in first.attrs.items() if k not in ("pads", "kernel_shape", "auto_pad")}
    kh, kw = layout["kernel"]
    attrs.update(kernel_shape=[int(kh), int(kw)], pads=layout["pads"])
    return [first.inputs[0], w_name, b_name], attrs


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    if m["split"] is not None:
        why = _depthwise_reason(graph, [conv for conv, _ in m["branches"]])
        if why is not None:
            return why
    layout = merged_window(graph, m["branches"], depthwise=m["split"] is not None)
    if isinstance(layout, str):
        return layout
    m["layout"] = layout
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    branches: list[tuple[Node, Node | None]] = m["branches"]
    layout = m["layout"]
    convs = [c for c, _ in branches]
    first = convs[0]
    weights = [graph.constants[c.inputs[1]] for c in convs]
    kh, kw = layout["kernel"]
    cin = weights[0].shape[1]
    w = np.zeros((sum(x.shape[0] for x in weights), cin, kh, kw), dtype=weights[0].dtype)
    b = np.zeros(w.shape[0], dtype=weights[0].dtype)
    row = 0
    for c, x, (oy, ox) in zip(convs, weights, layout["offsets"], strict=True):
        w[row : row + x.shape[0], :, oy : oy + x.shape[2], ox : ox + x.shape[3]] = x
        if len(c.inputs) > 2 and c.inputs[2]:
            b[row : row + x.shape[0]] = graph.constants[c.inputs[2]]
        row += x.shape[0]
    operands, attrs = merged_conv(graph, first, layout, w, b, "concat")
    if m["split"] is not None:  # one depthwise conv of the Split's input
        operands[0] = m["split"].inputs[0]
        attrs["group"] = int(w.shape[0])
    mid = f"{first.id}_concat_conv"
    out = node.outputs[0]
    act = branches[0][1]
    conv_out = mid if act is not None else out
    if act is not None:
        graph.values[mid] = TensorSpec(mid, graph.spec(out).dtype, graph.spec(out).shape)
    names = "+".join(c.name for c in convs if c.name)
    new = [Node(f"{first.id}c", "Conv", operands, [conv_out], attrs, names)]
    if act is not None:
        act_names = "+".join(a.name for _, a in branches if a is not None and a.name)
        new.append(Node(f"{first.id}a", act.op_type, [mid], [out], dict(act.attrs), act_names))
    graph.splice(graph.nodes.index(node) + 1, new, {n.id for n in m["nodes"]})


merge_concat_convs = Rule(
    RULE,
    _match,
    _check,
    _rewrite,
)
