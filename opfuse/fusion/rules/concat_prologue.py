"""`concat_prologue`: a 1x1 conv of a channel Concat, through per-channel affine ops and an
activation, reads the Concat's inputs one after another in its K loop.

DenseNet's layers (and DPN's, RDNet's) begin with relu(bn(cat(features))) -> 1x1 conv: the
Concat of every earlier feature map, a BatchNormalization that cannot fold into any conv (it
comes before its conv; `batchnorm_to_affine` makes it a Mul and an Add by per-channel
constants), a Relu. Applied inside the anchor rule (anchor_epilogue.py) to such an NHWC 1x1
conv (stride 1, unpadded: its pixels are the Concat's), the Concat and the ops between become the
conv's prologue: the kernel's K loop runs over each Concat input's channels in turn, applies the
ops to each loaded tile (the constants at that input's channel offset) and multiplies it by the
weight's rows for those channels. Neither the Concat nor its activated copy is written: a dense
layer is its two convolutions, where a kernel selecting and activating the Concat ran before
them (58 of them in densenet121). Refused, with the reason, where the template cannot.
"""

from __future__ import annotations

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node
from opfuse.ir.ops import NHWC_CONV
from opfuse.passes.rules import NotFired, node_label

RULE = names.CONCAT_PROLOGUE
ACTIVATIONS = ("Relu",)
AFFINE = ("Mul", "Add", "Sub")
MAX_INPUTS = 32  # the Concat's inputs the kernel reads, each a pointer argument and a K loop


def concat_prologue(
    graph: Graph,
    conv: Node,
    taken: set[str],
    producers: dict[str, Node],
    consumers: dict[str, list[Node]],
    not_fused: list[NotFired],
) -> list[Node]:
    """[Concat, the ops after it] before an NHWC 1x1 conv that alone reads them, or []."""
    if conv.op_type != NHWC_CONV or len(conv.inputs) > 3:
        return []
    outputs = {o.name for o in graph.outputs}
    chain: list[Node] = []
    value, reader = conv.inputs[0], conv
    while True:
        node = producers.get(value)
        if node is None or node.id in taken or value in outputs:
            return []
        if [c.id for c in consumers.get(value, [])] != [reader.id]:
            return []
        if node.op_type == "Concat":
            if not chain:
                # A Concat read by the conv as it is: `concat_epilogue` has its producer write it
                # in place, as many launches; reading it in pieces instead waits for the GPU.
                return []
            break
        if node.op_type not in (*AFFINE, *ACTIVATIONS) or len(chain) >= 8:
            return []
        chain.insert(0, node)
        data = [x for x in node.inputs if x and x not in graph.constants]
        if len(data) != 1:
            return []
        value, reader = data[0], node
    why = concat_prologue_reason(graph, node, chain, conv)
    if why is not None:
        not_fused.append(NotFired(RULE, [node_label(n) for n in (node, *chain, conv)], why))
        return []
    return [node, *chain]


def concat_prologue_reason(graph: Graph, concat: Node, chain: list[Node], conv: Node) -> str | None:
    """None if the conv's K loop can read the Concat's inputs with `chain` applied, else why not."""
    shape = graph.spec(concat.outputs[0]).shape
    if len(shape) != 4 or int(concat.attrs.get("axis", 0)) % 4 != 3:
        return "not a Concat of channels-last tensors along their channels"
    inputs = [x for x in concat.inputs if x]
    if len(inputs) > MAX_INPUTS:
        return f"a Concat of {len(inputs)} inputs (over {MAX_INPUTS}): one K loop and pointer each"
    if any(x in graph.constants for x in inputs):
        return "a constant input to the Concat"
    w = graph.spec(conv.inputs[1]).shape
    pads = [int(v) for v in conv.attrs.get("pads", [0, 0, 0, 0])]
    strides = [int(v) for v in conv.attrs.get("strides", [1, 1])]
    auto_pad = str(conv.attrs.get("auto_pad", "NOTSET"))
    if int(conv.attrs.get("group", 1)) != 1 or tuple(w[1:3]) != (1, 1) or any(pads) or strides != [1, 1]:
        return (
            "the conv is not a dense 1x1 conv of stride 1 without padding (its pixels are not the Concat's)"
        )
    if auto_pad not in ("NOTSET", "VALID"):
        return "the conv pads its input (auto_pad)"
    if conv.inputs[1] not in graph.constants:
        return "the conv's weight is not a constant"
    for n in chain:
        if n.op_type in ACTIVATIONS:
            continue
        const = next(x for x in n.inputs if x in graph.constants)
        c = graph.constants[const]
        if c.size != 1 and (c.shape[-1] != shape[3] or int(np.prod(c.shape)) != shape[3]):
            return f"{n.op_type} by a constant that is not one value per channel"
        if n.op_type == "Sub" and n.inputs[0] in graph.constants:
            return "Sub from a constant"
    return None
