"""`reshape_before_pointwise`: a Reshape a row op reads moves above the pointwise ops that compute
its input, and above the product by a weight matrix before them.

A normalization reads its input in its own shape; exporters often compute that input in another
one and reshape it between. Swin computes its residual stream as [B, H*W, C] tokens and its norms
read [B, H, W, C] (and the other way round): `x + proj(attn) -> view -> LayerNorm`. The row kernel
takes only ops of its own shape, so the residual Add ran as a kernel of its own, the GEMM before it
as another with the bias. Reshaped before them, `view(a) + view(b) -> LayerNorm`, the Add, the bias
and the GEMM are the row kernel's (`row_reduction`, `gemm_reduction`), and the views of `a` and `b`
are views of stored buffers (or of layout ops, which the row kernel reads through).

The move is exact: a pointwise op computes each element from the elements at the same index, and
a Reshape only renames indices; a product `A @ W` by a 2-D matrix computes each row of its output
from the same row of A, so where the Reshape keeps the last axis (only the leading axes regroup),
`view(A @ W) = view'(A) @ W`. It is made where
- a row op reads the Reshape's output as its data input, and the shapes on both sides are static;
- the op above has no reader but the Reshape and is not a graph output;
- a pointwise op's other tensor inputs have its output's shape (no broadcast between them), and
  its constants broadcast the same way on both sides of the view (a scalar, or per-channel
  constants of trailing axes the view keeps);
- a product's second input is 2-D and the Reshape keeps the last axis, the row op reduces over that
  axis alone (so `gemm_reduction` can compute the product on its tiles), and no other product
  reads its A (`merge_projections` makes one GEMM of products of one input: Hiera's stage
  projection and its attention's QKV, where the projection's output is pooled, not normalized).
It repeats up a chain of pointwise ops whose only reader the moved view is, through one product at
most (the product's A gets a view of its own, where the chain stops).
"""

from __future__ import annotations

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node
from opfuse.ir.ops import ROW_OPS
from opfuse.ir.rows import row_op_reason, row_space
from opfuse.ir.support import pointwise_reason
from opfuse.passes.pointwise_views import constant_like
from opfuse.passes.rules import PassContext

RULE = names.RESHAPE_BEFORE_POINTWISE


def _static(shape: tuple[int, ...]) -> bool:
    return all(isinstance(d, int) and d >= 0 for d in shape)


class _Mover:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.consumers = graph.consumers()
        self.producers = graph.producers()
        self.outputs = {o.name for o in graph.outputs}
        self.moved = 0

    def _single_reader(self, name: str, reader: Node) -> bool:
        readers = self.consumers.get(name, [])
        return name not in self.outputs and len(readers) == 1 and readers[0] is reader

    def _crosses(self, mm: Node, before: tuple[int, ...], after: tuple[int, ...], products: bool) -> bool:
        """Whether a view from `before` to `after` of the product's output may move above it."""
        graph = self.graph
        if not products or mm.op_type != "MatMul":
            return False
        if any(r is not mm and r.op_type in ("MatMul", "Gemm") for r in self.consumers.get(mm.inputs[0], [])):
            return False  # a projection of an input other products read too: merge_projections'
        b, a = graph.spec(mm.inputs[1]).shape, graph.spec(mm.inputs[0]).shape
        if len(b) != 2 or len(before) < 2 or len(after) < 2 or before[-1] != after[-1]:
            return False
        return tuple(a[:-1]) == before[:-1]  # else A broadcasts against B: not a row of A per row

    def move(self, view: Node, products: bool) -> None:
        """Move `view` above its producer where it may, and the views that puts on the producer's
        inputs above theirs (one product at most on the way, where `products`)."""
        graph = self.graph
        src = view.inputs[0]
        node = self.producers.get(src)
        if node is None or not self._single_reader(src, view):
            return
        before = tuple(graph.spec(src).shape)
        after = tuple(graph.spec(view.outputs[0]).shape)
        product = node.op_type == "MatMul"
        if product:
            if not self._crosses(node, before, after, products):
                return
            a = graph.spec(node.inputs[0]).shape
            wanted = {node.inputs[0]: (*after[:-1], int(a[-1]))}
            consts: dict[str, np.ndarray] = {}
        else:
            if pointwise_reason(graph, node) is not None:
                return
            wanted, consts = {}, {}
            for x in dict.fromkeys(i for i in node.inputs if i):
                if x in graph.constants:
                    arr = constant_like(graph, x, view, before, after)
                    if arr is None:
                        return
                    consts[x] = arr
                elif tuple(graph.spec(x).shape) == before:
                    wanted[x] = after
                else:
                    return  # a tensor that broadcasts: its view would need the other's shape
            for x in wanted:
                # A product's epilogue (its bias, an activation) moves with the product or stays
                # with it: a view between them would part them (and `merge_projections` matches
                # the product with its bias).
                p = self.producers.get(x)
                if p is None or p.op_type not in ("MatMul", "Gemm") or not self._single_reader(x, node):
                    continue
                if not self._crosses(p, before, after, products):
                    return
        # The views on the inputs, in front of the producer; the producer writes the view's output.
        at = graph.nodes.index(node)
        views: dict[str, Node] = {}
        for k, (x, shape) in enumerate(wanted.items()):
            tag = f"{view.id}_above_{node.id}_{k}"
            views[x] = graph.reshape_node(tag, x, shape, f"{tag}_view")
        inputs = []
        for x in node.inputs:
            if x in views:
                x = views[x].outputs[0]
            elif x in consts and consts[x].shape != graph.constants[x].shape:
                cname = f"{x}_as_{'x'.join(map(str, consts[x].shape)) or 'scalar'}"
                x = graph.add_constant(cname, consts[x], graph.spec(x).dtype)
            inputs.append(x)
        graph.nodes[at : at + 1] = [
            *views.values(),
            Node(node.id, node.op_type, inputs, list(view.outputs), dict(node.attrs), node.name),
        ]
        graph.nodes.remove(view)
        graph.values.pop(src, None)
        self.moved += 1
        # The maps for what follows: the producer now reads the views, the views their inputs.
        self.consumers, self.producers = graph.consumers(), graph.producers()
        if product:
            return
        for v in views.values():
            self.move(v, products)


def _over_last_axis(graph: Graph, row: Node) -> bool:
    """Whether the row op reduces over its input's last axis alone (a LayerNorm, a Softmax)."""
    if row_op_reason(graph, row) is not None:
        return False
    space = row_space(graph, row)
    return not space.groups and space.inner == 1 and space.first == len(space.full) - 1


def reshape_before_pointwise(graph: Graph, ctx: PassContext) -> None:
    mover = _Mover(graph)
    for view in [n for n in graph.nodes if n.op_type == "Reshape"]:
        if view not in graph.nodes:
            continue
        shapes = (tuple(graph.spec(view.inputs[0]).shape), tuple(graph.spec(view.outputs[0]).shape))
        if not all(_static(s) for s in shapes) or shapes[0] == shapes[1]:
            continue
        readers = mover.consumers.get(view.outputs[0], [])
        rows = [r for r in readers if r.op_type in ROW_OPS and r.inputs[0] == view.outputs[0]]
        if rows:
            mover.move(view, any(_over_last_axis(graph, r) for r in rows))
    if mover.moved:
        ctx.log.fire(RULE, mover.moved)
