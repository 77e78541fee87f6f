"""`depthwise_prologue` and `pool_prologue`: a memory-bound window op computed on the input tiles
of the conv that reads it.

A depthwise conv (with its one-input activation) whose output only a 1x1 conv reads is computed
inside that conv's kernel, as the tiles of its input are loaded: MobileNet's and ShuffleNet's
depthwise-separable pairs in one launch, and the depthwise output never written. The depthwise conv
is memory-bound (KH*KW multiply-adds per element), so it may join an anchor as a prologue; the
result is rounded to the model's type, as the unfused plan would store it. A max or average pool
read by a conv joins it the same way (SqueezeNet's pool before each squeeze conv, ResNet's stem
pool before its first 3x3 conv, the average pool of Inception's pool branch before its 1x1 conv):
the window's maximum, or its average divided as the pool's own kernel divides, computed on the
input tiles, at each window position of a wider conv. Where others read the pool's output too
(ResNet's residual Add), the conv stores the tile it loads at its centre position
(`_stores_prologue_reason` says where it cannot). One pass over the conv groups takes both, so a
lone conv that gains a prologue joins the groups in order.
"""

from __future__ import annotations

from collections.abc import Iterator

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import Group, group_boundary
from opfuse.fusion.rules.base import QUIET, Candidate, FusionRule
from opfuse.graph import Graph, Node
from opfuse.ir.ops import NHWC_CONV, NHWC_POOLS, has_shortcut, is_depthwise
from opfuse.ir.support import centre_tap, conv_params

DEPTHWISE_RULE = names.DEPTHWISE_PROLOGUE
POOL_PROLOGUE_RULE = names.POOL_PROLOGUE  # the same, for a max or average pool before a conv of any window
# The prologue runs once per column tile of the pointwise conv: beyond two tiles of the default
# width it would compute the depthwise conv too many times over.
DEPTHWISE_PROLOGUE_MAX_COLUMNS = 128


class WindowPrologue(FusionRule):
    def match(self) -> Iterator[Candidate]:
        """Each template conv group (lone ones too) whose input is the only output of a template
        depthwise conv group (for a 1x1 conv) or pool group (max or average)."""
        graph, state = self.graph, self.state
        self.consumers = graph.consumers()
        self.outputs = {o.name for o in graph.outputs}
        by_output = {o: g for g in [*state.anchors, *state.lone] for o in g.outputs}
        self.gone: set[str] = set()
        self.promoted: list[Group] = []  # lone convs that now have a prologue to run
        self.lone_ids = {g.id for g in state.lone}
        for g in [*state.anchors, *state.lone]:
            if g.kind != "conv" or g.variant != "template" or g.prologue or g.views:
                continue
            pw = g.nodes[0]
            if has_shortcut(pw):
                continue  # its second K loop reads the shortcut's input, not the prologue's tiles
            pointwise = _pointwise_conv(graph, pw)
            if not pointwise and not _dense_conv(graph, pw):
                continue
            src = by_output.get(pw.inputs[0])
            if src is None or src.id in self.gone or src.variant != "template" or src.prologue:
                continue
            dw = src.nodes[0]
            pool = src.kind == "pool" and dw.op_type in NHWC_POOLS.values()
            if not pool and not (src.kind == "conv" and dw.op_type == NHWC_CONV and is_depthwise(graph, dw)):
                continue
            if not pool and not pointwise:
                continue  # a depthwise conv joins 1x1 convs only
            rule = POOL_PROLOGUE_RULE if pool else DEPTHWISE_RULE
            if not state.on(rule) or src.outputs != [pw.inputs[0]]:
                continue
            yield Candidate(rule, [dw, pw], group=g, data=src)

    def check(self, c: Candidate) -> str | None:
        graph, g, src = self.graph, c.group, c.data
        assert g is not None
        dw, pw = c.nodes
        pool = c.rule == POOL_PROLOGUE_RULE
        x = pw.inputs[0]
        if x in self.outputs or [u.id for u in self.consumers.get(x, [])] != [pw.id]:
            # Read elsewhere too (a ResNet stem's pool, read by the first block's conv and by its
            # residual Add): the conv stores the pooled tile it loads at its centre tap as well.
            if not pool:
                return QUIET  # others read the depthwise conv's output
            reason = _stores_prologue_reason(graph, pw, g)
            if reason is not None:
                return reason
        # The depthwise epilogue: a chain of one-input ops (scalar constants aside).
        chain_ok = all(
            sum(1 for i in n.inputs if i and not (i in graph.constants and graph.constants[i].size == 1)) == 1
            for n in src.nodes[1:]
        )
        weights = [] if pool else [i for i in dw.inputs[1:3] if i]
        if not chain_ok or any(i not in graph.constants for i in weights):
            return QUIET
        columns = graph.spec(pw.outputs[0]).shape[3]
        if columns > DEPTHWISE_PROLOGUE_MAX_COLUMNS:
            conv = "1x1 conv" if _pointwise_conv(graph, pw) else "conv"
            return (
                f"the {conv} has {columns} output channels (over {DEPTHWISE_PROLOGUE_MAX_COLUMNS}): "
                f"each of its column tiles would compute the {'pool' if pool else 'depthwise conv'} again"
            )
        return None

    def claim(self, c: Candidate) -> None:
        g, src = c.group, c.data
        assert g is not None
        g.prologue = list(src.nodes)
        g.inputs, g.outputs = group_boundary(self.graph, [*g.prologue, *g.nodes])
        g.rule = f"{g.rule}+{c.rule}"
        self.gone.add(src.id)
        if g.id in self.lone_ids:
            g.note = ""
            self.promoted.append(g)

    def finish(self) -> None:
        """The prologues' own groups are gone; lone convs that gained one follow the groups."""
        state, gone, promoted = self.state, self.gone, self.promoted
        state.lone[:] = [g for g in state.lone if g.id not in gone and all(g is not p for p in promoted)]
        state.anchors = [g for g in state.anchors if g.id not in gone] + promoted


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
    """None if the conv can store its pool prologue's output for that output's other readers
    (at its centre tap, from the first column tile), else why not."""
    if centre_tap(graph, conv) is None:
        return "others read the pool's output, and the conv does not read every pooled pixel at one window position (stride 1, same size)"
    if any(conv.inputs[0] in n.inputs for n in g.nodes[1:]):
        return "the conv's epilogue reads the pool's output, which its kernel stores only as it goes"
    if any(n.op_type in ("Split", "Concat") for n in g.nodes[1:]):
        return "others read the pool's output, and the conv's kernel already stores a Split or Concat"
    return None


RULE = WindowPrologue
