"""Match attention: the pattern the `attention` rule (fusion/rules/attention.py) plans as one
flash-attention kernel.

    scores = (Q·s1) @ (Kᵀ·s2) [· s3 | / s3] [+ mask | Where(cond, ·, fill)]
    probs  = Softmax(scores, axis=-1) [guarded by Where(IsNaN(probs), 0, probs)] [Dropout removed]
    out    = act(probs @ V)   [one-input pointwise ops, scalar constants aside]
             | act(V' @ Transpose(probs))   [the channels-first form: V = V'ᵀ, out transposed]

Q, Kᵀ and V are read through their head-split Reshape/Transpose as strided views of the
projection outputs, and the output is written through the head-merge Transpose/Reshape, so the
layout ops disappear along with the score matrix. A Q or Kᵀ that a Concat joins along the head
dim (GPT-J's, GPT-NeoX's, Persimmon's partial rotary: the rotated dims, then the rest) is read
from the Concat's inputs, each view filling its columns of the tile (`concat_parts`): the
Concat, a copy kernel of its own otherwise, leaves the plan. One-input pointwise ops on the
output (LeViT's Hardswish, which `pointwise_before_views` moves above the head merge) run on the
output tile before it is stored (`_unary_epilogue`).
"""

from __future__ import annotations

import dataclasses

from opfuse.fusion.views import input_view, merged_run, output_view
from opfuse.graph import Graph, Node
from opfuse.ir.queries import UseDef, contiguous_strides, scalar_constant
from opfuse.ir.support import pointwise_reason
from opfuse.ir.views import AttentionMatch, StridedView

MAX_HEAD_DIM = 256
MAX_PARTS = 4  # Concat inputs a Q or Kᵀ operand is read from: a load each per tile
MAX_EPILOGUE = 8  # pointwise ops on the output tile


def concat_parts(graph: Graph, use: UseDef, view: StridedView, d_axis: int) -> list[StridedView]:
    """Where the buffer behind `view` (Q, or Kᵀ) is a Concat along the dim that becomes the view's
    `d_axis` (the head dim), read by nothing but the view: one view per Concat input, in the
    view's layout over that input's width of the head dim, the inputs read through their own
    layout ops (a Slice of a projection, a rotary's output). The view must permute the Concat's
    output (dims of size 1 aside); else, or where an input cannot be viewed, []."""
    cat = use.producer(view.base)
    if cat is None or cat.op_type != "Concat" or view.offset or use.is_output(view.base):
        return []
    owned = {n.id for n in view.owned()}
    if view.kept or any(u.id not in owned for u in use.consumers(view.base)):
        return []  # the Concat's output is read elsewhere: it stays, and the view reads it
    out = tuple(graph.spec(view.base).shape)
    axis = int(cat.attrs.get("axis", 0)) % len(out)
    inputs = [x for x in cat.inputs if x]
    if not 2 <= len(inputs) <= MAX_PARTS or any(x in graph.constants for x in inputs):
        return []
    # Each view dim's Concat dim: the one of its size whose contiguous stride it has.
    cs = contiguous_strides(out)
    dims: list[int | None] = []
    for size, stride in zip(view.shape, view.strides, strict=True):
        if size == 1:
            dims.append(None)
            continue
        found = [p for p in range(len(out)) if out[p] == size and cs[p] == stride and p not in dims]
        if len(found) != 1:
            return []
        dims.append(found[0])
    if dims[d_axis] != axis or sorted(d for d in dims if d is not None) != [
        p for p in range(len(out)) if out[p] != 1
    ]:
        return []
    parts: list[StridedView] = []
    for x in inputs:
        v = input_view(graph, x, allow_scale=False, readers=frozenset({cat.id}))
        if v.offset < 0 or len(v.shape) != len(out):
            return []
        width = graph.spec(x).shape[axis]
        shape = tuple(width if j == d_axis else n for j, n in enumerate(view.shape))
        strides = tuple(0 if p is None else v.strides[p] for p in dims)
        parts.append(StridedView(v.base, shape, strides, 1.0, v.nodes, v.offset, v.kept))
    return parts


def _batch_merged(view: StridedView) -> StridedView | None:
    """A view of rank 5 or more as rank 4: its leading dims as one batch dim, where they lie as
    one strided run (or are all broadcast). MaxViT's [B, G, H, S, D] (batch, window, head) is
    then the kernel's [B*G, H, S, D]."""
    lead = len(view.shape) - 3
    run = merged_run(list(zip(view.shape[:lead], view.strides[:lead], strict=True)))
    if run is None:
        return None
    return dataclasses.replace(
        view, shape=(run[0], *view.shape[lead:]), strides=(run[1], *view.strides[lead:])
    )


def _unary_epilogue(graph: Graph, use: UseDef, value: str) -> list[Node]:
    """The chain of pointwise ops after the attention output that each read only the one before
    (their other inputs scalar constants) and keep its shape: the kernel computes them on its
    output tile. pointwise_before_views moves an activation after the head merge up to here."""
    chain: list[Node] = []
    node = use.sole_consumer(value)
    while node is not None and len(chain) < MAX_EPILOGUE and pointwise_reason(graph, node) is None:
        tensors = [x for x in node.inputs if x and scalar_constant(graph, x) is None]
        if tensors != [value] or graph.spec(node.outputs[0]).shape != graph.spec(value).shape:
            break
        if graph.spec(node.outputs[0]).dtype != graph.spec(value).dtype:
            break
        chain.append(node)
        value = node.outputs[0]
        node = use.sole_consumer(value)
    return chain


def _transposed_product(graph: Graph, use: UseDef, node: Node | None, probs: str, rank: int) -> Node | None:
    """The MatMul of `V' @ Pᵀ` where `node` is the Transpose of the probabilities `probs` (last
    two axes swapped) that only that MatMul reads, as its second input; else None."""
    if node is None or node.op_type != "Transpose" or rank < 2:
        return None
    perm = [int(p) for p in node.attrs.get("perm", range(rank - 1, -1, -1))]
    if perm != [*range(rank - 2), rank - 1, rank - 2]:
        return None
    mm2 = use.sole_consumer(node.outputs[0])
    if mm2 is None or mm2.op_type != "MatMul" or mm2.inputs[1] != node.outputs[0] or mm2.inputs[0] == probs:
        return None
    return mm2


def _swap_last(view: StridedView) -> StridedView:
    """The view with its last two axes swapped (the transposed matrices, the same memory)."""
    shape, strides = list(view.shape), list(view.strides)
    shape[-2:], strides[-2:] = shape[:-3:-1], strides[:-3:-1]
    return dataclasses.replace(view, shape=tuple(shape), strides=tuple(strides))


def match_attention(graph: Graph, mm1: Node, use: UseDef | None = None) -> AttentionMatch | str | None:
    """None: not attention at all; a str: attention, but why it cannot fuse; else the match.
    `use`: the graph's use-def snapshot, where the caller matches many MatMuls of one graph."""
    if mm1.op_type != "MatMul":
        return None
    use = use if use is not None else UseDef(graph)
    nodes = [mm1]
    scale = 1.0
    cur = mm1.outputs[0]
    mask = cond = ""
    fill = 0.0
    node = use.sole_consumer(cur)
    while node is not None and node.op_type in ("Mul", "Div") and node.inputs[0] == cur:
        c = scalar_constant(graph, node.inputs[1])
        if c is None or c == 0.0:
            break
        scale *= c if node.op_type == "Mul" else 1.0 / c
        nodes.append(node)
        cur = node.outputs[0]
        node = use.sole_consumer(cur)
    if node is not None and node.op_type == "Add":
        other = node.inputs[1] if node.inputs[0] == cur else node.inputs[0]
        mask = other
        nodes.append(node)
        cur = node.outputs[0]
        node = use.sole_consumer(cur)
    elif node is not None and node.op_type == "Where" and node.inputs[1] == cur:
        f = scalar_constant(graph, node.inputs[2])
        if f is None:
            return "the masking Where fills with a tensor, not a constant"
        cond, fill = node.inputs[0], f
        nodes.append(node)
        cur = node.outputs[0]
        node = use.sole_consumer(cur)
    if node is None or node.op_type != "Softmax":
        return None
    scores = graph.spec(mm1.outputs[0]).shape
    for extra in (mask, cond):
        shape = graph.spec(extra).shape if extra else ()
        tail = scores[len(scores) - len(shape) :] if len(shape) <= len(scores) else None
        if tail is None or any(a not in (1, b) for a, b in zip(shape, tail, strict=True)):
            return f"the mask (shape {list(shape)}) broadcasts the scores {list(scores)} to a larger shape"
    rank = len(graph.spec(cur).shape)
    if int(node.attrs.get("axis", -1)) % rank != rank - 1:
        return "softmax is not over the last axis"
    nodes.append(node)
    probs = node.outputs[0]
    users = use.consumers(probs)
    nan_guard = False
    # The exporter's guard for fully masked rows: Where(IsNaN(p), 0, p).
    isnan = [u for u in users if u.op_type == "IsNaN"]
    where = [u for u in users if u.op_type == "Where" and u.inputs[2] == probs]
    if len(users) == 2 and isnan and where and where[0].inputs[0] == isnan[0].outputs[0]:
        if scalar_constant(graph, where[0].inputs[1]) != 0.0:
            return "the NaN guard does not fill with zero"
        nan_guard = True
        nodes += [isnan[0], where[0]]
        probs = where[0].outputs[0]
    node = use.sole_consumer(probs)
    while node is not None and node.op_type in ("Dropout", "Identity"):
        nodes.append(node)
        probs = node.outputs[0]
        node = use.sole_consumer(probs)
    # The channels-first form (LeViT's and EfficientViT's convolutional attention, MaxViT's 2-D
    # one): V' @ Pᵀ with V' = Vᵀ, which is (P @ V)ᵀ: V read as V'ᵀ, the output written transposed.
    flipped = _transposed_product(graph, use, node, probs, rank)
    if flipped is not None:
        assert node is not None  # the Transpose of the probabilities
        nodes.append(node)
        node = flipped
    elif node is None or node.op_type != "MatMul" or node.inputs[0] != probs:
        return None
    mm2 = node
    nodes.append(mm2)
    epilogue = _unary_epilogue(graph, use, mm2.outputs[0])
    q = input_view(graph, mm1.inputs[0])
    k = input_view(graph, mm1.inputs[1])
    v = input_view(graph, mm2.inputs[0] if flipped else mm2.inputs[1])
    out = output_view(graph, epilogue[-1].outputs[0] if epilogue else mm2.outputs[0])
    if flipped is not None:
        v, out = _swap_last(v), _swap_last(out)
    if len(q.shape) > 4:
        # Batch dims beyond [B, H]: one batch dim of the kernel, where each operand, the output
        # and the masks have them as one strided run (masks: broadcast along them).
        for extra in (mask, cond):
            if extra and any(d != 1 for d in graph.spec(extra).shape[:-3]):
                return f"a mask that varies along the {len(q.shape) - 3} batch dims of rank-{len(q.shape)} scores"
        merged = [_batch_merged(x) if len(x.shape) == len(q.shape) else None for x in (q, k, v, out)]
        if any(x is None for x in merged):
            return f"operands of rank {len(q.shape)} whose batch dims are not one strided run"
        q, k, v, out = (x for x in merged if x is not None)
    for view in (q, k, v):
        if len(view.shape) not in (3, 4):
            return f"operands of rank {len(view.shape)}: attention kernels take [B, H, S, D] or [B, S, D]"
    d = q.shape[-1]
    if k.shape[-2] != d or v.shape[-1] > MAX_HEAD_DIM or d > MAX_HEAD_DIM:
        return f"head dim {d} (value dim {v.shape[-1]}) over {MAX_HEAD_DIM}"
    if len(graph.spec(mm1.inputs[0]).shape) != len(graph.spec(mm1.inputs[1]).shape):
        return "Q and K have different ranks (broadcast batch)"
    for name in (mm1.inputs[0], mm1.inputs[1], mm2.inputs[1]):
        if graph.spec(name).dtype not in ("float32", "float16", "bfloat16"):
            return f"operand of type {graph.spec(name).dtype}"
    scale *= q.scale * k.scale
    if v.scale != 1.0:
        return "the value operand is scaled"
    nodes += epilogue + q.owned() + k.owned() + v.owned() + out.nodes
    q_parts = concat_parts(graph, use, q, len(q.shape) - 1)
    k_parts = concat_parts(graph, use, k, len(k.shape) - 2)
    for parts, view in ((q_parts, q), (k_parts, k)):
        if parts:  # the Concat leaves the plan with the layout ops its inputs are read through
            cat = use.producer(view.base)
            assert cat is not None
            nodes += [cat, *(n for part in parts for n in part.owned())]
    return AttentionMatch(q, k, v, out, scale, mask, cond, fill, nan_guard, nodes, q_parts, k_parts, epilogue)
