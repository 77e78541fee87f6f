"""The template registry: for each group kind, the template that writes its one kernel, the check
of the anchor it can compute, and whether the library's kernel is its alternative.

`lowering.build_plan` renders a group through its kind's `Template`; tuning asks the registry
which kinds have a library alternative to measure. A new template is one module of `codegen/`
and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from opfuse.codegen.attention import generate_attention
from opfuse.codegen.chain import generate_chain
from opfuse.codegen.conv import generate_conv
from opfuse.codegen.fragments import KernelSource
from opfuse.codegen.gemm import generate_gemm
from opfuse.codegen.pointwise import generate_pointwise
from opfuse.codegen.pool import generate_pool
from opfuse.codegen.rowwise import generate_rowwise
from opfuse.graph import Graph, Node
from opfuse.ir.rows import row_op_reason
from opfuse.ir.support import conv_anchor_reason, gemm_anchor_reason, pointwise_reason, pool_reason


class GroupLike(Protocol):
    """What a template reads of a fusion group (fusion.groups.Group has these fields)."""

    id: str
    kind: str
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    full: tuple[int, ...]
    split: int
    match: Any
    views: dict[str, Any]
    prologue: list[Node]


Render = Callable[[str, GroupLike, Graph, str], KernelSource]


@dataclass(frozen=True)
class Template:
    kind: str  # the group kind it writes the kernel of
    render: Render  # (kernel id, group, graph, precision) -> the kernel's source
    # None where the template computes the group's first node (its anchor, or any node of a
    # pointwise group), else why not; None for kinds whose matcher checks everything itself.
    check: Callable[[Graph, Node], str | None] | None
    # The library's kernel (one per-op step for the anchor, the epilogue as one pointwise kernel
    # after it) is the alternative tuning measures the template against.
    library: bool = False


def _gemm(kid: str, g: GroupLike, graph: Graph, precision: str) -> KernelSource:
    return generate_gemm(
        kid, g.nodes[0], g.nodes[1:], g.inputs, g.outputs, graph, g.id, precision, g.views, g.prologue
    )


def _conv(kid: str, g: GroupLike, graph: Graph, precision: str) -> KernelSource:
    return generate_conv(
        kid, g.nodes[0], g.nodes[1:], g.inputs, g.outputs, graph, g.id, precision, g.prologue, g.views
    )


def _pool(kid: str, g: GroupLike, graph: Graph, precision: str) -> KernelSource:
    return generate_pool(kid, g.nodes[0], g.nodes[1:], g.inputs, g.outputs, graph, g.id)


def _attention(kid: str, g: GroupLike, graph: Graph, precision: str) -> KernelSource:
    return generate_attention(kid, g.match, g.nodes, graph, g.id, precision)


def _chain(kid: str, g: GroupLike, graph: Graph, precision: str) -> KernelSource:
    cut = int(g.match)  # the second anchor's place in the group's nodes
    return generate_chain(
        kid,
        (g.nodes[0], g.nodes[cut]),
        (g.nodes[1:cut], g.nodes[cut + 1 :]),
        g.outputs,
        graph,
        g.id,
        precision,
    )


def _rowwise(kid: str, g: GroupLike, graph: Graph, precision: str) -> KernelSource:
    return generate_rowwise(
        kid, g.nodes, g.inputs, g.outputs, graph, g.id, g.full, g.split, g.views, g.prologue
    )


def _pointwise(kid: str, g: GroupLike, graph: Graph, precision: str) -> KernelSource:
    return generate_pointwise(kid, g.nodes, g.inputs, g.outputs, graph, g.id, g.views)


TEMPLATES: dict[str, Template] = {
    t.kind: t
    for t in (
        Template("gemm", _gemm, gemm_anchor_reason, library=True),
        Template("conv", _conv, conv_anchor_reason, library=True),
        Template("pool", _pool, pool_reason, library=True),
        Template("attention", _attention, None),
        Template("chain", _chain, None),
        Template("rowwise", _rowwise, row_op_reason),
        Template("pointwise", _pointwise, pointwise_reason),
    )
}


def template(kind: str) -> Template:
    """The template of a group kind; a kind without one is a bug in the planner."""
    try:
        return TEMPLATES[kind]
    except KeyError:
        raise ValueError(f"no template writes {kind!r} groups (kinds: {', '.join(TEMPLATES)})") from None


def has_library_alternative(kind: str) -> bool:
    """Whether tuning may measure a group of this kind against the library's kernel."""
    return kind in TEMPLATES and TEMPLATES[kind].library
