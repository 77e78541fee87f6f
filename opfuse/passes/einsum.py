"""`einsum_matmul`: a two-operand Einsum that is a (batched) matrix product becomes MatMul.

Models write attention and projections as einsum (MaxViT's `"bghid,bghjd->bghij"`, ...). As an
Einsum node it is one library call that no rule fuses: its scale, the Softmax after it and the
product with V stay separate kernels. Every letter of such an equation is a batch letter (in both
operands and the output), a row letter (in the first operand and the output), a column letter
(in the second and the output) or a contracted one (in both operands, not the output). The node
becomes Transpose the operands to [batch, rows, contracted] and [batch, contracted, columns],
Reshape where a part has other than one letter, MatMul, then Reshape and Transpose to the
output's order, each only where it is not the identity. The views cost nothing (the planner
reads through them), and attention, the GEMM epilogue and the operand prologue then fuse the
product like any other MatMul.

Left as it is, with the reason: another number of operands, a letter twice in one operand (a
diagonal), a letter in one operand only that is summed away, no contracted letter (an elementwise
or outer product), letters of different sizes (broadcast), non-float operands.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.ops import FLOAT_TYPES
from opfuse.passes.rules import Rule


def parse_equation(equation: str, ranks: list[int]) -> tuple[list[str], str] | None:
    """(the operands' letters, the output's) with each `...` spelled out as capital-free
    placeholder letters of the operand's rank, or None where the equation does not read. An
    implicit output (no `->`) is the letters used once, in alphabetical order, after the
    ellipsis' dims, as ONNX (and numpy) define it."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return None
    used = set(eq) - set(".,->")
    spare = [chr(c) for c in range(0x3B1, 0x3C9)]  # Greek letters: never an equation's own
    spare = [c for c in spare if c not in used]
    ellipsis_rank = 0
    for t, r in zip(terms, ranks, strict=True):
        if "..." in t:
            ellipsis_rank = max(ellipsis_rank, r - len(t.replace("...", "")))
    if ellipsis_rank > len(spare):
        return None
    dots = "".join(spare[:ellipsis_rank])
    spelled = []
    for t, r in zip(terms, ranks, strict=True):
        if "..." in t:
            own = r - len(t.replace("...", ""))
            if own < 0:
                return None
            t = t.replace("...", dots[ellipsis_rank - own :])
        if len(t) != r or not all(c.isalpha() for c in t):
            return None
        spelled.append(t)
    if arrow:
        output = out.replace("...", dots)
    else:
        letters = "".join(spelled)
        output = dots + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in dots))
    if not all(c.isalpha() for c in output) or len(set(output)) != len(output):
        return None
    return spelled, output


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "Einsum":
        return None
    return {"nodes": [node]}


def _parts(graph: Graph, node: Node) -> tuple[dict[str, Any] | None, str | None]:
    """The letters of the product by role, or why the Einsum is not a matrix product."""
    if len(node.inputs) != 2 or len([o for o in node.outputs if o]) != 1:
        return None, f"an Einsum of {len(node.inputs)} operands: only a product of two becomes MatMul"
    specs = [graph.spec(x) for x in node.inputs]
    if any(s.dtype not in FLOAT_TYPES for s in specs):
        return None, "the operands are not floating point"
    if any(any(d < 0 for d in s.shape) for s in specs):
        return None, "an operand's shape is not static"
    parsed = parse_equation(str(node.attrs.get("equation", "")), [len(s.shape) for s in specs])
    if parsed is None:
        return None, f"equation {node.attrs.get('equation')!r} could not be read"
    (a, b), out = parsed
    if len(set(a)) != len(a) or len(set(b)) != len(b):
        return None, "a letter repeats within one operand (a diagonal)"
    size: dict[str, int] = {}
    for term, s in ((a, specs[0]), (b, specs[1])):
        for c, d in zip(term, s.shape, strict=True):
            if size.setdefault(c, int(d)) != int(d):
                return None, f"dimension {c!r} has sizes {size[c]} and {d} (broadcast)"
    if any(c not in size for c in out):
        return None, "the output has a letter no operand has"
    if any(c not in out and c not in (b if c in a else a) for c in a + b):
        return None, "a letter of one operand only is summed away"
    if not any(c in b and c not in out for c in a):
        return None, "no letter is contracted: an elementwise or outer product, not a matrix product"
    batch = [c for c in out if c in a and c in b]
    rows = [c for c in a if c in out and c not in b]
    cols = [c for c in b if c in out and c not in a]
    contracted = [c for c in a if c not in out]
    return {
        "a": a,
        "b": b,
        "out": out,
        "batch": batch,
        "rows": rows,
        "cols": cols,
        "k": contracted,
        "size": size,
    }, None


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    parts, why = _parts(graph, node)
    if parts is None:
        return why
    m.update(parts)
    return None


class _Builder:
    """New nodes before the Einsum, named after it."""

    def __init__(self, graph: Graph, node: Node) -> None:
        self.graph, self.node, self.dtype = graph, node, graph.spec(node.outputs[0]).dtype
        self.made: list[Node] = []

    def value(self, tag: str, shape: tuple[int, ...]) -> str:
        name = f"{self.node.id}_{tag}"
        self.graph.values[name] = TensorSpec(name, self.dtype, shape)
        return name

    def transpose(self, x: str, perm: list[int], tag: str) -> str:
        if perm == list(range(len(perm))):
            return x
        shape = self.graph.spec(x).shape
        out = self.value(tag, tuple(shape[p] for p in perm))
        self.made.append(
            Node(f"{self.node.id}{tag}", "Transpose", [x], [out], {"perm": perm}, self.node.name)
        )
        return out

    def reshape(self, x: str, shape: tuple[int, ...], tag: str, out: str = "") -> str:
        if not out and tuple(self.graph.spec(x).shape) == shape:
            return x
        out = out or self.value(tag, shape)
        target = f"{self.node.id}_{tag}_shape"
        self.made.append(
            self.graph.reshape_node(f"{self.node.id}{tag}", x, shape, out, self.node.name, target)
        )
        return out


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    a, b, out, size = m["a"], m["b"], m["out"], m["size"]
    batch, rows, cols, k = m["batch"], m["rows"], m["cols"], m["k"]

    def sizes(letters: list[str]) -> tuple[int, ...]:
        return tuple(size[c] for c in letters)

    def n_of(letters: list[str]) -> int:
        return int(np.prod(sizes(letters), dtype=np.int64))

    bld = _Builder(graph, node)
    left = bld.transpose(node.inputs[0], [a.index(c) for c in batch + rows + k], "ta")
    left = bld.reshape(left, (*sizes(batch), n_of(rows), n_of(k)), "ra")
    right = bld.transpose(node.inputs[1], [b.index(c) for c in batch + k + cols], "tb")
    right = bld.reshape(right, (*sizes(batch), n_of(k), n_of(cols)), "rb")
    final = node.outputs[0]
    order = batch + rows + cols
    unflat = (*sizes(batch), *sizes(rows), *sizes(cols))
    flat = (*sizes(batch), n_of(rows), n_of(cols))
    perm = [order.index(c) for c in out]
    last_reshape = unflat != flat
    last_transpose = perm != list(range(len(perm)))
    product = final if not (last_reshape or last_transpose) else bld.value("mm", flat)
    bld.made.append(Node(f"{node.id}m", "MatMul", [left, right], [product], {}, node.name))
    if last_reshape:
        product = bld.reshape(product, unflat, "ro", out="" if last_transpose else final)
    if last_transpose:
        t = Node(f"{node.id}to", "Transpose", [product], [final], {"perm": perm}, node.name)
        bld.made.append(t)
    i = graph.nodes.index(node)
    graph.nodes[i : i + 1] = bld.made


einsum_matmul = Rule(names.EINSUM_MATMUL, _match, _check, _rewrite)
