"""Two memory-bound 1x1 convolutions back to back in one Triton kernel (squeeze-excitation's
reduce and expand: GEMVs over the channels of a pooled [N, 1, 1, C] tensor).

At these sizes each product reads its weight once and does M (the batch) multiply-adds per weight
element: far below the GPU's ridge point, so two launches cost more than the arithmetic. Each
program computes the whole hidden vector h = act1(x @ W1 + b1) for its rows (W1 is small: the
planner caps it, since every program along the output columns reads it again, from L2), rounds it
to the model's type as the unfused plan would store it, and then its tile of act2(h @ W2 + b2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opfuse.codegen.epilogue import (
    TileRead,
    dot_precision,
    dot_step,
    emit_dot,
    emit_launch,
    emit_loads,
    emit_nodes,
    emit_stores,
    pooled_a_tile,
    pooled_pixels,
)
from opfuse.codegen.fragments import (
    KernelSource,
    kernel_head,
    module_imports,
    module_title,
    node_comment,
    split_literals,
)
from opfuse.codegen.source import SourceBuffer, guarded_load, power_run
from opfuse.graph import Graph, Node
from opfuse.ir.queries import next_pow2


def hidden_width(graph: Graph, first: Node) -> int:
    """The hidden vector's register width: its channels, padded to a power of two (at least 16)."""
    out = graph.spec(first.outputs[0])
    return max(16, next_pow2(out.numel // out.shape[0]))


def _epilogue_literals(graph: Graph, anchor: Node, epilogue: list[Node]) -> tuple[dict[str, str], list[str]]:
    """The epilogue's one-element constants as literals, and any other tensor it would load."""
    inside = {anchor.outputs[0]} | {o for node in epilogue for o in node.outputs}
    return split_literals(graph, [x for node in epilogue for x in node.inputs if x], skip=inside)


def generate_chain(
    kernel_id: str,
    anchors: tuple[Node, Node],
    epilogues: tuple[list[Node], list[Node]],
    outputs: list[str],
    graph: Graph,
    group_id: str,
    precision: str,
    prologue: list[Node] | None = None,
    inputs: list[str] | None = None,
) -> KernelSource:
    """`prologue`: a global average pool whose mean is the first GEMV's input (pointwise ops, then
    a mean over the pixels: fusion/rules/pooled_gemm.py), computed on the input tiles; `inputs`:
    the group's inputs, of which the prologue loads those it reads."""
    first, second = anchors
    prologue = prologue or []
    x_name, w1_name, w2_name = first.inputs[0], first.inputs[1], second.inputs[1]
    b1 = first.inputs[2] if len(first.inputs) > 2 else ""
    b2 = second.inputs[2] if len(second.inputs) > 2 else ""
    # [N, 1, 1, C] or [N, C, 1, 1]: [N, C] in memory either way.
    m, c = graph.spec(x_name).shape[0], graph.spec(x_name).numel // graph.spec(x_name).shape[0]
    hidden = graph.spec(first.outputs[0]).numel // m
    n = graph.spec(second.outputs[0]).numel // m
    width = hidden_width(graph, first)
    dtype = graph.spec(x_name).dtype
    prec = dot_precision(dtype, precision)
    lit1, extra1 = _epilogue_literals(graph, first, epilogues[0])
    lit2, extra2 = _epilogue_literals(graph, second, epilogues[1])
    if extra1 or extra2:
        raise ValueError("a chained GEMV's epilogue reads only its accumulator and literals")
    biases = [b for b in (b1, b2) if b]
    pool = _Pool.read(graph, prologue, inputs or []) if prologue else None
    x_args, x_inputs = (
        (["x"], [x_name]) if pool is None else ([f"p{i}" for i in range(len(pool.loads))], pool.loads)
    )
    args = (
        [*x_args, "w1", "w2"]
        + [f"in{i}" for i in range(len(biases))]
        + [f"out{i}" for i in range(len(outputs))]
    )
    buf = SourceBuffer()
    module_title(buf, f"chained GEMV kernel {kernel_id} for group {group_id} (1x1 maps).")
    buf.line(f"# x [{m}, {c}] -> h [{m}, {hidden}] -> y [{m}, {n}]")
    for node in prologue:
        buf.line(node_comment(node, "prologue: x is the pool computed on its tiles"))
    for anchor, epilogue, role in ((first, epilogues[0], "first"), (second, epilogues[1], "second")):
        buf.line(node_comment(anchor, f"{role} anchor", op="Conv"))
        for node in epilogue:
            buf.line(node_comment(node, "its epilogue"))
    module_imports(buf)
    config: dict[str, Any] = {
        "BLOCK_M": 16,
        "BLOCK_N": min(64, max(32, next_pow2(n))),
        "BLOCK_K": min(64, max(16, next_pow2(c))),
        "num_warps": 4,
        "num_stages": 2,
        "UPCAST": False,
    }
    flags: dict[str, Any] = {}
    if pool is not None:  # pixels of the pool summed per step (a third tile dimension)
        config["BLOCK_P"] = min(64, next_pow2(pool.pixels))
        flags["BLOCK_P"] = next_pow2(pool.pixels)
    kernel_head(buf, "fused_chain", args, config, m, n, c, dtype, flags)
    with buf.indent():
        _hidden_tile(buf, graph, first, epilogues[0], b1, lit1, (m, c, hidden, width), prec, pool)
        _output_tile(buf, graph, second, epilogues[1], outputs, b2, len(biases), lit2, (n, hidden), prec)
    emit_launch(buf, "fused_chain", args, f'(triton.cdiv({m}, c["BLOCK_M"]), triton.cdiv({n}, c["BLOCK_N"]))')
    return KernelSource(
        kernel_id, "chain", buf.getvalue(), [*x_inputs, w1_name, w2_name, *biases], list(outputs), config
    )


@dataclass
class _Pool:
    """The pool a chain computes its input from: the prologue, the tensors it loads (`p0`, ...)
    and the one-element constants it reads as literals, and the pixels it averages."""

    prologue: list[Node]
    loads: list[str]
    literals: dict[str, str]
    pixels: int

    @staticmethod
    def read(graph: Graph, prologue: list[Node], inputs: list[str]) -> _Pool:
        pool = prologue[-1]
        axes = pool.inputs[1] if len(pool.inputs) > 1 else ""
        reads = [x for x in inputs if x != axes and any(x in node.inputs for node in prologue)]
        literals, loads = split_literals(graph, reads)
        return _Pool(prologue, loads, literals, pooled_pixels(graph, pool))


def _hidden_tile(
    buf: SourceBuffer,
    graph: Graph,
    first: Node,
    epilogue: list[Node],
    b1: str,
    literals: dict[str, str],
    dims: tuple[int, int, int, int],
    prec: str,
    pool: _Pool | None,
) -> None:
    """The first GEMV over the program's rows and every hidden column (`h`, in registers), its bias
    and epilogue, rounded as a stored h would be. Its input tiles are loaded, or (`pool`) computed
    as the mean over the pixels of the pool's input."""
    m, c, hidden, width = dims
    regs: dict[str, str] = {}
    buf.line("rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)")
    buf.line("rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)")
    buf.line(f"rh = tl.arange(0, {width})")
    buf.line("rk = tl.arange(0, BLOCK_K)")
    buf.line(f"row_ok = rm < {m}")
    buf.line(f"h_ok = rh < {hidden}")
    buf.line(f"acc = tl.zeros((BLOCK_M, {width}), dtype=tl.float32)")
    buf.line(f"for k0 in range(0, {c}, BLOCK_K):")
    with buf.indent():
        buf.line("kk = k0 + rk")
        buf.line(f"k_ok = kk < {c}")
        if pool is None:
            x_at = f"rm[:, None] * {c} + kk[None, :]"
            buf.line(
                f"a_tile = {guarded_load('x', x_at, 'row_ok[:, None] & k_ok[None, :]', run=power_run(c))}"
            )
        else:
            pooled_a_tile(buf, graph, pool.prologue, pool.loads, pool.literals, m, c, "w1.dtype.element_ty")
        w1_tile = TileRead("w1", f"rh[None, :] * {c} + kk[:, None]", power_run(c))
        dot_step(buf, w1_tile, "k_ok[:, None] & h_ok[None, :]", prec)
    buf.line("mask = row_ok[:, None] & h_ok[None, :]")
    if b1:
        emit_loads(buf, [b1], lambda name: ("rh[None, :]", "h_ok[None, :]"), regs)
        buf.line(f"acc = acc + {regs[b1]}")
    regs.update(literals)
    regs[first.outputs[0]] = "acc"
    emit_nodes(buf, graph, epilogue, regs)
    h_value = epilogue[-1].outputs[0] if epilogue else first.outputs[0]
    # Padding columns are zero (an epilogue may map 0 elsewhere), rounded as a stored h would be.
    model_type = "x.dtype.element_ty" if pool is None else "w1.dtype.element_ty"
    buf.line(f"h = tl.where(mask, {regs[h_value]}, 0.0).to({model_type})")


def _output_tile(
    buf: SourceBuffer,
    graph: Graph,
    second: Node,
    epilogue: list[Node],
    outputs: list[str],
    b2: str,
    biases: int,
    literals: dict[str, str],
    dims: tuple[int, int],
    prec: str,
) -> None:
    """The second GEMV, h times the program's output columns, its bias, epilogue and stores."""
    n, hidden = dims
    buf.line(f"col_ok = rn < {n}")
    buf.line(
        f"w_tile = tl.load(w2 + rn[None, :] * {hidden} + rh[:, None], mask=h_ok[:, None] & col_ok[None, :], other=0.0)"
    )
    buf.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
    emit_dot(buf, "acc", "h", "w_tile", prec)
    buf.line("cols = rn[None, :]")
    buf.line("mask = row_ok[:, None] & col_ok[None, :]")
    regs: dict[str, str] = {}
    if b2:
        # The second bias is the kernel's last tensor input: its register is named after it.
        buf.line(f"xb = tl.load(in{biases - 1} + cols, mask=col_ok[None, :], other=0.0).to(tl.float32)")
        buf.line("acc = acc + xb")
    regs.update(literals)
    regs[second.outputs[0]] = "acc"
    emit_nodes(buf, graph, epilogue, regs)
    buf.line(f"dst = rm[:, None] * {n} + cols")
    emit_stores(buf, outputs, regs, "dst")
