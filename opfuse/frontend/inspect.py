"""Cheap, torch-free checks of an uploaded ONNX model: is it valid, and what are its inputs."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx
from google.protobuf.message import DecodeError

from opfuse.errors import ModelError
from opfuse.frontend.external_data import has_external_data, inline_external_data
from opfuse.frontend.validate import SUPPORTED_ELEM_TYPES, sort_and_check_graph

# ONNX element types opfuse names in its API and reports: the ones it computes in.
DTYPE_NAMES: dict[int, str] = SUPPORTED_ELEM_TYPES

MAX_MODEL_BYTES = 2 * 1024**3 - 1  # protobuf's own limit for a single message


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int | str]  # a dynamic dim is its symbol; an unnamed one is "?"


@dataclass
class ModelInfo:
    opset: int
    ir_version: int
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)
    node_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dtype_name(elem_type: int) -> str:
    name = DTYPE_NAMES.get(elem_type)
    if name is None:
        return onnx.TensorProto.DataType.Name(elem_type).lower()
    return name


def _tensor_info(vi: onnx.ValueInfoProto) -> TensorInfo:
    tt = vi.type.tensor_type
    dims: list[int | str] = []
    if tt.HasField("shape"):
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.dim_param:
                dims.append(d.dim_param)
            else:
                dims.append("?")
    return TensorInfo(name=vi.name, dtype=dtype_name(tt.elem_type), shape=dims)


def parse_model(data: bytes) -> onnx.ModelProto:
    """Parse bytes into a ModelProto, refusing external data. Raises ModelError."""
    if len(data) > MAX_MODEL_BYTES:
        raise ModelError("model is larger than 2 GiB; ONNX protobuf cannot hold it in one file")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ModelError(f"not an ONNX model: the bytes do not parse as an ONNX protobuf ({exc})") from None
    if not model.HasField("graph") or len(model.graph.node) == 0:
        raise ModelError("not an ONNX model: it has no graph or the graph has no nodes")
    return model


def uses_external_data(model: onnx.ModelProto) -> bool:
    """Whether any tensor (in the graph, its subgraphs or the model's functions) is external."""
    return has_external_data(model)


# Float initializers whose bytes shape inference need not see (it reads their dims and type).
WEIGHT_TYPES = (
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
    onnx.TensorProto.DOUBLE,
)
WEIGHT_BYTES = 1024  # smaller initializers keep their bytes (data propagation reads small tensors)


def check_model(model: onnx.ModelProto, data: bytes | None = None) -> None:
    """opfuse's own refusals and structural checks, then the onnx checker. Raises ModelError.

    A graph whose nodes are listed out of order (but acyclic) is put in order, in place. `data`:
    the bytes `model` was parsed from, which the checker then reads instead of serializing the
    model again (a second copy of every weight) unless the nodes were reordered.
    """
    if uses_external_data(model):
        raise ModelError(
            "the model keeps its weights in external data files, which an upload cannot carry; "
            "save it with all tensors inside the .onnx file "
            "(onnx.save_model(model, path, save_as_external_data=False)) and upload that"
        )
    reordered = sort_and_check_graph(model.graph) if model.HasField("graph") else False
    try:
        # With the weights: it checks their sizes against their dims.
        onnx.checker.check_model(data if data is not None and not reordered else model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid model"
        raise ModelError(f"the ONNX checker rejected the model: {first}") from None
    except Exception as exc:  # the checker raises a few other types on odd protos
        raise ModelError(f"the ONNX checker rejected the model: {exc}") from None


def default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    raise ModelError("the model imports no version of the default ONNX opset ('' / ai.onnx)")


def inspect_model(source: bytes | str | os.PathLike[str]) -> ModelInfo:
    """Validate an untrusted model and describe its graph inputs and outputs. A model read from a
    path may keep its weights in external data files beside it (read safely, external_data.py)."""
    if isinstance(source, bytes):
        data = source
    else:
        with open(source, "rb") as f:
            data = f.read()
    model = parse_model(data)
    if isinstance(source, bytes) or not has_external_data(model):
        check_model(model, data)
    else:
        inline_external_data(model, os.path.dirname(os.path.abspath(source)), model_bytes=len(data))
        check_model(model)
    opset = default_opset(model)
    initializer_names = {init.name for init in model.graph.initializer}
    return ModelInfo(
        opset=opset,
        ir_version=int(model.ir_version),
        inputs=[_tensor_info(vi) for vi in model.graph.input if vi.name not in initializer_names],
        outputs=[_tensor_info(vi) for vi in model.graph.output],
        node_count=len(model.graph.node),
    )
