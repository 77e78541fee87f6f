"""A projection shortcut summed into a block's last convolution is one convolution (one implicit
GEMM) whose K loop reads two tensors.

A ResNet bottleneck that downsamples ends in relu(conv3(h) + shortcut(x)): conv3 reads the
block's inner tensor h, the shortcut is a 1x1 conv of the block input x (at stride 2 in ResNet-50's
layers 2-4). Both give the same [N, OH, OW, Cout] tensor, and their sum is one GEMM over a
concatenated K: A = [h's window at (oh, ow) | x(oh*s, ow*s, :)], B = [W3 ; Wsc] stacked along K,
bias = b3 + bsc. The rewrite makes that one `opfuse.ConvNHWC` with inputs [h, W3, b3 + bsc, x,
Wsc] and the shortcut's strides as `shortcut_strides`: the conv template runs a second K loop over
x's channels at the strided pixel into the same accumulator, so the shortcut's output is never
written nor read back, and the block's Add (and the activation after it) is the epilogue of one
launch instead of two.

Runs on the channels-last graph right after the layout pass and before `merge_sibling_convs`,
which would otherwise merge the shortcut with the block's first 1x1 conv (they read x at the same
stride in ResNet-50's layer 1). Two convolutions of one input are `sum_sibling_convs`' case (one
conv with the kernels summed), not this rule's. The library has no such convolution: its per-op
kernel (`runtime.ops_nn.conv_nhwc`) computes the two convolutions and their sum (three launches).
That is the group's vendor variant, which tuning times against the template (the library's
convolutions can be faster on large inputs: a ResNet bottleneck at batch 32), and what runs where
the group is not fused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.ops import NHWC_CONV, has_shortcut
from opfuse.passes.concat_convs import constant_weights_reason
from opfuse.passes.rules import NotFired, RuleLog, node_label

RULE = names.SHORTCUT_CONV


def _match(graph: Graph, node: Node) -> list[Node] | None:
    """Add(ConvNHWC(h), ConvNHWC(x)) of two different inputs, each conv's output read only by the
    Add and not a graph output: [conv, conv, add]."""
    if node.op_type != "Add" or len(node.inputs) != 2 or node.inputs[0] == node.inputs[1]:
        return None
    producers, consumers = graph.producers(), graph.consumers()
    outputs = {o.name for o in graph.outputs}
    convs = [producers.get(x) for x in node.inputs]
    pair = [c for c in convs if c is not None and c.op_type == NHWC_CONV]
    if len(pair) != 2 or pair[0].inputs[0] == pair[1].inputs[0]:
        return None
    if any(c.outputs[0] in outputs or len(consumers.get(c.outputs[0], [])) != 1 for c in pair):
        return None
    return [*pair, node]


def _is_shortcut(graph: Graph, conv: Node) -> bool:
    """A 1x1 conv without padding or dilation (any stride): one pixel of its input per output."""
    w = graph.spec(conv.inputs[1]).shape
    pads = [int(v) for v in conv.attrs.get("pads", [0, 0, 0, 0])]
    dilations = [int(v) for v in conv.attrs.get("dilations", [1, 1])]
    auto_pad = str(conv.attrs.get("auto_pad", "NOTSET"))
    return (
        tuple(w[1:3]) == (1, 1)
        and (auto_pad == "VALID" or (auto_pad == "NOTSET" and not any(pads)))
        and dilations == [1, 1]
    )


def _check(graph: Graph, convs: list[Node], add: Node) -> tuple[Node, Node] | str:
    """(main conv, shortcut), or why the two cannot be one convolution."""
    if any(has_shortcut(c) for c in convs):
        return "a convolution already sums a shortcut"
    if any(int(c.attrs.get("group", 1)) != 1 for c in convs):
        return "a grouped (or depthwise) convolution: the template sums a shortcut into group=1 only"
    why = constant_weights_reason(graph, convs)
    if why is not None:
        return why
    shapes = {graph.spec(c.outputs[0]).shape for c in convs}
    if len(shapes) != 1 or graph.spec(add.outputs[0]).shape not in shapes:
        return "the convolutions' outputs differ in shape (the Add broadcasts)"
    # The shortcut is the 1x1 one; of two, the strided one (the downsampling projection), else
    # the Add's second input.
    shortcuts = [c for c in convs if _is_shortcut(graph, c)]
    if not shortcuts:
        return "neither convolution is a 1x1 shortcut (1x1, no padding, dilation 1)"
    strided = [c for c in shortcuts if any(int(s) != 1 for s in c.attrs.get("strides", [1, 1]))]
    shortcut = strided[-1] if strided else shortcuts[-1]
    main = convs[0] if shortcut is convs[1] else convs[1]
    return main, shortcut


def shortcut_conv(graph: Graph, log: RuleLog) -> None:
    """Each Add of a convolution and a 1x1 shortcut conv of another input becomes one convolution
    whose K loop reads both inputs."""
    for add in list(graph.nodes):
        if add not in graph.nodes:
            continue
        m = _match(graph, add)
        if m is None:
            continue
        found = _check(graph, m[:2], add)
        if isinstance(found, str):
            log.not_fired.append(NotFired(RULE, [node_label(n) for n in m], found))
            continue
        _rewrite(graph, *found, add)
        log.fired[RULE] = log.fired.get(RULE, 0) + 1


def _rewrite(graph: Graph, main: Node, shortcut: Node, add: Node) -> None:
    w = graph.constants[main.inputs[1]]
    bias = np.zeros(w.shape[0], dtype=np.float64)
    for c in (main, shortcut):
        if len(c.inputs) > 2 and c.inputs[2]:
            bias += graph.constants[c.inputs[2]]
    b_name = f"{main.id}_shortcut_b"
    graph.constants[b_name] = bias.astype(w.dtype)
    graph.values[b_name] = TensorSpec(b_name, graph.spec(main.inputs[1]).dtype, (w.shape[0],))
    attrs: dict[str, Any] = dict(main.attrs)
    attrs["shortcut_strides"] = [int(s) for s in shortcut.attrs.get("strides", [1, 1])]
    operands = [main.inputs[0], main.inputs[1], b_name, shortcut.inputs[0], shortcut.inputs[1]]
    names = "+".join(n.name for n in (main, shortcut, add) if n.name)
    new = Node(f"{main.id}sc", NHWC_CONV, operands, [add.outputs[0]], attrs, names)
    graph.splice(graph.nodes.index(add), [new], {main.id, shortcut.id, add.id})
