"""Triton source for a pointwise group: one pass over the output, intermediates in registers.

Every node computes in float32 registers; inputs are loaded once (with broadcasting by index
arithmetic) and each group output is stored once in its own dtype. A window op (LRN) also loads its
input at neighbouring channel offsets, so that input is always one of the kernel's tensors. A
Concat selects: each element of its output is loaded from the input whose range along the axis
holds it, at the element's coordinate minus that input's offset, the other inputs' loads masked
off (`concat_select`), so its inputs are always kernel tensors too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from opfuse.codegen.resize import ResizeGather, resize_load
from opfuse.codegen.source import SourceBuffer, comment_text, float_literal
from opfuse.graph import Graph, Node

FLOAT_TYPES = ("float32", "float16", "bfloat16")
ONNX_FLOAT_CASTS = {1: "float32", 10: "float16", 16: "bfloat16"}  # Cast.to enum -> dtype
TL_DTYPES = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16"}

Emitter = Callable[[list[str], Node, list[float | None]], str]
EMITTERS: dict[str, Emitter] = {}


def emitter(*ops: str) -> Callable[[Emitter], Emitter]:
    def deco(fn: Emitter) -> Emitter:
        for op in ops:
            EMITTERS[op] = fn
        return fn

    return deco


_BINARY = {"Add": "({0} + {1})", "Sub": "({0} - {1})", "Mul": "({0} * {1})", "Div": "({0} / {1})"}


@emitter(*_BINARY)
def _binary(a: list[str], n: Node, c: list[float | None]) -> str:
    return _BINARY[n.op_type].format(*a)


@emitter("Max", "Min")
def _minmax(a: list[str], n: Node, c: list[float | None]) -> str:
    fn = "tl.maximum" if n.op_type == "Max" else "tl.minimum"
    expr = a[0]
    for arg in a[1:]:
        expr = f"{fn}({expr}, {arg})"
    return expr


_UNARY = {
    "Relu": "tl.maximum({0}, 0.0)",
    "Sigmoid": "tl.sigmoid({0})",
    "Erf": "tl.erf({0})",
    "Exp": "tl.exp({0})",
    "Log": "tl.log({0})",
    "Sqrt": "tl.sqrt({0})",
    "Neg": "(-{0})",
    "Abs": "tl.abs({0})",
    "Reciprocal": "(1.0 / {0})",
    "Identity": "{0}",
    # tanh through exp(-2|x|) is stable for every x (no overflow) and exact at the tails.
    "Tanh": "tl.where({0} >= 0.0, 1.0, -1.0) * (1.0 - tl.exp(-2.0 * tl.abs({0}))) / (1.0 + tl.exp(-2.0 * tl.abs({0})))",
    # softplus = max(x, 0) + log1p(exp(-|x|)): no overflow for large x; log1p(t) ≈ t - t²/2 for
    # small t keeps the digits that log(1 + t) loses when x ≪ 0 (Triton has no log1p).
    "Softplus": (
        "(tl.maximum({0}, 0.0) + tl.where(tl.exp(-tl.abs({0})) < 1e-4, "
        "tl.exp(-tl.abs({0})) * (1.0 - 0.5 * tl.exp(-tl.abs({0}))), tl.log(1.0 + tl.exp(-tl.abs({0})))))"
    ),
}


@emitter(*_UNARY)
def _unary(a: list[str], n: Node, c: list[float | None]) -> str:
    return _UNARY[n.op_type].format(a[0])


@emitter("LeakyRelu")
def _leaky(a: list[str], n: Node, c: list[float | None]) -> str:
    alpha = float_literal(float(n.attrs.get("alpha", 0.01)))
    return f"tl.where({a[0]} >= 0.0, {a[0]}, {a[0]} * {alpha})"


@emitter("Elu")
def _elu(a: list[str], n: Node, c: list[float | None]) -> str:
    alpha = float_literal(float(n.attrs.get("alpha", 1.0)))
    return f"tl.where({a[0]} > 0.0, {a[0]}, {alpha} * (tl.exp({a[0]}) - 1.0))"


@emitter("HardSigmoid")
def _hardsigmoid(a: list[str], n: Node, c: list[float | None]) -> str:
    alpha = float_literal(float(n.attrs.get("alpha", 0.2)))
    beta = float_literal(float(n.attrs.get("beta", 0.5)))
    return f"tl.minimum(tl.maximum({alpha} * {a[0]} + {beta}, 0.0), 1.0)"


@emitter("HardSwish")
def _hardswish(a: list[str], n: Node, c: list[float | None]) -> str:
    return f"({a[0]} * tl.minimum(tl.maximum({a[0]} * (1.0 / 6.0) + 0.5, 0.0), 1.0))"


@emitter("Clip")
def _clip(a: list[str], n: Node, c: list[float | None]) -> str:
    expr = a[0]
    if len(a) > 1 and a[1]:
        expr = f"tl.maximum({expr}, {a[1]})"
    if len(a) > 2 and a[2]:
        expr = f"tl.minimum({expr}, {a[2]})"
    return expr


# Gelu (opset 20, the default exporter's spelling of F.gelu): the same arithmetic as the older
# spellings written out with Erf or Tanh. tanh form: 0.5 * (1 + tanh(u)) = sigmoid(2u).
GELU_APPROXIMATIONS = ("none", "tanh")


def _gelu_approximate(n: Node) -> str:
    value = n.attrs.get("approximate", "none")
    return value.decode() if isinstance(value, bytes) else str(value)


@emitter("Gelu")
def _gelu(a: list[str], n: Node, c: list[float | None]) -> str:
    x = a[0]
    if _gelu_approximate(n) == "tanh":
        two_k = float_literal(2.0 * math.sqrt(2.0 / math.pi))
        return f"({x} * tl.sigmoid({two_k} * ({x} + 0.044715 * {x} * {x} * {x})))"
    return f"(0.5 * {x} * (1.0 + tl.erf({x} * {float_literal(1.0 / math.sqrt(2.0))})))"


@emitter("Pow")
def _pow(a: list[str], n: Node, c: list[float | None]) -> str:
    e = c[1]
    assert e is not None  # fusible only with a scalar constant exponent (see pointwise_reason)
    x = a[0]
    special = {
        1.0: x,
        2.0: f"({x} * {x})",
        3.0: f"({x} * {x} * {x})",
        4.0: f"(({x} * {x}) * ({x} * {x}))",
        0.5: f"tl.sqrt({x})",
        -1.0: f"(1.0 / {x})",
        -0.5: f"(1.0 / tl.sqrt({x}))",
        0.0: f"({x} * 0.0 + 1.0)",
    }
    if e in special:
        return special[e]
    # exp(e * log x): NaN for a negative base with a non-integer exponent, as ONNX Pow gives.
    return f"tl.exp({float_literal(e)} * tl.log({x}))"


@emitter("Where")
def _where(a: list[str], n: Node, c: list[float | None]) -> str:
    return f"tl.where({a[0]} != 0.0, {a[1]}, {a[2]})"


@emitter("Cast")
def _cast(a: list[str], n: Node, c: list[float | None]) -> str:
    target = ONNX_FLOAT_CASTS[int(n.attrs["to"])]
    if target == "float32":
        return a[0]
    # Round through the narrower type, as the unfused Cast would.
    return f"{a[0]}.to({TL_DTYPES[target]}).to(tl.float32)"


def scalar_constant(graph: Graph, name: str) -> float | None:
    """The value of a one-element constant, if it is one."""
    arr = graph.constants.get(name)
    if arr is None or arr.size != 1:
        return None
    return float(np.asarray(arr, dtype=np.float64).reshape(()))


def pointwise_reason(graph: Graph, node: Node) -> str | None:
    """None if the node can go into a generated pointwise kernel, else why not."""
    if node.op_type not in EMITTERS:
        return f"{node.op_type} is not a pointwise op opfuse generates code for"
    outs = [o for o in node.outputs if o]
    if len(outs) != 1:
        return "the node has more than one output"
    checked = [*[x for x in node.inputs if x], *outs]
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
    if node.op_type == "Gelu" and _gelu_approximate(node) not in GELU_APPROXIMATIONS:
        return f"Gelu with approximate={_gelu_approximate(node)!r}: only 'none' and 'tanh' are defined"
    if node.op_type == "Cast" and int(node.attrs.get("to", 0)) not in ONNX_FLOAT_CASTS:
        return "Cast to a non-float type"
    return None


# Window ops: pointwise but for one input read at neighbouring channel offsets as well (op -> the
# channel axis). That input must be in memory: a tensor input of the kernel, never computed in it.
WINDOW_OPS = {"LRN": 1, "opfuse.LRNNHWC": -1}


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


def window_input(node: Node) -> str:
    """The value a window op reads at neighbouring offsets."""
    return node.inputs[0]


def split_literals(
    graph: Graph,
    names: list[str],
    skip: set[str] | frozenset[str] = frozenset(),
    tensors: set[str] | frozenset[str] = frozenset(),
) -> tuple[dict[str, str], list[str]]:
    """Finite one-element constants become literals in the source; every other input (and each
    name in `tensors`) is loaded as a tensor, in first-use order; names in `skip` are neither."""
    literals: dict[str, str] = {}
    loaded: list[str] = []
    for name in names:
        if name in skip:
            continue
        value = scalar_constant(graph, name)
        if value is not None and np.isfinite(value) and name not in tensors:
            literals[name] = float_literal(value)
        elif name not in loaded:
            loaded.append(name)
    return literals, loaded


@dataclass
class KernelSource:
    id: str
    kind: str
    source: str
    inputs: list[str]  # values passed as tensors, in launch order
    outputs: list[str]
    config: dict[str, Any]


def _broadcast_index(
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    strides: tuple[int, ...] | None = None,
    offs: str = "offs",
) -> str | None:
    """Index expression into an input broadcast to out_shape; None for a scalar.

    `strides`: the input read through a folded Transpose/Reshape, as strides into its buffer.
    `offs`: the expression of the output offsets it is read at (a window op's shifted offsets).
    """
    if int(np.prod(in_shape, dtype=np.int64)) == 1:
        return None
    padded = (1,) * (len(out_shape) - len(in_shape)) + tuple(in_shape)
    contiguous = [int(np.prod(padded[d + 1 :], dtype=np.int64)) for d in range(len(padded))]
    if strides is not None:
        given = [0] * (len(padded) - len(strides)) + list(strides)
        if given != contiguous:
            out_strides = [int(np.prod(out_shape[d + 1 :], dtype=np.int64)) for d in range(len(out_shape))]
            terms = []
            for d in range(len(padded)):
                if padded[d] == 1 or given[d] == 0:
                    continue
                coord = (
                    f"(({offs} // {out_strides[d]}) % {out_shape[d]})"
                    if out_strides[d] > 1
                    else f"({offs} % {out_shape[d]})"
                )
                terms.append(f"{coord} * {given[d]}" if given[d] != 1 else coord)
            return "(" + " + ".join(terms) + ")"
    if padded == tuple(out_shape):
        return offs
    # Strides of the (contiguous) input, and of the output's iteration space.
    in_strides = contiguous
    out_strides = [int(np.prod(out_shape[d + 1 :], dtype=np.int64)) for d in range(len(out_shape))]
    live = [d for d in range(len(padded)) if padded[d] != 1]
    # A contiguous trailing block (e.g. a bias over the last dims): offs modulo its size.
    if live == list(range(live[0], len(padded))) and all(padded[d] == out_shape[d] for d in live):
        return f"({offs} % {int(np.prod(padded, dtype=np.int64))})"
    terms = []
    for d in live:
        coord = (
            f"(({offs} // {out_strides[d]}) % {out_shape[d]})"
            if out_strides[d] > 1
            else f"({offs} % {out_shape[d]})"
        )
        terms.append(f"{coord} * {in_strides[d]}" if in_strides[d] != 1 else coord)
    return "(" + " + ".join(terms) + ")"


def generate_pointwise(
    kernel_id: str,
    group_nodes: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    group_id: str,
    views: dict[str, Any] | None = None,
) -> KernelSource:
    """`views`: external inputs read through folded layout ops ({value: StridedView}), or computed
    by gather loads from the input of a Resize ({value: ResizeGather})."""
    views = views or {}
    shape = graph.spec(outputs[0]).shape
    numel = graph.spec(outputs[0]).numel
    fn = "fused_pointwise"
    windowed = {window_input(n) for n in group_nodes if n.op_type in WINDOW_OPS}
    # Inputs only Concats read are loaded by the Concats' selections, not at the kernel's offsets.
    selected = {x for n in group_nodes if n.op_type == "Concat" for x in n.inputs if x}
    selected_only = selected - {x for n in group_nodes if n.op_type != "Concat" for x in n.inputs if x}
    literals, tensor_inputs = split_literals(graph, inputs, tensors=windowed | selected)
    slot = {name: i for i, name in enumerate(tensor_inputs)}
    args = [f"in{i}" for i in range(len(tensor_inputs))] + [f"out{i}" for i in range(len(outputs))]
    buf = SourceBuffer()
    buf.line(f"# Generated by opfuse: pointwise kernel {kernel_id} for group {group_id}.")
    buf.line(f"# {len(group_nodes)} ONNX nodes, {numel} elements, shape {list(shape)}:")
    for n in group_nodes:
        buf.line(f"#   {n.id}: {n.op_type} {comment_text(n.name)}")
    for i, name in enumerate(tensor_inputs):
        g = views.get(name)
        if isinstance(g, ResizeGather):
            resized = [a.out_size for a in g.axes]
            buf.line(
                f"# in{i}: resized {resized} by gather loads from its input {[a.in_size for a in g.axes]}"
            )
    for n in group_nodes:
        if n.op_type == "Concat":
            axis, parts = concat_parts(graph, n)
            for name, start, length in parts:
                buf.line(f"# in{slot[name]}: {n.id} axis {axis} [{start}, {start + length})")
    buf.line("import triton")
    buf.line("import triton.language as tl")
    buf.line()
    buf.line(f"N = {numel}")
    buf.line('CONFIG = {"BLOCK": 1024, "num_warps": 4}')
    buf.line(
        f'INTERPRETER_CONFIG = {{"BLOCK": {min(1 << 16, max(16, 1 << max(0, (numel - 1).bit_length())))}}}'
    )
    buf.line()
    buf.line()
    buf.line("@triton.jit")
    buf.line(f"def {fn}({', '.join(args)}, n, BLOCK: tl.constexpr):")
    regs: dict[str, str] = {}
    with buf.indent():
        pid = "tl.program_id(0).to(tl.int64)" if numel >= 2**31 - 1 else "tl.program_id(0)"
        buf.line(f"offs = {pid} * BLOCK + tl.arange(0, BLOCK)")
        buf.line("mask = offs < n")
        wide = pid != "tl.program_id(0)" or any(
            isinstance(v, ResizeGather) and v.extent() >= 2**31 - 1 for v in views.values()
        )
        index_type = "tl.int64" if wide else "tl.int32"
        reads: dict[str, tuple[int, tuple[int, ...], tuple[int, ...] | None, str]] = {}
        for i, name in enumerate(tensor_inputs):
            if name in selected_only:
                continue
            view = views.get(name)
            if isinstance(view, ResizeGather):
                lines: list[str] = []
                value = resize_load(f"r{i}", f"in{i}", view, lines, index_type)
                for text in lines:
                    buf.line(text)
                buf.line(f"x{i} = {value}")
                regs[name] = f"x{i}"
                continue
            in_shape = tuple(view.shape if view is not None else graph.spec(name).shape)
            strides = tuple(view.strides) if view is not None else None
            idx = _broadcast_index(in_shape, shape, strides)
            offset = f" + {view.offset}" if view is not None and view.offset else ""  # a Split output
            if idx is None:
                buf.line(f"x{i} = tl.load(in{i}{offset}).to(tl.float32)")
            else:
                buf.line(f"x{i} = tl.load(in{i} + {idx}{offset}, mask=mask, other=0.0).to(tl.float32)")
            regs[name] = f"x{i}"
            reads[name] = (i, in_shape, strides, offset)
        for name, lit in literals.items():
            regs[name] = lit
        for j, n in enumerate(group_nodes):
            if n.op_type in WINDOW_OPS:
                x = window_input(n)
                address = functools.partial(_address, *reads[x], shape)
                expr = _emit_window(buf, n, f"v{j}", regs[x], address, shape)
                buf.line(f"v{j} = {expr}  # {n.op_type}")
                regs[n.outputs[0]] = f"v{j}"
                continue
            if n.op_type == "Concat":
                emit_concat(buf, graph, n, f"v{j}", slot, views, index_type)
                regs[n.outputs[0]] = f"v{j}"
                continue
            args_expr = [regs[x] if x else "" for x in n.inputs]
            consts = [scalar_constant(graph, x) if x else None for x in n.inputs]
            expr = EMITTERS[n.op_type](args_expr, n, consts)
            buf.line(f"v{j} = {expr}  # {n.op_type}")
            regs[n.outputs[0]] = f"v{j}"
        for i, name in enumerate(outputs):
            buf.line(f"tl.store(out{i} + offs, {regs[name]}.to(out{i}.dtype.element_ty), mask=mask)")
    buf.line()
    buf.line()
    buf.line(f"def launch({', '.join(args)}, config=None):")
    with buf.indent():
        buf.line("c = CONFIG if config is None else config")
        buf.line(f'{fn}[(triton.cdiv(N, c["BLOCK"]),)]({", ".join(args)}, N, **c)')
    passed = [views[x].base if x in views else x for x in tensor_inputs]
    return KernelSource(
        kernel_id, "pointwise", buf.getvalue(), passed, list(outputs), {"BLOCK": 1024, "num_warps": 4}
    )


def _address(
    i: int,
    in_shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    offset: str,
    shape: tuple[int, ...],
    at: str,
) -> str:
    """The address of kernel input `in{i}` at output offsets `at`."""
    return f"in{i} + {_broadcast_index(in_shape, shape, strides, at) or 0}{offset}"


def _emit_window(
    buf: SourceBuffer,
    node: Node,
    prefix: str,
    centre: str,
    address: Callable[[str], str],
    shape: tuple[int, ...],
) -> str:
    """LRN: the sum of squares over the channel window [c - (size-1)//2, c + size-1 - (size-1)//2],
    each neighbour loaded at the output offset shifted by whole channels (masked past either edge:
    the zero padding, which still counts in the divisor `size`); returns the expression of
    x / (bias + alpha / size * sum) ** beta. `address(at)` is the input's address at offsets `at`."""
    rank = len(shape)
    axis = WINDOW_OPS[node.op_type] % rank
    channels = int(shape[axis])
    stride = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    size = int(node.attrs["size"])
    before = (size - 1) // 2
    alpha = float(node.attrs.get("alpha", 1e-4))
    beta = float(node.attrs.get("beta", 0.75))
    bias = float(node.attrs.get("bias", 1.0))
    chan = f"{prefix}_c"
    buf.line(f"{chan} = (offs // {stride}) % {channels}" if stride > 1 else f"{chan} = offs % {channels}")
    buf.line(f"{prefix}_sq = {centre} * {centre}")
    for d in range(-before, size - before):
        if d == 0:
            continue
        at = f"(offs + {d * stride})" if d > 0 else f"(offs - {-d * stride})"
        inside = f"({chan} >= {-d})" if d < 0 else f"({chan} < {channels - d})"
        buf.line(
            f"{prefix}_w = tl.load({address(at)}, mask=mask & {inside}, other=0.0).to(tl.float32)"
            f"  # channel {'+' if d > 0 else '-'}{abs(d)}"
        )
        buf.line(f"{prefix}_sq += {prefix}_w * {prefix}_w")
    base = f"({float_literal(bias)} + {float_literal(alpha / size)} * {prefix}_sq)"
    return f"({centre} / {_pow([base], node, [None, beta])})"


def concat_parts(graph: Graph, node: Node) -> tuple[int, list[tuple[str, int, int]]]:
    """A Concat's axis (non-negative) and each input's (value, start, length) along it."""
    shape = tuple(graph.spec(node.outputs[0]).shape)
    axis = int(node.attrs.get("axis", 0)) % len(shape)
    parts: list[tuple[str, int, int]] = []
    start = 0
    for x in node.inputs:
        if not x:
            continue
        length = int(graph.spec(x).shape[axis])
        parts.append((x, start, length))
        start += length
    return axis, parts


def emit_concat(
    buf: SourceBuffer,
    graph: Graph,
    node: Node,
    prefix: str,
    slot: dict[str, int],
    views: dict[str, Any],
    index_type: str,
    offs: str = "offs",
    mask: str = "mask",
) -> None:
    """Concat: the output offset's position within its slab (the elements of one outer index,
    `length * inner` of them) picks the input whose range holds it; each input is loaded at its own
    offset (outer index * its slab + position - its start * inner), masked to the lanes it holds
    (through its layout view or resize gather as any input is), and `prefix` is the selection.
    `offs` and `mask`: the flat offsets into the Concat's output the kernel computes, and the
    lanes that load (a row kernel's rows: `row * R + cols` and its column mask)."""
    shape = tuple(graph.spec(node.outputs[0]).shape)
    axis, parts = concat_parts(graph, node)
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    slab = int(shape[axis]) * inner
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    pos = f"{prefix}_s"
    buf.line(f"{pos} = {offs} % {slab}" if outer > 1 else f"{pos} = {offs}")
    if outer > 1:
        buf.line(f"{prefix}_o = {offs} // {slab}")
    loaded: list[str] = []
    for k, (name, start, length) in enumerate(parts):
        i = slot[name]
        lo, hi = start * inner, (start + length) * inner
        local = f"{pos} - {lo}" if lo else pos
        buf.line(
            f"{prefix}_q{k} = {prefix}_o * {length * inner} + {local}"
            if outer > 1
            else f"{prefix}_q{k} = {local}"
        )
        held = [f"({pos} >= {lo})"] if lo else []
        held += [f"({pos} < {hi})"] if hi < slab else []
        buf.line(f"{prefix}_m{k} = {' & '.join([mask, *held])}")
        view = views.get(name)
        if isinstance(view, ResizeGather):
            lines: list[str] = []
            value = resize_load(
                f"{prefix}_r{k}", f"in{i}", view, lines, index_type, f"{prefix}_q{k}", f"{prefix}_m{k}"
            )
            for text in lines:
                buf.line(text)
            buf.line(f"{prefix}_{k} = {value}")
        else:
            in_shape = tuple(view.shape if view is not None else graph.spec(name).shape)
            strides = tuple(view.strides) if view is not None else None
            idx = _broadcast_index(in_shape, in_shape, strides, f"{prefix}_q{k}") or "0"
            offset = f" + {view.offset}" if view is not None and view.offset else ""
            buf.line(
                f"{prefix}_{k} = tl.load(in{i} + {idx}{offset}, mask={prefix}_m{k}, other=0.0).to(tl.float32)"
            )
        loaded.append(f"{prefix}_{k}")
    # The last input holds what the others' ranges do not: select from the end backwards.
    expr = loaded[-1]
    for k in range(len(parts) - 2, -1, -1):
        expr = f"tl.where({pos} < {(parts[k][1] + parts[k][2]) * inner}, {loaded[k]}, {expr})"
    buf.line(f"{prefix} = {expr}  # Concat")
