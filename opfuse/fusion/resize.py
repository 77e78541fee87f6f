"""`resize_gather`: a Resize read only by one pointwise kernel, or by one channels-last conv's
epilogue, is computed by that kernel's loads; any other Resize the gather can compute is a gather
kernel of its own (`resize_alone`, the pointwise rule's last groups), never the library's op.

A Resize of a 4-D tensor over H and W (nearest, bilinear or bicubic, constant scales or sizes) whose
output, directly or through unit-step Slices and Transposes, only one pointwise group or one
NHWC conv's epilogue (`fusion/rules/anchor_epilogue.py`) reads joins that group: an FPN's
upsampled map, run in NCHW and transposed back into the channels-last region, is gathered by the
kernel of the Add that sums it with the lateral conv's output (that conv's own, where the Add is
its epilogue). The kernel loads the Resize's input at the source coordinates of each element it computes
(`codegen/resize.py`), so neither the resized tensor nor the Slice's window is written. The
Resize's input itself may come through layout ops (the channels-last region's Transpose back to
NCHW): it is then read from the buffer behind them with strides, as `layout_views` reads.
"""

from __future__ import annotations

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.fusion.views import VIEW_THROUGH, input_view, slice_window
from opfuse.graph import Graph, Node
from opfuse.ir.ops import FLOAT_TYPES
from opfuse.ir.queries import contiguous_strides
from opfuse.ir.resize import COORDINATE_MODES, MODES, NEAREST_MODES, ResizeAxis, ResizeGather
from opfuse.passes.rules import NotFired, node_label

RESIZE_RULE = names.RESIZE_GATHER


def _attr(node: Node, key: str, default: object) -> object:
    value = node.attrs.get(key, default)
    return value.decode() if isinstance(value, bytes) else value


def _static(shape: tuple[int, ...]) -> bool:
    return all(isinstance(d, int) and d > 0 for d in shape)


def resize_reason(graph: Graph, node: Node) -> str | None:
    """None if a kernel can compute `node` (a Resize) by gather loads, else why not."""
    x = graph.spec(node.inputs[0])
    y = graph.spec(node.outputs[0])
    if len(x.shape) != 4:
        return f"a {len(x.shape)}-D Resize: the gather covers 4-D inputs resized over H and W"
    if not _static(tuple(x.shape)) or not _static(tuple(y.shape)):
        return "shapes not static"
    if x.dtype not in FLOAT_TYPES:
        return f"input of type {x.dtype}"
    mode = _attr(node, "mode", "nearest")
    if mode not in MODES:
        return "a mode other than nearest, linear and cubic"
    ctm = _attr(node, "coordinate_transformation_mode", "half_pixel")
    if ctm not in COORDINATE_MODES:
        return "coordinate_transformation_mode not one of " + ", ".join(COORDINATE_MODES)
    if mode == "nearest" and _attr(node, "nearest_mode", "round_prefer_floor") not in NEAREST_MODES:
        return "nearest_mode not one of " + ", ".join(NEAREST_MODES)
    if int(node.attrs.get("antialias", 0)):
        return "antialias: a filter that widens with the scale, not a fixed number of taps"
    if int(node.attrs.get("exclude_outside", 0)):
        return "exclude_outside: taps past the edges renormalize the weights"
    if "axes" in node.attrs:
        return "an axes attribute"
    if _attr(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
        return "keep_aspect_ratio_policy other than stretch"
    ins = list(node.inputs) + [""] * (4 - len(node.inputs))
    scales = graph.constants.get(ins[2]) if ins[2] else None
    sizes = graph.constants.get(ins[3]) if ins[3] else None
    if (ins[2] and scales is None) or (ins[3] and sizes is None):
        return "scales or sizes not constant"
    if (scales is None or scales.size == 0) and (sizes is None or sizes.size == 0):
        return "neither scales nor sizes given as a constant"
    if tuple(x.shape[:2]) != tuple(y.shape[:2]):
        return "resizes N or C: the gather resizes H and W"
    if scales is not None and scales.size and np.any(np.ravel(scales)[:2] != 1.0):
        return "resizes N or C: the gather resizes H and W"
    return None


def _axes(graph: Graph, node: Node) -> list[ResizeAxis]:
    x = graph.spec(node.inputs[0]).shape
    y = graph.spec(node.outputs[0]).shape
    ins = list(node.inputs) + [""] * (4 - len(node.inputs))
    scales = graph.constants.get(ins[2]) if ins[2] else None
    out: list[ResizeAxis] = []
    for d in range(4):
        if scales is not None and scales.size:
            scale = np.float32(np.ravel(scales)[d])
        else:  # sizes: onnxruntime's float32 out / in
            scale = np.float32(y[d]) / np.float32(x[d])
        out.append(ResizeAxis(int(x[d]), int(y[d]), float(scale)))
    return out


def plan_resize_gathers(
    graph: Graph,
    readers: set[str],
    values: list[str],
    iteration: tuple[int, ...],
    claimed: set[str],
    not_fused: list[NotFired],
    fold_layout: bool,
    selected: set[str] | frozenset[str] = frozenset(),
    *,
    producers: dict[str, Node] | None = None,
    consumers: dict[str, list[Node]] | None = None,
) -> tuple[dict[str, ResizeGather], list[Node]]:
    """The group inputs among `values` that are Resizes (through unit-step Slices and Transposes) read only by
    the group's nodes (`readers`), as gathers, and the nodes that leave the plan with them.
    `claimed`: nodes other groups hold (the ones taken here are added). `selected`: values only
    Concats of the group read, each loaded at offsets of its own shape, not `iteration`'s.
    `producers` and `consumers`: the graph's maps, where the caller holds them already."""
    held = set(claimed)
    producers = graph.producers() if producers is None else producers
    consumers = graph.consumers() if consumers is None else consumers
    graph_outputs = {o.name for o in graph.outputs}
    found: dict[str, tuple[Node, list[Node], list[int], list[int]]] = {}
    for x in values:
        chain: list[Node] = []  # the Slices and Transposes, nearest to the kernel first
        cur = x
        rank = len(graph.spec(x).shape)
        held_by = list(range(rank))  # each axis of `cur`: the axis of x that holds it
        starts = [0] * rank  # each axis of x: the Slices' starts on it
        ok = True
        while True:
            p = producers.get(cur)
            if p is None or cur in graph_outputs or p.id in held:
                ok = False
                break
            users = consumers.get(cur, [])
            inside = all(u.id in readers for u in users) if cur == x else len(users) == 1
            if not inside:
                ok = False
                break
            window = slice_window(graph, p) if p.op_type == "Slice" else None
            if window is not None:
                for a, start in window:
                    starts[held_by[a]] += start
            elif p.op_type == "Transpose" and len(graph.spec(p.inputs[0]).shape) == rank:
                perm = [int(a) for a in p.attrs.get("perm", range(rank - 1, -1, -1))]
                held_by = [held_by[perm.index(a)] for a in range(rank)]  # output axis i is input perm[i]
            elif p.op_type == "Resize":
                chain.append(p)
                break
            else:
                ok = False
                break
            chain.append(p)
            cur = p.inputs[0]
        if not ok or not chain or chain[-1].op_type != "Resize":
            continue
        resize = chain[-1]
        reason = resize_reason(graph, resize)
        if reason is not None:
            not_fused.append(NotFired(RESIZE_RULE, [node_label(resize)], reason))
            continue
        if x not in selected and tuple(graph.spec(x).shape) != tuple(iteration):
            not_fused.append(
                NotFired(
                    RESIZE_RULE,
                    [node_label(resize)],
                    "the kernel reading it broadcasts the resized value to a larger shape",
                )
            )
            continue
        found[x] = (resize, chain, held_by, starts)
    gathers: dict[str, ResizeGather] = {}
    owned: list[Node] = []
    # The Resizes' own inputs may be read through layout ops the group (with the Resizes) holds.
    every_reader = frozenset(readers | {n.id for _, chain, _, _ in found.values() for n in chain})
    for x, (resize, chain, order, starts) in found.items():
        gathers[x], folded = _gather(
            graph, resize, tuple(graph.spec(x).shape), order, starts, held, every_reader, fold_layout
        )
        owned += [n for n in folded if n.id not in {m.id for m in owned}]
        owned += chain
    claimed |= {n.id for n in owned}
    return gathers, owned


def resize_alone(
    graph: Graph, node: Node, claimed: set[str], fold_layout: bool
) -> tuple[ResizeGather, list[Node]]:
    """A Resize no kernel gathers (`resize_reason` None), as its own kernel: the gather of its
    output at the output's own offsets, read from its input (through the layout ops before it
    that only it reads, which leave the plan: the second value; they are added to `claimed`)."""
    rank = len(graph.spec(node.outputs[0]).shape)
    gather, folded = _gather(
        graph,
        node,
        tuple(graph.spec(node.outputs[0]).shape),
        list(range(rank)),
        [0] * rank,
        claimed,
        frozenset({node.id}),
        fold_layout,
    )
    claimed |= {n.id for n in folded}
    return gather, folded


def _gather(
    graph: Graph,
    resize: Node,
    shape: tuple[int, ...],
    order: list[int],
    starts: list[int],
    held: set[str],
    readers: frozenset[str],
    fold_layout: bool,
) -> tuple[ResizeGather, list[Node]]:
    """The gather of `resize` read at `shape` (its output after the Slices' `starts` and the
    Transposes' `order`), and the layout ops folded into its input's strides (read only by
    `readers`; none of them in `held`)."""
    axes = _axes(graph, resize)
    for d, axis in enumerate(axes):
        axis.start = starts[order[d]]
    source = resize.inputs[0]
    base, strides, offset = source, contiguous_strides(tuple(graph.spec(source).shape)), 0
    folded: list[Node] = []
    if fold_layout and source not in graph.constants:
        view = input_view(graph, source, allow_scale=False, readers=readers)
        if (
            view.nodes
            and not any(n.id in held for n in view.nodes)
            and view.base not in graph.constants
            and all(n.op_type in VIEW_THROUGH for n in view.nodes)
            and len(view.strides) == 4
        ):
            base, strides, offset = view.base, tuple(view.strides), view.offset
            folded = list(view.owned())
    gather = ResizeGather(
        base,
        strides,
        offset,
        shape,
        tuple(axes),
        str(_attr(resize, "mode", "nearest")),
        str(_attr(resize, "coordinate_transformation_mode", "half_pixel")),
        str(_attr(resize, "nearest_mode", "round_prefer_floor")),
        tuple(order),
        float(np.float32(float(resize.attrs.get("cubic_coeff_a", -0.75)))),
    )
    return gather, folded
