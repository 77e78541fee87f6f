"""Triton max and average pooling over NHWC tensors (`opfuse.MaxPoolNHWC`,
`opfuse.AveragePoolNHWC`), with the pointwise epilogue.

A program takes a [pixels, channels] tile of the output; each window position loads a tile of the
input whose channels are contiguous, and keeps the running maximum (or sum) in registers. For a
max pool, padding and windows that run past the input (ceil_mode) load -inf, so they never win, as
in ONNX. An average pool loads 0 there and divides by the taps that count, as onnxruntime does:
those inside the input (count_include_pad=0) or inside the padded input (1; the ceil_mode overhang
past the end pad never counts).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opfuse.codegen.epilogue import emit_launch, emit_loads, emit_nodes, emit_stores
from opfuse.codegen.fragments import (
    KernelSource,
    broadcast_offset,
    module_imports,
    module_title,
    node_comment,
    split_literals,
)
from opfuse.codegen.source import SourceBuffer, channel_run, guarded_load
from opfuse.codegen.window import PoolTaps, Window
from opfuse.graph import Graph, Node
from opfuse.ir.queries import next_pow2
from opfuse.ir.support import pool_params


def generate_pool(
    kernel_id: str,
    anchor: Node,
    epilogue: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    group_id: str,
) -> KernelSource:
    p = pool_params(graph, anchor)
    taps = PoolTaps.of(graph, anchor)
    win, average, counted = taps.window, taps.average, taps.counted
    out_shape = graph.spec(anchor.outputs[0]).shape
    m, c = p["N"] * p["OH"] * p["OW"], p["C"]
    x_name = anchor.inputs[0]
    epilogue_reads = {x for node in epilogue for x in node.inputs if x}
    literals, extra = split_literals(graph, inputs, skip={x_name} - epilogue_reads)
    args = ["x"] + [f"in{i}" for i in range(len(extra))] + [f"out{i}" for i in range(len(outputs))]
    buf = SourceBuffer()
    module_title(
        buf, f"{'average' if average else 'max'}-pool kernel {kernel_id} for group {group_id} (NHWC)."
    )
    buf.line(
        f"# x [{p['N']}, {p['H']}, {p['W']}, {c}] window {p['KH']}x{p['KW']} stride {p['SH']}x{p['SW']} "
        f"-> {list(out_shape)}"
    )
    if counted is not None:
        top, bottom, left, right = counted
        buf.line(
            f"# averaged over the taps inside input rows [{top}, {bottom}) and columns [{left}, {right})"
        )
    buf.line(node_comment(anchor, "anchor", op="AveragePool" if average else "MaxPool"))
    for node in epilogue:
        buf.line(node_comment(node, "epilogue"))
    module_imports(buf)
    config: dict[str, Any] = {"BLOCK_M": 32, "BLOCK_N": min(64, max(16, next_pow2(c))), "num_warps": 4}
    interp = {"BLOCK_M": min(256, max(16, next_pow2(m))), "BLOCK_N": min(128, max(16, next_pow2(c)))}
    buf.line(f"CONFIG = {config!r}")
    buf.line(f"INTERPRETER_CONFIG = {interp!r}")
    buf.line()
    buf.line()
    buf.line("@triton.jit")
    buf.line(f"def fused_pool({', '.join(args)}, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):")
    regs: dict[str, str] = {}
    with buf.indent():
        buf.line("rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)")
        buf.line("rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)")
        buf.line(f"img = rm // {p['OH'] * p['OW']}")
        buf.line(f"oh = (rm // {p['OW']}) % {p['OH']}")
        buf.line(f"ow = rm % {p['OW']}")
        buf.line(f"row_ok = rm < {m}")
        buf.line(f"col_ok = rn < {c}")
        taps.emit_start(buf, "acc", "BLOCK_N", "taps", "(BLOCK_M,)")
        with _tap_loop(buf, win, p, taps.fill):
            taps.emit_tap(buf, "acc", "v", "taps", "ih", "iw")
        taps.emit_mean(buf, "acc", "taps[:, None]")
        buf.line("cols = rn[None, :]")
        buf.line("mask = row_ok[:, None] & col_ok[None, :]")
        buf.line(f"dst = rm[:, None] * {c} + cols")
        coords = {0: "img[:, None]", 1: "oh[:, None]", 2: "ow[:, None]", 3: "cols"}

        def index_of(name: str) -> tuple[str | None, str]:
            if tuple(graph.spec(name).shape) == tuple(out_shape):
                return "dst", "mask"
            return broadcast_offset(graph.spec(name).shape, coords), "mask"

        emit_loads(buf, extra, index_of, regs)
        regs.update(literals)
        regs[anchor.outputs[0]] = "acc"
        emit_nodes(buf, graph, epilogue, regs)
        emit_stores(buf, outputs, regs, "dst")
    emit_launch(buf, "fused_pool", args, f'(triton.cdiv({m}, c["BLOCK_M"]), triton.cdiv({c}, c["BLOCK_N"]))')
    return KernelSource(kernel_id, "pool", buf.getvalue(), [x_name, *extra], list(outputs), config)


@contextmanager
def _tap_loop(buf: SourceBuffer, win: Window, p: dict[str, int], fill: str) -> Iterator[None]:
    """The loop over the window's positions, each loading v (`fill` outside the input) at input
    pixel (ih, iw); the body follows in the loop."""
    c = p["C"]
    buf.line(f"for t in tl.static_range(0, {win.taps}):")
    with buf.indent():
        win.emit_tap(buf, win.origin("oh", "ow"), "t", "row_ok", ("ih", "iw", "ok"))
        buf.line(f"base = ((img * {p['H']} + ih) * {p['W']} + iw) * {c}")
        buf.line("v_ok = ok[:, None] & col_ok[None, :]")
        buf.line(f"v = {guarded_load('x', 'base[:, None] + rn[None, :]', 'v_ok', fill, channel_run(c))}")
        yield
