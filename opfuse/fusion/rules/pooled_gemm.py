"""`pooled_gemm`: a global average pool computed on the A tiles of the GEMM that reads it.

The pool is a row kernel (the mean over H and W of an NHWC or NCHW tensor, with the pointwise ops
before it) whose result only a GEMM reads, as its A operand (through Flatten or Reshape): each K
block of A is the mean over the pixels, so the pooled vector is never written. The GEMM is a
classifier's head, a 1x1 conv of the pooled 1x1 map (NHWC: a GEMV, which the GEMM template then
computes; ESE's attention in VoVNet and RDNet), or the chain of two such convs (gemv_chain:
squeeze-excitation's MLP after a dense conv, ResNeSt's split attention), which computes the pool
on its first GEMV's input tiles. The GEMM has as many rows as there are images, and the pool is
computed once per column tile of the GEMM (read again from L2): so only up to
POOLED_GEMM_MAX_ROWS images. Tuning times it against the split form (the row kernel, then the
GEMM as without the rule: the library's for a GEMM alone, its template for one with an
epilogue; or the chain).
"""

from __future__ import annotations

from collections.abc import Iterator

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import Group, group_boundary, merge_refusal
from opfuse.fusion.rules.anchor_epilogue import MAX_EPILOGUE_NODES, MAX_EPILOGUE_TENSORS
from opfuse.fusion.rules.base import Candidate, FusionRule
from opfuse.fusion.rules.gemv_chain import gemv
from opfuse.fusion.views import RESHAPES
from opfuse.graph import Graph, Node
from opfuse.ir.ops import NHWC_CONV, POINTWISE_OPS, ROW_OPS
from opfuse.ir.rows import row_space
from opfuse.ir.support import gemm_dims, pointwise_reason

POOLED_GEMM_RULE = names.POOLED_GEMM
POOLS = ("ReduceMean", "GlobalAveragePool")
# Every column tile of the GEMM computes the pool again: rows x pixels x channels loads each. At
# batch 1-4 (a GEMV) that is a few hundred KB from L2; at batch 32 (ResNet-50's head) tens of MB.
POOLED_GEMM_MAX_ROWS = 4


class PooledGemm(FusionRule):
    def match(self) -> Iterator[Candidate]:
        """Each template GEMM, conv GEMV or chain group (lone ones too) whose A operand, or the
        buffer behind its view, is the one output of a row group."""
        state = self.state
        self.order = {n.id: i for i, n in enumerate(self.graph.nodes)}  # for the cycle check
        self.consumers, self.producers = self.graph.consumers(), self.graph.producers()
        self.held = state.held()  # the graph's maps and the held nodes, once for every candidate
        self.given: dict[str, tuple[Group, list[Node]]] = {}  # row group id -> _give_back's
        pooled_by = {g.outputs[0]: g for g in state.rows if g.kind == "rowwise" and len(g.outputs) == 1}
        for row in state.rows:
            if row.kind == "rowwise" and len(row.outputs) > 1 and (back := self._give_back(row)) is not None:
                self.given[row.id] = back
                pooled_by[row.nodes[-1].outputs[0]] = row
        self.gone: set[str] = set()
        self.between: dict[str, list[Node]] = {}  # group id -> _reshapes' nodes
        for g in [*state.anchors, *state.lone]:
            if g.variant != "template" or g.prologue:
                continue
            if g.kind not in ("gemm", "chain") and not _conv_gemv(self.graph, g):
                continue
            a = g.nodes[0].inputs[0]
            view = g.views.get(a)
            between = self._reshapes(a) if g.kind != "gemm" else []
            rg = pooled_by.get(view.base if view is not None else between[0].inputs[0] if between else a)
            if rg is None or rg.id in self.gone or rg.prologue or rg.views:
                continue
            self.between[g.id] = between
            yield Candidate(POOLED_GEMM_RULE, [rg.nodes[-1], g.nodes[0]], group=g, data=rg)

    def check(self, c: Candidate) -> str | None:
        graph, g, rg = self.graph, c.group, c.data
        assert g is not None
        reduce, anchor = c.nodes
        a = anchor.inputs[0]
        space = row_space(graph, reduce)
        m, _n, k, _t = gemm_dims(graph, anchor) if g.kind != "chain" else _gemv_dims(graph, a)
        pooled = reduce.outputs[0]
        between = self.between.get(g.id, [])
        readers = {n.id for n in [*g.absorbed, *between[:1], anchor]}
        if reduce.op_type not in POOLS or any(n.op_type in ROW_OPS for n in rg.nodes[:-1]):
            return "the row kernel is not one mean after pointwise ops"
        if len(space.full) != 4 or space.groups or (space.first, space.end) not in ((1, 3), (2, 4)):
            return "the mean is not over the pixels (H and W) of an NHWC or NCHW tensor"
        if (m, k) != (space.full[0], space.full[3 if space.first == 1 else 1]):
            return "the GEMM's rows are not the images, or its K not the channels"
        if m > POOLED_GEMM_MAX_ROWS:
            return f"{m} images (over {POOLED_GEMM_MAX_ROWS}): each of the GEMM's column tiles would pool them all again"
        if pooled in {o.name for o in graph.outputs} or any(
            u.id not in readers for u in graph.consumers().get(pooled, [])
        ):
            return "the pooled value is read outside the GEMM too"
        if any(a in n.inputs for n in g.nodes[1:]):
            return "the GEMM's epilogue reads the pooled value"
        return None

    def claim(self, c: Candidate) -> None:
        state, g, rg = self.state, c.group, c.data
        assert g is not None
        if rg.id in self.given:  # the conv's epilogue stores the values the pool reads
            conv_group, ops = self.given.pop(rg.id)
            conv_group.nodes += ops
            conv_group.inputs, conv_group.outputs = group_boundary(self.graph, conv_group.nodes)
            conv_group.note = ""
            state.lone[:] = [x for x in state.lone if x is not conv_group]
            state.anchors.append(conv_group)
            state.in_rows -= {n.id for n in ops}
            rg.nodes = rg.nodes[-1:]
            rg.inputs, rg.outputs = group_boundary(self.graph, rg.nodes)
        g.prologue = list(rg.nodes)
        g.absorbed += self.between.get(g.id, [])  # the pooled vector is never written to view
        g.inputs, g.outputs = group_boundary(self.graph, [*g.prologue, *g.absorbed, *g.nodes])
        g.rule = f"{g.rule}+{POOLED_GEMM_RULE}"
        if g.kind == "conv":  # a GEMV the GEMM template computes (ir.support.gemm_dims)
            g.kind = "gemm"
        self.gone.add(rg.id)
        if any(g is x for x in state.lone):
            state.lone[:] = [x for x in state.lone if x is not g]
            g.note = ""
            state.anchors.append(g)

    def finish(self) -> None:
        self.state.rows[:] = [rg for rg in self.state.rows if rg.id not in self.gone]

    def _reshapes(self, a: str) -> list[Node]:
        """The layout ops that only reshape the pooled vector into `a` (each value read by the
        next alone; a Transpose that moves only axes of 1, as between the [N, C, 1, 1] mean and
        its channels-last twin), first to last; [] where `a` is no such op's output."""
        graph = self.graph
        outputs = {o.name for o in graph.outputs}
        chain: list[Node] = []
        while (node := self.producers.get(a)) is not None and node.id not in self.held:
            if node.op_type not in RESHAPES and not (
                node.op_type == "Transpose" and _keeps_order(graph, node)
            ):
                break
            if a in outputs or len(self.consumers.get(a, [])) != 1:
                break
            chain.insert(0, node)
            a = node.inputs[0]
        return chain

    def _give_back(self, rg: Group) -> tuple[Group, list[Node]] | None:
        """A mean whose row kernel also stores values of the pointwise ops before it (the
        activation that squeeze-excitation scales after the pool, in SE-ResNets) can still be
        pooled where those ops can be the epilogue of the lone conv whose output only they read:
        that conv's group and the ops, which move there when the pool is claimed (the conv's
        kernel stores them; the row kernel would have kept only the mean)."""
        graph, state = self.graph, self.state
        ops, reduce = rg.nodes[:-1], rg.nodes[-1]
        if rg.prologue or rg.views or not ops or reduce.op_type not in POOLS:
            return None
        if any(pointwise_reason(graph, n) is not None for n in ops):
            return None
        made = {o for n in ops for o in n.outputs}
        reads = {x for n in ops for x in n.inputs if x and x not in made and x not in graph.constants}
        if len(reads) != 1:
            return None
        (y,) = reads
        conv_group = next((x for x in state.lone if x.kind == "conv" and x.outputs == [y]), None)
        if conv_group is None or conv_group.variant != "template" or conv_group.prologue or conv_group.views:
            return None
        mine = {n.id for n in ops}
        shape = graph.spec(y).shape
        if y in {o.name for o in graph.outputs} or any(u.id not in mine for u in self.consumers.get(y, [])):
            return None
        if any(graph.spec(n.outputs[0]).shape != shape for n in ops):
            return None
        merged = {n.id for n in conv_group.nodes} | mine
        why, _ = merge_refusal(
            graph, merged, self.order, MAX_EPILOGUE_NODES + 1, MAX_EPILOGUE_TENSORS, fixed_tensors=2
        )
        return (conv_group, list(ops)) if why is None else None


def _keeps_order(graph: Graph, node: Node) -> bool:
    """A Transpose that moves only axes of size 1: its output is its input's memory."""
    shape = graph.spec(node.inputs[0]).shape
    perm = [int(p) for p in node.attrs.get("perm", range(len(shape) - 1, -1, -1))]
    moved = [p for p in perm if shape[p] != 1]
    return moved == sorted(moved)


def _gemv_dims(graph: Graph, x: str) -> tuple[int, int, int, bool]:
    """(M, N, K, _) of a chain's first GEMV over its [N, 1, 1, C] (or [N, C, 1, 1]) input: the
    images and the channels (N is not read)."""
    spec = graph.spec(x)
    return spec.shape[0], 0, spec.numel // spec.shape[0], False


def _conv_gemv(graph: Graph, g: Group) -> bool:
    """A conv group of one NHWC 1x1 conv of a 1x1 map (a GEMV) with a pointwise epilogue, nothing
    folded into it: the GEMM template computes it as its A times the transposed weight."""
    anchor = g.nodes[0]
    return (
        g.kind == "conv"
        and anchor.op_type == NHWC_CONV
        and not g.views
        and not g.absorbed
        and gemv(graph, anchor)
        and all(n.op_type in POINTWISE_OPS for n in g.nodes[1:])
    )


RULE = PooledGemm
