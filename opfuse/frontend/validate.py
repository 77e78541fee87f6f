"""Structural and type checks of an untrusted graph, with errors that name the node and value at fault.

The onnx checker catches most malformed graphs, but its messages are about ONNX's rules ("nodes in a
graph must be topologically sorted") rather than about the user's graph ("'b' is produced by 'relu',
which depends on 'b'"). These checks run first, and put a graph whose nodes are merely listed out of
order into order instead of refusing it. Torch-free: the API server runs them on upload.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from opfuse.errors import ModelError

# Element types a model may use: what the torch runtime computes in (opfuse.runtime.ops_registry).
SUPPORTED_ELEM_TYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8",
    onnx.TensorProto.BOOL: "bool",
}

# Why a type is refused, by family: the reason the user reads, and the label the conformance
# report counts refusals under.
_STRING = "string tensors"
_NARROW = "float8/float4/int4/int2 element types"
_UNSIGNED = "uint16/uint32/uint64 element types"
_COMPLEX = "complex element types"
REFUSED_ELEM_TYPES: dict[int, str] = {onnx.TensorProto.STRING: _STRING}
for _name in ("UINT16", "UINT32", "UINT64"):
    REFUSED_ELEM_TYPES[getattr(onnx.TensorProto, _name)] = _UNSIGNED
for _name in ("COMPLEX64", "COMPLEX128"):
    REFUSED_ELEM_TYPES[getattr(onnx.TensorProto, _name)] = _COMPLEX
for _name in onnx.TensorProto.DataType.keys():  # noqa: SIM118 (a protobuf enum, not a dict)
    _value = onnx.TensorProto.DataType.Value(_name)
    if _value not in SUPPORTED_ELEM_TYPES and _value not in REFUSED_ELEM_TYPES and _name != "UNDEFINED":
        REFUSED_ELEM_TYPES[_value] = _NARROW


def node_label(node: onnx.NodeProto, index: int) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"node #{index} ({node.op_type})"


def sort_and_check_graph(graph: onnx.GraphProto) -> bool:
    """Refuse dangling inputs, values written twice and cycles; put acyclic graphs in order, in place.
    Returns whether the nodes were reordered.

    Only the top-level graph: subgraphs (If/Loop/Scan bodies) are refused later as unsupported ops.
    """
    provided: dict[str, str] = {}
    problems: list[str] = []

    def provide(name: str, by: str) -> None:
        if not name:
            return
        if name in provided:
            problems.append(f"value {name!r} is written twice (by {provided[name]} and by {by})")
        else:
            provided[name] = by

    for vi in graph.input:
        if vi.name in provided:
            problems.append(f"graph input {vi.name!r} is declared twice")
        provided[vi.name] = f"graph input {vi.name!r}"
    init_names: set[str] = set()
    for init in graph.initializer:
        if init.name in init_names:
            problems.append(f"initializer {init.name!r} is declared twice")
        init_names.add(init.name)
        provided.setdefault(init.name, f"initializer {init.name!r}")
    for i, node in enumerate(graph.node):
        for out in node.output:
            provide(out, node_label(node, i))
    for i, node in enumerate(graph.node):
        for name in node.input:
            if name and name not in provided:
                problems.append(
                    f"{node_label(node, i)} reads {name!r}, which no node, graph input or initializer provides"
                )
    seen_outputs: set[str] = set()
    for vi in graph.output:
        if vi.name in seen_outputs:
            problems.append(f"graph output {vi.name!r} is listed twice")
        seen_outputs.add(vi.name)
        if vi.name not in provided:
            problems.append(
                f"graph output {vi.name!r} is not produced by any node, graph input or initializer"
            )
    if problems:
        raise ModelError("the graph is malformed: " + "; ".join(_first(problems, 8)))
    order = _topological_order(graph)
    if order == list(range(len(graph.node))):
        return False
    nodes = [graph.node[i] for i in order]
    del graph.node[:]
    graph.node.extend(nodes)
    return True


def _topological_order(graph: onnx.GraphProto) -> list[int]:
    """Node indices with every producer before its consumers (ties keep the model's order)."""
    producer = {out: i for i, n in enumerate(graph.node) for out in n.output if out}
    deps = [sorted({producer[x] for x in n.input if x in producer}) for n in graph.node]
    users: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            users.setdefault(j, []).append(i)
    pending = [len(d) for d in deps]
    ready = [i for i, d in enumerate(deps) if not d]
    order: list[int] = []
    while ready:
        ready.sort(reverse=True)
        i = ready.pop()
        order.append(i)
        for u in users.get(i, []):
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)
    if len(order) < len(graph.node):
        cycle = _find_cycle(deps, set(range(len(graph.node))) - set(order))
        path = " -> ".join(node_label(graph.node[i], i) for i in cycle)
        raise ModelError(
            f"the graph is malformed: it has a cycle ({path}); an ONNX graph must be acyclic "
            "(loops belong in a Loop or Scan node)"
        )
    return order


def _find_cycle(deps: list[list[int]], stuck: set[int]) -> list[int]:
    """One cycle among the nodes that could not be ordered, as a path that ends where it starts."""
    start = min(stuck)
    path, index = [start], {start: 0}
    while True:
        nxt = next(d for d in deps[path[-1]] if d in stuck)
        if nxt in index:
            cycle = path[index[nxt] :]
            # Walked against the data flow (consumer to producer): reverse to read producer -> consumer.
            cycle.reverse()
            return [*cycle, cycle[0]]
        index[nxt] = len(path)
        path.append(nxt)


def value_type_problem(tp: onnx.TypeProto) -> str | None:
    """Why a value of this type cannot be handled, or None for a tensor of a supported element type."""
    kind = tp.WhichOneof("value")
    if kind is None:
        return None  # untyped (e.g. an output left to inference): inference gives it a type later
    if kind == "sparse_tensor_type":
        return "is a sparse tensor (sparse tensors are not supported)"
    if kind != "tensor_type":
        word = {"sequence_type": "a sequence", "optional_type": "an optional", "map_type": "a map"}.get(
            kind, kind
        )
        return f"is {word}, not a tensor (sequence, optional and map values are not supported)"
    elem = tp.tensor_type.elem_type
    if elem == onnx.TensorProto.UNDEFINED or elem in SUPPORTED_ELEM_TYPES:
        return None
    name = onnx.TensorProto.DataType.Name(elem).lower()
    return (
        f"has element type {name} ({REFUSED_ELEM_TYPES.get(elem, 'unknown element type')} are not supported)"
    )


def check_value_types(model: onnx.ModelProto, values: Iterable[onnx.ValueInfoProto] = ()) -> None:
    """Every graph input, output, initializer and typed value is a tensor of a supported element type."""
    g = model.graph
    problems: list[str] = []
    for kind, vis in (
        ("graph input", g.input),
        ("graph output", g.output),
        ("value", [*g.value_info, *values]),
    ):
        for vi in vis:
            why = value_type_problem(vi.type)
            if why:
                problems.append(f"{kind} {vi.name!r} {why}")
    for init in g.initializer:
        if init.data_type not in SUPPORTED_ELEM_TYPES:
            name = onnx.TensorProto.DataType.Name(init.data_type).lower()
            problems.append(f"initializer {init.name!r} has element type {name}")
    for i, node in enumerate(g.node):
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type not in SUPPORTED_ELEM_TYPES:
                name = onnx.TensorProto.DataType.Name(attr.t.data_type).lower()
                problems.append(f"{node_label(node, i)} has a {name} tensor attribute {attr.name!r}")
            if attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                problems.append(f"{node_label(node, i)} has a sparse tensor attribute {attr.name!r}")
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if (
            node.op_type == "Cast"
            and node.domain in ("", "ai.onnx")
            and to is not None
            and to not in SUPPORTED_ELEM_TYPES
        ):
            name = onnx.TensorProto.DataType.Name(to).lower() if to in REFUSED_ELEM_TYPES else str(to)
            problems.append(f"{node_label(node, i)} casts to element type {name}")
    if problems:
        supported = ", ".join(SUPPORTED_ELEM_TYPES.values())
        raise ModelError(
            "the model uses types opfuse does not support: "
            + "; ".join(_first(problems, 8))
            + f". opfuse runs tensors of {supported}"
        )


def _first(items: list[str], n: int) -> list[str]:
    return items if len(items) <= n else [*items[:n], f"and {len(items) - n} more"]
