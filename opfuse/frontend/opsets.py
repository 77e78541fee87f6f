"""Opsets: bring every model to the semantics the runtime implements.

Models older than CANONICAL_OPSET are converted up with `onnx.version_converter`, with a small pass
before or after it for each case where the converter is wrong (each named for what it fixes, each
tested in tests/unit/test_opsets.py). Models newer than CANONICAL_OPSET are kept at their opset: for
the ops opfuse runs, the versions after 18 add element types or attributes whose defaults keep the
old meaning, and the runtime implements the newer meaning (`REVIEWED_VERSIONS` lists what has been
checked); a node of a version nobody has reviewed is refused rather than guessed at.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import helper, shape_inference, version_converter

from opfuse.errors import ModelError
from opfuse.frontend.inspect import default_opset
from opfuse.frontend.validate import node_label

CANONICAL_OPSET = 18
DEFAULT_DOMAINS = ("", "ai.onnx")
# The oldest opset tested (tests/unit/test_opsets.py); older ones go through the converter untested.
OLDEST_TESTED_OPSET = 7
# IR version 8 is the first that may import opset 18.
CANONICAL_IR_VERSION = 8

# Ops with versions after CANONICAL_OPSET whose newer semantics the runtime implements: the newest
# since_version reviewed. Reviewed means read the changelog and, where meaning changed, implemented
# it in opfuse/runtime (noted here); most changes add element types only.
REVIEWED_VERSIONS: dict[str, int] = {
    # Types only (bfloat16, float8, int4, ...): the refused types are refused by the frontend.
    **dict.fromkeys(
        ["Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Cos", "Cosh", "Sin", "Sinh", "Tan"], 22
    ),
    **dict.fromkeys(["Conv", "ConvTranspose", "Dropout", "Elu", "EyeLike", "HardSigmoid", "HardSwish"], 22),
    **dict.fromkeys(["GlobalAveragePool", "GlobalLpPool", "GlobalMaxPool", "InstanceNormalization"], 22),
    **dict.fromkeys(["LpNormalization", "LpPool", "MaxPool", "Mish", "Round", "Selu", "Softplus"], 22),
    **dict.fromkeys(["Softsign", "ThresholdedRelu", "Det"], 22),
    **dict.fromkeys(["CastLike", "Constant", "ConstantOfShape", "Flatten", "Identity", "Pad"], 25),
    **dict.fromkeys(["Reshape", "Shape", "Size", "Squeeze", "Transpose", "Unsqueeze"], 25),
    "If": 25,  # types only; an If is only ever run inlined (control_flow.py)
    "Cast": 28,  # 19 adds `saturate`, 24 `round_mode`: both for float8 targets only, which are refused
    "AveragePool": 22,  # 19 adds dilations (implemented)
    "Equal": 19,  # string inputs (refused)
    "Gelu": 20,  # new at 20
    "IsInf": 20,
    "IsNaN": 20,
    "ReduceMax": 20,  # bool inputs (implemented)
    "ReduceMin": 20,
    "Resize": 19,  # coordinate_transformation_mode=half_pixel_symmetric (implemented)
    "GroupNormalization": 21,  # 21: scale and bias per channel, not per group (both implemented)
    "TopK": 24,  # types
    "Swish": 24,  # new at 24
    "Range": 27,  # 27 adds stash_type for float16/bfloat16 accumulation (implemented)
    "Mod": 28,  # 28 defines fmod=0 for floats (implemented)
    "Celu": 28,
    "BitShift": 28,  # signed integer types, with arithmetic right shifts (implemented)
    "Compress": 28,
    "ReverseSequence": 28,
    "CumProd": 26,  # new at 26
    "DepthToSpace": 28,
    "SpaceToDepth": 28,  # 28 adds `mode` (DCR, the old meaning, by default; CRD implemented)
    "Einsum": 28,
    "OneHot": 28,
    "ReduceLogSum": 28,  # integer types
    "ReduceLogSumExp": 28,
    "RMSNormalization": 23,  # new at 23
    "RotaryEmbedding": 23,  # new at 23
    "GridSample": 22,  # 20 renames modes (bilinear -> linear, bicubic -> cubic; both accepted), N-D
    "AffineGrid": 20,  # new at 20
    "SwiGLU": 28,  # new at 28
    "TensorScatter": 24,  # new at 24
    "Attention": 25,  # 24 adds nonpad_kv_seqlen, 25 sliding windows (both implemented)
    **dict.fromkeys(["RNN", "GRU", "LSTM"], 22),  # types only
    "DFT": 20,  # 20 moves `axis` to an input, default -2 (explicit_dft_axis writes it out)
}


def since_version(op_type: str, opset: int) -> int | None:
    try:
        return int(onnx.defs.get_schema(op_type, opset, "").since_version)
    except onnx.defs.SchemaError:
        return None


def check_node_versions(model: onnx.ModelProto) -> None:
    """Refuse nodes whose op version (after CANONICAL_OPSET) has semantics the runtime was not checked for."""
    opset = default_opset(model)
    if opset <= CANONICAL_OPSET:
        return
    problems = []
    for i, node in enumerate(model.graph.node):
        if node.domain not in DEFAULT_DOMAINS:
            continue
        version = since_version(node.op_type, opset)
        if version is not None and version > REVIEWED_VERSIONS.get(node.op_type, CANONICAL_OPSET):
            problems.append(f"{node_label(node, i)} is version {version}")
    if problems:
        raise ModelError(
            f"the model's opset {opset} gives ops versions opfuse does not support yet: "
            + "; ".join(problems[:8])
            + f". Re-export the model at opset {CANONICAL_OPSET}"
        )


# --- fixes around the version converter ------------------------------------------------------------

FixBefore = Callable[[onnx.ModelProto, int], None]


def flatten_legacy_softmax(model: onnx.ModelProto, opset: int) -> None:
    """Softmax, LogSoftmax and Hardmax before opset 13 work on the input flattened to 2-D at `axis`.

    The converter rewrites Softmax and LogSoftmax but not Hardmax; all three are rewritten here, the
    same way: Flatten(axis) -> op(axis=-1) -> Reshape back to the input's shape.
    """
    if opset >= 13:
        return
    ranks = _ranks(model)
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        if node.op_type not in ("Softmax", "LogSoftmax", "Hardmax") or node.domain not in DEFAULT_DOMAINS:
            nodes.append(node)
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        rank = ranks.get(node.input[0])
        if rank is not None and (axis + rank if axis < 0 else axis) == rank - 1:
            nodes.append(node)  # already the last axis: 2-D flattening changes nothing
            continue
        x, y = node.input[0], node.output[0]
        flat, shape, inner = f"{y}__flat2d", f"{y}__shape", f"{y}__2d"
        nodes += [
            helper.make_node("Shape", [x], [shape], name=f"{node.name}__shape"),
            helper.make_node("Flatten", [x], [flat], axis=axis, name=f"{node.name}__flatten"),
            helper.make_node(node.op_type, [flat], [inner], axis=1, name=node.name),
            helper.make_node("Reshape", [inner, shape], [y], name=f"{node.name}__reshape"),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def expand_spatial0_batchnorm(model: onnx.ModelProto, opset: int) -> None:
    """BatchNormalization-7 with spatial=0 normalizes per element (statistics of shape C x D1 x ...).

    Opset 9 dropped the attribute and the converter drops it too, which would change the meaning:
    written out as elementwise arithmetic instead, which broadcasts the per-element statistics.
    """
    if opset >= 9:
        return
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        spatial = next((a.i for a in node.attribute if a.name == "spatial"), 1)
        if node.op_type != "BatchNormalization" or spatial != 0:
            nodes.append(node)
            continue
        if len([o for o in node.output if o]) > 1:
            raise ModelError(f"{node.name or 'BatchNormalization'}: training mode is not supported")
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        x, scale, bias, mean, var = node.input[:5]
        y, p = node.output[0], f"{node.output[0]}__bn"
        eps_name = f"{p}_eps"
        model.graph.initializer.append(
            helper.make_tensor(eps_name, onnx.TensorProto.FLOAT, [], [eps])  # float32 models only
        )
        nodes += [
            helper.make_node("Sub", [x, mean], [f"{p}_centered"]),
            helper.make_node("Add", [var, eps_name], [f"{p}_var_eps"]),
            helper.make_node("Sqrt", [f"{p}_var_eps"], [f"{p}_std"]),
            helper.make_node("Div", [f"{p}_centered", f"{p}_std"], [f"{p}_normed"]),
            helper.make_node("Mul", [f"{p}_normed", scale], [f"{p}_scaled"]),
            helper.make_node("Add", [f"{p}_scaled", bias], [y], name=node.name),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


FIXES_BEFORE: list[FixBefore] = [flatten_legacy_softmax, expand_spatial0_batchnorm]


def legacy_resize_modes(model: onnx.ModelProto, opset: int) -> dict[str, dict[str, str]]:
    """Upsample (7-9) and Resize-10 map output pixels to input pixels asymmetrically (x_in = x_out / scale).

    The converter turns them into Resize-18 nodes with the default half_pixel mapping, which moves
    every pixel; the attributes to set on the converted node, by output name, are found here. Nearest
    rounds down when upsampling and up when downsampling (onnxruntime's opset-10 behaviour).
    """
    if opset > 10:
        return {}
    scales_of = _constant_values(model)
    fixes: dict[str, dict[str, str]] = {}
    for node in model.graph.node:
        if node.op_type not in ("Upsample", "Resize") or node.domain not in DEFAULT_DOMAINS:
            continue
        mode = next((a.s.decode() for a in node.attribute if a.name == "mode"), "nearest")
        attrs = {"coordinate_transformation_mode": "asymmetric"}
        if mode == "nearest":
            scales = next((list(a.floats) for a in node.attribute if a.name == "scales"), None)
            if scales is None and len(node.input) > 1:
                scales = scales_of.get(node.input[1])
            down = scales is not None and any(s < 1 for s in scales)
            if scales is not None and down and any(s > 1 for s in scales):
                raise ModelError(
                    f"{node.op_type} {node.name!r}: opset-{opset} nearest resizing that enlarges some axes and "
                    "shrinks others rounds differently per axis, which opfuse does not reproduce; "
                    "re-export the model at opset 11 or later"
                )
            attrs["nearest_mode"] = "ceil" if down else "floor"
        fixes[node.output[0]] = attrs
    return fixes


def explicit_mvn_axes(model: onnx.ModelProto) -> None:
    """MeanVarianceNormalization without `axes` gets its default [0, 2, 3] written out.

    ONNX shape inference expands the op's function body, whose Constant reads the attribute, and
    fails when the attribute is left to its default.
    """
    for node in model.graph.node:
        is_mvn = node.op_type == "MeanVarianceNormalization" and node.domain in DEFAULT_DOMAINS
        if is_mvn and not any(a.name == "axes" for a in node.attribute):
            node.attribute.append(helper.make_attribute("axes", [0, 2, 3]))


def explicit_dft_axis(model: onnx.ModelProto) -> None:
    """DFT-20 without its `axis` input gets the default, -2, as a constant input.

    DFT-17 keeps `axis` as an attribute (default 1) and DFT-20 as its third input (default -2);
    the runtime tells the two apart by which one a node has, so the newer default is written out."""
    if default_opset(model) < 20:
        return
    for node in model.graph.node:
        if node.op_type != "DFT" or node.domain not in DEFAULT_DOMAINS:
            continue
        if len(node.input) >= 3 and node.input[2]:
            continue
        name = f"{node.output[0]}__dft_axis"
        model.graph.initializer.append(helper.make_tensor(name, onnx.TensorProto.INT64, [], [-2]))
        while len(node.input) < 2:
            node.input.append("")
        if len(node.input) == 2:
            node.input.append(name)
        else:
            node.input[2] = name


# Fixes every model gets after conversion, whatever its opset.
FIXES_AFTER: list[Callable[[onnx.ModelProto], None]] = [explicit_mvn_axes, explicit_dft_axis]


def convert_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model at CANONICAL_OPSET (or its own, newer opset), with the converter's mistakes fixed."""
    opset = default_opset(model)
    model = _copy(model)
    if opset >= CANONICAL_OPSET:
        for after in FIXES_AFTER:
            after(model)
        return model
    for fix in FIXES_BEFORE:
        fix(model, opset)
    resize_fixes = legacy_resize_modes(model, opset)
    try:
        converted = version_converter.convert_version(model, CANONICAL_OPSET)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"cannot convert the model from opset {opset} to opset {CANONICAL_OPSET} "
            f"(onnx's version converter failed: {first}). Re-export it at opset {CANONICAL_OPSET}"
        ) from None
    converted.ir_version = max(converted.ir_version, CANONICAL_IR_VERSION)
    for node in converted.graph.node:
        attrs = resize_fixes.get(node.output[0]) if node.op_type == "Resize" and node.output else None
        if attrs:
            keep = [a for a in node.attribute if a.name not in attrs]
            del node.attribute[:]
            node.attribute.extend([*keep, *(helper.make_attribute(k, v) for k, v in attrs.items())])
    for after in FIXES_AFTER:
        after(converted)
    return converted


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Rank of every value ONNX shape inference can tell, on a best-effort basis."""
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    g = inferred.graph
    ranks = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.HasField("shape"):
            ranks[vi.name] = len(tt.shape.dim)
    for init in g.initializer:
        ranks[init.name] = len(init.dims)
    return ranks


def _constant_values(model: onnx.ModelProto) -> dict[str, list[float]]:
    """Float values of initializers and Constant nodes (small ones: Upsample scales)."""
    from onnx import numpy_helper

    values: dict[str, list[float]] = {}
    for init in model.graph.initializer:
        if init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE) and len(init.dims) <= 1:
            values[init.name] = [float(v) for v in numpy_helper.to_array(init).reshape(-1)]
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            arr = numpy_helper.to_array(node.attribute[0].t)
            if arr.dtype.kind == "f" and arr.ndim <= 1:
                values[node.output[0]] = [float(v) for v in arr.reshape(-1)]
    return values
