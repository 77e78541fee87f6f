"""Refuse shapes that depend on run-time data: opfuse compiles every shape at compile time.

Some inputs of some ops decide the shape of their output (Reshape's `shape`, Slice's `starts`, ...)
and some ops' output shapes depend on the data itself (NonZero). After `input_shapes` are bound, such
an input must be computable at compile time: from initializers and Constants, from the (now static)
shapes of tensors through Shape/Size, and through any deterministic op of those. One fed at run time
would change shapes the plan was compiled for, so it is refused here, naming the graph inputs it
comes from, instead of running to a wrong answer.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from opfuse.errors import ModelError
from opfuse.frontend.validate import node_label

# Inputs (by index) whose values decide the node's output shape, or an axis the kernel is built for.
SHAPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "Pad": (1, 3),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "Split": (1,),
    "TopK": (1,),
    "OneHot": (1,),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "CenterCropPad": (1,),
    "AffineGrid": (1,),
    "Col2Im": (1, 2),
    "DFT": (1, 2),
    "HannWindow": (0,),
    "HammingWindow": (0,),
    "BlackmanWindow": (0,),
    # Axes the kernel must know on the host.
    "CumSum": (1,),
    "CumProd": (1,),
    "ReduceMean": (1,),
    "ReduceSum": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
    "ReduceProd": (1,),
    "ReduceL1": (1,),
    "ReduceL2": (1,),
    "ReduceSumSquare": (1,),
    "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,),
    # The output's shape depends on the data itself.
    "NonZero": (0,),
    "Compress": (1,),
    "Unique": (0,),
}

# Ops whose outputs are never compile-time values: random ones, and control flow (whose subgraphs
# may read any value of the enclosing graph).
OPAQUE_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}
    | {"If", "Loop", "Scan", "SequenceMap"}
)


def _propagate(
    model: onnx.ModelProto,
) -> tuple[dict[str, frozenset[str]], list[tuple[int, int, frozenset[str]]]]:
    """What each run-time value is computed from, and the shape-deciding inputs among them.

    Sources are graph inputs, and "<Op>" for values no compile-time evaluation can give (random
    ops, control flow, ops of other domains). Compile-time values are absent from the map.
    """
    g = model.graph
    init_names = {init.name for init in g.initializer}
    runtime_from: dict[str, frozenset[str]] = {
        vi.name: frozenset({vi.name}) for vi in g.input if vi.name not in init_names
    }
    found: list[tuple[int, int, frozenset[str]]] = []
    for i, node in enumerate(g.node):
        sources = _union(runtime_from.get(x, frozenset()) for x in [*node.input, *captured_names(node)] if x)
        if node.domain not in ("", "ai.onnx") or node.op_type in OPAQUE_OPS:
            sources |= {f"<{node.op_type}>"}
        else:
            for idx in SHAPE_INPUTS.get(node.op_type, ()):
                if idx < len(node.input) and node.input[idx] in runtime_from:
                    found.append((i, idx, runtime_from[node.input[idx]]))
            if node.op_type in ("Shape", "Size"):
                continue  # shapes are static once input_shapes are bound
        if sources:
            for out in node.output:
                if out:
                    runtime_from[out] = sources
    return runtime_from, found


def captured_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (If branches, Loop and Scan bodies) read from the enclosing graph."""
    names: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            defined = {vi.name for vi in sub.input} | {t.name for t in sub.initializer}
            defined |= {o for n in sub.node for o in n.output}
            for n in sub.node:
                names |= {x for x in [*n.input, *captured_names(n)] if x and x not in defined}
            names |= {vi.name for vi in sub.output if vi.name not in defined}
    return names


def runtime_values(model: onnx.ModelProto) -> set[str]:
    """Names of the values computed at run time (the rest are compile-time constants)."""
    return set(_propagate(model)[0])


def runtime_shape_inputs(model: onnx.ModelProto) -> list[tuple[int, int, frozenset[str]]]:
    """(node index, input index, sources) of every shape-deciding input computed at run time.

    Needs shapes bound (specialized) so that Shape and Size of any tensor are compile-time values.
    """
    return _propagate(model)[1]


def check_static_shape_inputs(model: onnx.ModelProto) -> None:
    """Every shape-deciding input is a compile-time value. Raises ModelError listing each one that is not."""
    problems = [
        f"{node_label(model.graph.node[i], i)} input {idx} ({model.graph.node[i].input[idx]!r}) is computed "
        f"at run time from {_describe(sources)}"
        for i, idx, sources in runtime_shape_inputs(model)
    ]
    if problems:
        raise ModelError(
            "opfuse compiles for static shapes, but the model's shapes depend on run-time data: "
            + "; ".join(problems[:8])
            + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            + ". Make these values constants (initializers) in the model, or compute them from "
            "input shapes (Shape) rather than input values"
        )


def _union(sets: Iterable[frozenset[str]]) -> frozenset[str]:
    out: frozenset[str] = frozenset()
    for s in sets:
        out |= s
    return out


def _describe(sources: frozenset[str]) -> str:
    inputs = sorted(s for s in sources if not s.startswith("<"))
    ops = sorted(s.strip("<>") for s in sources if s.startswith("<"))
    parts = []
    if inputs:
        parts.append("graph input(s) " + ", ".join(repr(s) for s in inputs))
    if ops:
        parts.append("the output of " + ", ".join(ops))
    return " and ".join(parts)
