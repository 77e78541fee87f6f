"""`gemm_epilogue`, `conv_epilogue`, `pool_epilogue`: one compute-bound op (GEMM or Conv), or an
NHWC max or average pool, with the pointwise epilogue after it.

The epilogue grows from the anchor's output through pointwise consumers of the same shape (bias,
activation, residual add, scale, cast). Never two compute-bound anchors in one kernel: only
pointwise ops join; memory-bound neighbours join later by rules of their own (window_prologue,
gemv_chain, depthwise_reduction, concat_epilogue, pooled_gemm). The three kinds share one pass
over the graph, so their groups share one numbering. Inside it, `pad_prologue` and
`layout_prologue` (pad_prologue.py; the latter only for a conv with an epilogue, so that a lone
one stays the library's or a row kernel's), `concat_prologue` (concat_prologue.py) and a conv's
per-(image, channel) input scale read the anchor's input through the nodes before it,
`operand_prologue` (operand_prologue.py) computes a GEMM's A on its tiles; `layout_views` reads a
GEMM's A operand behind layout ops. An anchor with nothing to fuse that a template can run goes
to `state.lone` (the library kernel runs it unless tuning measures the template faster).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import Group, creates_cycle, group_boundary, merge_refusal
from opfuse.fusion.pad_gather import plan_pad_gathers
from opfuse.fusion.resize import plan_resize_gathers
from opfuse.fusion.rules.base import Candidate, FusionRule
from opfuse.fusion.rules.concat_prologue import concat_prologue
from opfuse.fusion.rules.gemm_reduction import left_to_a_row_kernel
from opfuse.fusion.rules.operand_prologue import operand_prologue, prologue_views
from opfuse.fusion.rules.pad_prologue import input_pad, input_transpose
from opfuse.fusion.views import RESHAPES, VIEW_THROUGH, input_view
from opfuse.graph import Graph, Node
from opfuse.ir.index_map import IndexMap
from opfuse.ir.ops import CONV_OPS, NHWC_CONV, NHWC_POOLS, has_shortcut, is_depthwise
from opfuse.ir.support import (
    conv_anchor_reason,
    gemm_anchor_reason,
    input_scale_reason,
    is_batched,
    pointwise_reason,
    pool_reason,
    pool_tail_reason,
)
from opfuse.ir.views import StridedView
from opfuse.passes.rules import NotFired, node_label

GEMM_RULE = names.GEMM_EPILOGUE
CONV_RULE = names.CONV_EPILOGUE
POOL_RULE = names.POOL_EPILOGUE
PAD_RULE = names.PAD_PROLOGUE
LAYOUT_PROLOGUE_RULE = names.LAYOUT_PROLOGUE
RESIZE_RULE = names.RESIZE_GATHER
PAD_GATHER_RULE = names.PAD_GATHER
# Group id prefixes, unique across group kinds: m (GEMM), c (conv), p (pool), a (attention),
# r (row), g (pointwise), s (chained GEMVs).
PREFIX = {"gemm": "m", "conv": "c", "pool": "p"}
KIND = {GEMM_RULE: "gemm", CONV_RULE: "conv", POOL_RULE: "pool"}
MAX_EPILOGUE_NODES = 16
MAX_EPILOGUE_TENSORS = 8  # besides A and B: each is a tile of loads live beside the accumulator


class AnchorEpilogue(FusionRule):
    options = (
        PAD_RULE,
        LAYOUT_PROLOGUE_RULE,
        names.CONCAT_PROLOGUE,
        names.OPERAND_PROLOGUE,
        RESIZE_RULE,
        PAD_GATHER_RULE,
        names.LAYOUT_VIEWS,
        names.POOL_TAIL,
    )

    def match(self) -> Iterator[Candidate]:
        graph, state = self.graph, self.state
        self.order = {n.id: i for i, n in enumerate(graph.nodes)}
        self.consumers = graph.consumers()
        self.producers = graph.producers()  # the graph does not change while the rule plans
        self.taken = set(state.in_rows)  # the row groups' nodes, then each anchor group's
        for anchor in graph.nodes:
            if anchor.id in self.taken:
                continue
            if anchor.op_type in ("MatMul", "Gemm") and state.on(GEMM_RULE):
                yield Candidate(GEMM_RULE, [anchor])
            elif anchor.op_type in CONV_OPS and state.on(CONV_RULE):
                yield Candidate(CONV_RULE, [anchor])
            elif anchor.op_type in NHWC_POOLS.values() and state.on(POOL_RULE):
                # Memory-bound, but a head like an anchor's: the window's maximum or average, then the
                # pointwise ops after it. Alone, it stays the library's pool unless its kernel is
                # measured faster.
                yield Candidate(POOL_RULE, [anchor])

    def check(self, c: Candidate) -> str | None:
        if c.rule == GEMM_RULE:
            return gemm_anchor_reason(self.graph, c.nodes[0])
        if c.rule == POOL_RULE:
            return pool_reason(self.graph, c.nodes[0])
        return None  # a conv the template cannot run runs as the library's, with its epilogue

    def claim(self, c: Candidate) -> None:
        graph, state, taken, consumers, order = self.graph, self.state, self.taken, self.consumers, self.order
        producers = self.producers
        not_fused, lone, groups = state.not_fused, state.lone, state.anchors
        anchor, rule, kind = c.nodes[0], c.rule, KIND[c.rule]
        variant, note = "template", ""
        if kind == "conv":
            reason = conv_anchor_reason(graph, anchor)
            if reason is not None:
                variant, note = "vendor", f"vendor convolution: {reason}"
        prologue = []
        computed = False  # a conv's input computed by operand_prologue's ops
        # A conv summing a shortcut (passes/shortcut_conv.py) reads a second input in a second K
        # loop: no prologue on its tiles (its vendor variant is the library's two convolutions).
        shortcut = kind == "conv" and has_shortcut(anchor)
        if shortcut:
            rule = f"{rule}+{names.SHORTCUT_CONV}"  # the pass that made this conv (passes/shortcut_conv.py)
        mark = len(not_fused)  # refusals of the prologues tried below
        if variant == "template" and not shortcut:
            prologue = _input_scale(graph, anchor, taken, producers, consumers, not_fused)
            if not prologue and state.on(PAD_RULE):
                prologue = input_pad(graph, anchor, taken, producers, consumers, not_fused)
                rule = f"{rule}+{PAD_RULE}" if prologue else rule
            if not prologue and state.on(names.CONCAT_PROLOGUE):
                prologue = concat_prologue(graph, anchor, taken, producers, consumers, not_fused)
                rule = f"{rule}+{names.CONCAT_PROLOGUE}" if prologue else rule
        operand = variant == "template" and state.on(names.OPERAND_PROLOGUE)
        if operand and kind == "gemm" and not left_to_a_row_kernel(graph, anchor, consumers, state):
            prologue = operand_prologue(graph, anchor, taken, producers, consumers, not_fused, order)
        elif operand and not prologue and not shortcut and _dense_nhwc_conv(graph, anchor):
            prologue = operand_prologue(graph, anchor, taken, producers, consumers, not_fused, order)
            computed = bool(prologue)
            if computed:  # an input scale refused for a Mul these ops now compute: moot
                mine = {node_label(n) for n in prologue}
                not_fused[mark:] = [
                    x for x in not_fused[mark:] if x.rule != CONV_RULE or not mine & set(x.nodes)
                ]
        members, pending = self._epilogue(anchor, fixed_tensors=4 if shortcut else 2)
        # The Split of merged sibling convs joins, each part stored, unless a group planned before
        # reads the whole output (attention reading Q, K and V through the Split as views of it;
        # an epilogue gathering a part's Resize from it): the kernel must store it, not its parts.
        lone_nhwc = (
            kind == "conv" and variant == "template" and anchor.op_type == NHWC_CONV and len(members) == 1
        )
        if lone_nhwc and anchor.outputs[0] not in state.read():
            members |= _split_epilogue(graph, anchor, taken, producers, consumers, order)
        by_id = {x.id: x for x in graph.nodes}
        members = _pull_side_inputs(graph, anchor, members, taken, consumers, order)
        if (
            not prologue
            and variant == "template"
            and not shortcut
            and len(members) > 1
            and state.on(LAYOUT_PROLOGUE_RULE)
        ):
            # Only a conv with an epilogue: a lone one is left to the library, or to a row
            # kernel that computes it on its tiles (gemm_reduction, depthwise_reduction).
            prologue = input_transpose(graph, anchor, taken, producers, consumers)
            rule = f"{rule}+{LAYOUT_PROLOGUE_RULE}" if prologue else rule
        for cid, why in pending.items():
            if cid not in members:
                not_fused.append(NotFired(rule, [node_label(anchor), node_label(by_id[cid])], why))
        # The anchor first; a pulled-in side input may stand before it in the graph.
        nodes = [anchor, *(x for x in graph.nodes if x.id in members and x.id != anchor.id)]
        views: dict[str, Any] = {}
        a_chain: list[Node] = []  # the layout ops an index map of A computes (_a_operand_map)
        if (kind == "gemm" and prologue) or computed:
            epilogue_reads = {x for n in nodes[1:] for x in n.inputs if x}
            if epilogue_reads & {x for n in prologue for x in n.inputs}:
                prologue = []  # the epilogue loads that input at the output's index: it stays a buffer
            else:
                rule = f"{rule}+{names.OPERAND_PROLOGUE}"
                if state.on(names.LAYOUT_VIEWS):
                    readers = frozenset(n.id for n in prologue)
                    views = prologue_views(graph, prologue, readers, taken | members, epilogue_reads)
        batched = kind == "gemm" and is_batched(graph, anchor)
        if batched and len(members) == 1 and not prologue:
            return  # nothing to fuse: the library's batched matmul reads strided operands itself
        if kind == "gemm" and variant == "template" and state.on(names.LAYOUT_VIEWS):
            if batched:
                # A with a prologue is computed on its tiles: only B is read through a view.
                skip = {anchor.inputs[0]} if prologue else set()
                views.update(_batched_operand_views(graph, anchor, nodes[1:], taken | members, skip))
            elif not prologue:
                if state.on(PAD_GATHER_RULE) and not left_to_a_row_kernel(graph, anchor, consumers, state):
                    views, a_chain = _a_operand_map(
                        graph, anchor, nodes[1:], taken | members, producers, consumers
                    )
                    rule = f"{rule}+{PAD_GATHER_RULE}" if views else rule
                if not views:
                    views = _a_operand_view(graph, anchor, nodes[1:], taken | members)
                if views and _plain_reshape(views) and left_to_a_row_kernel(graph, anchor, consumers, state):
                    # A reshaped (leading axes regrouped) is the same buffer: the row kernel that
                    # reads the output computes the GEMM on its tiles and loads A as it lies.
                    views = {}
        if (
            kind == "conv"
            and variant == "template"
            and anchor.op_type == NHWC_CONV
            and not prologue
            and state.on(names.LAYOUT_VIEWS)
        ):
            views.update(channel_window_input(graph, anchor, taken | members))
            # The epilogue's inputs of the output's shape too (Res2Net's running sum: the previous
            # scale's conv output plus this scale's part of the Split, in that conv's epilogue).
            out_shape = tuple(graph.spec(anchor.outputs[0]).shape)
            epilogue = frozenset(members - {anchor.id})
            for x in dict.fromkeys(y for n in nodes[1:] for y in n.inputs if y):
                made_here = any(x in n.outputs for n in nodes)
                if x in views or made_here or tuple(graph.spec(x).shape) != out_shape:
                    continue
                view = channel_window(graph, x, epilogue, taken | members)
                if view is not None:
                    views[x] = view
        tail = None
        if kind == "conv" and variant == "template" and state.on(names.POOL_TAIL):
            # A pool whose windows tile the map, on the output tile: a lone conv's too (a
            # DenseNet transition's 1x1 conv, then its average pool).
            written = group_boundary(graph, [*prologue, *nodes])[1]
            tail = _pool_tail(
                graph, anchor, nodes, prologue, views, written, taken | members, consumers, not_fused
            )
            if tail is not None:
                nodes.append(tail)
                members = members | {tail.id}
                rule = f"{rule}+{names.POOL_TAIL}"
        prefix = PREFIX[kind]
        if len(members) == 1 and not views and not prologue and not shortcut:
            # Nothing to fuse: the vendor kernel runs the anchor alone, unless its own template
            # is measured faster (a depthwise 7x7, a small GEMM).
            if variant == "template":
                lone.append(
                    Group(
                        f"{prefix}{len(groups) + len(lone)}",
                        kind,
                        rule,
                        [anchor],
                        *group_boundary(graph, [anchor]),
                        variant="template",
                        note=f"{'a pool' if kind == 'pool' else 'an anchor'} alone: its template was measured "
                        "faster than the library kernel",
                    )
                )
            return
        absorbed = [n for v in views.values() if isinstance(v, StridedView) for n in v.owned()] + a_chain
        # Inputs as the nodes read them; codegen reads a folded A from the buffer behind its view.
        ins, outs = group_boundary(graph, [*prologue, *nodes])
        resize = tail is None and state.on(RESIZE_RULE)  # a gathered input is loaded at rows in order
        if kind == "conv" and variant == "template" and anchor.op_type == NHWC_CONV and resize:
            # An input of the epilogue that is a Resize (through the Transposes around it: an
            # FPN's upsampled map added to the lateral conv's output) is gathered by its loads.
            gathers, gathered = plan_resize_gathers(
                graph,
                members - {anchor.id},
                [x for x in ins if x not in anchor.inputs and x not in graph.constants],
                tuple(graph.spec(anchor.outputs[0]).shape),
                taken | members,
                not_fused,
                state.on(names.LAYOUT_VIEWS),
                producers=producers,
                consumers=consumers,
            )
            if gathers:
                views = {**views, **gathers}
                absorbed += gathered
                rule = f"{rule}+{RESIZE_RULE}"
        if kind == "gemm" and variant == "template" and state.on(PAD_GATHER_RULE):
            # An epilogue input of the output's shape that is a constant Pad (CoaT's convolutional
            # position term, padded with the class token's row) is loaded through the Pad.
            out_shape = tuple(graph.spec(anchor.outputs[0]).shape)
            candidates = [
                x
                for x in ins
                if x not in anchor.inputs and x not in views and tuple(graph.spec(x).shape) == out_shape
            ]
            pads, padded = plan_pad_gathers(
                graph, members - {anchor.id}, candidates, taken | members, producers, consumers
            )
            if pads:
                views = {**views, **pads}
                absorbed += padded
                rule = f"{rule}+{PAD_GATHER_RULE}"
        taken |= members | {x.id for x in [*prologue, *absorbed]}
        groups.append(
            Group(
                f"{prefix}{len(groups) + len(lone)}",  # one numbering with the lone anchors
                kind,
                rule,
                nodes,
                ins,
                outs,
                variant=variant,
                note=note,
                prologue=prologue,
                views=views,
                absorbed=absorbed,
            )
        )

    def _epilogue(self, anchor: Node, fixed_tensors: int) -> tuple[set[str], dict[str, str]]:
        """The anchor and the pointwise consumers of its output's shape that join it, breadth
        first under the epilogue's caps; and the refusals a later join may resolve (cycles)."""
        graph, taken, consumers = self.graph, self.taken, self.consumers
        out_shape = graph.spec(anchor.outputs[0]).shape
        members = {anchor.id}
        frontier = [anchor]
        pending: dict[str, str] = {}
        while frontier:
            node = frontier.pop(0)
            for o in node.outputs:
                for u in consumers.get(o, []) if o else []:
                    if u.id in members or u.id in taken or pointwise_reason(graph, u) is not None:
                        continue
                    if graph.spec(u.outputs[0]).shape != out_shape:
                        continue
                    merged = members | {u.id}
                    why, _ = merge_refusal(
                        graph,
                        merged,
                        self.order,
                        MAX_EPILOGUE_NODES + 1,
                        MAX_EPILOGUE_TENSORS,
                        fixed_tensors=fixed_tensors,
                    )
                    if why is not None:
                        pending[u.id] = why
                        continue
                    members = merged
                    pending.pop(u.id, None)
                    frontier.append(u)
        return members, pending


RULE = AnchorEpilogue


def _pool_tail(
    graph: Graph,
    anchor: Node,
    nodes: list[Node],
    prologue: list[Node],
    views: dict[str, Any],
    outs: list[str],
    taken: set[str],
    consumers: dict[str, list[Node]],
    not_fused: list[NotFired],
) -> Node | None:
    """The NHWC pool that alone reads the one value the conv group writes, where its windows tile
    the map (ir.support.pool_tail_reason): computed on the conv's output tile, whose rows then run
    window by window (codegen.conv), so that only the pooled tile is stored. Not for a group whose
    rows are read or stored as pixels in order (a Concat read in its K loop or written by its
    stores, a Split's parts, a Resize gathered by its loads), a shortcut's second K loop or a
    depthwise conv; a Concat read in the K loop (concat_prologue) is read at each row's pixel."""
    if len(outs) != 1 or outs[0] in {o.name for o in graph.outputs}:
        return None
    readers = consumers.get(outs[0], [])
    if len(readers) != 1 or readers[0].op_type not in NHWC_POOLS.values() or readers[0].id in taken:
        return None
    pool = readers[0]
    why = pool_tail_reason(graph, pool)
    if why is None and (
        anchor.op_type != NHWC_CONV
        or has_shortcut(anchor)
        or is_depthwise(graph, anchor)
        or any(n.op_type in ("Concat", "Split") for n in nodes)
        or any(not isinstance(v, StridedView) for v in views.values())
    ):
        why = "the conv's rows are stored as pixels in order here (a Concat, a Split, a gathered input)"
    if why is not None:
        not_fused.append(NotFired(names.POOL_TAIL, [node_label(anchor), node_label(pool)], why))
        return None
    return pool


MAX_SPLIT_SIDE_INPUTS = 2  # tensors of a part's shape the parts' chains load (a residual each)


def _split_epilogue(
    graph: Graph,
    anchor: Node,
    taken: set[str],
    producers: dict[str, Node],
    consumers: dict[str, list[Node]],
    order: dict[str, int],
) -> set[str]:
    """A Split of the conv's output channels that only it feeds (sibling convolutions merged by
    passes/sibling_convs.py, or the model's own: DPN cuts each block's output into its residual
    and its dense part), and after each part the chain of pointwise ops of the part's shape that
    only it feeds: an activation (scalar constants aside), or an op that also reads one tensor of
    the part's shape made before the conv (DPN's residual sum, `resid + part`), loaded at the
    part's own elements. The kernel stores each part, or the last op of its chain, as a buffer of
    its own (codegen.conv: the columns of that part)."""
    out = anchor.outputs[0]
    users = consumers.get(out, [])
    if len(users) != 1 or users[0].op_type != "Split" or users[0].id in taken:
        return set()
    split = users[0]
    sizes = graph.constants.get(split.inputs[1]) if len(split.inputs) > 1 else None
    graph_outputs = {o.name for o in graph.outputs}
    if sizes is None or int(split.attrs.get("axis", 0)) % 4 != 3 or out in graph_outputs:
        return set()
    members = {split.id}
    sides: dict[str, str] = {}  # each side input, and the part whose elements it is loaded at
    for part in split.outputs:
        value = part
        while True:
            nxt = consumers.get(value, [])
            if len(nxt) != 1 or nxt[0].id in taken or pointwise_reason(graph, nxt[0]) is not None:
                break
            node = nxt[0]
            tensors = [
                x for x in node.inputs if x and not (x in graph.constants and graph.constants[x].size == 1)
            ]
            shape = graph.spec(value).shape
            if tensors.count(value) != 1 or graph.spec(node.outputs[0]).shape != shape:
                break
            side = [x for x in tensors if x != value]
            if side and not (
                len(side) == 1
                and graph.spec(side[0]).shape == shape
                and graph.spec(side[0]).dtype == graph.spec(value).dtype
                and _whole_buffer(producers, side[0])
                # made outside the kernel, and not from its output: no cycle through the side
                and getattr(producers.get(side[0]), "id", None) not in members
                and creates_cycle(graph, {anchor.id, *members, node.id}, order) is None
                and sides.get(side[0], part) == part  # at one part's elements only
                and len(sides.keys() | {side[0]}) <= MAX_SPLIT_SIDE_INPUTS
            ):
                break
            if value in graph_outputs:
                break
            members.add(node.id)
            sides.update((x, part) for x in side)
            value = node.outputs[0]
    return members


def _whole_buffer(producers: dict[str, Node], value: str) -> bool:
    """Whether `value` is a buffer of its own, or Reshapes of one: not a strided view (a Slice's
    channels, a Transpose), which the runtime would copy into a buffer before the kernel."""
    node = producers.get(value)
    while node is not None and node.op_type in RESHAPES:
        node = producers.get(node.inputs[0])
    return node is None or node.op_type not in VIEW_THROUGH


def _dense_nhwc_conv(graph: Graph, conv: Node) -> bool:
    """A channels-last conv of group 1 (the template's window, segment and flat loops, where
    operand_prologue computes each tap's input tile)."""
    return (
        conv.op_type == NHWC_CONV and int(conv.attrs.get("group", 1)) == 1 and not is_depthwise(graph, conv)
    )


def _plain_reshape(views: dict[str, Any]) -> bool:
    """A view of reshapes alone of a whole buffer (its elements in their order: the same memory)."""
    return all(
        isinstance(v, StridedView) and not v.offset and all(n.op_type in RESHAPES for n in v.nodes)
        for v in views.values()
    )


def _a_operand_map(
    graph: Graph,
    anchor: Node,
    epilogue: list[Node],
    taken: set[str],
    producers: dict[str, Node],
    consumers: dict[str, list[Node]],
) -> tuple[dict[str, IndexMap], list[Node]]:
    """A GEMM's A operand behind layout ops with a constant Pad, or a chain strides do not reach
    (pad_gather's chains): a window partition (Swin's, DaViT's: the tokens padded to whole
    windows, split into windows, the windows made the rows of the projection). The Pad was a
    kernel of its own and the Reshape of the permuted windows a copy the runtime made; the GEMM
    now loads each row of A from its row of the buffer behind them (codegen/gemm.py), a Pad's
    border rows its value. Only where the chain leaves K (A's last axis) alone (IndexMap.rows)
    and the epilogue reads neither A nor that buffer; the chain's ops leave the plan."""
    a = anchor.inputs[0]
    read = {x for n in epilogue for x in n.inputs if x}
    if a in graph.constants or a in read:
        return {}, []
    maps, chain = plan_pad_gathers(graph, {anchor.id}, [a], taken, producers, consumers)
    im = maps.get(a)
    if im is None or im.rows() is None or im.base in read:
        return {}, []
    return maps, chain


def channel_window_input(graph: Graph, anchor: Node, held: set[str]) -> dict[str, StridedView]:
    """A dense NHWC conv's input that is a window of the channels of a wider NHWC buffer, as
    {input: its view}: Res2Net's scales, a channel Split left in NCHW between the channels-last
    region's Transposes, each part read by its own 3x3 conv. The template reads the window in
    place (each pixel at the buffer's channel stride, from the window's first channel), where the
    runtime would first copy the strided view into a buffer of its own: a kernel no launch count
    shows. Only the template's loops that address pixels alone (codegen/conv_operands.py
    `_read_channel_window`): the window loop, the flat one of few channels and the depthwise
    one (FocalNet's focal levels); no prologue, not grouped."""
    x = anchor.inputs[0]
    if int(anchor.attrs.get("group", 1)) != 1 and not is_depthwise(graph, anchor):
        return {}
    view = channel_window(graph, x, frozenset({anchor.id}), held)
    return {x: view} if view is not None else {}


def channel_window(graph: Graph, x: str, readers: frozenset[str], held: set[str]) -> StridedView | None:
    """`x` (NHWC) as a window of the channels of a wider NHWC buffer behind layout ops (a channel
    Split or Slice between Transposes), read in place by `readers`; None where it is not one, or
    is the buffer's own order (no copy to save)."""
    if x in graph.constants or len(graph.spec(x).shape) != 4:
        return None
    view = input_view(graph, x, allow_scale=False, readers=readers)
    if (
        not view.nodes
        or view.base in graph.constants
        or any(n.id in held for n in view.nodes)
        or any(n.op_type not in VIEW_THROUGH for n in view.nodes)
        or not view.channel_window()
    ):
        return None
    return view


def _a_operand_view(
    graph: Graph, anchor: Node, epilogue: list[Node], taken: set[str]
) -> dict[str, StridedView]:
    """A GEMM's A operand reached through Transpose/Reshape (heads split off a projection,
    then rotated; gMLP's tokens transposed for its spatial projection, K then strided), or one
    output of a Split (q of a merged QKV projection): read with strides from the buffer behind
    them instead of copied first. The Split stays in the plan for its other readers (it is a
    view)."""
    a = anchor.inputs[0]
    if a in graph.constants:
        return {}
    readers = frozenset([anchor.id, *(n.id for n in epilogue)])
    view = input_view(graph, a, allow_scale=False, readers=readers)
    if not view.nodes or view.base in graph.constants or view.strides[-1] < 1:
        return {}
    if any(n.op_type not in VIEW_THROUGH for n in view.nodes):
        return {}
    # A view through a node another group holds (a merged conv's Split, whose parts that group
    # stores as buffers of their own) would read a buffer nobody writes.
    if any(n.id in taken for n in view.nodes):
        return {}
    if any(a in n.inputs for n in epilogue) and graph.spec(a).shape != graph.spec(anchor.outputs[0]).shape:
        return {}  # the epilogue reads A at the output index: only when A is output-shaped
    return {a: view}


def _batched_operand_views(
    graph: Graph, anchor: Node, epilogue: list[Node], taken: set[str], skip: set[str]
) -> dict[str, StridedView]:
    """Both operands of a batched MatMul read through the layout ops before them (heads split off
    a projection and rotated, Kᵀ as a Transpose): the batched template reads any strides, so no
    copy is made. An operand the epilogue reads too is read as it is, and those in `skip` (an A
    computed by a prologue) are not read at all."""
    views: dict[str, StridedView] = {}
    read = {x for n in epilogue for x in n.inputs if x}
    readers = frozenset([anchor.id, *(n.id for n in epilogue)])
    for x in dict.fromkeys(anchor.inputs[:2]):
        if x in graph.constants or x in read or x in skip:
            continue
        view = input_view(graph, x, allow_scale=False, readers=readers)
        if not view.nodes or view.base in graph.constants:
            continue
        if any(n.op_type not in VIEW_THROUGH for n in view.nodes) or any(n.id in taken for n in view.nodes):
            continue
        views[x] = view
    return views


def _pull_side_inputs(
    graph: Graph,
    anchor: Node,
    members: set[str],
    taken: set[str],
    consumers: dict[str, list[Node]],
    order: dict[str, int],
) -> set[str]:
    """Pointwise producers whose only readers are epilogue nodes join the epilogue: computed from
    their own inputs loaded at the output index (x * cos beside rotate_half(x) * sin in rotary
    embeddings), they need no kernel and no buffer of their own."""
    if len(members) == 1:
        return members
    producers = graph.producers()
    outputs = {o.name for o in graph.outputs}
    out_shape = graph.spec(anchor.outputs[0]).shape
    by_id = {x.id: x for x in graph.nodes}
    changed = True
    while changed:
        changed = False
        for mid in sorted(members - {anchor.id}, key=order.__getitem__):
            for x in by_id[mid].inputs:
                p = producers.get(x) if x else None
                if p is None or p.id in members or p.id in taken or pointwise_reason(graph, p) is not None:
                    continue
                out = p.outputs[0]
                if graph.spec(out).shape != out_shape or out in outputs:
                    continue
                if any(c.id not in members for c in consumers.get(out, [])):
                    continue
                merged = members | {p.id}
                why, _ = merge_refusal(
                    graph, merged, order, MAX_EPILOGUE_NODES + 1, MAX_EPILOGUE_TENSORS, fixed_tensors=2
                )
                if why is None:
                    members, changed = merged, True
    return members


def _input_scale(
    graph: Graph,
    conv: Node,
    taken: set[str],
    producers: dict[str, Node],
    consumers: dict[str, list[Node]],
    not_fused: list[NotFired],
) -> list[Node]:
    """The Mul that scales an NHWC conv's input per (image, channel), as squeeze-excitation does,
    when it can be applied to the input tiles inside the conv kernel (its only reader)."""
    if conv.op_type != NHWC_CONV:
        return []
    mul = producers.get(conv.inputs[0])
    if mul is None or mul.op_type != "Mul" or mul.id in taken:
        return []
    if len(consumers.get(mul.outputs[0], [])) != 1 or mul.outputs[0] in {o.name for o in graph.outputs}:
        return []
    why = input_scale_reason(graph, mul, conv)
    if why is not None:
        not_fused.append(NotFired(CONV_RULE, [node_label(mul), node_label(conv)], why))
        return []
    return [mul]
