"""Plan anchor groups: one compute-bound op (GEMM or Conv) with the pointwise epilogue after it,
and a max pool with its epilogue.

The epilogue grows from the anchor's output through pointwise consumers of the same shape (bias,
activation, residual add, scale, cast). Never two compute-bound anchors in one kernel: only
pointwise ops join, and, after the groups are formed, memory-bound neighbours by rules of their
own: a depthwise conv or max pool computed on a 1x1 conv's input tiles (`window_prologues`),
squeeze-excitation's two GEMVs in one kernel (`chain_gemv_groups`), and a depthwise conv computed
on the tiles of the row kernel that pools its output (`depthwise_reductions`).
"""

from __future__ import annotations

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import Group, group_boundary, merge_refusal
from opfuse.fusion.views import VIEW_THROUGH, input_view
from opfuse.graph import Graph, Node
from opfuse.ir.ops import CONV_OPS, MAX_POOL_NHWC, NHWC_CONV, has_shortcut, is_depthwise
from opfuse.ir.support import (
    PAD_MODES,
    centre_tap,
    conv_anchor_reason,
    conv_params,
    gemm_anchor_reason,
    input_scale_reason,
    pad_per_dim,
    pointwise_reason,
    pool_reason,
)
from opfuse.ir.views import StridedView
from opfuse.passes.rules import NotFired, node_label

GEMM_RULE = names.GEMM_EPILOGUE
CONV_RULE = names.CONV_EPILOGUE
POOL_RULE = names.POOL_EPILOGUE
# Group id prefixes, unique across group kinds: m (GEMM), c (conv), p (pool), a (attention),
# r (row), g (pointwise), s (chained GEMVs).
PREFIX = {"gemm": "m", "conv": "c", "pool": "p"}
MAX_EPILOGUE_NODES = 16
MAX_EPILOGUE_TENSORS = 8  # besides A and B: each is a tile of loads live beside the accumulator


def _split_epilogue(
    graph: Graph, anchor: Node, taken: set[str], consumers: dict[str, list[Node]]
) -> set[str]:
    """Sibling convolutions merged into one (passes/sibling_convs.py): the Split of the conv's
    output channels that only it feeds, and after each part the chain of one-input pointwise ops
    (an activation; scalar constants aside) that only it feeds. The kernel stores each part, or
    the last op of its chain, as a buffer of its own (codegen.conv: the columns of that part)."""
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
            if tensors != [value] or graph.spec(node.outputs[0]).shape != graph.spec(value).shape:
                break
            if value in graph_outputs:
                break
            members.add(node.id)
            value = node.outputs[0]
    return members


def plan_anchor_groups(
    graph: Graph,
    taken: set[str],
    not_fused: list[NotFired],
    disabled: set[str] | frozenset[str],
    lone: list[Group] | None = None,
) -> list[Group]:
    """Anchor groups; anchors with nothing to fuse that a template can run go to `lone` (the
    library kernel runs them unless tuning measures the template faster)."""
    order = {n.id: i for i, n in enumerate(graph.nodes)}
    consumers = graph.consumers()
    groups: list[Group] = []
    for anchor in graph.nodes:
        if anchor.id in taken:
            continue
        if anchor.op_type in ("MatMul", "Gemm") and GEMM_RULE not in disabled:
            rule, kind = GEMM_RULE, "gemm"
            reason = gemm_anchor_reason(graph, anchor)
            if reason is not None:
                not_fused.append(NotFired(rule, [node_label(anchor)], reason))
                continue
            variant, note = "template", ""
        elif anchor.op_type in CONV_OPS and CONV_RULE not in disabled:
            rule, kind = CONV_RULE, "conv"
            reason = conv_anchor_reason(graph, anchor)
            variant, note = (
                ("template", "") if reason is None else ("vendor", f"vendor convolution: {reason}")
            )
        elif anchor.op_type == MAX_POOL_NHWC and POOL_RULE not in disabled:
            # Memory-bound, but a head like an anchor's: the window's maximum, then the pointwise
            # ops after it. Alone, it stays the library's pool unless its kernel is measured faster.
            rule, kind = POOL_RULE, "pool"
            reason = pool_reason(graph, anchor)
            if reason is not None:
                not_fused.append(NotFired(rule, [node_label(anchor)], reason))
                continue
            variant, note = "template", ""
        else:
            continue
        prologue = []
        # A conv summing a shortcut (passes/shortcut_conv.py) reads a second input in a second K
        # loop: no prologue on its tiles, and always its template (the library has no such conv).
        shortcut = kind == "conv" and has_shortcut(anchor)
        if shortcut:
            rule = f"{rule}+{names.SHORTCUT_CONV}"  # the pass that made this conv (passes/shortcut_conv.py)
        if variant == "template" and not shortcut:
            prologue = _input_scale(graph, anchor, taken, consumers, not_fused)
            if not prologue and PAD_RULE not in disabled:
                prologue = _input_pad(graph, anchor, taken, consumers, not_fused)
                rule = f"{rule}+{PAD_RULE}" if prologue else rule
        out_shape = graph.spec(anchor.outputs[0]).shape
        members = {anchor.id}
        frontier = [anchor]
        pending: dict[str, str] = {}  # refusals that a later join may resolve (cycles)
        while frontier:
            node = frontier.pop(0)
            for o in node.outputs:
                for c in consumers.get(o, []) if o else []:
                    if c.id in members or c.id in taken or pointwise_reason(graph, c) is not None:
                        continue
                    if graph.spec(c.outputs[0]).shape != out_shape:
                        continue
                    merged = members | {c.id}
                    why, _ = merge_refusal(
                        graph,
                        merged,
                        order,
                        MAX_EPILOGUE_NODES + 1,
                        MAX_EPILOGUE_TENSORS,
                        fixed_tensors=4 if shortcut else 2,
                    )
                    if why is not None:
                        pending[c.id] = why
                        continue
                    members = merged
                    pending.pop(c.id, None)
                    frontier.append(c)
        if kind == "conv" and variant == "template" and anchor.op_type == NHWC_CONV and len(members) == 1:
            members |= _split_epilogue(graph, anchor, taken, consumers)
        by_id = {x.id: x for x in graph.nodes}
        members = _pull_side_inputs(graph, anchor, members, taken, consumers, order)
        for cid, why in pending.items():
            if cid not in members:
                not_fused.append(NotFired(rule, [node_label(anchor), node_label(by_id[cid])], why))
        # The anchor first; a pulled-in side input may stand before it in the graph.
        nodes = [anchor, *(x for x in graph.nodes if x.id in members and x.id != anchor.id)]
        views = {}
        if kind == "gemm" and variant == "template" and names.LAYOUT_VIEWS not in disabled:
            views = _a_operand_view(graph, anchor, nodes[1:], taken | members)
        if len(members) == 1 and not views and not prologue and not shortcut:
            # Nothing to fuse: the vendor kernel runs the anchor alone, unless its own template
            # is measured faster (a depthwise 7x7, a small GEMM).
            if variant == "template" and lone is not None:
                prefix = PREFIX[kind]
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
            continue
        absorbed = [n for v in views.values() for n in v.owned()]
        # Inputs as the nodes read them; codegen reads a folded A from the buffer behind its view.
        ins, outs = group_boundary(graph, [*prologue, *nodes])
        taken |= members | {x.id for x in [*prologue, *absorbed]}
        prefix = PREFIX[kind]
        groups.append(
            Group(
                f"{prefix}{len(groups) + len(lone or [])}",  # one numbering with the lone anchors
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
    return groups


def _a_operand_view(
    graph: Graph, anchor: Node, epilogue: list[Node], taken: set[str]
) -> dict[str, StridedView]:
    """A GEMM's A operand reached through Transpose/Reshape (heads split off a projection,
    then rotated), or one output of a Split (q of a merged QKV projection): read with strides
    from the buffer behind them instead of copied first. The Split stays in the plan for its
    other readers (it is a view)."""
    a = anchor.inputs[0]
    if a in graph.constants:
        return {}
    readers = frozenset([anchor.id, *(n.id for n in epilogue)])
    view = input_view(graph, a, allow_scale=False, readers=readers)
    if not view.nodes or view.base in graph.constants or view.strides[-1] != 1:
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
    graph: Graph, conv: Node, taken: set[str], consumers: dict[str, list[Node]], not_fused: list[NotFired]
) -> list[Node]:
    """The Mul that scales an NHWC conv's input per (image, channel), as squeeze-excitation does,
    when it can be applied to the input tiles inside the conv kernel (its only reader)."""
    if conv.op_type != NHWC_CONV:
        return []
    mul = graph.producers().get(conv.inputs[0])
    if mul is None or mul.op_type != "Mul" or mul.id in taken:
        return []
    if len(consumers.get(mul.outputs[0], [])) != 1 or mul.outputs[0] in {o.name for o in graph.outputs}:
        return []
    why = input_scale_reason(graph, mul, conv)
    if why is not None:
        not_fused.append(NotFired(CONV_RULE, [node_label(mul), node_label(conv)], why))
        return []
    return [mul]


PAD_RULE = names.PAD_PROLOGUE


def _input_pad(
    graph: Graph, conv: Node, taken: set[str], consumers: dict[str, list[Node]], not_fused: list[NotFired]
) -> list[Node]:
    """The Pad before an NHWC conv (an NCHW Pad, then the region's Transpose to NHWC), read by
    nothing else: the conv template reads the unpadded tensor, each padded pixel mapped to the one
    it copies (reflect, edge) or filled (constant). Reflection padding before every 3x3 conv is
    how image-to-image generators and segmentation heads keep their borders."""
    if conv.op_type != NHWC_CONV or is_depthwise(graph, conv):
        return []
    producers = graph.producers()
    outputs = {o.name for o in graph.outputs}
    t = producers.get(conv.inputs[0])
    if t is None or t.op_type != "Transpose" or t.id in taken:
        return []
    if [int(a) for a in t.attrs.get("perm", ())] != [0, 2, 3, 1]:
        return []
    pad = producers.get(t.inputs[0])
    if pad is None or pad.op_type != "Pad" or pad.id in taken:
        return []
    for v, reader in ((t.outputs[0], conv), (pad.outputs[0], t)):
        if v in outputs or [c.id for c in consumers.get(v, [])] != [reader.id]:
            return []
    why = pad_prologue_reason(graph, pad)
    if why is not None:
        not_fused.append(NotFired(PAD_RULE, [node_label(pad), node_label(conv)], why))
        return []
    return [pad, t]


def pad_prologue_reason(graph: Graph, pad: Node) -> str | None:
    """None if a conv's input tiles can be read through this Pad, else why not."""
    mode = str(pad.attrs.get("mode", "constant"))
    x = graph.spec(pad.inputs[0])
    if mode not in PAD_MODES:
        return f"Pad mode {mode!r}: the conv reads through constant, reflect and edge padding"
    if len(x.shape) != 4:
        return "not a 4-D Pad"
    per_dim = pad_per_dim(graph, pad)
    if per_dim is None:
        return "the pads (or axes) are not constants"
    if per_dim[0] != (0, 0) or per_dim[1] != (0, 0):
        return "the Pad pads the batch or channel axis"
    if any(b < 0 or e < 0 for b, e in per_dim):
        return "negative pads (a crop)"
    if mode == "reflect" and any(max(per_dim[a]) >= x.shape[a] for a in (2, 3)):
        return "a reflection wider than the image"
    if len(pad.inputs) > 2 and pad.inputs[2]:
        value = graph.constants.get(pad.inputs[2])
        if value is None or value.size != 1 or not np.isfinite(np.asarray(value, dtype=np.float64)).all():
            return "the pad value is not a finite constant"
    return None


CHAIN_RULE = names.GEMV_CHAIN
# Every program along the second product's columns computes the whole hidden vector, reading the
# first weight again (from L2): only for a small first weight and a hidden vector that fits one
# register tile beside the accumulator.
CHAIN_MAX_FIRST_WEIGHT = 65536  # elements
CHAIN_MAX_HIDDEN = 256
CHAIN_MAX_ROWS = 256  # beyond this batch the products are no longer GEMVs


def _gemv(graph: Graph, node: Node) -> bool:
    """A 1x1 convolution of a 1x1 map by a constant weight: a GEMV over channels. NCHW or NHWC
    alike: a [N, C, 1, 1] tensor lies in memory as [N, 1, 1, C] does, and so do the weights."""
    if node.op_type not in CONV_OPS or int(node.attrs.get("group", 1)) != 1 or has_shortcut(node):
        return False
    x, y = graph.spec(node.inputs[0]).shape, graph.spec(node.outputs[0]).shape
    w = graph.constants.get(node.inputs[1])
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    spatial = slice(1, 3) if node.op_type == NHWC_CONV else slice(2, 4)
    return (
        len(x) == 4
        and x[spatial] == (1, 1)
        and y[spatial] == (1, 1)
        and w is not None
        and w.shape[spatial] == (1, 1)
        and (not bias or bias in graph.constants)
    )


def chain_gemv_groups(graph: Graph, groups: list[Group], not_fused: list[NotFired]) -> list[Group]:
    """Conv groups of two GEMVs back to back, the first's output read only by the second (the
    squeeze-excitation MLP), become one "chain" group: two memory-bound anchors in one kernel,
    which the rule "never two compute-bound anchors" allows (their arithmetic intensity is the
    batch size, far below the ridge point)."""
    consumers = graph.consumers()
    outputs = {o.name for o in graph.outputs}
    by_output = {o: g for g in groups for o in g.outputs}
    merged: dict[str, Group] = {}
    drop: set[str] = set()

    def simple(g: Group) -> bool:
        if (
            g.kind != "conv"
            or g.variant != "template"
            or g.prologue
            or g.views
            or not _gemv(graph, g.nodes[0])
        ):
            return False
        # The epilogue reads the accumulator and one-element constants only.
        anchor = g.nodes[0]
        own = {anchor.inputs[0], anchor.inputs[1], *anchor.inputs[2:]}
        return all(x in own or (x in graph.constants and graph.constants[x].size == 1) for x in g.inputs)

    for g2 in groups:
        second = g2.nodes[0]
        g1 = by_output.get(second.inputs[0])
        if g1 is None or g1.id in drop or g2.id in drop or not simple(g1) or not simple(g2):
            continue
        h = second.inputs[0]
        if g1.outputs != [h] or h in outputs or [c.id for c in consumers.get(h, [])] != [second.id]:
            continue
        first = g1.nodes[0]
        labels = [node_label(first), node_label(second)]
        rows = graph.spec(first.inputs[0]).shape[0]
        w1 = graph.constants[first.inputs[1]]
        if w1.shape[0] > CHAIN_MAX_HIDDEN:
            reason = (
                f"the hidden vector has {w1.shape[0]} channels (over {CHAIN_MAX_HIDDEN} held in registers)"
            )
        elif w1.size > CHAIN_MAX_FIRST_WEIGHT:
            reason = (
                f"the first weight has {w1.size} elements (over {CHAIN_MAX_FIRST_WEIGHT}), which every "
                "program of the second product would read again"
            )
        elif rows > CHAIN_MAX_ROWS:
            reason = f"{rows} rows: the products are GEMMs, not memory-bound GEMVs"
        else:
            reason = None
        if reason is not None:
            not_fused.append(NotFired(CHAIN_RULE, labels, reason))
            continue
        nodes = [*g1.nodes, *g2.nodes]
        ins, outs = group_boundary(graph, nodes)
        merged[g2.id] = Group(
            "s" + g1.id[1:], "chain", CHAIN_RULE, nodes, ins, outs, variant="template", match=len(g1.nodes)
        )
        drop |= {g1.id, g2.id}
    return [merged.get(g.id, g) for g in groups if g.id not in drop or g.id in merged]


DEPTHWISE_RULE = names.DEPTHWISE_PROLOGUE
POOL_PROLOGUE_RULE = names.POOL_PROLOGUE  # the same, for a max pool before a conv of any window
# The prologue runs once per column tile of the pointwise conv: beyond two tiles of the default
# width it would compute the depthwise conv too many times over.
DEPTHWISE_PROLOGUE_MAX_COLUMNS = 128


def _pointwise_conv(graph: Graph, node: Node) -> bool:
    """An NHWC 1x1 convolution, stride 1, no padding, group 1: a GEMM over the input's pixels."""
    if node.op_type != NHWC_CONV or int(node.attrs.get("group", 1)) != 1:
        return False
    w = graph.constants.get(node.inputs[1])
    p = conv_params(graph, node)
    return w is not None and (p["KH"], p["KW"], p["SH"], p["SW"], p["PH"], p["PW"]) == (1, 1, 1, 1, 0, 0)


def _dense_conv(graph: Graph, node: Node) -> bool:
    """An NHWC convolution of group 1 with a constant weight (the implicit-GEMM template)."""
    return (
        node.op_type == NHWC_CONV
        and int(node.attrs.get("group", 1)) == 1
        and node.inputs[1] in graph.constants
        and not is_depthwise(graph, node)
    )


def _stores_prologue_reason(graph: Graph, conv: Node, g: Group) -> str | None:
    """None if the conv can store its max-pool prologue's output for that output's other readers
    (at its centre tap, from the first column tile), else why not."""
    if centre_tap(graph, conv) is None:
        return "others read the pool's output, and the conv does not read every pooled pixel at one window position (stride 1, same size)"
    if any(conv.inputs[0] in n.inputs for n in g.nodes[1:]):
        return "the conv's epilogue reads the pool's output, which its kernel stores only as it goes"
    if any(n.op_type in ("Split", "Concat") for n in g.nodes[1:]):
        return "others read the pool's output, and the conv's kernel already stores a Split or Concat"
    return None


def window_prologues(
    graph: Graph,
    groups: list[Group],
    lone: list[Group],
    not_fused: list[NotFired],
    disabled: set[str] | frozenset[str] = frozenset(),
) -> list[Group]:
    """A depthwise conv (with its one-input activation) whose output only a 1x1 conv reads is
    computed inside that conv's kernel, as the tiles of its input are loaded: MobileNet's and
    ShuffleNet's depthwise-separable pairs in one launch, and the depthwise output never written.
    The depthwise conv is memory-bound (KH*KW multiply-adds per element), so it may join an anchor
    as a prologue; the result is rounded to the model's type, as the unfused plan would store it.
    A max pool read by a conv joins it the same way (SqueezeNet's pool before each squeeze
    conv, ResNet's stem pool before its first 3x3 conv): the window's maximum computed on the
    input tiles, at each window position of a wider conv. Where others read the pool's output too
    (ResNet's residual Add), the conv stores the tile it loads at its centre position
    (`_stores_prologue_reason` says where it cannot)."""
    consumers = graph.consumers()
    outputs = {o.name for o in graph.outputs}
    by_output = {o: g for g in [*groups, *lone] for o in g.outputs}
    gone: set[str] = set()
    promoted: list[Group] = []  # lone 1x1 convs that now have a prologue to run
    lone_ids = {g.id for g in lone}
    for g in [*groups, *lone]:
        if g.kind != "conv" or g.variant != "template" or g.prologue or g.views:
            continue
        pw = g.nodes[0]
        if has_shortcut(pw):
            continue  # its second K loop reads the shortcut's input, not the prologue's tiles
        pointwise = _pointwise_conv(graph, pw)
        if not pointwise and not _dense_conv(graph, pw):
            continue
        src = by_output.get(pw.inputs[0])
        if src is None or src.id in gone or src.variant != "template" or src.prologue:
            continue
        dw = src.nodes[0]
        pool = src.kind == "pool" and dw.op_type == MAX_POOL_NHWC
        if not pool and not (src.kind == "conv" and dw.op_type == NHWC_CONV and is_depthwise(graph, dw)):
            continue
        if not pool and not pointwise:
            continue  # a depthwise conv joins 1x1 convs only
        rule = POOL_PROLOGUE_RULE if pool else DEPTHWISE_RULE
        if rule in disabled:
            continue
        x = pw.inputs[0]
        if src.outputs != [x]:
            continue
        if x in outputs or [c.id for c in consumers.get(x, [])] != [pw.id]:
            # Read elsewhere too (a ResNet stem's pool, read by the first block's conv and by its
            # residual Add): the conv stores the pooled tile it loads at its centre tap as well.
            reason = (
                _stores_prologue_reason(graph, pw, g) if pool else "others read the depthwise conv's output"
            )
            if reason is not None:
                if pool:
                    not_fused.append(NotFired(rule, [node_label(dw), node_label(pw)], reason))
                continue
        # The depthwise epilogue: a chain of one-input ops (scalar constants aside).
        chain_ok = all(
            sum(1 for i in n.inputs if i and not (i in graph.constants and graph.constants[i].size == 1)) == 1
            for n in src.nodes[1:]
        )
        weights = [] if pool else [i for i in dw.inputs[1:3] if i]
        if not chain_ok or any(i not in graph.constants for i in weights):
            continue
        columns = graph.spec(pw.outputs[0]).shape[3]
        if columns > DEPTHWISE_PROLOGUE_MAX_COLUMNS:
            not_fused.append(
                NotFired(
                    rule,
                    [node_label(dw), node_label(pw)],
                    f"the 1x1 conv has {columns} output channels (over {DEPTHWISE_PROLOGUE_MAX_COLUMNS}): "
                    f"each of its column tiles would compute the {'pool' if pool else 'depthwise conv'} again",
                )
            )
            continue
        g.prologue = list(src.nodes)
        g.inputs, g.outputs = group_boundary(graph, [*g.prologue, *g.nodes])
        g.rule = f"{g.rule}+{rule}"
        gone.add(src.id)
        if g.id in lone_ids:
            g.note = ""
            promoted.append(g)
    lone[:] = [g for g in lone if g.id not in gone and all(g is not p for p in promoted)]
    return [g for g in groups if g.id not in gone] + promoted


DEPTHWISE_REDUCTION_RULE = names.DEPTHWISE_REDUCTION


def depthwise_reductions(
    graph: Graph, row_groups: list[Group], lone: list[Group], not_fused: list[NotFired]
) -> None:
    """A depthwise conv (NHWC) read only by a row kernel that reduces over the conv's pixels
    (squeeze-excitation's pooling, with the activation between) or over its channels (ConvNeXt's
    LayerNorm after its 7x7 depthwise conv) is computed on that kernel's tiles: the depthwise conv
    and the reduction in one launch, and the conv's output never written. Such a conv has
    nothing else to fuse (a lone anchor, which runs as the library kernel without this rule);
    tuning times the group against that split form."""
    from opfuse.ir.ops import ROW_OPS
    from opfuse.ir.rows import row_space

    consumers = graph.consumers()
    graph_outputs = {o.name for o in graph.outputs}
    lone_by_output = {g.outputs[0]: g for g in lone if g.kind == "conv" and len(g.outputs) == 1}
    gone: set[str] = set()
    for rg in row_groups:
        if rg.kind != "rowwise" or rg.prologue or rg.views:
            continue
        head = next(n for n in rg.nodes if n.op_type in ROW_OPS)
        space = row_space(graph, head)
        for x in rg.inputs:
            src = lone_by_output.get(x)
            if src is None or src.id in gone:
                continue
            dw = src.nodes[0]
            if dw.op_type != NHWC_CONV or not is_depthwise(graph, dw):
                continue
            labels = [node_label(dw), node_label(head)]
            members = {n.id for n in rg.nodes}
            if len(space.full) != 4 or space.groups or (space.first, space.end) not in ((1, 3), (3, 4)):
                reason = "the row kernel reduces neither over the depthwise conv's pixels nor its channels"
            elif tuple(graph.spec(x).shape) != space.full:
                reason = "the depthwise conv's output is not the row kernel's full-shaped input"
            elif x in graph_outputs or any(c.id not in members for c in consumers.get(x, [])):
                reason = "the depthwise conv's output is read outside the row kernel too"
            elif any(i not in graph.constants for i in dw.inputs[1:3] if i):
                reason = "the depthwise conv's weight or bias is not a constant"
            else:
                reason = None
            if reason is not None:
                not_fused.append(NotFired(DEPTHWISE_REDUCTION_RULE, labels, reason))
                continue
            rg.prologue = [dw]
            rg.inputs, rg.outputs = group_boundary(graph, [dw, *rg.nodes])
            rg.rule = f"{rg.rule}+{DEPTHWISE_REDUCTION_RULE}"
            rg.variant = "template"  # against the split form, where tuning measures
            gone.add(src.id)
            break
    lone[:] = [g for g in lone if g.id not in gone]


CONCAT_RULE = names.CONCAT_EPILOGUE
# Inputs of a Concat copied by the conv kernel that absorbs it: each is a loop of loads and stores.
CONCAT_MAX_COPIED = 8


def concat_epilogues(
    graph: Graph, groups: list[Group], lone: list[Group], not_fused: list[NotFired], claimed: set[str]
) -> None:
    """A channel Concat (NHWC, the last axis) whose input is the one output of a conv group, read
    by nothing else, joins that group: the kernel stores its result at its channel offset of the
    Concat's output and copies the Concat's other inputs into theirs (a block of channels per
    program), reading inputs that come through Slice/Transpose from the buffer behind them. The
    Concat's copy kernel is gone, and the conv's result is written once, where it belongs:
    ShuffleNet's blocks end this way (the branch conv beside the half passed through). Where
    several inputs are conv outputs, the last conv in the graph takes the Concat; the others' outputs
    are copied like any other input. A lone conv (nothing else to fuse) that takes a Concat
    joins `groups`. `claimed`: nodes other groups hold (views never fold them)."""
    consumers = graph.consumers()
    graph_outputs = {o.name for o in graph.outputs}
    order = {n.id: i for i, n in enumerate(graph.nodes)}
    by_output = {g.outputs[0]: g for g in [*groups, *lone] if len(g.outputs) == 1}
    for cat in graph.nodes:
        if cat.op_type != "Concat" or cat.id in claimed:
            continue
        out = graph.spec(cat.outputs[0]).shape
        if len(out) != 4 or int(cat.attrs.get("axis", 0)) % 4 != 3:
            continue
        owners = [
            by_output[x]
            for x in cat.inputs
            if x in by_output
            and by_output[x].kind == "conv"
            and by_output[x].variant == "template"
            and by_output[x].nodes[0].op_type == NHWC_CONV
            and x not in graph_outputs
            and [c.id for c in consumers.get(x, [])] == [cat.id]
            and cat.inputs.count(x) == 1
        ]
        if not owners:
            continue
        g = max(owners, key=lambda grp: max(order[n.id] for n in grp.nodes))
        labels = [node_label(g.nodes[0]), node_label(cat)]
        others = [x for x in cat.inputs if x and x != g.outputs[0]]
        if len(others) > CONCAT_MAX_COPIED:
            reason = f"{len(others)} other inputs to copy (over {CONCAT_MAX_COPIED})"
        elif any(x in graph.constants for x in others):
            reason = "a constant input: the library's Concat copies it"
        else:
            reason = None
        if reason is not None:
            not_fused.append(NotFired(CONCAT_RULE, labels, reason))
            continue
        members = frozenset({cat.id})
        for x in others:
            view = input_view(graph, x, allow_scale=False, readers=members)
            own = view.owned()
            if (
                not view.nodes
                or view.base in graph.constants
                or any(n.op_type not in VIEW_THROUGH for n in view.nodes)
                or any(n.id in claimed for n in view.nodes)
                or len(view.shape) != 4
            ):
                continue
            g.views[x] = view
            g.absorbed += own
            claimed |= {n.id for n in own}
        if any(g is x for x in lone):
            lone[:] = [x for x in lone if x is not g]
            g.note = ""
            groups.append(g)
        g.nodes.append(cat)
        claimed.add(cat.id)
        g.inputs, g.outputs = group_boundary(graph, [*g.prologue, *g.nodes])
        g.rule = f"{g.rule}+{CONCAT_RULE}"


POOLED_GEMM_RULE = names.POOLED_GEMM
# Every column tile of the GEMM computes the pool again: rows x pixels x channels loads each. At
# batch 1-4 (a GEMV) that is a few hundred KB from L2; at batch 32 (ResNet-50's head) tens of MB.
POOLED_GEMM_MAX_ROWS = 4


def pooled_gemms(
    graph: Graph, row_groups: list[Group], groups: list[Group], lone: list[Group], not_fused: list[NotFired]
) -> None:
    """A classifier's head: the global average pool (a row kernel: the mean over H and W of an
    NHWC or NCHW tensor, with the pointwise ops before it) whose result only a GEMM reads, as its A
    operand (through Flatten or Reshape), is computed on the GEMM's A tiles: each K block of A is
    the mean over the pixels, so the pooled vector is never written. The GEMM has as many rows as
    there are images, and the pool is computed once per column tile of the GEMM (read again from
    L2): so only up to POOLED_GEMM_MAX_ROWS images. Tuning times it against the split form (the
    row kernel, then the GEMM's template)."""
    from opfuse.ir.ops import ROW_OPS
    from opfuse.ir.rows import row_space
    from opfuse.ir.support import gemm_dims

    consumers = graph.consumers()
    graph_outputs = {o.name for o in graph.outputs}
    pooled_by = {g.outputs[0]: g for g in row_groups if g.kind == "rowwise" and len(g.outputs) == 1}
    gone: set[str] = set()
    for g in [*groups, *lone]:
        if g.kind != "gemm" or g.variant != "template" or g.prologue:
            continue
        anchor = g.nodes[0]
        a = anchor.inputs[0]
        view = g.views.get(a)
        rg = pooled_by.get(view.base if view is not None else a)
        if rg is None or rg.id in gone or rg.prologue or rg.views:
            continue
        reduce = rg.nodes[-1]
        labels = [node_label(reduce), node_label(anchor)]
        space = row_space(graph, reduce)
        m, _n, k, _t = gemm_dims(graph, anchor)
        pooled = rg.outputs[0]
        readers = {n.id for n in [*g.absorbed, anchor]}
        if reduce.op_type not in ("ReduceMean", "GlobalAveragePool") or any(
            n.op_type in ROW_OPS for n in rg.nodes[:-1]
        ):
            reason = "the row kernel is not one mean after pointwise ops"
        elif len(space.full) != 4 or space.groups or (space.first, space.end) not in ((1, 3), (2, 4)):
            reason = "the mean is not over the pixels (H and W) of an NHWC or NCHW tensor"
        elif (m, k) != (space.full[0], space.full[3 if space.first == 1 else 1]):
            reason = "the GEMM's rows are not the images, or its K not the channels"
        elif m > POOLED_GEMM_MAX_ROWS:
            reason = (
                f"{m} images (over {POOLED_GEMM_MAX_ROWS}): each of the GEMM's column tiles would "
                "pool them all again"
            )
        elif pooled in graph_outputs or any(c.id not in readers for c in consumers.get(pooled, [])):
            reason = "the pooled value is read outside the GEMM too"
        elif any(a in n.inputs for n in g.nodes[1:]):
            reason = "the GEMM's epilogue reads the pooled value"
        else:
            reason = None
        if reason is not None:
            not_fused.append(NotFired(POOLED_GEMM_RULE, labels, reason))
            continue
        g.prologue = list(rg.nodes)
        g.inputs, g.outputs = group_boundary(graph, [*g.prologue, *g.absorbed, *g.nodes])
        g.rule = f"{g.rule}+{POOLED_GEMM_RULE}"
        gone.add(rg.id)
        if any(g is x for x in lone):
            lone[:] = [x for x in lone if x is not g]
            g.note = ""
            groups.append(g)
    row_groups[:] = [rg for rg in row_groups if rg.id not in gone]
