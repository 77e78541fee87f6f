"""Local response normalization written out becomes one LRN node.

PyTorch exports nn.LocalResponseNorm (TorchScript exporter, opset 18) as Mul(x, x) → Reshape to
[N, 1, C, ...] → Pad the channel axis → AveragePool with kernel [size, 1, ...] → Reshape or Squeeze
back → Mul by alpha → Add k → Pow beta → Div(x, ·): a Pad, a pool, a pointwise kernel and a Div,
four launches with three intermediate tensors. As one LRN node it is one generated kernel (the
window's squares loaded at neighbouring channel offsets, codegen/pointwise.py) with its pointwise
neighbours.

The window must be ONNX LRN's: c - floor((size-1)/2) to c + ceil((size-1)/2). torch pads
size // 2 channels in front and (size-1) // 2 behind, the same window for odd sizes and one
channel earlier for even sizes; a padding that is not ONNX's window is left written out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node
from opfuse.ir.queries import scalar_constant
from opfuse.passes.rules import Rule

RULE = names.LOCAL_RESPONSE_NORM


def _single(graph: Graph, name: str, op_types: tuple[str, ...]) -> Node | None:
    """The one consumer of `name`, if it has exactly one and it is one of `op_types`."""
    users = graph.consumers().get(name, [])
    return users[0] if len(users) == 1 and users[0].op_type in op_types else None


def _scalar_operand(node: Node, produced: str) -> str:
    """The operand of a binary node that is not `produced` (the chain's value)."""
    return node.inputs[1] if node.inputs[0] == produced else node.inputs[0]


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    """Anchored on the AveragePool: its Pad, the Reshape/Unsqueeze before it and the square before
    that; after it the Reshape/Squeeze back and the Mul → Add → Pow → Div as far as they go."""
    if node.op_type != "AveragePool" or len(node.attrs.get("kernel_shape", [])) < 2:
        return None
    producers = graph.producers()
    pad = producers.get(node.inputs[0])
    lift = producers.get(pad.inputs[0]) if pad is not None and pad.op_type == "Pad" else None
    square = producers.get(lift.inputs[0]) if lift is not None else None
    if pad is None or lift is None or square is None or lift.op_type not in ("Reshape", "Unsqueeze"):
        return None
    if not (
        (square.op_type == "Mul" and square.inputs[0] == square.inputs[1])
        or (square.op_type == "Pow" and scalar_constant(graph, square.inputs[1]) == 2.0)
    ):
        return None
    chain = [square, lift, pad, node]
    tail = node
    for ops in (("Reshape", "Squeeze"), ("Mul",), ("Add",), ("Pow",), ("Div",)):
        nxt = _single(graph, tail.outputs[0], ops)
        if nxt is None:
            break
        chain.append(nxt)
        tail = nxt
    return {"nodes": chain, "x": square.inputs[0]}


def _pads(graph: Graph, pad: Node) -> np.ndarray | None:
    """The Pad's [begin..., end...] amounts, when they are a constant over every axis."""
    if len(pad.inputs) < 2 or pad.inputs[1] not in graph.constants:
        return None
    if len(pad.inputs) > 3 and pad.inputs[3]:
        return None  # padding chosen axes: not the exporter's form
    return np.asarray(graph.constants[pad.inputs[1]], dtype=np.int64).ravel()


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    nodes = m["nodes"]
    if len(nodes) < 9:
        return "the pool is not followed by Reshape → Mul → Add → Pow → Div as LocalResponseNorm writes it"
    _, lift, pad, pool, merge, mul, add, power, div = nodes
    x = graph.spec(m["x"]).shape
    if len(x) < 3:
        return "the input is not an [N, C, ...] tensor"
    lifted = tuple(graph.spec(lift.outputs[0]).shape)
    if lifted != (x[0], 1, *x[1:]) or tuple(graph.spec(merge.outputs[0]).shape) != tuple(x):
        return "the reshapes do not put the channels on a pooling axis and back"
    size = int(pool.attrs["kernel_shape"][0])
    if list(pool.attrs["kernel_shape"][1:]) != [1] * (len(x) - 2):
        return "the pool's window is not over the channel axis alone"
    for key in ("strides", "dilations"):
        if any(int(s) != 1 for s in pool.attrs.get(key, [])):
            return f"the pool has {key} other than 1"
    if (
        any(int(p) != 0 for p in pool.attrs.get("pads", []))
        or pool.attrs.get("auto_pad", "NOTSET") != "NOTSET"
    ):
        return "the pool pads on its own"
    pads = _pads(graph, pad)
    rank = len(lifted)
    if pad.attrs.get("mode", "constant") != "constant" or pads is None or pads.size != 2 * rank:
        return "the Pad is not a constant zero padding by constant amounts"
    if len(pad.inputs) > 2 and pad.inputs[2] and scalar_constant(graph, pad.inputs[2]) != 0.0:
        return "the Pad's value is not zero"
    before, after = int(pads[2]), int(pads[2 + rank])
    if any(int(p) for i, p in enumerate(pads) if i not in (2, 2 + rank)):
        return "the Pad pads axes other than the channels"
    want = ((size - 1) // 2, size - 1 - (size - 1) // 2)
    if (before, after) != want:
        return (
            f"the window of {size} channels is padded ({before}, {after}), ONNX LRN's is {want}: "
            "an even size centred the other way is a different function"
        )
    if merge.op_type == "Squeeze" and len(merge.inputs) < 2:
        return "the Squeeze has no axes input"
    params = {}
    prev = merge.outputs[0]
    for name, n in (("alpha", mul), ("bias", add), ("beta", power)):
        if n.op_type == "Pow" and n.inputs[0] != prev:
            return "the Pow raises a constant to the window sum"
        other = n.inputs[1] if n.op_type == "Pow" else _scalar_operand(n, prev)
        value = scalar_constant(graph, other)
        if value is None or not np.isfinite(value):
            return f"the {n.op_type}'s {name} is not a finite scalar constant"
        params[name] = value
        prev = n.outputs[0]
    if div.inputs != [m["x"], power.outputs[0]]:
        return "the Div does not divide the squared input by the normalizer"
    outputs = {o.name for o in graph.outputs}
    consumers = graph.consumers()
    for a in nodes[:-1]:
        if a.outputs[0] in outputs or len(consumers.get(a.outputs[0], [])) != 1:
            return "an intermediate value is also used elsewhere"
    m.update(params, size=size)
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    div = m["nodes"][-1]
    lrn = Node(
        node.id,
        "LRN",
        [m["x"]],
        [div.outputs[0]],
        {"size": m["size"], "alpha": m["alpha"], "beta": m["beta"], "bias": m["bias"]},
        node.name,
    )
    i = graph.nodes.index(m["nodes"][0])
    for n in m["nodes"]:
        graph.nodes.remove(n)
    graph.nodes.insert(i, lrn)


local_response_norm = Rule(
    RULE,
    _match,
    _check,
    _rewrite,
)
