"""`operand_prologue`: the pointwise ops that compute a GEMM's A operand run on its A tiles.

A gate applied just before a projection (gMLP's spatial gating unit, `u * v` read by the next
Linear), an attention map rescaled before it meets V (ConViT's `attn / attn.sum(-1)`), a query
scaled before Q @ Kᵀ where no attention rule took the MatMul (CaiT's talking heads): each is an
elementwise op whose only reader is the GEMM, and it ran as a kernel of its own that wrote A for
the GEMM to read back. Applied inside the anchor rule (anchor_epilogue.py) to a GEMM (batched or
not), the pointwise ops before A that only the GEMM reads, and that have A's shape, become its
prologue: each K step loads the ops' inputs at the A tile's coordinates (broadcast, or through
the layout ops before them as strides), computes A's tile in float32, and rounds it to the
model's type as the stored A would be. A is never written. Tuning times the one kernel against
the split form: the ops as one pointwise kernel, the library's GEMM, the epilogue's kernel.

A Concat along A's K axis (Sequencer's LSTM outputs, both directions and both axes, side by side
before the block's projection) is no copy either: each K step loads every part at its own
columns, masked to them, and adds the loads up; ops after the Concat apply to that sum. The
parts are loaded, not computed (one computed by another of the ops, or read by one, would be
loaded at two K offsets: refused), and only for a GEMM, whose A's last axis is K.

The same holds for a channels-last conv of group 1 (StarNet's `relu6(a) * b` before its 1x1
conv, a gate that varies over the image, which no input scale folds): each tap's input tile is
computed from the ops' inputs at its pixels and channels, 0 in the padding. And for a GEMM that
`gemm_reduction` computes on a row kernel's tiles: the row kernel computes A's tiles.
"""

from __future__ import annotations

from opfuse.frontend import rule_registry as names
from opfuse.fusion.views import VIEW_THROUGH, input_view
from opfuse.graph import Graph, Node
from opfuse.ir.support import pointwise_reason
from opfuse.ir.views import StridedView
from opfuse.passes.rules import NotFired, node_label

RULE = names.OPERAND_PROLOGUE
MAX_NODES = 12  # ops computed on every A tile, at each K step of each column tile (a gated tanh-GELU is 9)
MAX_TENSORS = 4  # their tensor inputs: a pointer and a load each per K step
MAX_PARTS = 4  # parts of a Concat along K (each one of the tensors)


def operand_prologue(
    graph: Graph,
    anchor: Node,
    taken: set[str],
    producers: dict[str, Node],
    consumers: dict[str, list[Node]],
    not_fused: list[NotFired],
    order: dict[str, int],
) -> list[Node]:
    """The pointwise ops (in graph order: `order`, each node's place) that compute the GEMM's A
    operand and that only the GEMM reads, each of A's shape; [] where there are none or the
    template cannot compute them. The anchor rule asks it for a GEMM's own kernel,
    `gemm_reduction` for a GEMM it computes on a row kernel's tiles. A node joins only when every
    reader of its output is the anchor or a member already, so the set is closed: nothing outside
    it reads what it computes."""
    a = anchor.inputs[0]
    shape = graph.spec(a).shape
    outputs = {o.name for o in graph.outputs}
    members: dict[str, Node] = {}
    frontier = [a]
    k_axis = len(shape) - 1 if _k_is_last(anchor) else None
    while frontier:
        value = frontier.pop()
        node = producers.get(value)
        if node is None or node.id in taken or node.id in members or value in outputs:
            continue
        if graph.spec(value).shape != shape:
            continue
        concat = k_axis is not None and _k_concat(graph, node, k_axis)
        if not concat and pointwise_reason(graph, node) is not None:
            continue
        readers = {c.id for c in consumers.get(value, [])}
        if not readers <= {anchor.id, *members}:
            continue  # another reader needs the value stored
        members[node.id] = node
        if not concat:  # a Concat's parts are loaded, each at its own K offset
            frontier.extend(x for x in node.inputs if x)
    if not members:
        return []
    for node in members.values():
        if node.op_type != "Concat":
            continue
        parts = {x for x in node.inputs if x}
        if any(parts & set(n.inputs) for n in members.values() if n is not node) or parts & {
            o for n in members.values() for o in n.outputs
        }:
            # A part another op reads (at A's own K coordinates) or computes: loaded two ways.
            why = "a part of the Concat along K is read or computed by another of the ops too"
            not_fused.append(
                NotFired(RULE, [*(node_label(n) for n in members.values()), node_label(anchor)], why)
            )
            return []
    if len(members) > MAX_NODES:
        # Part of the ops would still be a kernel writing a buffer of A's size: none saved.
        labels = [node_label(n) for n in members.values()]
        why = f"A is computed by {len(members)} ops (over {MAX_NODES}) on every tile of every K step"
        not_fused.append(NotFired(RULE, [*labels, node_label(anchor)], why))
        return []
    prologue = sorted(members.values(), key=lambda n: order[n.id])
    leaves = prologue_inputs(graph, prologue)
    resized = [x for x in leaves if _behind_views(producers, x, "Resize")]
    if resized:
        # The ops' own kernel gathers an upsampled input from the Resize's input (resize_gather,
        # an FPN's top-down Add); a prologue would read the Resize's output, copied first.
        why = "an input is a Resize that the ops' own kernel gathers instead of copying (resize_gather)"
        not_fused.append(NotFired(RULE, [*(node_label(n) for n in prologue), node_label(anchor)], why))
        return []
    if len(leaves) > MAX_TENSORS:
        not_fused.append(
            NotFired(
                RULE,
                [*(node_label(n) for n in prologue), node_label(anchor)],
                f"A is computed from {len(leaves)} tensors (over {MAX_TENSORS}): a load of each per K step",
            )
        )
        return []
    return prologue


def _k_is_last(anchor: Node) -> bool:
    """Whether A's last axis is the GEMM's K: a MatMul's, or a Gemm's without transA."""
    return anchor.op_type == "MatMul" or (anchor.op_type == "Gemm" and not int(anchor.attrs.get("transA", 0)))


def _k_concat(graph: Graph, node: Node, k_axis: int) -> bool:
    """A Concat along A's K axis of up to MAX_PARTS tensors: each K step loads every part at its
    own offset along K, masked to its columns (codegen/epilogue.py: computed_a_tile)."""
    if node.op_type != "Concat" or int(node.attrs.get("axis", 0)) % (k_axis + 1) != k_axis:
        return False
    parts = [x for x in node.inputs if x]
    distinct = len(set(parts)) == len(parts)  # a tensor twice would be loaded at two offsets
    return 1 < len(parts) <= MAX_PARTS and distinct and not any(x in graph.constants for x in parts)


def _behind_views(producers: dict[str, Node], value: str, op_type: str) -> bool:
    """Whether `value` is an `op_type` node's output, directly or through layout views."""
    node = producers.get(value)
    while node is not None and node.op_type in VIEW_THROUGH:
        node = producers.get(node.inputs[0])
    return node is not None and node.op_type == op_type


def prologue_inputs(graph: Graph, prologue: list[Node]) -> list[str]:
    """The tensors the prologue loads: its inputs made outside it, but one-value constants (the
    kernel's literals)."""
    made = {o for n in prologue for o in n.outputs}
    seen: dict[str, None] = {}
    for n in prologue:
        for x in n.inputs:
            if not x or x in made:
                continue
            if x in graph.constants and graph.constants[x].size == 1:
                continue
            seen[x] = None
    return list(seen)


def prologue_views(
    graph: Graph, prologue: list[Node], readers: frozenset[str], taken: set[str], epilogue_reads: set[str]
) -> dict[str, StridedView]:
    """The prologue's inputs reached through Transpose/Reshape/Slice/Split (a projection's output
    transposed back, one half of a chunked projection): read with strides from the buffer behind
    them. An input the epilogue reads too is read as it is."""
    views: dict[str, StridedView] = {}
    for x in prologue_inputs(graph, prologue):
        if x in graph.constants or x in epilogue_reads:
            continue
        view = input_view(graph, x, allow_scale=False, readers=readers)
        if not view.nodes or view.base in graph.constants:
            continue
        if any(n.op_type not in VIEW_THROUGH for n in view.nodes) or any(n.id in taken for n in view.nodes):
            continue
        views[x] = view
    return views
