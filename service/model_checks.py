"""Checks of an uploaded model before it is stored: the server's limits (node count, graph depth,
declared input sizes), then opfuse.frontend's own checks; and its description (opset, inputs, outputs).

Runs in the API process on untrusted bytes: everything here is linear in the size of the graph.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import onnx

from opfuse.errors import ModelError
from opfuse.frontend.inspect import (
    ModelInfo,
    TensorInfo,
    check_model,
    default_opset,
    dtype_name,
    parse_model,
    uses_external_data,
)
from service.errors import UnprocessableError
from service.settings import Settings
from service.storable import check_storable

EXTERNAL_DATA_HINT = (
    "the model keeps its weights in external data files, which a raw .onnx upload cannot carry; "
    "upload a zip holding the .onnx file and its data files with 'Content-Type: application/zip', "
    "or save the model with all tensors inside the .onnx file "
    "(onnx.save_model(model, path, save_as_external_data=False)) and upload that"
)


@dataclass(frozen=True)
class ModelLimits:
    max_nodes: int
    max_depth: int
    max_input_elements: int
    # A zip upload is held to these once unpacked, before any of it is decompressed.
    max_unpacked_bytes: int = 2**31
    max_zip_ratio: float = 100.0

    @classmethod
    def of(cls, settings: Settings) -> ModelLimits:
        return cls(
            settings.max_graph_nodes,
            settings.max_graph_depth,
            settings.max_input_elements,
            settings.max_upload_bytes,
            settings.max_zip_ratio,
        )


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def count_nodes(graph: onnx.GraphProto) -> int:
    """Nodes of the graph and of every subgraph (If/Loop/Scan bodies), without recursion."""
    total, pending = 0, [graph]
    while pending:
        current = pending.pop()
        total += len(current.node)
        for node in current.node:
            pending.extend(subgraphs(node))
    return total


def graph_depth(graph: onnx.GraphProto) -> int:
    """The longest chain of nodes, each consuming an output of the one before (nodes on a cycle are
    left out: the structural checks refuse cycles with a better message)."""
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for name in node.output:
            if name:
                producer.setdefault(name, i)
    consumers: list[list[int]] = [[] for _ in graph.node]
    waiting = [0] * len(graph.node)
    for i, node in enumerate(graph.node):
        for source in {producer[name] for name in node.input if name in producer} - {i}:
            consumers[source].append(i)
            waiting[i] += 1
    depth = [1] * len(graph.node)
    ready = deque(i for i, count in enumerate(waiting) if count == 0)
    deepest = 0
    while ready:
        i = ready.popleft()
        deepest = max(deepest, depth[i])
        for j in consumers[i]:
            depth[j] = max(depth[j], depth[i] + 1)
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    return deepest


def _graph_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    initializers = {init.name for init in graph.initializer}
    return [vi for vi in graph.input if vi.name not in initializers]


def input_size_problems(graph: onnx.GraphProto, max_elements: int) -> list[str]:
    """Inputs whose declared static dims alone multiply to more than `max_elements`."""
    problems = []
    for vi in _graph_inputs(graph):
        tensor_type = vi.type.tensor_type
        if not tensor_type.HasField("shape"):
            continue
        static = [d.dim_value for d in tensor_type.shape.dim if d.HasField("dim_value")]
        if any(d < 0 for d in static):
            problems.append(f"input '{vi.name}' declares a negative dim {static}")
            continue
        elements = math.prod(static)
        if elements > max_elements:
            problems.append(
                f"input '{vi.name}' declares {elements} elements ({' x '.join(map(str, static))}), "
                f"over this server's limit of {max_elements} (OPFUSE_MAX_INPUT_ELEMENTS)"
            )
    return problems


def limit_problems(model: onnx.ModelProto, limits: ModelLimits) -> list[str]:
    """What in `model` is over the server's limits, in words (empty: nothing)."""
    nodes = count_nodes(model.graph)
    if nodes > limits.max_nodes:
        # Checked first and alone: the other checks walk the graph.
        return [
            f"the graph has {nodes} nodes (subgraphs included), over this server's limit of "
            f"{limits.max_nodes} (OPFUSE_MAX_GRAPH_NODES)"
        ]
    problems = input_size_problems(model.graph, limits.max_input_elements)
    depth = graph_depth(model.graph)
    if depth > limits.max_depth:
        problems.append(
            f"the graph is {depth} nodes deep (its longest chain of dependent nodes), over this "
            f"server's limit of {limits.max_depth} (OPFUSE_MAX_GRAPH_DEPTH)"
        )
    return problems


def _tensor_info(vi: onnx.ValueInfoProto) -> TensorInfo:
    tensor_type = vi.type.tensor_type
    dims: list[int | str] = []
    if tensor_type.HasField("shape"):
        for d in tensor_type.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or "?")
    return TensorInfo(name=vi.name, dtype=dtype_name(tensor_type.elem_type), shape=dims)


def check_and_describe(model: onnx.ModelProto, limits: ModelLimits) -> ModelInfo:
    """422 with every reason when the model is over a limit or invalid; else its description."""
    problems = limit_problems(model, limits)
    if problems:
        raise UnprocessableError("; ".join(problems))
    if uses_external_data(model):
        raise UnprocessableError(EXTERNAL_DATA_HINT)
    try:
        check_model(model)
        opset = default_opset(model)
    except ModelError as exc:
        raise UnprocessableError(str(exc)) from None
    info = ModelInfo(
        opset=opset,
        ir_version=int(model.ir_version),
        inputs=[_tensor_info(vi) for vi in _graph_inputs(model.graph)],
        outputs=[_tensor_info(vi) for vi in model.graph.output],
        node_count=len(model.graph.node),
    )
    _check_names_storable(info)
    return info


def _check_names_storable(info: ModelInfo) -> None:
    """The names a job refers to (inputs, outputs, their dim symbols) are stored and queried: 422
    for one the database cannot hold, naming it by position."""
    for kind, tensors in (("input", info.inputs), ("output", info.outputs)):
        for i, tensor in enumerate(tensors):
            check_storable(tensor.name, f"the name of graph {kind} {i}")
            for j, dim in enumerate(tensor.shape):
                if isinstance(dim, str):
                    check_storable(dim, f"the symbol of dim {j} of graph {kind} {i}")


def parse_upload(data: bytes) -> onnx.ModelProto:
    """The bytes as a ModelProto; 422 with the reason when they are empty or not ONNX."""
    if not data:
        raise UnprocessableError("the request body is empty: send the bytes of the .onnx file")
    try:
        return parse_model(data)
    except ModelError as exc:
        raise UnprocessableError(str(exc)) from None
