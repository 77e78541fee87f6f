"""Triton source for a pointwise group: one pass over the output, intermediates in registers.

Every node computes in float32 registers (integers and booleans in their own: mask and position-id
arithmetic, `ir.ops.MASK_OPS`, is exact); inputs are loaded once (with broadcasting by index
arithmetic) and each group output is stored once in its own dtype. A window op (LRN) also loads its
input at neighbouring channel offsets, so that input is always one of the kernel's tensors. A
Concat selects: each element of its output is loaded from the input whose range along the axis
holds it, at the element's coordinate minus that input's offset, the other inputs' loads masked
off (`concat_select`), so its inputs are always kernel tensors too. A Resize alone in its group
(`resize_gather`, where no reader's kernel gathers it) is its input's gather loads, stored.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from opfuse.codegen.emitters import EMITTERS, pow_expr
from opfuse.codegen.fragments import (
    KernelSource,
    broadcast_index,
    concat_comments,
    module_imports,
    module_title,
    node_comment,
    split_literals,
)
from opfuse.codegen.index_map import index_map_load, table_args
from opfuse.codegen.resize import resize_load
from opfuse.codegen.select import emit_concat
from opfuse.codegen.source import SourceBuffer, float_literal
from opfuse.graph import Graph, Node
from opfuse.ir.index_map import IndexMap
from opfuse.ir.ops import FLOAT_TYPES, ONNX_CASTS, WINDOW_OPS, window_input
from opfuse.ir.queries import scalar_constant
from opfuse.ir.resize import ResizeGather


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
    tables = table_args(tensor_inputs, views)  # Gathers the loads compute (pad_gather)
    args = (
        [f"in{i}" for i in range(len(tensor_inputs))]
        + list(tables.values())
        + [f"out{i}" for i in range(len(outputs))]
    )
    buf = SourceBuffer()
    module_title(buf, f"pointwise kernel {kernel_id} for group {group_id}.")
    buf.line(f"# {len(group_nodes)} ONNX nodes, {numel} elements, shape {list(shape)}:")
    for n in group_nodes:
        buf.line(node_comment(n))
    for i, name in enumerate(tensor_inputs):
        g = views.get(name)
        if isinstance(g, ResizeGather):
            resized = [a.out_size for a in g.axes]
            buf.line(
                f"# in{i}: resized {resized} by gather loads from its input {[a.in_size for a in g.axes]}"
            )
        elif isinstance(g, IndexMap):
            ops = " <- ".join(step.op for step in g.steps)
            buf.line(f"# in{i}: {list(g.shape)} loaded through {ops} from {list(g.base_shape)}")
    concat_comments(buf, graph, group_nodes, slot)
    module_imports(buf)
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
            isinstance(v, ResizeGather | IndexMap) and v.extent() >= 2**31 - 1 for v in views.values()
        )
        index_type = "tl.int64" if wide else "tl.int32"
        reads = _pointwise_loads(
            buf, graph, tensor_inputs, selected_only, views, shape, index_type, regs, tables
        )
        for name, lit in literals.items():
            regs[name] = lit
        for j, n in enumerate(group_nodes):
            _pointwise_node(buf, graph, n, f"v{j}", regs, reads, shape, slot, views, index_type, tables)
        for i, name in enumerate(outputs):
            buf.line(f"tl.store(out{i} + offs, {regs[name]}.to(out{i}.dtype.element_ty), mask=mask)")
    buf.line()
    buf.line()
    buf.line(f"def launch({', '.join(args)}, config=None):")
    with buf.indent():
        buf.line("c = CONFIG if config is None else config")
        buf.line(f'{fn}[(triton.cdiv(N, c["BLOCK"]),)]({", ".join(args)}, N, **c)')
    passed = [views[x].base if x in views else x for x in tensor_inputs] + list(tables)
    return KernelSource(
        kernel_id, "pointwise", buf.getvalue(), passed, list(outputs), {"BLOCK": 1024, "num_warps": 4}
    )


_Read = tuple[int, tuple[int, ...], tuple[int, ...] | None, str]  # slot, shape, strides, offset


def _pointwise_loads(
    buf: SourceBuffer,
    graph: Graph,
    tensor_inputs: list[str],
    selected_only: set[str],
    views: dict[str, Any],
    shape: tuple[int, ...],
    index_type: str,
    regs: dict[str, str],
    tables: dict[str, str] | None = None,
) -> dict[str, _Read]:
    """Each tensor input loaded once at the output's offsets (broadcast, through a folded view,
    or gathered from a Resize's input), but those only a Concat's selection reads; returns how
    each was read, for the window ops that read it again at other offsets."""
    reads: dict[str, _Read] = {}
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
        if isinstance(view, IndexMap):
            lines = []
            at = (
                "offs"
                if tuple(view.shape) == tuple(shape)
                else f"({broadcast_index(view.shape, shape) or 0})"
            )
            value = index_map_load(f"m{i}", f"in{i}", view, lines, at, tables=tables)
            for text in lines:
                buf.line(text)
            buf.line(f"x{i} = {value}")
            regs[name] = f"x{i}"
            continue
        in_shape = tuple(view.shape if view is not None else graph.spec(name).shape)
        strides = tuple(view.strides) if view is not None else None
        idx = broadcast_index(in_shape, shape, strides)
        offset = f" + {view.offset}" if view is not None and view.offset else ""  # a Split output
        # Floats compute in float32; integers and booleans stay as they are (exact arithmetic).
        floating = graph.spec(name).dtype in FLOAT_TYPES
        up, zero = (".to(tl.float32)", "0.0") if floating else ("", "0")
        if idx is None:
            buf.line(f"x{i} = tl.load(in{i}{offset}){up}")
        else:
            buf.line(f"x{i} = tl.load(in{i} + {idx}{offset}, mask=mask, other={zero}){up}")
        regs[name] = f"x{i}"
        reads[name] = (i, in_shape, strides, offset)
    return reads


def _pointwise_node(
    buf: SourceBuffer,
    graph: Graph,
    n: Node,
    v: str,
    regs: dict[str, str],
    reads: dict[str, _Read],
    shape: tuple[int, ...],
    slot: dict[str, int],
    views: dict[str, Any],
    index_type: str,
    tables: dict[str, str],
) -> None:
    """Node `n` as register `v`: a window op (LRN), a Concat's selection, or its emitter."""
    if n.op_type in WINDOW_OPS:
        x = window_input(n)
        address = functools.partial(_address, *reads[x], shape)
        expr = _emit_window(buf, n, v, regs[x], address, shape)
        buf.line(f"{v} = {expr}  # {n.op_type}")
    elif n.op_type == "Concat":
        emit_concat(buf, graph, n, v, slot, views, index_type, tables=tables)
    elif n.op_type == "Resize":  # a Resize alone: its input's loads gather the resized value
        buf.line(f"{v} = {regs[n.inputs[0]]}  # Resize")
    else:
        args_expr = [regs[x] if x else "" for x in n.inputs]
        to_float = n.op_type == "Cast" and ONNX_CASTS[int(n.attrs["to"])] in FLOAT_TYPES
        if to_float and graph.spec(n.inputs[0]).dtype not in FLOAT_TYPES:  # an integer or boolean
            args_expr[0] = f"{args_expr[0]}.to(tl.float32)"
        consts = [scalar_constant(graph, x) if x else None for x in n.inputs]
        buf.line(f"{v} = {EMITTERS[n.op_type](args_expr, n, consts)}  # {n.op_type}")
    regs[n.outputs[0]] = v


def _address(
    i: int,
    in_shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    offset: str,
    shape: tuple[int, ...],
    at: str,
) -> str:
    """The address of kernel input `in{i}` at output offsets `at`."""
    return f"in{i} + {broadcast_index(in_shape, shape, strides, at) or 0}{offset}"


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
    return f"({centre} / {pow_expr([base], node, [None, beta])})"
