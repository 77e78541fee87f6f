"""Load an untrusted model, convert it to the canonical opset and give every dim a value."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import onnx
from onnx import shape_inference

from opfuse.errors import ModelError
from opfuse.frontend.batch_statistics import write_out_batch_statistics
from opfuse.frontend.control_flow import fold_compile_time_values
from opfuse.frontend.external_data import has_external_data, inline_external_data
from opfuse.frontend.inspect import WEIGHT_BYTES, WEIGHT_TYPES, check_model, parse_model
from opfuse.frontend.opsets import CANONICAL_OPSET, check_node_versions, convert_opset
from opfuse.frontend.static_values import check_static_shape_inputs
from opfuse.frontend.unsupported import check_inference_mode, check_supported
from opfuse.frontend.validate import check_value_types

# Retired ops the version converter replaces (Upsample -> Resize, Scatter -> ScatterElements).
RENAMED_BY_CONVERSION = frozenset({"Upsample", "Scatter"})

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip with entries / an empty zip

__all__ = ["CANONICAL_OPSET", "check_supported", "infer_shapes", "load_and_specialize", "read_model"]


def read_model(source: str | os.PathLike[str] | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """Parse and check a model from a path, bytes or proto. Raises ModelError.

    A model read from a path may keep its weights in external data files (what torch.onnx.export
    writes by default, `m.onnx.data`): they are read, safely, from the model's folder only
    (external_data.py). Bytes or a proto with external references have no folder: refused.
    """
    folder: str | None = None
    if isinstance(source, onnx.ModelProto):
        if has_external_data(source):
            raise ModelError(
                "the ModelProto refers to external data files but has no folder to read them from; "
                "pass the path of the .onnx file instead (opfuse.compile('m.onnx')): opfuse reads its "
                "data files from beside it"
            )
        data = source.SerializeToString()
    elif isinstance(source, bytes):
        data = source
    else:
        try:
            with open(source, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ModelError(f"cannot read the model file: {exc}") from None
        folder = os.path.dirname(os.path.abspath(source))
    if data.startswith(ZIP_MAGIC):
        raise ModelError(
            "this is a zip file, not an ONNX model; unpack it and pass the path of the .onnx file "
            "(its data files are read from beside it)"
        )
    model = parse_model(data)
    if not has_external_data(model):
        check_model(model, data)
        return model
    if folder is None:
        raise ModelError(
            "the model bytes refer to external data files, which bytes cannot carry; pass the path of "
            "the .onnx file instead (opfuse reads its data files from beside it), or save the model "
            "self-contained (onnx.save_model(model, path, save_as_external_data=False))"
        )
    size = len(data)
    del data
    inline_external_data(model, folder, model_bytes=size)
    check_model(model)
    return model


def drop_initializer_inputs(model: onnx.ModelProto, fed: Sequence[str]) -> None:
    """Old models (IR < 4) list initializers as graph inputs: treat them as constants unless fed."""
    init_names = {init.name for init in model.graph.initializer}
    keep = [vi for vi in model.graph.input if vi.name not in init_names or vi.name in fed]
    if len(keep) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(keep)
        # Initializers that are not inputs are only valid from IR version 4 (onnx's version
        # converter refuses them, as "undefined", in an older model).
        model.ir_version = max(model.ir_version, 4)


def specialize_shapes(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]] | None) -> None:
    """Bind every dynamic input dim from input_shapes, in place. One error lists every problem."""
    shapes = {k: [int(d) for d in v] for k, v in (input_shapes or {}).items()}
    init_names = {init.name for init in model.graph.initializer}
    graph_inputs = [vi for vi in model.graph.input if vi.name not in init_names]
    names = {vi.name for vi in graph_inputs}
    problems: list[str] = []
    for name in shapes:
        if name not in names:
            problems.append(
                f"input_shapes names {name!r}, which is not a graph input (inputs: {sorted(names)})"
            )
    for vi in graph_inputs:
        tt = vi.type.tensor_type
        given = shapes.get(vi.name)
        dims = list(tt.shape.dim) if tt.HasField("shape") else None
        if given is not None:
            # 0 is a valid size (an empty tensor); only negative sizes are meaningless.
            if any(d < 0 for d in given):
                problems.append(f"input {vi.name!r}: every dim must be a non-negative integer, got {given}")
                continue
            if dims is not None and len(dims) != len(given):
                problems.append(f"input {vi.name!r} has rank {len(dims)} but input_shapes gives {given}")
                continue
            if dims is not None:
                for i, (d, g) in enumerate(zip(dims, given, strict=True)):
                    if d.HasField("dim_value") and d.dim_value != g:
                        problems.append(
                            f"input {vi.name!r} dim {i} is fixed at {d.dim_value} but input_shapes gives {g}"
                        )
            continue
        if dims is None:
            problems.append(f"input {vi.name!r} has no declared shape: give it in input_shapes")
            continue
        for i, d in enumerate(dims):
            if not d.HasField("dim_value"):
                label = f" ({d.dim_param!r})" if d.dim_param else ""
                problems.append(
                    f"input {vi.name!r} dim {i}{label} is dynamic: give its value in input_shapes"
                )
    if problems:
        raise ModelError("cannot specialize the model's shapes: " + "; ".join(problems))
    for vi in graph_inputs:
        given = shapes.get(vi.name)
        if given is None:
            continue
        shape = vi.type.tensor_type.shape
        del shape.dim[:]
        for g in given:
            shape.dim.add().dim_value = g


def _light_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without the bytes of its large float initializers (inspect.WEIGHT_BYTES): what
    shape inference needs (dims and types) at a fraction of the copying."""
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g, src = light.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    for t in src.initializer:
        if t.data_type in WEIGHT_TYPES and t.HasField("raw_data") and len(t.raw_data) > WEIGHT_BYTES:
            light_t = g.initializer.add()
            light_t.name, light_t.data_type = t.name, t.data_type
            light_t.dims.extend(t.dims)
        else:
            g.initializer.add().CopyFrom(t)
    return light


def _infer_without_weights(model: onnx.ModelProto, data_prop: bool) -> onnx.ModelProto:
    """onnx shape inference on a copy without the bytes of the large weights (it serializes the
    whole model on each call; for a 440 MB transformer that was most of the load time). The
    inferred value_info and output types are written into `model`, which is returned."""
    inferred = shape_inference.infer_shapes(
        _light_copy(model), check_type=True, strict_mode=True, data_prop=data_prop
    )
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference, strict: a type or shape contradiction is the model's error.

    With data propagation first (it makes shapes computed by Shape arithmetic static); onnx's data
    propagation itself fails on some valid graphs (2-D integer tensors such as position grids), so
    a failure there is retried without it before it counts against the model.
    """
    try:
        return _infer_without_weights(model, data_prop=True)
    except Exception:
        pass
    try:
        return _infer_without_weights(model, data_prop=False)
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"ONNX shape inference failed on the specialized model (its types or shapes are inconsistent): {msg}"
        ) from None


def load_and_specialize(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]] | None,
    supported: frozenset[str],
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Returns (original as uploaded, specialized canonical model with inferred shapes).

    Every refusal is a ModelError, raised before any compile work: malformed graphs and bad types
    first (read_model, check_value_types), then unsupported ops (all of them at once), unbound dims,
    training mode, ops of unreviewed newer versions, type or shape contradictions (ONNX shape
    inference), If nodes on run-time data, and shapes that would depend on run-time data.
    """
    original = read_model(source)
    model = onnx.ModelProto()
    model.CopyFrom(original)
    check_value_types(model)
    # Before conversion, so that an op the converter cannot handle is reported as unsupported. An If
    # may still go: inlined when its condition is known once shapes are bound.
    check_supported(model, supported | RENAMED_BY_CONVERSION | {"If"})
    drop_initializer_inputs(model, list((input_shapes or {}).keys()))
    specialize_shapes(model, input_shapes)
    model = convert_opset(model)
    write_out_batch_statistics(model)  # weight standardization's training-mode BatchNormalization
    check_inference_mode(model)
    check_node_versions(model)
    del model.graph.value_info[:]
    model = fold_compile_time_values(infer_shapes(model), infer_shapes)
    # Again: what inlined If branches brought in is checked too.
    check_supported(model, supported)
    check_node_versions(model)
    check_value_types(model, model.graph.value_info)
    check_static_shape_inputs(model)
    return original, model
