"""Move a Conv's bias into the bias of the unpadded Convs that read its output.

A conv whose only readers are other convs (a depthwise conv and the 1x1 conv after it: Xception's
and MobileNet's separable convs, a conv's BatchNormalization folded into it) runs with nothing
fused after it; where the library runs it, torch adds its bias with a kernel of its own. A conv
that pads nothing reads every input pixel at every tap, so for its weight W

    conv(x + b) = conv(x) + sum over input channels and taps of W * b

exactly: the first conv's bias becomes a constant added to each reader's own bias, and the first
conv runs without one. Readers that pad (the bias would reach their zero border) or have no bias
of their own (the add would only move) keep it where it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.support import window_pads
from opfuse.passes.rules import Rule, node_label


def _bias(node: Node) -> str:
    return node.inputs[2] if len(node.inputs) > 2 else ""


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "Conv" or not _bias(node):
        return None
    readers = graph.consumers().get(node.outputs[0], [])
    if not readers or any(r.op_type != "Conv" for r in readers):
        return None
    return {"readers": readers, "nodes": [node, *readers]}


def _pads_nothing(graph: Graph, conv: Node) -> bool:
    """No tap of `conv` reads outside its input (explicit pads, or auto_pad resolved)."""
    size, out = graph.spec(conv.inputs[0]).shape[2:], graph.spec(conv.outputs[0]).shape[2:]
    begins, ends = window_pads(conv, tuple(size), tuple(out), tuple(graph.spec(conv.inputs[1]).shape[2:]))
    return not any(begins) and not any(ends)


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    if _bias(node) not in graph.constants:
        return "the Conv bias is not a constant"
    if node.outputs[0] in {o.name for o in graph.outputs}:
        return "the Conv output is a graph output"
    channels = graph.constants[_bias(node)].size
    for reader in m["readers"]:
        if reader.inputs[0] != node.outputs[0] or node.outputs[0] in reader.inputs[1:]:
            return f"{node_label(reader)} reads it as a weight or bias"
        if not _pads_nothing(graph, reader):
            return f"{node_label(reader)} pads its input: the bias would reach its zero border"
        if reader.inputs[1] not in graph.constants:
            return f"the weight of {node_label(reader)} is not a constant"
        if _bias(reader) not in graph.constants:
            return f"{node_label(reader)} has no constant bias to take it (the add would only move)"
        w = graph.constants[reader.inputs[1]]
        if w.shape[1] * int(reader.attrs.get("group", 1)) != channels:
            return f"{node_label(reader)} reads another number of channels"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    b = graph.constants[_bias(node)].astype(np.float64)
    for reader in m["readers"]:
        w = graph.constants[reader.inputs[1]]
        groups = int(reader.attrs.get("group", 1))
        per_tap = w.astype(np.float64).reshape(w.shape[0], w.shape[1], -1).sum(axis=2)  # [out, in/group]
        # Output channel o of group o // (out / groups) reads that group's input channels.
        ins = b.reshape(groups, w.shape[1])[np.arange(w.shape[0]) // (w.shape[0] // groups)]
        old = graph.constants[_bias(reader)]
        new = (old.astype(np.float64) + (per_tap * ins).sum(axis=1)).astype(old.dtype)
        name = f"{reader.id}_bias_in"
        graph.constants[name] = new
        graph.values[name] = TensorSpec(name, graph.values[_bias(reader)].dtype, tuple(new.shape))
        reader.inputs = [reader.inputs[0], reader.inputs[1], name]
    node.inputs = node.inputs[:2]


forward_conv_bias = Rule(names.FORWARD_CONV_BIAS, _match, _check, _rewrite)
