"""`gemm_reduction`: a GEMM computed on the tiles of the row kernel that reduces over its output's
columns, or over its rows of one item.

A transformer's Linear before a LayerNorm (the output projection and the second MLP layer, with the
bias and the residual add between) is a lone GEMM: the row kernel takes its bias and residual add,
and nothing is left to fuse into the GEMM. Where the row kernel reduces over exactly the GEMM's
output columns (N, the last axis) and a row fits one tile (N at most GEMM_ROW_MAX), each program of
the row kernel computes its BLOCK_M rows of the product over the whole K, all N columns at once, and
runs the row kernel's nodes on that tile: the GEMM, bias, residual, normalization and whatever the
row kernel stores, in one launch, and the product is never written. This holds for post-norm
(BERT: Linear -> add -> LayerNorm) and pre-norm layers (GPT-2, LLaMA: the residual stream and the
next layer's norm are both stored by the row kernel). On the GPU tuning times the one kernel against
the plan without the rule (the library's GEMM, then the row kernel). One GEMM per row kernel: where
a row kernel adds two (a parallel-residual layer, GPT-NeoX's `x + attn(..) + mlp(..)`), the other
runs in its own kernel, which computes its A operand (`operand_prologue`: the MLP's activation).
The row kernel's other full-shaped inputs may be read through folded layout ops (`layout_views`:
Swin's residual stream viewed as the grid its norm reads), and the GEMM's A may be a reshape of a
stored buffer (leading axes regrouped): the anchor rule leaves such an A as it lies, the same
memory, so the GEMM stays lone for this rule (`reshape_before_pointwise` makes both).

A dense NHWC conv is the same GEMM, implicit: its rows the output pixels, its columns the output
channels, K the window's taps times the input channels, each A tile loaded through the window (the
taps' pixels, zero outside the image). Where a LayerNorm over the channels follows a conv (the
patch embeddings and spatial-reduction convs of PVT and SegFormer, wav2vec2-style feature
encoders' convs with a LayerNorm each, ConvNeXt's and Swin's stems), the conv, its bias and the
norm run as one kernel. A grouped conv of a few groups (GEMM_CONV_GROUPS: data2vec-audio's
positional convs, each with its LayerNorm) multiplies its block-diagonal weight as a dense one. Not
a conv that sums a shortcut; a conv's A tiles are not computed by pointwise ops (no
`operand_prologue`).

The row kernel may reduce over the product's rows of one item instead: the strided layout, whose
tile is an image's R pixels (a sequence's tokens) by BLOCK_I columns of the product, each program
computing that tile (tl.dot's 16 columns at least; R fits the strided tile already, at most
TILE / MIN_TILED_COLUMNS rows). The conv before a mean over its pixels (ECA-ResNet's last conv of
each block, whose gate the mean feeds), ConvNeXt V2's Linear before its global response norm's L2
norm over the pixels, and a mean of a Linear's tokens run in the reduction's kernel. A mean a GEMM
of the items by its columns reads (a classifier's head, squeeze-excitation's MLP) is left alone:
`pooled_gemm` computes it on that GEMM's tiles, the launch this would save. In either layout a
product that others read too is stored by the row kernel, which computes it anyway.

A norm over each item (GroupNorm with one group, which the channels-last pass writes as a
LayerNorm over H, W and C; a LayerNorm over a sequence's tokens and channels) reduces over the
product's rows of one item and all its columns: the row kernel holds the item as its rows by all
its columns (the strided layout's tile, every column in one block, `ITEM_TILE` in the generated
module, which tuning keeps), reduced over both axes, one program per item, within GEMM_ITEM_TILE
accumulator elements (a row kernel's own MAX_ROW). PoolFormer's fc2 with its layer scale and
residual before the next block's norm, MobileViT V2's out-projection and second FFN conv before
theirs. Only where the row kernel stores full-shaped values and reads no views.
"""

from __future__ import annotations

from collections.abc import Iterator

from opfuse.frontend import rule_registry as names
from opfuse.fusion.groups import Group, group_boundary, merge_refusal
from opfuse.fusion.rules.base import Candidate, PlanState, RowPrologueRule
from opfuse.fusion.rules.operand_prologue import operand_prologue, prologue_views
from opfuse.fusion.views import RESHAPES
from opfuse.graph import Graph, Node
from opfuse.ir.ops import NHWC_CONV, has_shortcut, is_depthwise
from opfuse.ir.queries import next_pow2
from opfuse.ir.rows import is_item_space, row_space
from opfuse.ir.support import gemm_dims, is_batched
from opfuse.ir.views import StridedView

GEMM_REDUCTION_RULE = names.GEMM_REDUCTION
# Columns of one row kernel tile: a [BLOCK_M >= 16, next_pow2(N)] float32 accumulator per program.
# 1024 covers hidden sizes up to BERT-large's; longer rows would spill registers.
GEMM_ROW_MAX = 1024
# A grouped conv on the tiles multiplies a block-diagonal weight as a dense one: `groups` times
# the products it needs, so only a few groups (a speech encoder's positional conv).
GEMM_CONV_GROUPS = 16
# A norm over each item computes the item's whole product in one program: its [rows, columns]
# float32 accumulator within the strided tile's budget (a row kernel's MAX_ROW elements).
GEMM_ITEM_TILE = 16384


class GemmReduction(RowPrologueRule):
    rule = GEMM_REDUCTION_RULE
    kinds = ("gemm", "conv")
    strided_rows = True
    through_reshapes = True

    def takes(self, anchor: Node) -> bool:
        """A MatMul or Gemm, or an NHWC conv of at most GEMM_CONV_GROUPS groups (not depthwise:
        depthwise_reduction's), no shortcut summed in."""
        if anchor.op_type != NHWC_CONV:  # one B for every row (not a batched MatMul's B per item)
            return anchor.op_type in ("MatMul", "Gemm") and not is_batched(self.graph, anchor)
        groups = int(anchor.attrs.get("group", 1))
        if groups > 1 and (groups > GEMM_CONV_GROUPS or is_depthwise(self.graph, anchor)):
            return False
        return not has_shortcut(anchor)

    def match(self) -> Iterator[Candidate]:
        graph = self.graph
        self.order = {n.id: i for i, n in enumerate(graph.nodes)}  # the cycle check, prologues
        yield from super().match()

    def check(self, c: Candidate) -> str | None:
        graph, rg = self.graph, c.group
        assert rg is not None
        mm, head = c.nodes
        src, x = c.data
        space = row_space(graph, head)
        full = space.full
        m, n, _k, _trans_b = gemm_dims(graph, mm)
        columns = not space.groups and space.inner == 1 and space.first == len(full) - 1
        rows = not space.groups and space.inner == n == full[-1] and space.outer * space.r == m
        # A norm over each item (its rows and columns): the item's rows by all its columns.
        item = not columns and is_item_space(space) and full[-1] == n and space.outer * space.r == m * n
        if not (columns or rows or item):
            return "the row kernel does not reduce over the GEMM's output columns alone, nor over its rows of one item"
        if item and (rg.views or any(graph.spec(o).numel != space.outer * space.r for o in rg.outputs)):
            return "the row kernel over each item reads views or stores a reduced value"
        if item and max(16, next_pow2(space.r // n)) * max(16, next_pow2(n)) > GEMM_ITEM_TILE:
            return f"an item of {space.r // n} x {n} is more than one tile of the row kernel holds ({GEMM_ITEM_TILE})"
        if tuple(graph.spec(x).shape) != full:
            return "the GEMM's output is not the row kernel's full-shaped input"
        view = rg.views.get(x)
        if rows and rg.views:
            return "the row kernel reads rows through folded layout ops"
        if (rows or item) and self._pooled_by_gemm(rg):
            return "a GEMM reads the mean: pooled_gemm computes the mean on that GEMM's tiles instead"
        # A product read outside the row kernel too is stored by it, unless read through a view.
        if view is not None and not (isinstance(view, StridedView) and view.base == mm.outputs[0]):
            return "the row kernel reads the GEMM's output through a view"
        if view is not None and (self.read_outside(x, rg) or not self._only_viewed(view)):
            return "the GEMM's output is read outside the row kernel too"
        made = {o for n in rg.nodes for o in n.outputs}
        if any(i in made for i in mm.inputs if i):
            return "the GEMM reads what the row kernel computes"
        if src.views or src.prologue or src.absorbed or len(src.nodes) != 1:
            return "the GEMM reads its operand through folded layout ops"
        if mm.op_type == NHWC_CONV and len(graph.spec(mm.inputs[0]).shape) != 4:
            return "the conv is not a 2-D NHWC conv"
        if mm.op_type == "Gemm" and (
            (len(mm.inputs) > 2 and mm.inputs[2]) or float(mm.attrs.get("alpha", 1.0)) != 1.0
        ):
            return "a Gemm with alpha or C (its own epilogue)"
        if columns and (m != space.outer or n != space.r):
            return "the GEMM's rows and columns are not the row kernel's"
        if columns and n > GEMM_ROW_MAX:
            return f"a row of {n} columns is longer than one tile of the row kernel holds ({GEMM_ROW_MAX})"
        between = {node.id for node in view.nodes} if view is not None else set()
        why, _ = merge_refusal(graph, {mm.id, *between, *(node.id for node in rg.nodes)}, self.order)
        return why

    def _pooled_by_gemm(self, rg: Group) -> bool:
        """The row kernel is a global mean that a GEMM reads (through reshapes), which pooled_gemm
        computes on that GEMM's A tiles (a classifier's head, squeeze-excitation's MLP): the GEMM
        before the mean stays where it is, so that rule may take the mean."""
        means = [n for n in rg.nodes if n.op_type in ("ReduceMean", "GlobalAveragePool")]
        if not self.state.on(names.POOLED_GEMM) or len(means) != 1:
            return False
        head = means[0]
        space = row_space(self.graph, head)
        frontier, seen = list(head.outputs), 0
        while frontier and seen < 8:
            readers = self.consumers.get(frontier.pop(), [])
            seen += 1
            for u in readers:
                if u.op_type in RESHAPES or u.op_type == "Transpose":
                    frontier.extend(u.outputs)
                elif u.op_type in ("MatMul", "Gemm", NHWC_CONV) and not is_batched(self.graph, u):
                    m, _n, k, _t = gemm_dims(self.graph, u)  # rows the items, K the pooled columns
                    if (m, k) == (space.outer, space.inner):
                        return True
        return False

    def _only_viewed(self, view: StridedView) -> bool:
        """The anchor's output is read by the view's layout ops alone (a reshape the row kernel
        folded: `reads_in_order`), so the tile computed in the kernel replaces the whole chain."""
        if view.base in {o.name for o in self.graph.outputs}:
            return False
        chain = {n.id for n in view.nodes}
        return all(u.id in chain for u in self.consumers.get(view.base, []))

    def claim(self, c: Candidate) -> None:
        """The GEMM joins the row kernel; with `operand_prologue` on, so do the pointwise ops that
        compute its A and that only it reads (a gated FFN's `gelu(x @ wi_0) * (x @ wi_1)` before
        `wo`, gMLP's gate before its projection): the row kernel computes A's tiles in its K loop."""
        super().claim(c)
        rg = c.group
        assert rg is not None
        self._operand_prologue(c, rg)
        if c.data[1] in rg.views:  # the anchor's output read through a reshape: the tile is the view's
            rg.inputs = [x for x in rg.inputs if x != c.data[1]]

    def _operand_prologue(self, c: Candidate, rg: Group) -> None:
        graph, state = self.graph, self.state
        if not state.on(names.OPERAND_PROLOGUE) or c.nodes[0].op_type == NHWC_CONV:
            return  # a conv's A tiles are loaded through its window
        mm, held = c.nodes[0], state.held()
        ops = operand_prologue(graph, mm, held, self.producers, self.consumers, state.not_fused, self.order)
        if not ops:
            return
        rows_read = {x for n in rg.nodes for x in n.inputs if x}
        if rows_read & {x for n in ops for x in n.inputs if x}:
            return  # the row kernel loads that input as a row: it stays a buffer
        readers = frozenset(n.id for n in ops)
        views = prologue_views(graph, ops, readers, held, set()) if state.on(names.LAYOUT_VIEWS) else {}
        absorbed = {x.id for x in rg.absorbed}
        if any(n.id in absorbed for v in views.values() for n in v.nodes):
            return
        rg.prologue = [*ops, mm]
        rg.views.update(views)
        rg.absorbed += [n for v in views.values() for n in v.owned()]
        rg.inputs, rg.outputs = group_boundary(graph, [*rg.prologue, *rg.nodes])
        rg.rule = f"{rg.rule}+{names.OPERAND_PROLOGUE}"

    def finish(self) -> None:
        """The lone GEMMs left to a row kernel that took another one (one GEMM per row kernel: a
        parallel-residual layer's `x + attn_out(..) + mlp_out(gelu(..))` adds two GEMMs in one row
        kernel) compute their A operand in their own kernel instead: the anchor rule left them
        without the pointwise ops before A, for this rule to take with them, and they would run
        as a kernel of their own that writes A."""
        super().finish()
        state, graph = self.state, self.graph
        if not state.on(names.OPERAND_PROLOGUE):
            return
        promoted: list[Group] = []
        for g in state.lone:
            if g.kind != "gemm" or g.variant != "template" or len(g.nodes) != 1 or g.prologue or g.views:
                continue
            mm, held = g.nodes[0], state.held()
            if not left_to_a_row_kernel(graph, mm, self.consumers, state):
                continue  # the anchor rule tried its prologue already
            ops = operand_prologue(
                graph, mm, held, self.producers, self.consumers, state.not_fused, self.order
            )
            if not ops:
                continue
            readers = frozenset(n.id for n in ops)
            views = prologue_views(graph, ops, readers, held, set()) if state.on(names.LAYOUT_VIEWS) else {}
            g.prologue, g.views = ops, views
            g.absorbed = [n for v in views.values() for n in v.owned()]
            g.inputs, g.outputs = group_boundary(graph, [*g.prologue, *g.nodes])
            g.rule, g.note = f"{g.rule}+{names.OPERAND_PROLOGUE}", ""
            promoted.append(g)
        if promoted:
            state.lone[:] = [g for g in state.lone if all(g is not p for p in promoted)]
            state.anchors = [*state.anchors, *promoted]


def left_to_a_row_kernel(
    graph: Graph, anchor: Node, consumers: dict[str, list[Node]], state: PlanState
) -> bool:
    """Only row kernels read the GEMM's output, a row of it fits one tile: this rule will compute
    the GEMM on the row kernel's tiles, and the pointwise ops before A with it. The anchor rule
    gives such a GEMM no prologue of its own (it would not be lone); where the row kernel takes
    another GEMM, `finish` gives it one."""
    readers = consumers.get(anchor.outputs[0], [])
    if not readers or not all(c.id in state.in_rows for c in readers) or not state.on(names.GEMM_REDUCTION):
        return False
    return not is_batched(graph, anchor) and gemm_dims(graph, anchor)[1] <= GEMM_ROW_MAX


RULE = GemmReduction
