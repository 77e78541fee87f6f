"""What the kernel templates compute: fusion asks before it plans a group, codegen honours it.

Each `*_reason` returns None where a template computes the node, else why not (the reason goes
into the report's `fusion.not_fused`). Geometry helpers read the numbers a template is specialized
on (window strides, pads, sizes) off the node and its shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import (
    AVERAGE_POOL_NHWC,
    COMPARE_OPS,
    CONV_OPS,
    EXACT_INT_OPS,
    FLOAT_TYPES,
    GELU_APPROXIMATIONS,
    INT_TYPES,
    LOGIC_OPS,
    MASK_OPS,
    NHWC_CONV,
    NHWC_POOLS,
    ONNX_CASTS,
    ONNX_FLOAT_CASTS,
    POINTWISE_OPS,
    WINDOW_OPS,
    gelu_approximate,
)
from opfuse.ir.queries import scalar_constant

# Element offsets below this are computed in int32 by the depthwise and pool templates (a margin
# below 2**31 for the window's reach past the last pixel).
INT32_INDEX_LIMIT = 2**31 - 2**24


def pointwise_reason(graph: Graph, node: Node, integers: bool = False) -> str | None:
    """None if the node can go into a generated pointwise kernel, else why not. `integers`: the
    pointwise template's own kernels, which also compute on integers and booleans (`MASK_OPS`,
    and the `EXACT_INT_OPS` on integer values); the anchor and row templates hold float32 alone."""
    if node.op_type not in POINTWISE_OPS and not (integers and node.op_type in MASK_OPS):
        return f"{node.op_type} is not a pointwise op opfuse generates code for"
    outs = [o for o in node.outputs if o]
    if len(outs) != 1:
        return "the node has more than one output"
    checked = [*[x for x in node.inputs if x], *outs]
    if integers and (
        node.op_type in MASK_OPS or any(graph.spec(x).dtype not in FLOAT_TYPES for x in checked)
    ):
        return _exact_reason(graph, node, checked)
    if node.op_type == "Where":
        if graph.spec(node.inputs[0]).dtype != "bool":
            return "Where with a non-boolean condition"
        checked = checked[1:]  # the condition is a bool mask; the values must be float
    for name in checked:
        if graph.spec(name).dtype not in FLOAT_TYPES:
            return f"value of type {graph.spec(name).dtype}: pointwise kernels take float32/float16/bfloat16"
    if node.op_type == "Pow" and scalar_constant(graph, node.inputs[1]) is None:
        return "Pow with a tensor exponent: only a constant scalar exponent has an exact kernel form"
    if node.op_type == "Clip":
        for bound in node.inputs[1:3]:
            if bound and scalar_constant(graph, bound) is None:
                return "Clip with a non-constant bound"
    if node.op_type == "Gelu" and gelu_approximate(node) not in GELU_APPROXIMATIONS:
        return f"Gelu with approximate={gelu_approximate(node)!r}: only 'none' and 'tanh' are defined"
    if node.op_type == "Cast" and int(node.attrs.get("to", 0)) not in ONNX_FLOAT_CASTS:
        return "Cast to a non-float type"
    return None


def _exact_reason(graph: Graph, node: Node, values: list[str]) -> str | None:
    """A pointwise node on integers or booleans (or a comparison of floats): None if the pointwise
    template computes it exactly in registers of the values' own types."""
    types = {x: graph.spec(x).dtype for x in values}
    known = (*FLOAT_TYPES, *INT_TYPES, "bool")
    for t in types.values():
        if t not in known:
            return f"value of type {t}: pointwise kernels take float, int32, int64 and bool values"
    ins = [x for x in node.inputs if x]
    op = node.op_type
    if op in COMPARE_OPS:
        return None if types[ins[0]] != "bool" else f"{op} of booleans"
    if op in LOGIC_OPS or op == "Not":
        return None if all(types[x] == "bool" for x in ins) else f"{op} of non-boolean values"
    if op == "Cast":
        return None if int(node.attrs.get("to", 0)) in ONNX_CASTS else "Cast to a type kernels do not hold"
    if op == "Where":
        return None if types[ins[0]] == "bool" else "Where with a non-boolean condition"
    if op not in EXACT_INT_OPS or any(types[x] == "bool" for x in ins):
        return f"{op} on integers: only exact integer arithmetic ({', '.join(sorted(EXACT_INT_OPS))}) is generated"
    return None


def window_reason(graph: Graph, node: Node) -> str | None:
    """None if a window op can be computed by a generated pointwise kernel, else why not."""
    if node.op_type not in WINDOW_OPS:
        return f"{node.op_type} is not a window op opfuse generates code for"
    x, y = graph.spec(node.inputs[0]), graph.spec(node.outputs[0])
    if x.dtype not in FLOAT_TYPES or y.dtype not in FLOAT_TYPES:
        return f"value of type {x.dtype}: window kernels take float32/float16/bfloat16"
    if len(x.shape) < 3 or tuple(x.shape) != tuple(y.shape):
        return "the input is not an [N, C, ...] tensor the size of the output"
    if int(node.attrs.get("size", 0)) < 1:
        return "the window size is not positive"
    for key, default in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)):
        if not np.isfinite(float(node.attrs.get(key, default))):
            return f"the {key} is not finite"
    return None


def gemm_anchor_reason(graph: Graph, node: Node) -> str | None:
    """None if the MatMul/Gemm can be the anchor of a GEMM template, else why not."""
    if node.op_type not in ("MatMul", "Gemm"):
        return f"{node.op_type} is not a GEMM"
    a, b = graph.spec(node.inputs[0]), graph.spec(node.inputs[1])
    if a.dtype not in FLOAT_TYPES or b.dtype != a.dtype:
        return f"operands of type {a.dtype}/{b.dtype}"
    if len(a.shape) < 2 or len(b.shape) < 2:
        return "an operand is a vector"
    if len(b.shape) > 2:
        if node.op_type != "MatMul":
            return "a Gemm of batched operands"
        why = batch_reason(a.shape[:-2], b.shape[:-2])
        if why is not None:
            return why
    if node.op_type == "Gemm":
        if int(node.attrs.get("transA", 0)):
            return "Gemm with transA"
        if len(node.inputs) > 2 and node.inputs[2]:
            c = graph.spec(node.inputs[2])
            out = graph.spec(node.outputs[0]).shape
            if len(c.shape) > 2 or any(
                d not in (1, o) for d, o in zip(reversed(c.shape), reversed(out), strict=False)
            ):
                return "Gemm bias does not broadcast to the output"
    k = a.shape[-1]
    if k < 1:
        return "empty reduction"
    return None


def batch_reason(a: tuple[int, ...], b: tuple[int, ...]) -> str | None:
    """None if the batch dims of a batched MatMul's operands broadcast (numpy's rule, from the
    right) to batches the template can number in one grid axis, else why not."""
    for x, y in zip(reversed(a), reversed(b), strict=False):
        if x != y and 1 not in (x, y):
            return f"batch dims {tuple(a)} and {tuple(b)} do not broadcast"
    return None


def is_batched(graph: Graph, node: Node) -> bool:
    """A MatMul whose second operand has batch dims: every batch entry multiplies by its own B
    (codegen.gemm's batched form); otherwise A's leading dims fold into the rows of one 2-D B."""
    return node.op_type == "MatMul" and len(graph.spec(node.inputs[1]).shape) > 2


def gemm_dims(graph: Graph, node: Node) -> tuple[int, int, int, bool]:
    """(M, N, K, B transposed) of a MatMul or Gemm, or of a dense NHWC conv as the implicit GEMM it
    is: M the output pixels (images, height, width flattened), N its channels, K the window's taps
    times the input channels, B its [Cout, KH, KW, Cin] weight, transposed. A 1x1 conv of a 1x1
    map is a GEMV of its [N, 1, 1, C] input (pooled_gemm); a conv on a row kernel's tiles loads A
    through the window (gemm_reduction)."""
    if node.op_type == NHWC_CONV:
        y, w = graph.spec(node.outputs[0]).shape, graph.spec(node.inputs[1]).shape
        return int(np.prod(y[:-1], dtype=np.int64)), w[0], int(np.prod(w[1:], dtype=np.int64)), True
    a, b = graph.spec(node.inputs[0]).shape, graph.spec(node.inputs[1]).shape
    trans_b = node.op_type == "Gemm" and bool(int(node.attrs.get("transB", 0)))
    k = a[-1]
    n = b[0] if trans_b else b[1]
    m = int(np.prod(a[:-1], dtype=np.int64))
    return m, n, k, trans_b


def window_pads(
    node: Node, size: tuple[int, ...], out: tuple[int, ...], kernel: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(leading, trailing) pads per spatial axis of a window op (Conv, a pool; 2-D: ((top, left),
    (bottom, right))), auto_pad resolved from the input and output sizes."""
    rank = len(size)
    strides = [int(v) for v in node.attrs.get("strides", [1] * rank)]
    dilations = [int(v) for v in node.attrs.get("dilations", [1] * rank)]
    auto_pad = str(node.attrs.get("auto_pad", "NOTSET"))
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for n, o, k, st, d in zip(size, out, kernel, strides, dilations, strict=True):
            total = max(0, (o - 1) * st + (k - 1) * d + 1 - n)
            begins.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
            ends.append(total - begins[-1])
        return tuple(begins), tuple(ends)
    if auto_pad == "VALID":
        return (0,) * rank, (0,) * rank
    p = [int(v) for v in node.attrs.get("pads", [0] * (2 * rank))]
    return tuple(p[:rank]), tuple(p[rank:])


def window_geometry(
    node: Node, size: tuple[int, int], out: tuple[int, int], kernel: tuple[int, int]
) -> dict[str, int]:
    """Strides, dilations and leading pads of a 2-D window op (Conv, a pool), auto_pad resolved
    from the input and output sizes."""
    sh, sw = (int(v) for v in node.attrs.get("strides", [1, 1]))
    dh, dw = (int(v) for v in node.attrs.get("dilations", [1, 1]))
    (ph, pw), _ = window_pads(node, size, out, kernel)
    return {"SH": sh, "SW": sw, "DH": dh, "DW": dw, "PH": ph, "PW": pw}


def conv_params(graph: Graph, node: Node) -> dict[str, int]:
    x = graph.spec(node.inputs[0]).shape
    w = graph.spec(node.inputs[1]).shape
    y = graph.spec(node.outputs[0]).shape
    if node.op_type == NHWC_CONV:  # the same numbers read off NHWC shapes
        x, w, y = (x[0], x[3], x[1], x[2]), (w[0], w[3], w[1], w[2]), (y[0], y[3], y[1], y[2])
    kh, kw = w[2], w[3]
    geometry = window_geometry(node, (x[2], x[3]), (y[2], y[3]), (kh, kw))
    return {"N": x[0], "C": x[1], "H": x[2], "W": x[3], "CO": w[0], "KH": kh, "KW": kw, **geometry} | {
        "OH": y[2],
        "OW": y[3],
    }


@dataclass(frozen=True)
class ConvAxis:
    """One spatial axis of a channels-first convolution (any number of them)."""

    name: str  # "d", "h" or "w": the generated code's coordinates are o<name>, i<name>, k<name>
    size: int  # the input's extent
    out: int
    kernel: int
    stride: int
    dilation: int
    pad: int  # leading padding


SPATIAL_NAMES = {1: ("w",), 2: ("h", "w"), 3: ("d", "h", "w")}


def conv_axes(graph: Graph, node: Node) -> list[ConvAxis]:
    """The spatial axes of a channels-first Conv ([N, C, *spatial]), auto_pad resolved."""
    x = graph.spec(node.inputs[0]).shape[2:]
    y = graph.spec(node.outputs[0]).shape[2:]
    k = graph.spec(node.inputs[1]).shape[2:]
    rank = len(x)
    strides = [int(v) for v in node.attrs.get("strides", [1] * rank)]
    dilations = [int(v) for v in node.attrs.get("dilations", [1] * rank)]
    pads, _ = window_pads(node, tuple(x), tuple(y), tuple(k))
    return [
        ConvAxis(name, *dims)
        for name, *dims in zip(SPATIAL_NAMES[rank], x, y, k, strides, dilations, pads, strict=True)
    ]


PAD_MODES = ("constant", "reflect", "edge")


def pad_per_dim(graph: Graph, pad: Node) -> list[tuple[int, int]] | None:
    """(begin, end) per axis of a Pad whose pads (and axes) are constants; None otherwise."""
    rank = len(graph.spec(pad.inputs[0]).shape)
    if pad.inputs[1] not in graph.constants:
        return None
    pads = [int(v) for v in np.asarray(graph.constants[pad.inputs[1]]).ravel()]
    axes = list(range(rank))
    if len(pad.inputs) > 3 and pad.inputs[3]:
        if pad.inputs[3] not in graph.constants:
            return None
        axes = [int(a) % rank for a in np.asarray(graph.constants[pad.inputs[3]]).ravel()]
    if len(pads) != 2 * len(axes):
        return None
    per_dim = [(0, 0)] * rank
    for i, axis in enumerate(axes):
        per_dim[axis] = (pads[i], pads[i + len(axes)])
    return per_dim


def spatial_pad_reason(graph: Graph, pad: Node, nhwc: bool = False) -> str | None:
    """None where a Pad's pads are constants, non-negative, and on the spatial axes only (what a
    conv can take as its own padding or read through), else why not. `nhwc`: a 4-D channels-last
    Pad, its channels the last axis."""
    per_dim = pad_per_dim(graph, pad)
    if per_dim is None:
        return "the pads (or axes) are not constants"
    if per_dim[0] != (0, 0) or per_dim[-1 if nhwc else 1] != (0, 0):
        return "the Pad pads the batch or channel axis"
    if any(b < 0 or e < 0 for b, e in per_dim):
        return "negative pads (a crop)"
    return None


def centre_tap(graph: Graph, conv: Node) -> int | None:
    """The window position at which a conv's output pixel reads the input pixel at its own
    coordinates, where the conv keeps the input's size at stride 1 (so its tiles at that position
    cover the whole input); None otherwise."""
    p = conv_params(graph, conv)
    if (p["SH"], p["SW"], p["OH"], p["OW"]) != (1, 1, p["H"], p["W"]):
        return None
    if p["PH"] % p["DH"] or p["PW"] % p["DW"]:
        return None
    th, tw = p["PH"] // p["DH"], p["PW"] // p["DW"]
    return th * p["KW"] + tw if th < p["KH"] and tw < p["KW"] else None


def conv_anchor_reason(graph: Graph, node: Node) -> str | None:
    """None if the Conv can run as the implicit-GEMM template, else why not. The channels-last
    template is 2-D (a 1-D conv runs as one image row, passes/layout.py); the NCHW one 1-D to
    3-D."""
    x = graph.spec(node.inputs[0])
    if node.op_type not in CONV_OPS:
        return f"{node.op_type} is not a convolution"
    if x.dtype not in FLOAT_TYPES:
        return f"input of type {x.dtype}"
    if node.op_type == NHWC_CONV and len(x.shape) != 4:
        return f"a {len(x.shape) - 2}-D convolution: the channels-last template is 2-D"
    if len(x.shape) not in (3, 4, 5):
        return f"a {len(x.shape) - 2}-D convolution: the template covers 1-D to 3-D"
    group = int(node.attrs.get("group", 1))
    if group != 1 and node.op_type != NHWC_CONV:
        return "a grouped (or depthwise) convolution: the NCHW template computes group=1"
    if node.inputs[1] not in graph.constants:
        return "the weight is not a constant"
    return None


def input_scale_operands(graph: Graph, mul: Node, conv: Node) -> tuple[str, str]:
    """(act, scale) of a Mul feeding an NHWC conv whose input it scales per (image, channel)."""
    a, b = mul.inputs[0], mul.inputs[1]
    full = graph.spec(conv.inputs[0]).shape
    return (a, b) if graph.spec(a).shape == full else (b, a)


def input_scale_reason(graph: Graph, mul: Node, conv: Node) -> str | None:
    """None if `mul` can run as `conv`'s input-scale prologue, else why not."""
    if mul.op_type != "Mul" or len(mul.inputs) != 2:
        return "not a Mul"
    full = graph.spec(conv.inputs[0]).shape
    act, scale = input_scale_operands(graph, mul, conv)
    s = graph.spec(scale).shape
    if graph.spec(act).shape != full or len(s) != 4:
        return "the Mul does not scale the full conv input by a 4-D tensor"
    if s[1] != 1 or s[2] != 1 or s[0] not in (1, full[0]) or s[3] not in (1, full[3]):
        return f"the scale {list(s)} varies over the image (only per image and channel can be folded)"
    if scale in graph.constants:
        return "the scale is a constant (it belongs in the weights)"
    if int(conv.attrs.get("group", 1)) != 1:
        return "the conv is grouped (the input scale is applied in the group=1 template)"
    if graph.spec(scale).dtype != graph.spec(act).dtype:
        return "the scale's type differs from the input's"
    return None


def pool_params(graph: Graph, node: Node) -> dict[str, int]:
    """The window of an NHWC pool; PH_END and PW_END are its bottom and right pads (an average
    pool with count_include_pad counts the taps inside them)."""
    n, h, w, c = graph.spec(node.inputs[0]).shape
    _, oh, ow, _ = graph.spec(node.outputs[0]).shape
    kh, kw = (int(v) for v in node.attrs["kernel_shape"])
    geometry = window_geometry(node, (h, w), (oh, ow), (kh, kw))
    _, (ph_end, pw_end) = window_pads(node, (h, w), (oh, ow), (kh, kw))
    return {"N": n, "H": h, "W": w, "C": c, "OH": oh, "OW": ow, "KH": kh, "KW": kw, **geometry} | {
        "PH_END": ph_end,
        "PW_END": pw_end,
    }


POOL_TAIL_MAX_WINDOW = 16  # taps of a window a conv's row tile (16 rows at least) holds whole


def pool_tail_reason(graph: Graph, node: Node) -> str | None:
    """None if the NHWC pool can be computed on the output tile of the conv before it
    (fusion/rules/anchor_epilogue.py, `pool_tail`): windows that tile the map (the window its
    stride, no padding or dilation, the ceiling mode off) of a power-of-two number of taps up to
    POOL_TAIL_MAX_WINDOW, so that the conv's rows, taken window by window, hold whole windows;
    else why not."""
    why = pool_reason(graph, node)
    if why is not None:
        return why
    p = pool_params(graph, node)
    taps = p["KH"] * p["KW"]
    if (p["SH"], p["SW"]) != (p["KH"], p["KW"]) or (p["DH"], p["DW"]) != (1, 1):
        return f"its {p['KH']}x{p['KW']} windows at stride ({p['SH']}, {p['SW']}) overlap or skip pixels"
    if p["PH"] or p["PW"] or p["PH_END"] or p["PW_END"] or int(node.attrs.get("ceil_mode", 0)):
        return "it pads the map (or rounds its windows up)"
    if taps & (taps - 1) or taps > POOL_TAIL_MAX_WINDOW:
        return f"a window of {taps} taps (the conv's row tiles hold whole windows of 2, 4, 8 or 16)"
    if p["OH"] * p["KH"] > p["H"] or p["OW"] * p["KW"] > p["W"]:
        return "its windows reach past the map"
    return None


def pool_reason(graph: Graph, node: Node) -> str | None:
    """None if the NHWC max or average pool can run as the template, else why not."""
    if node.op_type not in NHWC_POOLS.values():
        return f"{node.op_type} is not an NHWC max or average pool"
    if len([o for o in node.outputs if o]) > 1:
        return "the pool's Indices output is used"
    x = graph.spec(node.inputs[0])
    if x.dtype not in FLOAT_TYPES or len(x.shape) != 4 or "kernel_shape" not in node.attrs:
        return "not a 2-D float pool"
    if node.op_type == AVERAGE_POOL_NHWC and int(node.attrs.get("count_include_pad", 0)) not in (0, 1):
        return "count_include_pad is neither 0 nor 1"
    if max(x.numel, graph.spec(node.outputs[0]).numel) >= INT32_INDEX_LIMIT:
        return "over 2**31 elements (the template indexes in int32)"
    return None
