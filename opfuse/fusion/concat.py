"""`concat_select`: a Concat computed by the pointwise kernel that reads it, not copied.

A Concat (any axis) is a member of a pointwise group like a pointwise op whose inputs are always
kernel tensors: the kernel iterates over the Concat's output and loads each element from the
input whose range along the axis holds it (`codegen/pointwise.py`), so the concatenated tensor is
not written by a copy of its own, and the pointwise ops after it join the same kernel. Its inputs
come through the load forms every input has: plain tensors, layout views (`layout_views`) and
Resizes computed by gather loads (`resize_gather`). Producers never join it (their iteration
shape is an input's, not the Concat's). A Concat no pointwise op joins runs as a kernel of its own
when at least one input is gathered or read through a view (one launch instead of those ops and
the copy); over plain tensors it stays the copy (one launch either way).
"""

from __future__ import annotations

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node
from opfuse.ir.ops import FLOAT_TYPES

CONCAT_SELECT_RULE = names.CONCAT_SELECT

LONE_COPY_REASON = (
    "a Concat of plain tensors that no pointwise op after it joins is one launch either way: "
    "it runs as the copy"
)


def concat_reason(graph: Graph, node: Node) -> str | None:
    """None if a generated pointwise kernel can compute `node` (a Concat) by selecting loads,
    else why not."""
    ins = [x for x in node.inputs if x]
    if not ins or len(node.outputs) != 1:
        return "not one output of at least one input"
    y = graph.spec(node.outputs[0])
    if not y.shape:
        return "a scalar output"
    for name in [*ins, node.outputs[0]]:
        spec = graph.spec(name)
        if spec.dtype not in FLOAT_TYPES:
            return f"value of type {spec.dtype}: pointwise kernels take float32/float16/bfloat16"
        if not all(isinstance(d, int) and d >= 0 for d in spec.shape):
            return "shapes not static"
    axis = int(node.attrs.get("axis", 0)) % len(y.shape)
    if any(int(graph.spec(x).shape[axis]) == 0 for x in ins):
        return "an input of length 0 along the axis"
    if y.numel == 0:
        return "an empty output"
    return None
