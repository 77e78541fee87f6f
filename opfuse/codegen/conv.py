"""Triton implicit-GEMM convolution (2-D) with a fused epilogue, NCHW or NHWC (NHWC also grouped
and depthwise).

The convolution is a GEMM over M = N*OH*OW output pixels, Cout columns and K = Cin*KH*KW: the A
tile is gathered from the input window on the fly (zero outside the padding), B is the weight
viewed as [Cout, K]. Bias and the pointwise epilogue (activation, residual add) run on the
accumulator tile before its one store.

NHWC (`opfuse.ConvNHWC`, made by the channels-last pass) is the fast form: K runs (kh, kw, cin)
with cin innermost, so an A row is a contiguous run of input channels, the weight is stored
[Cout, KH, KW, Cin], and the output tile is a plain [M, Cout] row-major block. What the NHWC
template reads off its group is `conv_operands.NhwcConv`; its loops are written below, one
function per loop form, from the fragments of `conv_fragments` and `window`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from opfuse.codegen.conv_fragments import (
    concat_stores,
    depthwise_taps,
    padded_load,
    shortcut_loop,
    shortcut_params,
    source_pixel,
    window_position,
    window_prologue,
)
from opfuse.codegen.conv_operands import NhwcConv, nhwc_conv
from opfuse.codegen.epilogue import (
    TileRead,
    accumulator_epilogue,
    computed_a_tile,
    dot_precision,
    dot_step,
    emit_dot,
    emit_launch,
    emit_nodes,
    emit_stores,
    k_loop,
    split_k_launch,
    split_k_reduction,
)
from opfuse.codegen.fragments import (
    KernelSource,
    broadcast_offset,
    kernel_head,
    matmul_tile_config,
    module_imports,
    module_title,
    node_comment,
    split_literals,
    start_split,
)
from opfuse.codegen.resize import resize_load
from opfuse.codegen.source import SourceBuffer, channel_run, comment_text, guarded_load, power_run
from opfuse.codegen.window import PoolTaps, Window
from opfuse.graph import Graph, Node
from opfuse.ir.ops import AVERAGE_POOL_NHWC, MAX_POOL_NHWC, NHWC_CONV
from opfuse.ir.queries import next_pow2
from opfuse.ir.support import INT32_INDEX_LIMIT, SPATIAL_NAMES, conv_axes
from opfuse.ir.views import StridedView

Dot = Callable[[str, str], None]


def _epilogue_index(shape: tuple[int, ...], out: tuple[int, ...]) -> str | None:
    """The offset of an epilogue input of `shape`, broadcast against the channels-first output
    `out` [N, C, *spatial], from the tile's coordinates (img, cols, then o<axis> per spatial axis)."""
    coords = ["img", "cols", *(f"o{a}" for a in SPATIAL_NAMES[len(out) - 2])]
    return broadcast_offset(shape, dict(enumerate(coords)))


def _row_major(coords: list[str], sizes: list[int]) -> str:
    """The offset of `coords` in a row-major block of `sizes` (`i * W + j`)."""
    return broadcast_offset(tuple(sizes), dict(enumerate(coords))) or "0"


def _unflatten(index: str, name: str, d: int, sizes: list[int]) -> str:
    """Coordinate `d` of the row-major `index` over `sizes` (`(i // W) % H`, `i % W`)."""
    inner = int(np.prod(sizes[d + 1 :], dtype=np.int64))
    return (
        f"{name} = {index} % {sizes[d]}"
        if d == len(sizes) - 1
        else f"{name} = ({index} // {inner}) % {sizes[d]}"
    )


def generate_conv(
    kernel_id: str,
    anchor: Node,
    epilogue: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    group_id: str,
    precision: str,
    prologue: list[Node] | None = None,
    views: dict[str, Any] | None = None,
) -> KernelSource:
    """`views`: inputs of a Concat in the epilogue read through folded layout ops ({value:
    StridedView}), from the buffer behind them (fusion.anchors.concat_epilogues)."""
    if anchor.op_type == NHWC_CONV:
        cv = nhwc_conv(anchor, epilogue, inputs, outputs, graph, precision, prologue or [], views or {})
        cv.small_index = cv.largest_offset < INT32_INDEX_LIMIT
        return _generate_conv_nhwc(kernel_id, group_id, cv)
    if prologue or any(node.op_type in ("Concat", "Split") for node in epilogue):
        raise ValueError("a prologue, or a Concat or Split in the epilogue, needs the NHWC template")
    return _generate_conv_nchw(kernel_id, anchor, epilogue, inputs, outputs, graph, group_id, precision)


def _generate_conv_nchw(
    kernel_id: str,
    anchor: Node,
    epilogue: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    group_id: str,
    precision: str,
) -> KernelSource:
    """Channels-first, 1-D to 3-D: M runs (image, output pixel), K (input channel, window tap),
    each spatial axis `a` with its coordinates o<a> (output), k<a> (tap), i<a> (input)."""
    axes = conv_axes(graph, anchor)
    x_shape = graph.spec(anchor.inputs[0]).shape
    batch, cin, cout = x_shape[0], x_shape[1], graph.spec(anchor.inputs[1]).shape[0]
    sizes, outs, kernels = [a.size for a in axes], [a.out for a in axes], [a.kernel for a in axes]
    pixels, taps = int(np.prod(outs)), int(np.prod(kernels))
    out_shape = graph.spec(anchor.outputs[0]).shape
    dtype = graph.spec(anchor.inputs[0]).dtype
    m, n, k = batch * pixels, cout, cin * taps
    x_name, w_name = anchor.inputs[0], anchor.inputs[1]
    b_name = anchor.inputs[2] if len(anchor.inputs) > 2 and anchor.inputs[2] else ""
    epilogue_reads = {x for node in epilogue for x in node.inputs if x}
    # The anchor's operands are loaded tile by tile; the epilogue loads them again only if it reads them.
    operands_only = {x_name, w_name} - epilogue_reads
    literals, extra = split_literals(graph, inputs, skip=operands_only, tensors={b_name} - {""})
    args = ["x", "w"] + [f"in{i}" for i in range(len(extra))] + [f"out{i}" for i in range(len(outputs))]
    buf = SourceBuffer()
    module_title(buf, f"implicit-GEMM conv kernel {kernel_id} for group {group_id}.")
    buf.line(f"# x {[batch, cin, *sizes]} * w {[n, cin, *kernels]} -> {list(out_shape)}; M={m} N={n} K={k}")
    buf.line(node_comment(anchor, "anchor", op="Conv"))
    for node in epilogue:
        buf.line(node_comment(node, "epilogue"))
    module_imports(buf)
    # Split-K (a tuning choice, split_k_candidates): few output tiles and a long K, the 3-D convs
    # of a video network's last stages at batch 1 (a few pixels by 512 channels, K 4608).
    split = "split_k" not in graph.disabled
    flags: dict[str, Any] = {"SPLIT_K": 1} if split else {}
    config: dict[str, Any] = {**matmul_tile_config(m, n, k), "UPCAST": False, **flags}
    if split:
        config["SPLIT_K"] = start_split(m, n, k, config)
    kernel_head(
        buf, "fused_conv", args + (["partials", "lock"] if split else []), config, m, n, k, dtype, flags
    )
    regs: dict[str, str] = {}

    def a_tile() -> None:
        buf.line(f"ci = kk[None, :] // {taps}")
        for d, a in enumerate(axes):
            buf.line(_unflatten("kk[None, :]", f"k{a.name}", d, kernels))
        for a in axes:
            buf.line(f"i{a.name} = o{a.name} * {a.stride} - {a.pad} + k{a.name} * {a.dilation}")
        inside = " & ".join(f"(i{a.name} >= 0) & (i{a.name} < {a.size})" for a in axes)
        buf.line(f"ok = (rm[:, None] < {m}) & (kk[None, :] < {k}) & {inside}")
        pixel = _row_major([f"i{a.name}" for a in axes], sizes)
        a_offset = f"img * {cin * int(np.prod(sizes))} + ci * {int(np.prod(sizes))} + {pixel}"
        buf.line(f"a_tile = {guarded_load('x', a_offset, 'ok')}")

    with buf.indent():
        buf.line("rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)")
        buf.line("rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)")
        buf.line("rk = tl.arange(0, BLOCK_K)")
        buf.line(f"img = rm[:, None] // {pixels}")
        for d, a in enumerate(axes):
            buf.line(_unflatten("rm[:, None]", f"o{a.name}", d, outs))
        buf.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        w_tile = TileRead("w", f"rn[None, :] * {k} + kk[:, None]", power_run(k))
        k_loop(buf, k, n, w_tile, dot_precision(dtype, precision), a_tile, split)
        if split:
            split_k_reduction(buf)
            buf.line("if last:")

    def index_of(name: str) -> tuple[str | None, str]:
        return ("cols" if name == b_name else _epilogue_index(graph.spec(name).shape, out_shape)), "mask"

    def bias(regs: dict[str, str]) -> None:
        if b_name:
            buf.line(f"acc = acc + {regs[b_name]}")

    with buf.indent(), buf.indent() if split else contextlib.nullcontext():
        buf.line("cols = rn[None, :]")
        buf.line(f"mask = (rm[:, None] < {m}) & (cols < {n})")
        accumulator_epilogue(buf, graph, anchor.outputs[0], epilogue, extra, index_of, literals, regs, bias)
        pixel = _row_major([f"o{a.name}" for a in axes], outs)
        buf.line(f"dst = img * {n * pixels} + cols * {pixels} + {pixel}")
        emit_stores(buf, outputs, regs, "dst")
    if split:
        split_k_launch(buf, "fused_conv", args, _conv_tiles(m, n))
    else:
        emit_launch(
            buf, "fused_conv", args, f'(triton.cdiv({m}, c["BLOCK_M"]), triton.cdiv({n}, c["BLOCK_N"]))'
        )
    return KernelSource(kernel_id, "conv", buf.getvalue(), [x_name, w_name, *extra], list(outputs), config)


# -- the NHWC template ------------------------------------------------------------------------


def _conv_tiles(m: int, n: int) -> list[str]:
    """The grid's axes of output tiles (rows, columns) at launch config `c`."""
    return [f'triton.cdiv({m}, c["BLOCK_M"])', f'triton.cdiv({n}, c["BLOCK_N"])']


def _generate_conv_nhwc(kernel_id: str, group_id: str, cv: NhwcConv) -> KernelSource:
    c, m, n = cv.p["C"], cv.m, cv.n
    buf = SourceBuffer()
    _nhwc_header(buf, cv, kernel_id, group_id)
    config: dict[str, Any] = {**matmul_tile_config(m, n, cv.k), "UPCAST": False}
    if not cv.flat and not cv.depthwise:
        # A Concat's inputs are read one K loop each: a block no wider than the narrowest; a
        # grouped conv's, no wider than a group's channels.
        narrowest = min(ch for _, _, ch in cv.pieces) if cv.pieces else c // cv.groups
        config["BLOCK_K"] = min(64, max(16, next_pow2(narrowest)))
    flags: dict[str, Any] = {"UNROLL": False} if cv.depthwise else {"SPLIT_K": 1} if cv.splittable else {}
    config.update(flags)
    if cv.splittable:
        config["SPLIT_K"] = start_split(m, n, c, config)  # K as the kernel's header gives it
    args = cv.args
    scratch = ["partials", "lock"] if cv.splittable else []
    dtype = cv.graph.spec(cv.anchor.inputs[0]).dtype
    kernel_head(buf, "fused_conv", args + scratch, config, m, n, cv.k if cv.flat else c, dtype, flags)

    def dot(a: str, b: str) -> None:
        emit_dot(buf, "acc", a, b, cv.prec)

    with buf.indent():
        _nhwc_prelude(buf, cv)
        _nhwc_k_loops(buf, cv, dot)
        if cv.sx_name and not cv.splittable:
            shortcut_loop(buf, shortcut_params(cv.graph, cv.anchor), n, dot)
        if cv.splittable:
            split_k_reduction(buf)
    if cv.splittable:
        with buf.indent():
            buf.line("if last:")
    with buf.indent(), buf.indent() if cv.splittable else contextlib.nullcontext():
        _nhwc_epilogue(buf, cv)
    if cv.splittable:
        split_k_launch(buf, "fused_conv", args, _conv_tiles(m, n))
    else:
        emit_launch(
            buf, "fused_conv", args, f'(triton.cdiv({m}, c["BLOCK_M"]), triton.cdiv({n}, c["BLOCK_N"]))'
        )
    return KernelSource(kernel_id, "conv", buf.getvalue(), cv.tensor_inputs, list(cv.outputs), config)


def _nhwc_header(buf: SourceBuffer, cv: NhwcConv, kernel_id: str, group_id: str) -> None:
    """The module's title, the comment of each node it computes, and the imports."""
    p, c, graph = cv.p, cv.p["C"], cv.graph
    form = "depthwise conv" if cv.depthwise else "implicit-GEMM conv"
    module_title(buf, f"{form} kernel {kernel_id} for group {group_id} (NHWC).")
    out_shape = graph.spec(cv.anchor.outputs[0]).shape  # [N, OH, OW, CO]
    buf.line(
        f"# x [{p['N']}, {p['H']}, {p['W']}, {c}] * w [{cv.n}, {p['KH']}, {p['KW']}, {c // cv.groups}] -> "
        f"{list(out_shape)}; M={cv.m} N={cv.n} K={cv.k}" + (f", {cv.groups} groups" if cv.grouped else "")
    )
    if cv.x_stride:
        buf.line(
            f"# x read in place: a window of a buffer of {cv.x_stride} channels a pixel, from element {cv.x_offset}"
        )
    window = cv.window
    windows = {MAX_POOL_NHWC: "max pool", AVERAGE_POOL_NHWC: "average pool", NHWC_CONV: "depthwise conv"}
    for node in cv.prologue:
        if window is not None:
            role = f"{windows[window.op_type]} on the input tiles"
        elif cv.pieces:
            role = "its inputs read in turn" if node.op_type == "Concat" else "on each loaded tile"
        elif cv.ops:
            role = "computed on the input tiles"
        else:
            role = "read through" if cv.pad is not None else "input scale"
        buf.line(node_comment(node, f"prologue: {role}"))
    buf.line(node_comment(cv.anchor, "anchor", op="Conv"))
    if cv.sx_name:
        sp = shortcut_params(graph, cv.anchor)
        buf.line(
            f"#   + shortcut: 1x1 conv of xs [{p['N']}, {sp['H']}, {sp['W']}, {sp['C']}] at stride "
            f"({sp['SH']}, {sp['SW']}), summed in a second K loop"
        )
    for node in cv.epilogue:
        buf.line(node_comment(node, "epilogue"))
    if cv.tail is not None:
        buf.line(node_comment(cv.tail, "on the output tile, its windows' rows adjacent"))
    for i, g in cv.gathers.items():
        resized, source = [a.out_size for a in g.axes], [a.in_size for a in g.axes]
        buf.line(f"#   + in{i}: resized {resized} by gather loads from its input {source}")
    if cv.concat is not None:
        buf.line(
            f"#   {cv.concat.id}: Concat {comment_text(cv.concat.name)} (written in place, other inputs copied)"
        )
    if cv.split is not None:
        buf.line(node_comment(cv.split, "each part stored from its columns", op="Split"))
    module_imports(buf)


def _nhwc_prelude(buf: SourceBuffer, cv: NhwcConv) -> None:
    """The program's rows (output pixels) and columns (output channels), the pixel each row's
    window starts at, and the accumulator."""
    p = cv.p
    if cv.depthwise and cv.small_index:
        buf.line("rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)")
    else:
        buf.line("rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)")
    buf.line("rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)")
    buf.line("rk = tl.arange(0, BLOCK_K)")
    if cv.x_offset:
        buf.line(f"x += {cv.x_offset}  # the window's first element in the wider buffer")
    if cv.tail is not None:  # the rows window by window: a window's taps are adjacent rows
        tp = cv.tail_p
        taps = tp["KH"] * tp["KW"]
        buf.line(f"tap = rm % {taps}")
        buf.line(f"win = rm // {taps}")
        buf.line(f"img = win // {tp['OH'] * tp['OW']}")
        buf.line(f"oh = ((win // {tp['OW']}) % {tp['OH']}) * {tp['KH']} + tap // {tp['KW']}")
        buf.line(f"ow = (win % {tp['OW']}) * {tp['KW']} + tap % {tp['KW']}")
        if cv.pieces:  # a 1x1 conv of a Concat reads each row's own pixel of its inputs
            buf.line(f"pix = (img * {p['OH']} + oh) * {p['OW']} + ow")
    else:
        buf.line(f"img = rm // {p['OH'] * p['OW']}")
        buf.line(f"oh = (rm // {p['OW']}) % {p['OH']}")
        buf.line(f"ow = rm % {p['OW']}")
    ih0, iw0 = Window.of(p).origin("oh", "ow")
    buf.line(f"ih0 = {ih0}")
    buf.line(f"iw0 = {iw0}")
    buf.line(f"row_ok = rm < {cv.m}")
    buf.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")


def _nhwc_k_loops(buf: SourceBuffer, cv: NhwcConv, dot: Dot) -> None:
    """The conv's own K loop, in the form its group takes (conv_operands._read_loop_form)."""
    if cv.depthwise:
        _depthwise_loop(buf, cv)
    elif cv.grouped:
        _grouped_loop(buf, cv, dot)
    elif cv.window is not None and not cv.pooled:
        window_prologue(buf, cv.graph, cv.window, cv.prologue[1:], {**cv.literals}, cv.p["C"], cv.n, dot)
    elif cv.pieces:
        _concat_loop(buf, cv, dot)
    elif cv.flat:
        _flat_loop(buf, cv)
    elif cv.segments:
        _segment_loop(buf, cv, dot)
    elif cv.splittable:
        shortcut = shortcut_params(cv.graph, cv.anchor) if cv.sx_name else None
        buf.line("if SPLIT_K == 1:")
        with buf.indent():
            _window_loop(buf, cv, dot)
            if shortcut is not None:
                shortcut_loop(buf, shortcut, cv.n, dot)
        buf.line("else:")
        with buf.indent():
            # Step it of the (window position, channel block) loop, every SPLIT_K-th.
            buf.line(f"blocks = tl.cdiv({cv.p['C']}, BLOCK_K)")
            buf.line(f"for it in range(tl.program_id(2), {cv.p['KH'] * cv.p['KW']} * blocks, SPLIT_K):")
            with buf.indent():
                buf.line("t = it // blocks")
                window_position(buf, cv.tap)
                buf.line("c0 = (it % blocks) * BLOCK_K")
                _channel_block(buf, cv, dot)
            if shortcut is not None:
                shortcut_loop(buf, shortcut, cv.n, dot, split=True)
    else:
        _window_loop(buf, cv, dot)


def _concat_loop(buf: SourceBuffer, cv: NhwcConv, dot: Dot) -> None:
    """A 1x1 conv of a Concat (stride 1, unpadded: each output row is a pixel of every input):
    one K loop per Concat input over its channels, each tile loaded from that input, put through
    the prologue's ops (their per-channel constants at the input's channels in the Concat),
    rounded to the model's type as the stored tensor would be, and multiplied by the weight's
    rows for those channels."""
    c, n = cv.p["C"], cv.n
    concat = cv.prologue[0]
    for i, (_, first, channels) in enumerate(cv.pieces):
        buf.line(f"for c0 in range(0, {channels}, BLOCK_K):")
        with buf.indent():
            buf.line("ci = c0 + rk")
            buf.line(f"c_ok = ci < {channels}")
            buf.line("x_ok = row_ok[:, None] & c_ok[None, :]")
            pixel = "pix" if cv.tail is not None else "rm"  # rows window by window: pixels from coordinates
            offset = f"{pixel}[:, None] * {channels} + ci[None, :]"
            xv = guarded_load(f"xp{i}", offset, "x_ok", run=channel_run(channels))
            buf.line(f"xv = {xv}.to(tl.float32)")
            regs = {**cv.literals, concat.outputs[0]: "xv"}
            for j, const in enumerate(cv.act_consts):
                buf.line(f"k{j} = {guarded_load(f'pc{j}', f'{first} + ci', 'c_ok')}.to(tl.float32)[None, :]")
                regs[const] = f"k{j}"
            emit_nodes(buf, cv.graph, cv.act, regs, prefix="u")
            last = cv.act[-1].outputs[0] if cv.act else concat.outputs[0]
            buf.line(f"a_tile = tl.where(x_ok, {regs[last]}, 0.0).to(xp0.dtype.element_ty)")
            w_at = f"rn[None, :] * {c} + {first} + ci[:, None]"
            w_ok = f"c_ok[:, None] & (rn[None, :] < {n})"
            buf.line(f"b_tile = {guarded_load('w', w_at, w_ok, run=power_run(c, first), axis=0)}")
            dot("a_tile", "b_tile")


def _depthwise_loop(buf: SourceBuffer, cv: NhwcConv) -> None:
    buf.line(f"col_ok = rn < {cv.n}")
    # Index arithmetic is int32 where every offset fits, else int64 with the window loop
    # always unrolled: with int64 offsets and a runtime loop, Triton 3.6 miscompiled this
    # kernel on the H200 (sm_90) at some tiles only (fp32 [64, 64] and [32/64, 32] with
    # 4 warps, fp16 [128, 64]): wrong sums in up to 1588 of 9216 outputs, right in the
    # interpreter. Unrolled (int32 or int64) and runtime-loop int32 were right at every
    # tile tried, fp32 and fp16 (tests/gpu sweeps the tuning candidates). With int32 the
    # unrolled loop (UNROLL) is a tuning choice: its loads issue together, but it holds
    # more registers.
    taps, tap = cv.p["KH"] * cv.p["KW"], cv.tap
    if cv.small_index:
        buf.line("if UNROLL:")
        with buf.indent():
            depthwise_taps(buf, tap, f"tl.static_range(0, {taps})")
        buf.line("else:")
        with buf.indent():
            depthwise_taps(buf, tap, f"range(0, {taps})")
    else:
        depthwise_taps(buf, tap, f"tl.static_range(0, {taps})")


def _grouped_loop(buf: SourceBuffer, cv: NhwcConv, dot: Dot) -> None:
    """A grouped conv (ResNeXt's, RegNet's): output channel n reads the input channels of its
    group n // COG, CIG of them from channel (n // COG) * CIG. The program's columns span groups
    g_lo..g_hi; at each window position its K loop runs over their input channels, and the
    weight's tile is block-diagonal: zero where a channel is not of its column's group. Where
    BLOCK_N divides COG a tile holds one group and multiplies no zeros; narrower groups share a
    tile, at (groups in it) times the multiply-adds and the same loads. Channel blocks start at a
    group's first channel, not at a multiple of BLOCK_K: the loads claim no alignment."""
    p, n, k = cv.p, cv.n, cv.k
    cig, cog = p["C"] // cv.groups, n // cv.groups
    buf.line("n_lo = tl.program_id(1) * BLOCK_N")
    buf.line(f"c_lo = (n_lo // {cog}) * {cig}")
    buf.line(f"c_hi = ((tl.minimum(n_lo + BLOCK_N, {n}) - 1) // {cog} + 1) * {cig}")
    buf.line(f"cg = rn // {cog}")
    buf.line(f"for t in range(0, {p['KH'] * p['KW']}):")
    with buf.indent():
        window_position(buf, cv.tap)
        buf.line("for c0 in range(c_lo, c_hi, BLOCK_K):")
        with buf.indent():
            buf.line("ci = c0 + rk")
            buf.line("a_ok = ok[:, None] & (ci[None, :] < c_hi)")
            padded_load(buf, cv.tap, "base[:, None]", "a_ok")
            w_at = f"rn[None, :] * {k} + t * {cig} + ci[:, None] - cg[None, :] * {cig}"
            w_ok = f"(ci[:, None] // {cig} == cg[None, :]) & (ci[:, None] < c_hi) & (rn[None, :] < {n})"
            dot_step(buf, TileRead("w", w_at, 1), w_ok, cv.prec)


def _flat_loop(buf: SourceBuffer, cv: NhwcConv) -> None:
    """Few input channels: one K loop over (kh, kw, cin), cin = k % C."""
    p, c, k, tap = cv.p, cv.p["C"], cv.k, cv.tap

    def a_tile() -> None:
        buf.line(f"ci = kk % {c}")
        buf.line(f"kh = kk // {c * p['KW']}")
        buf.line(f"kw = (kk // {c}) % {p['KW']}")
        buf.line(f"ih = ih0[:, None] + kh[None, :] * {p['DH']}")
        buf.line(f"iw = iw0[:, None] + kw[None, :] * {p['DW']}")
        buf.line(f"ok = row_ok[:, None] & (kk[None, :] < {k}) & {Window.of(p).inside('ih', 'iw')}")
        if cv.ops:
            _computed_tile(buf, cv, {0: "img[:, None]", 1: "ih", 2: "iw", 3: "ci"}, "ok")
            return
        padded_load(buf, tap, source_pixel(buf, tap, "ih", "iw", "img[:, None]"), "ok")
        if cv.scale:
            _scale_tile(buf, cv, "ok")

    k_loop(buf, k, cv.n, TileRead("w", f"rn[None, :] * {k} + kk[:, None]", power_run(k)), cv.prec, a_tile)


def _window_loop(buf: SourceBuffer, cv: NhwcConv, dot: Dot) -> None:
    buf.line(f"for t in range(0, {cv.p['KH'] * cv.p['KW']}):")
    with buf.indent():
        _window_body(buf, cv, dot)


def _window_body(buf: SourceBuffer, cv: NhwcConv, dot: Dot) -> None:
    """Window position t: its input pixels, then its channels a BLOCK_K block at a time."""
    window_position(buf, cv.tap)
    buf.line(f"for c0 in range(0, {cv.p['C']}, BLOCK_K):")
    with buf.indent():
        _channel_block(buf, cv, dot)


def _segment_loop(buf: SourceBuffer, cv: NhwcConv, dot: Dot) -> None:
    """Output channels whose weights are zero outside a sub-window (a conv merged from
    side-by-side branches: passes/concat_convs.py): a program runs only the window rows and
    columns its tile's channels use (the union over the segments it touches)."""
    kh_, kw_ = cv.p["KH"], cv.p["KW"]
    buf.line("n_lo = tl.program_id(1) * BLOCK_N")
    buf.line(f"n_hi = tl.minimum(n_lo + BLOCK_N, {cv.n})")
    for j, (a, b, r0, r1, c0, c1) in enumerate(cv.segments or []):
        buf.line(f"hit = (n_lo < {b}) & (n_hi > {a})")
        for var, lo, hi, full in (("th", r0, r1, kh_), ("tw", c0, c1, kw_)):
            if j == 0:
                buf.line(f"{var}0 = tl.where(hit, {lo}, {full})")
                buf.line(f"{var}1 = tl.where(hit, {hi}, 0)")
            else:
                buf.line(f"{var}0 = tl.minimum({var}0, tl.where(hit, {lo}, {full}))")
                buf.line(f"{var}1 = tl.maximum({var}1, tl.where(hit, {hi}, 0))")
    buf.line("for th in range(th0, th1):")
    with buf.indent():
        buf.line("for tw in range(tw0, tw1):")
        with buf.indent():
            buf.line(f"t = th * {kw_} + tw")
            _window_body(buf, cv, dot)


def _channel_block(buf: SourceBuffer, cv: NhwcConv, dot: Dot) -> None:
    """Channels c0 .. c0 + BLOCK_K of window position t: the A tile (the input, padded, or the
    pool's maximum or average), then the weight's tile into the accumulator."""
    c, k, n = cv.p["C"], cv.k, cv.n
    buf.line("ci = c0 + rk")
    buf.line(f"a_ok = ok[:, None] & (ci[None, :] < {c})")
    if cv.pooled:
        _pooled_tile(buf, cv, "ih[:, None]", "iw[:, None]", "a_ok")
        if cv.pool_out:
            _store_pooled(buf, cv, "ih[:, None]", "iw[:, None]", "a_ok")
    elif cv.ops:
        _computed_tile(
            buf, cv, {0: "img[:, None]", 1: "ih[:, None]", 2: "iw[:, None]", 3: "ci[None, :]"}, "a_ok"
        )
    else:
        padded_load(buf, cv.tap, "base[:, None]", "a_ok", blocked=True)
    if cv.scale:
        _scale_tile(buf, cv, "a_ok")
    dot_step(
        buf,
        TileRead("w", f"rn[None, :] * {k} + t * {c} + ci[:, None]", power_run(k, c)),
        f"(ci[:, None] < {c}) & (rn[None, :] < {n})",
        cv.prec,
    )


def _computed_tile(buf: SourceBuffer, cv: NhwcConv, coords: dict[int, str], mask: str) -> None:
    """The input tile computed by the pointwise ops before the conv (operand_prologue): their
    inputs loaded at the tap's pixels and channels (`coords`: axis of the NHWC input ->
    expression), 0 outside `mask` (the conv's zero padding is of the ops' result)."""
    if mask != "a_ok":
        buf.line(f"a_ok = {mask}")
    pointers = [f"xo{i}" for i in range(len(cv.op_loads))]
    shape = tuple(cv.graph.spec(cv.anchor.inputs[0]).shape)
    computed_a_tile(
        buf, cv.graph, cv.ops, cv.anchor.inputs[0], cv.op_loads, pointers, cv.op_literals, shape, coords,
        cv.views, "w.dtype.element_ty",
    )  # fmt: skip


def _scale_tile(buf: SourceBuffer, cv: NhwcConv, mask: str) -> None:
    """An input scale's prologue: the loaded tile times the scale, in the model's type."""
    buf.line(f"sc_tile = {guarded_load('sc', cv.scale_index, mask)}")
    buf.line("a_tile = (a_tile.to(tl.float32) * sc_tile.to(tl.float32)).to(a_tile.dtype)")


def _pooled_tile(buf: SourceBuffer, cv: NhwcConv, ih: str, iw: str, ok: str) -> None:
    """a_tile at conv-input pixels (ih, iw): the pool's output there (`PoolTaps`: its window's
    maximum over x, -inf outside x, or its average, as the pool's own kernel divides), then its
    activation chain, rounded to the model's type as the stored tensor would be; 0 where (ih, iw)
    is outside the pooled tensor (the conv's padding). (ih, iw) are columns ([BLOCK_M, 1]), and
    so is an average pool's tap count; a pixel of the conv's padding counts none, and divides by 1
    (its lane is 0 all the same) rather than make a NaN."""
    assert cv.window is not None
    pool = PoolTaps.of(cv.graph, cv.window)
    win = pool.window
    pool.emit_start(buf, "pv", "BLOCK_K", "pcount", "(BLOCK_M, 1)")
    buf.line(f"for pt in tl.static_range(0, {win.taps}):")
    with buf.indent():
        win.emit_tap(buf, win.origin(ih, iw), "pt", ok, ("ph", "pw", "p_ok"))
        p_offset = f"((img[:, None] * {win.h} + ph) * {win.w} + pw) * {cv.p['C']} + ci[None, :]"
        value = guarded_load("x", p_offset, "p_ok", pool.fill, channel_run(cv.p["C"]))
        pool.emit_tap(buf, "pv", value, "pcount", "ph", "pw")
    pool.emit_mean(buf, "pv", "tl.maximum(pcount, 1.0)")
    chain_regs = {**cv.literals, cv.window.outputs[0]: "pv"}
    emit_nodes(buf, cv.graph, cv.prologue[1:], chain_regs, prefix="u")
    buf.line(f"a_tile = tl.where({ok}, {chain_regs[cv.anchor.inputs[0]]}, 0.0).to(x.dtype.element_ty)")


def _store_pooled(buf: SourceBuffer, cv: NhwcConv, ih: str, iw: str, ok: str) -> None:
    """The pooled tile, for the pool's other readers: stored where this program loads it at
    the centre tap, by the programs of the first column tile only."""
    p, slot = cv.p, cv.outputs.index(cv.pool_out)
    buf.line(f"if t == {cv.centre}:")
    with buf.indent():
        buf.line("if tl.program_id(1) == 0:")
        with buf.indent():
            buf.line(
                f"tl.store(out{slot} + ((img[:, None] * {p['H']} + {ih}) * {p['W']} + {iw}) * {p['C']} + ci[None, :], "
                f"a_tile.to(out{slot}.dtype.element_ty), mask={ok})"
            )


def _store_tail(buf: SourceBuffer, cv: NhwcConv, value: str) -> None:
    """The pool on the output tile (`cv.tail`): the tile's value rounded to the model's type, as
    the stored tensor would be, each window's adjacent rows reduced to its maximum or average,
    and the pooled rows stored (window w of the program's tile is output pixel w: the pooled
    map's pixels in order)."""
    assert cv.tail is not None
    taps = cv.tail_p["KH"] * cv.tail_p["KW"]
    windows = cv.m // taps
    out = f"out{cv.outputs.index(cv.tail.outputs[0])}"
    buf.line(
        f"tv = tl.reshape({value}.to({out}.dtype.element_ty).to(tl.float32), (BLOCK_M // {taps}, {taps}, BLOCK_N))"
    )
    if cv.tail.op_type == MAX_POOL_NHWC:
        buf.line("pooled = tl.max(tv, axis=1)")
    else:
        buf.line(f"pooled = tl.sum(tv, axis=1) / {taps}")
    buf.line(f"prow = tl.program_id(0) * (BLOCK_M // {taps}) + tl.arange(0, BLOCK_M // {taps})")
    buf.line(
        f"tl.store({out} + prow[:, None] * {cv.n} + cols, pooled.to({out}.dtype.element_ty), "
        f"mask=(prow[:, None] < {windows}) & (cols < {cv.n}))"
    )


def _nhwc_epilogue(buf: SourceBuffer, cv: NhwcConv) -> None:
    """Bias and the epilogue on the accumulator, then the stores: plain, the Split's parts from
    their columns, or the Concat's rows."""
    graph, n = cv.graph, cv.n
    out_shape = graph.spec(cv.anchor.outputs[0]).shape
    buf.line("cols = rn[None, :]")
    buf.line(f"mask = row_ok[:, None] & (cols < {n})")
    if cv.tail is not None:  # rows are not pixels in order: each row's pixel from its coordinates
        buf.line(f"dst = ((img * {cv.p['OH']} + oh) * {cv.p['OW']} + ow)[:, None] * {n} + cols")
    else:
        buf.line(f"dst = rm[:, None] * {n} + cols")
    coords = {0: "img[:, None]", 1: "oh[:, None]", 2: "ow[:, None]", 3: "cols"}

    def index_of(name: str) -> tuple[str | None, str]:
        shape = graph.spec(name).shape
        if name == cv.b_name:
            return "cols", "mask"
        view = cv.views.get(name)
        if isinstance(view, StridedView):  # read through its strides (a window of a buffer's channels)
            if len(view.shape) != 4 or any(
                d not in (1, o) for d, o in zip(view.shape, out_shape, strict=True)
            ):
                raise ValueError(
                    f"an epilogue input viewed as {list(view.shape)} against the output {list(out_shape)}"
                )
            terms = [
                coords[d] if st == 1 else f"{coords[d]} * {st}"
                for d, st in enumerate(view.strides)
                if view.shape[d] > 1
            ]
            return " + ".join([*terms, *([str(view.offset)] if view.offset else [])]) or "0", "mask"
        if tuple(shape) == tuple(out_shape):
            return "dst", "mask"
        if name in cv.parts:  # a side input of a Split's part: at the part's own elements
            first, width = cv.parts[name]
            return (
                f"rm[:, None] * {width} + cols - {first}",
                f"mask & (cols >= {first}) & (cols < {first + width})",
            )
        return broadcast_offset(shape, coords), "mask"

    def bias(regs: dict[str, str]) -> None:
        if cv.b_name:
            buf.line(f"acc = acc + {regs[cv.b_name]}")
        for o in cv.split.outputs if cv.split is not None else []:
            regs[o] = "acc"

    regs: dict[str, str] = {}
    for i, gather in cv.gathers.items():  # a Resize the epilogue reads, gathered from its input
        lines: list[str] = []
        regs[cv.extra[i]] = resize_load(f"g{i}", f"in{i}", gather, lines, "tl.int64", "dst", "mask")
        for line in lines:
            buf.line(line)
    accumulator_epilogue(
        buf, graph, cv.anchor.outputs[0], cv.epilogue, cv.extra, index_of, cv.literals, regs, bias
    )
    if cv.split is not None:
        for i, name in enumerate(cv.outputs):
            first, width = cv.parts[name]
            buf.line(
                f"tl.store(out{i} + rm[:, None] * {width} + cols - {first}, "
                f"{regs[name]}.to(out{i}.dtype.element_ty), mask=mask & (cols >= {first}) & (cols < {first + width}))"
            )
    elif cv.tail is not None:
        _store_tail(buf, cv, regs[cv.tail.inputs[0]])
    elif cv.concat is None:
        emit_stores(buf, cv.outputs, regs, "dst", skip={cv.pool_out})
    else:
        concat_stores(buf, graph, cv.concat, cv.copied, cv.outputs, regs, cv.views)
