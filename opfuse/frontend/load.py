"""Load an untrusted model, convert it to the canonical opset and give every dim a value."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import onnx
from onnx import shape_inference, version_converter

from opfuse.errors import ModelError
from opfuse.frontend.inspect import check_model, default_opset, parse_model

# Every model is converted to this opset before passes run; runtime ops follow its semantics.
CANONICAL_OPSET = 18
DEFAULT_DOMAINS = ("", "ai.onnx")


def read_model(source: str | os.PathLike[str] | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """Parse and check a model from a path, bytes or proto. Raises ModelError."""
    if isinstance(source, onnx.ModelProto):
        data = source.SerializeToString()
    elif isinstance(source, bytes):
        data = source
    else:
        try:
            with open(source, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ModelError(f"cannot read the model file: {exc}") from None
    model = parse_model(data)
    check_model(model)
    return model


def unsupported_ops(model: onnx.ModelProto, supported: frozenset[str]) -> dict[str, list[str]]:
    """Op types opfuse cannot run, each with the node names that use it."""
    found: dict[str, list[str]] = {}
    for i, node in enumerate(model.graph.node):
        key = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"
        if node.domain in DEFAULT_DOMAINS and node.op_type in supported:
            continue
        found.setdefault(key, []).append(node.name or f"#{i}")
    return found


def check_supported(model: onnx.ModelProto, supported: frozenset[str]) -> None:
    missing = unsupported_ops(model, supported)
    if not missing:
        return
    parts = []
    for op, names in sorted(missing.items()):
        shown = ", ".join(repr(n) for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        parts.append(f"{op} (nodes {shown}{more})")
    raise ModelError(
        f"the model uses {len(missing)} op type(s) opfuse does not support: " + "; ".join(parts) + ". "
        "Export without them (e.g. decompose them in the exporter) or file a request for the op."
    )


def convert_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    opset = default_opset(model)
    if opset == CANONICAL_OPSET:
        return model
    try:
        return version_converter.convert_version(model, CANONICAL_OPSET)
    except Exception as exc:
        if opset > CANONICAL_OPSET:
            # Newer opsets changed few ops we run; the runtime follows opset-18 semantics for the rest.
            return model
        raise ModelError(
            f"cannot convert the model from opset {opset} to opset {CANONICAL_OPSET}: {exc}. "
            f"Re-export it at opset {CANONICAL_OPSET}."
        ) from None


def drop_initializer_inputs(model: onnx.ModelProto, fed: Sequence[str]) -> None:
    """Old models (IR < 4) list initializers as graph inputs: treat them as constants unless fed."""
    init_names = {init.name for init in model.graph.initializer}
    keep = [vi for vi in model.graph.input if vi.name not in init_names or vi.name in fed]
    if len(keep) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(keep)


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
            if any(d <= 0 for d in given):
                problems.append(f"input {vi.name!r}: every dim must be a positive integer, got {given}")
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


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"ONNX shape inference failed on the specialized model: {msg}") from None


def load_and_specialize(
    source: str | os.PathLike[str] | bytes | onnx.ModelProto,
    input_shapes: Mapping[str, Sequence[int]] | None,
    supported: frozenset[str],
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """Returns (original as uploaded, specialized canonical model with inferred shapes)."""
    original = read_model(source)
    model = onnx.ModelProto()
    model.CopyFrom(original)
    drop_initializer_inputs(model, list((input_shapes or {}).keys()))
    specialize_shapes(model, input_shapes)
    try:
        model = convert_opset(model)
    except ModelError:
        check_supported(original, supported)  # an unsupported op is the better explanation
        raise
    # Checked after conversion: conversion renames a few retired ops (e.g. Upsample -> Resize).
    check_supported(model, supported)
    del model.graph.value_info[:]
    model = infer_shapes(model)
    return original, model
