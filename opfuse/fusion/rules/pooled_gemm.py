"""`pooled_gemm`: a classifier's global average pool computed on the A tiles of the GEMM that
reads it.

The pool is a row kernel (the mean over H and W of an NHWC or NCHW tensor, with the pointwise ops
before it) whose result only a GEMM reads, as its A operand (through Flatten or Reshape): each K
block of A is the mean over the pixels, so the pooled vector is never written. The GEMM has as
many rows as there are images, and the pool is computed once per column tile of the GEMM (read
again from L2): so only up to POOLED_GEMM_MAX_ROWS images. Tuning times it against the split form
(the row kernel, then the GEMM's template).
"""

from __future__ import annotations

from collections.abc import Iterator

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import group_boundary
from opfuse.fusion.rules.base import Candidate, FusionRule
from opfuse.ir.ops import ROW_OPS
from opfuse.ir.rows import row_space
from opfuse.ir.support import gemm_dims

POOLED_GEMM_RULE = names.POOLED_GEMM
# Every column tile of the GEMM computes the pool again: rows x pixels x channels loads each. At
# batch 1-4 (a GEMV) that is a few hundred KB from L2; at batch 32 (ResNet-50's head) tens of MB.
POOLED_GEMM_MAX_ROWS = 4


class PooledGemm(FusionRule):
    def match(self) -> Iterator[Candidate]:
        """Each template GEMM group (lone ones too) whose A operand, or the buffer behind its view,
        is the one output of a row group."""
        state = self.state
        pooled_by = {g.outputs[0]: g for g in state.rows if g.kind == "rowwise" and len(g.outputs) == 1}
        self.gone: set[str] = set()
        for g in [*state.anchors, *state.lone]:
            if g.kind != "gemm" or g.variant != "template" or g.prologue:
                continue
            a = g.nodes[0].inputs[0]
            view = g.views.get(a)
            rg = pooled_by.get(view.base if view is not None else a)
            if rg is None or rg.id in self.gone or rg.prologue or rg.views:
                continue
            yield Candidate(POOLED_GEMM_RULE, [rg.nodes[-1], g.nodes[0]], group=g, data=rg)

    def check(self, c: Candidate) -> str | None:
        graph, g, rg = self.graph, c.group, c.data
        assert g is not None
        reduce, anchor = c.nodes
        a = anchor.inputs[0]
        space = row_space(graph, reduce)
        m, _n, k, _t = gemm_dims(graph, anchor)
        pooled = rg.outputs[0]
        readers = {n.id for n in [*g.absorbed, anchor]}
        if reduce.op_type not in ("ReduceMean", "GlobalAveragePool") or any(
            n.op_type in ROW_OPS for n in rg.nodes[:-1]
        ):
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
        g.prologue = list(rg.nodes)
        g.inputs, g.outputs = group_boundary(self.graph, [*g.prologue, *g.absorbed, *g.nodes])
        g.rule = f"{g.rule}+{POOLED_GEMM_RULE}"
        self.gone.add(rg.id)
        if any(g is x for x in state.lone):
            state.lone[:] = [x for x in state.lone if x is not g]
            g.note = ""
            state.anchors.append(g)

    def finish(self) -> None:
        self.state.rows[:] = [rg for rg in self.state.rows if rg.id not in self.gone]


RULE = PooledGemm
