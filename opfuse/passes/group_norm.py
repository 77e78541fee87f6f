"""GroupNorm written out becomes one GroupNormalization node.

PyTorch exports nn.GroupNorm at opset 18 as Reshape to [N, G, -1] → InstanceNormalization (unit
scale, zero bias) → Reshape back → Mul by the per-channel weight → Add the per-channel bias. As one
GroupNormalization node (per-channel scale and bias, the opset-21 form) it is one row kernel with
the rest of the group's pointwise neighbours, instead of two kernels and two layout copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.rules import Rule


def _per_channel(graph: Graph, name: str, channels: int, rank: int) -> np.ndarray | None:
    """The [C] values of a constant that broadcasts along the channel axis of a rank-`rank` tensor."""
    if name not in graph.constants:
        return None
    arr = np.asarray(graph.constants[name])
    padded = (1,) * (rank - arr.ndim) + arr.shape
    if arr.ndim > rank or padded[1] != channels or any(d != 1 for i, d in enumerate(padded) if i != 1):
        return None
    return arr.reshape(channels)


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "InstanceNormalization":
        return None
    producers, consumers = graph.producers(), graph.consumers()
    split = producers.get(node.inputs[0])
    users = consumers.get(node.outputs[0], [])
    if split is None or split.op_type != "Reshape" or len(users) != 1 or users[0].op_type != "Reshape":
        return None
    chain = [split, node, users[0]]
    tail = users[0]
    x = graph.spec(split.inputs[0]).shape
    for op in ("Mul", "Add"):
        nxt = consumers.get(tail.outputs[0], [])
        if len(nxt) != 1 or nxt[0].op_type != op or len(x) < 2:
            continue
        # The affine's Mul or Add, not the block's own (a norm without bias is followed by the
        # residual Add): only one by a per-channel constant joins.
        other = nxt[0].inputs[1] if nxt[0].inputs[0] == tail.outputs[0] else nxt[0].inputs[0]
        if _per_channel(graph, other, x[1], len(x)) is not None:
            chain.append(nxt[0])
            tail = nxt[0]
    return {"nodes": chain}


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    split, _, merge, *affine = m["nodes"]
    x = graph.spec(split.inputs[0]).shape
    grouped = graph.spec(split.outputs[0]).shape
    if len(x) < 3 or len(grouped) != 3 or grouped[0] != x[0]:
        return "the reshapes do not group the channels of an [N, C, ...] tensor"
    groups, channels = grouped[1], x[1]
    if channels % groups or grouped[2] * groups != int(np.prod(x[1:], dtype=np.int64)):
        return f"[N, {groups}, -1] does not split {channels} channels into equal groups"
    if graph.spec(merge.outputs[0]).shape != x:
        return "the second reshape does not restore the input's shape"
    scale, bias = (graph.constants.get(n) for n in node.inputs[1:3])
    if scale is None or bias is None or not np.all(scale == 1) or not np.all(bias == 0):
        return "the InstanceNormalization has its own scale or bias"
    outputs = {o.name for o in graph.outputs}
    consumers = graph.consumers()
    for a in m["nodes"][:-1]:
        if a.outputs[0] in outputs or len(consumers.get(a.outputs[0], [])) != 1:
            return "an intermediate value is also used elsewhere"
    produced = {n.outputs[0] for n in m["nodes"]}
    for n in affine:
        other = n.inputs[1] if n.inputs[0] in produced else n.inputs[0]
        if _per_channel(graph, other, channels, len(x)) is None:
            return f"the {n.op_type} after it is not by a per-channel constant"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    split, _, _, *affine = m["nodes"]
    x_name = split.inputs[0]
    x = graph.spec(x_name)
    channels, groups = x.shape[1], graph.spec(split.outputs[0]).shape[1]
    produced = {n.outputs[0] for n in m["nodes"]}
    params = {"Mul": np.ones(channels, np.float32), "Add": np.zeros(channels, np.float32)}
    for n in affine:
        other = n.inputs[1] if n.inputs[0] in produced else n.inputs[0]
        values = _per_channel(graph, other, channels, len(x.shape))
        assert values is not None  # _check made sure
        params[n.op_type] = values
    names = []
    for op, suffix in (("Mul", "scale"), ("Add", "bias")):
        name = f"{node.id}_gn_{suffix}"
        arr = np.asarray(params[op])
        dtype = graph.spec(node.inputs[1]).dtype
        graph.constants[name] = arr.astype(graph.constants[node.inputs[1]].dtype)
        graph.values[name] = TensorSpec(name, dtype, (channels,))
        names.append(name)
    last = m["nodes"][-1]
    gn = Node(
        node.id,
        "GroupNormalization",
        [x_name, *names],
        [last.outputs[0]],
        {"epsilon": float(node.attrs.get("epsilon", 1e-5)), "num_groups": groups},
        node.name,
    )
    i = graph.nodes.index(split)
    for n in m["nodes"]:
        graph.nodes.remove(n)
    graph.nodes.insert(i, gn)


group_norm = Rule(
    names.GROUP_NORM,
    _match,
    _check,
    _rewrite,
)
