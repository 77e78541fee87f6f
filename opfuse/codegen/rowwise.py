"""Triton source for a row group: reductions over trailing axes with their prologue and epilogue.

The shape splits at the first reduced axis: leading dims index rows, the trailing dims (flattened)
are one row of R elements, held in one program's registers. The program runs the pointwise
prologue, any number of reductions over the row (Softmax, LogSoftmax, LayerNormalization,
InstanceNormalization, ReduceMean/Sum/Max/Min, GlobalAverage/MaxPool), and the pointwise epilogue,
with one load of each input and one store of each output. Values are either row vectors (the full
shape) or per-row scalars (the reduced shape).
"""

from __future__ import annotations

import numpy as np

from opfuse.codegen.pointwise import EMITTERS, KernelSource, scalar_constant, split_literals
from opfuse.codegen.source import SourceBuffer, comment_text, float_literal
from opfuse.graph import Graph, Node

ROW_REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"})
GLOBAL_POOLS = frozenset({"GlobalAveragePool", "GlobalMaxPool"})
ROW_OPS = (
    ROW_REDUCTIONS | GLOBAL_POOLS | {"Softmax", "LogSoftmax", "LayerNormalization", "InstanceNormalization"}
)
MAX_ROW = 16384  # a row lives in one program's registers


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def matmul_tile_config(m: int, n: int, k: int) -> dict[str, int]:
    """A starting tile for an M×N×K product on the GPU, before any tuning: 64×64×32 (measured the
    better default on the H200 for the zoo), shrunk where the problem is smaller (batch 1)."""
    bm = min(64, max(16, next_pow2(m)))
    bn = min(64, max(32, next_pow2(n)))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}


def reduced_axes(graph: Graph, node: Node) -> list[int] | None:
    """The axes a row op reduces over (normalized), or None when they are not constant."""
    rank = len(graph.spec(node.inputs[0]).shape)
    if node.op_type in ROW_REDUCTIONS:
        if len(node.inputs) > 1 and node.inputs[1]:
            arr = graph.constants.get(node.inputs[1])
            if arr is None:
                return None
            axes = [int(a) for a in np.asarray(arr).ravel()]
        else:
            axes = [int(a) for a in node.attrs.get("axes", [])]
        if not axes:
            return [] if node.attrs.get("noop_with_empty_axes", 0) else list(range(rank))
        return sorted(a % rank for a in axes)
    if node.op_type == "LayerNormalization":
        axis = int(node.attrs.get("axis", -1)) % rank
        return list(range(axis, rank))
    if node.op_type in GLOBAL_POOLS or node.op_type == "InstanceNormalization":
        return list(range(2, rank))
    return [int(node.attrs.get("axis", -1)) % rank]


def row_split(graph: Graph, node: Node) -> int:
    """The first reduced axis: dims before it index rows, dims from it on form one row."""
    axes = reduced_axes(graph, node)
    assert axes
    return axes[0]


def row_op_reason(graph: Graph, node: Node) -> str | None:
    """None if `node` is a reduction a row kernel can compute, else why not."""
    if node.op_type not in ROW_OPS:
        return f"{node.op_type} is not a row reduction"
    x = graph.spec(node.inputs[0])
    if x.dtype not in ("float32", "float16", "bfloat16"):
        return f"input of type {x.dtype}"
    axes = reduced_axes(graph, node)
    rank = len(x.shape)
    if axes is None:
        return "the reduction axes are not constant"
    if not axes or axes != list(range(axes[0], rank)):
        return f"reduces over axes {axes}: row kernels reduce over trailing axes only"
    r = int(np.prod(x.shape[axes[0] :], dtype=np.int64))
    if r > MAX_ROW:
        return f"a row of {r} elements does not fit one program (limit {MAX_ROW})"
    if (
        node.op_type in ("LayerNormalization", "InstanceNormalization")
        and len([o for o in node.outputs if o]) > 1
    ):
        return f"the extra outputs of {node.op_type} are used"
    if node.op_type == "LayerNormalization":
        for p in node.inputs[1:3]:
            if p and graph.spec(p).shape not in (tuple(x.shape[axes[0] :]), ()):
                return "scale or bias does not cover the normalized axes"
    return None


def _input_expr(
    shape: tuple[int, ...], full: tuple[int, ...], split: int | None = None
) -> tuple[str | None, bool]:
    """(index expression, is_vector) for loading an input broadcast to `full` from row `row`.

    Dims before `split` (default: the last axis) index rows; the trailing dims are the row,
    addressed by `cols`. An input either covers the whole row or is constant along it.
    """
    rank = len(full)
    k = rank - 1 if split is None else split
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    strides = [int(np.prod(padded[d + 1 :], dtype=np.int64)) for d in range(rank)]
    row_strides = [int(np.prod(full[d + 1 : k], dtype=np.int64)) for d in range(k)]
    terms = []
    for d in range(k):
        if padded[d] == 1:
            continue
        coord = f"((row // {row_strides[d]}) % {full[d]})" if row_strides[d] > 1 else f"(row % {full[d]})"
        terms.append(f"{coord} * {strides[d]}" if strides[d] != 1 else coord)
    trailing, whole = padded[k:], tuple(full[k:])
    vector = trailing == whole and int(np.prod(whole, dtype=np.int64)) != 1
    if not vector and any(t != 1 for t in trailing):
        raise ValueError(f"input of shape {shape} varies along only part of the row {whole}")
    if vector:
        terms.append("cols")
    if not terms:
        return None, False
    return " + ".join(terms), vector


def row_input_reason(shape: tuple[int, ...], full: tuple[int, ...], split: int) -> str | None:
    try:
        _input_expr(shape, full, split)
    except ValueError as exc:
        return str(exc)
    return None


def generate_rowwise(
    kernel_id: str,
    nodes: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    group_id: str,
    full: tuple[int, ...],
    split: int | None = None,
) -> KernelSource:
    k = len(full) - 1 if split is None or split < 0 else split
    rows = int(np.prod(full[:k], dtype=np.int64))
    r = int(np.prod(full[k:], dtype=np.int64))
    block = next_pow2(r)
    fn = f"{kernel_id}_rowwise"
    # Reduction axes are compile-time facts already in the code, not data to load.
    axes_only = {
        n.inputs[1] for n in nodes if n.op_type in ROW_REDUCTIONS and len(n.inputs) > 1 and n.inputs[1]
    }
    axes_only -= {x for n in nodes if n.op_type not in ROW_REDUCTIONS for x in n.inputs}
    literals, tensor_inputs = split_literals(graph, inputs, skip=axes_only)
    args = [f"in{i}" for i in range(len(tensor_inputs))] + [f"out{i}" for i in range(len(outputs))]
    buf = SourceBuffer()
    buf.line(f"# Generated by opfuse: row kernel {kernel_id} for group {group_id}.")
    buf.line(f"# {len(nodes)} ONNX nodes over {rows} rows of {r} elements (shape {list(full)}):")
    for n in nodes:
        buf.line(f"#   {n.id}: {n.op_type} {comment_text(n.name)}")
    buf.line("import triton")
    buf.line("import triton.language as tl")
    buf.line()
    buf.line(f"ROWS = {rows}")
    buf.line(f"R = {r}")
    warps = 4 if block <= 2048 else 8
    buf.line(f'CONFIG = {{"BLOCK_R": {block}, "num_warps": {warps}}}')
    buf.line(f'INTERPRETER_CONFIG = {{"BLOCK_R": {block}}}')
    buf.line()
    buf.line()
    buf.line("@triton.jit")
    buf.line(f"def {fn}({', '.join(args)}, BLOCK_R: tl.constexpr):")
    regs: dict[str, str] = {}
    with buf.indent():
        buf.line("row = tl.program_id(0).to(tl.int64)")
        buf.line("cols = tl.arange(0, BLOCK_R)")
        buf.line(f"cmask = cols < {r}")
        per_channel = {x for n in nodes if n.op_type == "InstanceNormalization" for x in n.inputs[1:3] if x}
        for i, name in enumerate(tensor_inputs):
            if name in per_channel:  # InstanceNormalization scale/bias: one value per channel (axis 1)
                buf.line(f"x{i} = tl.load(in{i} + (row % {full[1]})).to(tl.float32)")
                regs[name] = f"x{i}"
                continue
            idx, vector = _input_expr(graph.spec(name).shape, full, k)
            if idx is None:
                buf.line(f"x{i} = tl.load(in{i}).to(tl.float32)")
            elif vector:
                buf.line(f"x{i} = tl.load(in{i} + {idx}, mask=cmask, other=0.0).to(tl.float32)")
            else:
                buf.line(f"x{i} = tl.load(in{i} + {idx}).to(tl.float32)")
            regs[name] = f"x{i}"
        regs.update(literals)
        for j, n in enumerate(nodes):
            a = [regs.get(x, "") if x else "" for x in n.inputs]
            v = f"v{j}"
            if n.op_type in EMITTERS:
                consts = [scalar_constant(graph, x) if x else None for x in n.inputs]
                buf.line(f"{v} = {EMITTERS[n.op_type](a, n, consts)}  # {n.id} {n.op_type}")
            elif n.op_type in ("ReduceSum", "ReduceMean", "GlobalAveragePool"):
                buf.line(f"{v} = tl.sum(tl.where(cmask, {a[0]}, 0.0), axis=0)  # {n.id} {n.op_type}")
                if n.op_type != "ReduceSum":
                    buf.line(f"{v} = {v} / {r}.0")
            elif n.op_type in ("ReduceMax", "ReduceMin", "GlobalMaxPool"):
                fn_name, pad = (
                    ("tl.min", 'float("inf")') if n.op_type == "ReduceMin" else ("tl.max", 'float("-inf")')
                )
                buf.line(f"{v} = {fn_name}(tl.where(cmask, {a[0]}, {pad}), axis=0)  # {n.id} {n.op_type}")
            elif n.op_type in ("Softmax", "LogSoftmax"):
                buf.line(
                    f'{v}_max = tl.max(tl.where(cmask, {a[0]}, float("-inf")), axis=0)  # {n.id} {n.op_type}'
                )
                buf.line(f"{v}_exp = tl.exp({a[0]} - {v}_max)")
                buf.line(f"{v}_sum = tl.sum(tl.where(cmask, {v}_exp, 0.0), axis=0)")
                if n.op_type == "Softmax":
                    buf.line(f"{v} = {v}_exp / {v}_sum")
                else:
                    buf.line(f"{v} = {a[0]} - {v}_max - tl.log({v}_sum)")
            elif n.op_type == "InstanceNormalization":
                eps = float_literal(float(n.attrs.get("epsilon", 1e-5)))
                channels = full[1]
                buf.line(
                    f"{v}_mean = tl.sum(tl.where(cmask, {a[0]}, 0.0), axis=0) / {r}.0  # {n.id} InstanceNormalization"
                )
                buf.line(f"{v}_diff = tl.where(cmask, {a[0]} - {v}_mean, 0.0)")
                buf.line(f"{v}_rstd = 1.0 / tl.sqrt(tl.sum({v}_diff * {v}_diff, axis=0) / {r}.0 + {eps})")
                buf.line(f"{v} = {v}_diff * {v}_rstd * {a[1]} + {a[2]}")
                del channels
            elif n.op_type == "LayerNormalization":
                eps = float_literal(float(n.attrs.get("epsilon", 1e-5)))
                buf.line(
                    f"{v}_mean = tl.sum(tl.where(cmask, {a[0]}, 0.0), axis=0) / {r}.0  # {n.id} LayerNormalization"
                )
                buf.line(f"{v}_diff = tl.where(cmask, {a[0]} - {v}_mean, 0.0)")
                buf.line(f"{v}_rstd = 1.0 / tl.sqrt(tl.sum({v}_diff * {v}_diff, axis=0) / {r}.0 + {eps})")
                expr = f"{v}_diff * {v}_rstd"
                if len(a) > 1 and a[1]:
                    expr = f"({expr}) * {a[1]}"
                if len(a) > 2 and a[2]:
                    expr = f"{expr} + {a[2]}"
                buf.line(f"{v} = {expr}")
            else:  # pragma: no cover - the planner admits only the ops above
                raise AssertionError(n.op_type)
            regs[n.outputs[0]] = v
        for i, name in enumerate(outputs):
            spec = graph.spec(name)
            if spec.numel == rows * r and r != 1:
                buf.line(
                    f"tl.store(out{i} + row * {r} + cols, {regs[name]}.to(out{i}.dtype.element_ty), mask=cmask)"
                )
            else:
                buf.line(f"tl.store(out{i} + row, {regs[name]}.to(out{i}.dtype.element_ty))")
    buf.line()
    buf.line()
    buf.line(f"def launch({', '.join(args)}, config=None):")
    with buf.indent():
        buf.line("c = CONFIG if config is None else config")
        buf.line(f"{fn}[(ROWS,)]({', '.join(args)}, **c)")
    return KernelSource(
        kernel_id,
        "rowwise",
        buf.getvalue(),
        tensor_inputs,
        list(outputs),
        {"BLOCK_R": block, "num_warps": warps},
    )
