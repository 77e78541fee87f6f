"""The template registry: for each group kind, the template that writes its one kernel, the check
of the anchor it can compute, the launch configs tuning tries for its kernels, and its
alternatives (the library's kernel, the split form).

`lowering.build_plan` renders a group through its kind's `Template`; tuning asks the registry for
a kernel's candidates (`opfuse.tuning.candidates`) and for what a group is measured against
(`split_form`, `has_library_alternative`, `template_only`). A new template is one module of
`codegen/` and one entry here (docs/design.md, "Codegen").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opfuse.codegen.attention import generate_attention
from opfuse.codegen.chain import generate_chain
from opfuse.codegen.conv import generate_conv
from opfuse.codegen.fragments import KernelSource
from opfuse.codegen.gemm import POOLS, generate_gemm
from opfuse.codegen.pointwise import generate_pointwise
from opfuse.codegen.pool import generate_pool
from opfuse.codegen.rowwise import generate_rowwise
from opfuse.codegen.tuning_space import (
    Candidates,
    chain_candidates,
    conv_candidates,
    fixed,
    gemm_candidates,
    rowwise_candidates,
)
from opfuse.frontend.rule_registry import DEPTHWISE_REDUCTION
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.ir.ops import NHWC_CONV, NHWC_POOLS
from opfuse.ir.rows import row_op_reason, row_space
from opfuse.ir.support import conv_anchor_reason, gemm_anchor_reason, pointwise_reason, pool_reason


class GroupLike(Protocol):
    """What a template reads of a fusion group (fusion.groups.Group has these fields)."""

    id: str
    kind: str
    rule: str
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
    # The launch configs tuning times for a kernel of the template (codegen.tuning_space).
    candidates: Candidates
    # The library's kernel (one per-op step for the anchor, the epilogue as one pointwise kernel
    # after it) is the alternative tuning measures the template against.
    library: bool = False
    # The split form, for a group computing a prologue on its tiles: what tuning measures the one
    # kernel against instead of the library's (two kernels); None where the group has none.
    split: Callable[[GroupLike], SplitForm | None] | None = None


@dataclass(frozen=True)
class SplitPiece:
    """One step of a split form: a kernel of template `kind` computing `nodes` (as a group of its
    own: `full` and `split` a row kernel's space, `views` the folded inputs), or, kind None,
    the library's per-op steps of `nodes`."""

    kind: str | None
    nodes: list[Node]
    full: tuple[int, ...] = ()
    split: int = -1
    views: dict[str, Any] = field(default_factory=dict)
    match: Any = None  # the template's own reading of `nodes` (a chain's second anchor's place)


@dataclass(frozen=True)
class SplitForm:
    form: str  # what it is, as the report's `vendor_form` says it
    pieces: Callable[[Graph], list[SplitPiece]]  # its steps, in order (lowering.build_plan)


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
        g.prologue,
        g.inputs,
    )


def _rowwise(kid: str, g: GroupLike, graph: Graph, precision: str) -> KernelSource:
    return generate_rowwise(
        kid, g.nodes, g.inputs, g.outputs, graph, g.id, g.full, g.split, g.views, g.prologue, precision
    )


def _pointwise(kid: str, g: GroupLike, graph: Graph, precision: str) -> KernelSource:
    return generate_pointwise(kid, g.nodes, g.inputs, g.outputs, graph, g.id, g.views)


def _conv_split(g: GroupLike) -> SplitForm | None:
    """A depthwise conv or a max or average pool computed on the input tiles: the prologue's own
    kernel (the conv's or the pool's template, with its activation), then the anchor's template,
    as without the prologue rule."""
    windows = (NHWC_CONV, *NHWC_POOLS.values())
    # A Pad, or the region's Transpose alone (pad_prologue, layout_prologue): the library's
    # conv reads them as ops before it, its vendor form as for a conv without a prologue.
    if g.prologue and not any(n.op_type in (*windows, "Pad", "Transpose") for n in g.prologue):
        # Pointwise ops on the input tiles (operand_prologue, or an input scale), or a Concat and
        # the ops after it (concat_prologue): one pointwise kernel for them, as for a GEMM.
        return SplitForm(
            "split: the prologue's kernel, the library's conv, the epilogue's kernel", _prologue_split(g)
        )
    if not (g.prologue and g.prologue[0].op_type in windows):
        return None
    head = "pool" if g.prologue[0].op_type in NHWC_POOLS.values() else "conv"
    return SplitForm(
        "split: the prologue's kernel, then the anchor's",
        lambda graph: [SplitPiece(head, g.prologue), SplitPiece("conv", g.nodes, views=g.views)],
    )


def _rowwise_split(g: GroupLike) -> SplitForm | None:
    """A depthwise conv or a GEMM on the row tiles (fusion/rules/depthwise_reduction.py,
    gemm_reduction.py): the library's kernel for it, as without the rule, then the row kernel."""
    if not g.prologue:
        return None
    gemm = [n for n in g.prologue if n.op_type in ("MatMul", "Gemm")]
    if gemm and len(g.prologue) > 1:
        # Pointwise ops computing the GEMM's A (operand_prologue): their own pointwise kernel
        # through the group's views of their inputs, the library's GEMM, the row kernel.
        ops = [n for n in g.prologue if n not in gemm]
        reads = {x for n in ops for x in n.inputs if x}
        views = {x: v for x, v in g.views.items() if x in reads}
        rest = {x: v for x, v in g.views.items() if x not in reads}
        return SplitForm(
            "split: the prologue's kernel, the library's GEMM, then the row kernel",
            lambda graph: [
                SplitPiece("pointwise", ops, views=views),
                SplitPiece(None, gemm),
                SplitPiece("rowwise", g.nodes, g.full, g.split, rest),
            ],
        )
    what = {"MatMul": "GEMM", "Gemm": "GEMM", "Gather": "Gather"}.get(g.prologue[0].op_type, "conv")
    if DEPTHWISE_REDUCTION in g.rule.split("+"):
        what = "depthwise conv"
    return SplitForm(
        f"split: the library's {what}, then the row kernel",
        lambda graph: [
            SplitPiece(None, g.prologue),
            SplitPiece("rowwise", g.nodes, g.full, g.split, g.views),
        ],
    )


def _gemm_split(g: GroupLike) -> SplitForm | None:
    """A global average pool on the A tiles (fusion/rules/pooled_gemm.py): the pool's row kernel,
    then the GEMM as without the rule: a GEMM alone (a classifier's Gemm and its bias), the
    library's, as a lone anchor runs; one with an epilogue, its template. Pointwise ops computing
    A (operand_prologue): their own pointwise kernel (reading its inputs through the same views),
    the library's GEMM, then the epilogue's kernel, as without the rule."""
    if not g.prologue:
        return None
    if g.prologue[-1].op_type not in POOLS:
        return SplitForm(
            "split: the prologue's kernel, the library's GEMM, the epilogue's kernel", _prologue_split(g)
        )
    gemm = g.nodes[0]
    if len(g.nodes) == 1 and not any(x in g.views for x in gemm.inputs[1:] if x):
        start, every = _layout_chain(g, library=True)
        if start == g.prologue[-1].outputs[0]:
            # One to four images: a GEMV, where the template took 10.2 us for ResNeXt-50's 2048 x
            # 1000 head at batch 1 on an H100 (2026-12-06), a tenth of the chip's bandwidth.
            return _pooled_split(g, every, SplitPiece(None, [gemm]), "the library's GEMM")
    between = _layout_chain(g, library=False)[1]
    return _pooled_split(g, between, SplitPiece("gemm", g.nodes, views=g.views), "the GEMM's template")


def _chain_split(g: GroupLike) -> SplitForm | None:
    """A global average pool computed on the chain's input tiles (pooled_gemm): the pool's row
    kernel, then the chain."""
    if not g.prologue:
        return None
    between = _layout_chain(g, library=False)[1]
    return _pooled_split(g, between, SplitPiece("chain", g.nodes, match=g.match), "the chain")


def _layout_chain(g: GroupLike, library: bool) -> tuple[str, list[Node]]:
    """(where the walk stopped, the ops walked): the layout ops folded into the group (`absorbed`)
    from the GEMM's A back towards the pooled vector, stopping at a value the template reads
    through a view (never for a `library` reader, which reads none)."""
    made = {n.outputs[0]: n for n in getattr(g, "absorbed", [])}
    a, between = g.nodes[0].inputs[0], list[Node]()
    while (library or a not in g.views) and a in made:
        between.insert(0, made[a])
        a = made[a].inputs[0]
    return a, between


def _pooled_split(g: GroupLike, between: list[Node], reader: SplitPiece, what: str) -> SplitForm:
    """A pool computed on the tiles of its reader (pooled_gemm): the pool's row kernel, the layout
    ops `between` the pooled vector and the reader that the reader does not read through
    (_layout_chain), as the library's ops, then the reader's kernel (or the library's op)."""

    def pieces(graph: Graph) -> list[SplitPiece]:
        space = row_space(graph, g.prologue[-1])
        views = [SplitPiece(None, between)] if between else []
        return [SplitPiece("rowwise", g.prologue, space.full, space.first), *views, reader]

    return SplitForm(f"split: the row kernel, then {what}", pieces)


def bias_to_epilogue(graph: Graph, anchor: Node, epilogue: list[Node]) -> tuple[Node, list[Node]]:
    """The library's conv of a "vendor" form and its epilogue's kernel, with the conv's bias moved
    from the one to the other: torch runs a convolution's bias as an add kernel of its own after
    the library's (cuDNN's) kernel, a launch and a pass over the output that the epilogue's kernel
    makes for nothing. The conv writes `<output>__nobias`; the epilogue's first op adds the bias
    (laid along the channel axis) and writes the conv's output as before. Unchanged where there is
    no epilogue, no bias, or a bias that is not a constant."""
    if anchor.op_type not in (NHWC_CONV, "Conv") or not epilogue:
        return anchor, epilogue
    bias = anchor.inputs[2] if len(anchor.inputs) > 2 else ""
    if not bias or bias not in graph.constants or graph.constants[bias].ndim != 1:
        return anchor, epilogue
    out = anchor.outputs[0]
    spec = graph.spec(out)
    if anchor.op_type == "Conv" and len(spec.shape) > 2:  # channels first: along axis 1
        column = f"{bias}__channels"
        if column not in graph.constants:
            shape = (graph.constants[bias].shape[0], *[1] * (len(spec.shape) - 2))
            graph.add_constant(column, graph.constants[bias].reshape(shape), graph.spec(bias).dtype)
        bias = column
    raw = f"{out}__nobias"
    graph.values[raw] = TensorSpec(raw, spec.dtype, spec.shape)
    conv = Node(
        anchor.id,
        anchor.op_type,
        [*anchor.inputs[:2], "", *anchor.inputs[3:]],
        [raw],
        dict(anchor.attrs),
        anchor.name,
    )
    add = Node(f"{anchor.id}_bias", "Add", [raw, bias], [out], {}, anchor.name)
    return conv, [add, *epilogue]


def _prologue_split(g: GroupLike) -> Callable[[Graph], list[SplitPiece]]:
    """A prologue of memory-bound ops on the anchor's input tiles (a Concat and the ops after it
    before a 1x1 conv, pointwise ops computing a GEMM's A): as the plan without the rule runs
    them, one pointwise kernel (reading its inputs through the group's views), the library's
    anchor, then the epilogue's kernel (and a pool on the output tile as the library's pool). Not
    the prologue's ops one library launch each: that alternative lost to the one kernel where the
    plan without the rule would have won."""

    def pieces(graph: Graph) -> list[SplitPiece]:
        reads = {x for n in g.prologue for x in n.inputs if x}
        views = {x: v for x, v in g.views.items() if x in reads}
        own = {n.id for v in views.values() for n in v.owned()}
        # Layout ops folded into the GEMM's own operand view (a batched B) run as the library's.
        # (A fusion group has `absorbed`; a split form is only ever asked of one.)
        before = [n for n in getattr(g, "absorbed", []) if n.id not in own]
        # A pool on the output tile (pool_tail) runs as the library's pool after the epilogue.
        tail = [n for n in g.nodes[1:] if n.op_type in NHWC_POOLS.values()]
        epilogue = [n for n in g.nodes[1:] if n.op_type != "Concat" and n not in tail]
        concat = [n for n in g.nodes[1:] if n.op_type == "Concat"]  # written in place: a copy after
        out = [SplitPiece(None, before)] if before else []
        anchor, epilogue = bias_to_epilogue(graph, g.nodes[0], epilogue)
        out += [
            SplitPiece("pointwise", g.prologue, views=views),
            SplitPiece(None, [anchor]),
        ]
        if epilogue:
            out.append(SplitPiece("pointwise", epilogue))
        if concat:
            out.append(SplitPiece(None, concat))
        if tail:
            out.append(SplitPiece(None, tail))
        return out

    return pieces


TEMPLATES: dict[str, Template] = {
    t.kind: t
    for t in (
        Template("gemm", _gemm, gemm_anchor_reason, gemm_candidates, library=True, split=_gemm_split),
        Template("conv", _conv, conv_anchor_reason, conv_candidates, library=True, split=_conv_split),
        Template("pool", _pool, pool_reason, fixed("pool"), library=True),
        Template("attention", _attention, None, fixed("attention")),
        Template("chain", _chain, None, chain_candidates, split=_chain_split),
        Template("rowwise", _rowwise, row_op_reason, rowwise_candidates, split=_rowwise_split),
        Template("pointwise", _pointwise, pointwise_reason, fixed("pointwise")),
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


def split_of(g: GroupLike) -> SplitForm | None:
    """Group `g`'s split form: its "vendor" variant where that is not the library's kernel."""
    t = TEMPLATES.get(g.kind)
    return t.split(g) if t is not None and t.split is not None else None


def split_form(g: GroupLike) -> str | None:
    """The split form tuning measures group `g` against instead of the library's kernel (two
    kernels), said as the report's `vendor_form`; None where it has none."""
    form = split_of(g)
    return form.form if form is not None else None


def has_alternative(g: GroupLike) -> bool:
    """Whether tuning times group `g`'s template against another form (variant "vendor"): its
    split form, or else the library's kernel (none for a template-only group)."""
    return split_of(g) is not None or (has_library_alternative(g.kind) and not template_only(g))


def template_only(g: GroupLike) -> bool:
    """A group only its template runs, with no library alternative for tuning to measure: merged
    sibling convs (a Split in the epilogue: the template alone stores the parts). A conv that sums
    a shortcut (passes/shortcut_conv.py) has one: the library's two convolutions and their sum
    (`runtime.ops_nn.conv_nhwc`), then the epilogue's kernel."""
    return any(n.op_type == "Split" for n in g.nodes)
