"""Triton implicit-GEMM convolution (2-D, groups=1) with a fused epilogue, NCHW or NHWC.

The convolution is a GEMM over M = N*OH*OW output pixels, Cout columns and K = Cin*KH*KW: the A
tile is gathered from the input window on the fly (zero outside the padding), B is the weight
viewed as [Cout, K]. Bias and the pointwise epilogue (activation, residual add) run on the
accumulator tile before its one store.

NHWC (`opfuse.ConvNHWC`, made by the channels-last pass) is the fast form: K runs (kh, kw, cin)
with cin innermost, so an A row is a contiguous run of input channels, the weight is stored
[Cout, KH, KW, Cin], and the output tile is a plain [M, Cout] row-major block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from opfuse.codegen.epilogue import dot_precision, emit_dot, emit_launch, emit_loads, emit_nodes, emit_stores
from opfuse.codegen.fragments import (
    KernelSource,
    broadcast_offset,
    kernel_head,
    matmul_tile_config,
    module_imports,
    module_title,
    node_comment,
    split_literals,
)
from opfuse.codegen.source import SourceBuffer, comment_text, float_literal
from opfuse.graph import Graph, Node
from opfuse.ir.ops import MAX_POOL_NHWC, NHWC_CONV, has_shortcut, is_depthwise
from opfuse.ir.queries import next_pow2
from opfuse.ir.support import INT32_INDEX_LIMIT, centre_tap, conv_params, input_scale_operands, pad_per_dim


def pad_geometry(graph: Graph, pad: Node) -> dict[str, Any]:
    """A 4-D NCHW Pad of the spatial axes only, as a conv prologue reads it: the source's H and
    W, the top and left pads, the mode, and a constant Pad's value as a literal."""
    h, w = graph.spec(pad.inputs[0]).shape[2:]
    per_dim = pad_per_dim(graph, pad)
    assert per_dim is not None  # checked by the planner (fusion.anchors.pad_prologue_reason)
    value = 0.0
    if len(pad.inputs) > 2 and pad.inputs[2]:
        value = float(np.asarray(graph.constants[pad.inputs[2]]).reshape(()))
    return {
        "H": h,
        "W": w,
        "top": per_dim[2][0],
        "left": per_dim[3][0],
        "mode": str(pad.attrs.get("mode", "constant")),
        "value": float_literal(value),
    }


def _epilogue_index(shape: tuple[int, ...], out: tuple[int, ...]) -> str | None:
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    strides = [int(np.prod(padded[d + 1 :], dtype=np.int64)) for d in range(4)]
    coords = ["img", "cols", "oh", "ow"]
    terms = [
        f"{coords[d]} * {strides[d]}" if strides[d] != 1 else coords[d] for d in range(4) if padded[d] != 1
    ]
    return " + ".join(terms) if terms else None


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
        return _generate_conv_nhwc(
            kernel_id,
            anchor,
            epilogue,
            inputs,
            outputs,
            graph,
            group_id,
            precision,
            prologue or [],
            views or {},
        )
    if prologue or any(node.op_type in ("Concat", "Split") for node in epilogue):
        raise ValueError("a prologue, or a Concat or Split in the epilogue, needs the NHWC template")
    p = conv_params(graph, anchor)
    out_shape = graph.spec(anchor.outputs[0]).shape
    dtype = graph.spec(anchor.inputs[0]).dtype
    m = p["N"] * p["OH"] * p["OW"]
    n = p["CO"]
    k = p["C"] * p["KH"] * p["KW"]
    x_name, w_name = anchor.inputs[0], anchor.inputs[1]
    b_name = anchor.inputs[2] if len(anchor.inputs) > 2 and anchor.inputs[2] else ""
    epilogue_reads = {x for node in epilogue for x in node.inputs if x}
    # The anchor's operands are loaded tile by tile; the epilogue loads them again only if it reads them.
    operands_only = {x_name, w_name} - epilogue_reads
    literals, extra = split_literals(graph, inputs, skip=operands_only, tensors={b_name} - {""})
    args = ["x", "w"] + [f"in{i}" for i in range(len(extra))] + [f"out{i}" for i in range(len(outputs))]
    fn = "fused_conv"
    prec = dot_precision(dtype, precision)
    buf = SourceBuffer()
    module_title(buf, f"implicit-GEMM conv kernel {kernel_id} for group {group_id}.")
    buf.line(
        f"# x [{p['N']}, {p['C']}, {p['H']}, {p['W']}] * w [{n}, {p['C']}, {p['KH']}, {p['KW']}] -> "
        f"{list(out_shape)}; M={m} N={n} K={k}"
    )
    buf.line(node_comment(anchor, "anchor", op="Conv"))
    for node in epilogue:
        buf.line(node_comment(node, "epilogue"))
    module_imports(buf)
    config: dict[str, Any] = {**matmul_tile_config(m, n, k), "UPCAST": False}
    kernel_head(buf, fn, args, config, m, n, k, dtype)
    regs: dict[str, str] = {}
    khw = p["KH"] * p["KW"]
    ohw = p["OH"] * p["OW"]
    with buf.indent():
        buf.line("rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)")
        buf.line("rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)")
        buf.line("rk = tl.arange(0, BLOCK_K)")
        buf.line(f"img = rm[:, None] // {ohw}")
        buf.line(f"oh = (rm[:, None] // {p['OW']}) % {p['OH']}")
        buf.line(f"ow = rm[:, None] % {p['OW']}")
        buf.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        buf.line(f"for k0 in range(0, {k}, BLOCK_K):")
        with buf.indent():
            buf.line("kk = k0 + rk")
            buf.line(f"ci = kk[None, :] // {khw}")
            buf.line(f"kh = (kk[None, :] // {p['KW']}) % {p['KH']}")
            buf.line(f"kw = kk[None, :] % {p['KW']}")
            buf.line(f"ih = oh * {p['SH']} - {p['PH']} + kh * {p['DH']}")
            buf.line(f"iw = ow * {p['SW']} - {p['PW']} + kw * {p['DW']}")
            buf.line(
                f"ok = (rm[:, None] < {m}) & (kk[None, :] < {k}) & (ih >= 0) & (ih < {p['H']}) & (iw >= 0) & (iw < {p['W']})"
            )
            buf.line(
                f"a_tile = tl.load(x + img * {p['C'] * p['H'] * p['W']} + ci * {p['H'] * p['W']} + ih * {p['W']} + iw, mask=ok, other=0.0)"
            )
            buf.line(
                f"b_tile = tl.load(w + rn[None, :] * {k} + kk[:, None], mask=(kk[:, None] < {k}) & (rn[None, :] < {n}), other=0.0)"
            )
            emit_dot(buf, "acc", "a_tile", "b_tile", prec)
        buf.line("cols = rn[None, :]")
        buf.line(f"mask = (rm[:, None] < {m}) & (cols < {n})")
        emit_loads(
            buf,
            extra,
            lambda name: (
                "cols" if name == b_name else _epilogue_index(graph.spec(name).shape, out_shape),
                "mask",
            ),
            regs,
        )
        regs.update(literals)
        if b_name:
            buf.line(f"acc = acc + {regs[b_name]}")
        regs[anchor.outputs[0]] = "acc"
        emit_nodes(buf, graph, epilogue, regs)
        buf.line(f"dst = img * {n * ohw} + cols * {ohw} + oh * {p['OW']} + ow")
        emit_stores(buf, outputs, regs, "dst")
    emit_launch(buf, fn, args, f'(triton.cdiv({m}, c["BLOCK_M"]), triton.cdiv({n}, c["BLOCK_N"]))')
    tensor_inputs = [x_name, w_name, *extra]
    return KernelSource(kernel_id, "conv", buf.getvalue(), tensor_inputs, list(outputs), config)


def _generate_conv_nhwc(
    kernel_id: str,
    anchor: Node,
    epilogue: list[Node],
    inputs: list[str],
    outputs: list[str],
    graph: Graph,
    group_id: str,
    precision: str,
    prologue: list[Node],
    views: dict[str, Any],
) -> KernelSource:
    p = conv_params(graph, anchor)
    # A channel Concat the kernel writes: its result at its offset, the other inputs copied.
    concat = next((node for node in epilogue if node.op_type == "Concat"), None)
    epilogue = [node for node in epilogue if node is not concat]
    # A Split of the output channels (sibling convolutions merged): each part, or the last op of
    # the activation chain after it, is stored from its own columns of the tile.
    split = next((node for node in epilogue if node.op_type == "Split"), None)
    epilogue = [node for node in epilogue if node is not split]
    parts: dict[str, tuple[int, int]] = {}  # value -> (first column, columns)
    if split is not None:
        at = 0
        for o, size in zip(split.outputs, graph.constants[split.inputs[1]].tolist(), strict=True):
            parts[o], at = (at, int(size)), at + int(size)
        for node in epilogue:
            part = next((parts[x] for x in node.inputs if x in parts), None)
            if part is not None:
                parts[node.outputs[0]] = part
    copied: list[str] = []
    if concat is not None:
        made = {anchor.outputs[0], *(o for node in epilogue for o in node.outputs)}
        copied = list(dict.fromkeys(x for x in concat.inputs if x and x not in made))
    out_shape = graph.spec(anchor.outputs[0]).shape  # [N, OH, OW, CO]
    dtype = graph.spec(anchor.inputs[0]).dtype
    c, kh_, kw_ = p["C"], p["KH"], p["KW"]
    depthwise = is_depthwise(graph, anchor)
    m, n, k = p["N"] * p["OH"] * p["OW"], p["CO"], (1 if depthwise else c) * kh_ * kw_
    x_name, w_name = anchor.inputs[0], anchor.inputs[1]
    b_name = anchor.inputs[2] if len(anchor.inputs) > 2 and anchor.inputs[2] else ""
    # A 1x1 shortcut conv summed in (passes/shortcut_conv.py): its input and weight [CO, 1, 1, C2].
    sx_name, sw_name = (anchor.inputs[3], anchor.inputs[4]) if has_shortcut(anchor) else ("", "")
    scale = ""
    pad: Node | None = None
    # A depthwise conv or a max pool computed as the input tiles are loaded.
    window: Node | None = None
    dw_w = dw_b = ""
    if prologue and prologue[0].op_type in (NHWC_CONV, MAX_POOL_NHWC):
        window = prologue[0]
        x_name = window.inputs[0]
        if window.op_type == NHWC_CONV:
            dw_w = window.inputs[1]
            dw_b = window.inputs[2] if len(window.inputs) > 2 else ""
    elif prologue and prologue[0].op_type == "Pad":
        # Pad (NCHW) -> Transpose to NHWC -> conv: the kernel reads the unpadded NCHW tensor, the
        # padded pixel mapped to the one it copies (reflect, edge) or filled (constant).
        pad = prologue[0]
        x_name = pad.inputs[0]
    elif prologue:  # x = act * scale: the kernel reads act and scales each loaded tile
        x_name, scale = input_scale_operands(graph, prologue[0], anchor)
    # A max pool before a conv wider than 1x1, or whose output others read too (the conv then
    # stores it, from its centre tap): the template's loops, each tile loaded as the pool's maximum.
    pool_out = anchor.inputs[0] if window is not None and anchor.inputs[0] in outputs else ""
    centre = centre_tap(graph, anchor) if pool_out else None
    pooled = (
        window is not None and window.op_type == MAX_POOL_NHWC and ((kh_, kw_) != (1, 1) or bool(pool_out))
    )
    epilogue_reads = {x for node in epilogue for x in node.inputs if x}
    split_sizes = {split.inputs[1]} if split is not None else set()
    pad_operands = set(pad.inputs[1:]) if pad is not None else set()
    operands_only = (
        {x_name, w_name, sx_name, sw_name, scale, dw_w, dw_b, *copied, *split_sizes, *pad_operands}
        - {""}
        - epilogue_reads
    )
    literals, extra = split_literals(graph, inputs, skip=operands_only, tensors={b_name} - {""})
    extra = [e for e in extra if e not in (scale, dw_w, dw_b)]
    dw_args = (["dw"] if dw_w else []) + (["db"] if dw_b else [])
    args = (
        ["x", "w"]
        + (["xs", "ws"] if sx_name else [])
        + (["sc"] if scale else [])
        + dw_args
        + [f"in{i}" for i in range(len(extra))]
        + [f"cat{i}" for i in range(len(copied))]
        + [f"out{i}" for i in range(len(outputs))]
    )
    fn = "fused_conv"
    prec = dot_precision(dtype, precision)
    scale_index = ""
    if scale:
        s_shape = graph.spec(scale).shape
        terms = ([f"img[:, None] * {s_shape[3]}"] if s_shape[0] != 1 else []) + (
            ["ci[None, :]"] if s_shape[3] != 1 else []
        )
        scale_index = " + ".join(terms) or "0"
    # Few input channels (a network's first layer): one flat K loop, cin = k % C. Otherwise a loop
    # over the KH*KW window positions, each reading contiguous blocks of channels.
    flat = c < 16
    cat_width = graph.spec(concat.outputs[0]).shape[3] if concat is not None else n
    cat_bases = [graph.spec(views[x].base if x in views else x).numel for x in copied]
    small_index = max(p["N"] * p["H"] * p["W"] * c, m * cat_width, *cat_bases) < INT32_INDEX_LIMIT
    buf = SourceBuffer()
    if depthwise:
        module_title(buf, f"depthwise conv kernel {kernel_id} for group {group_id} (NHWC).")
    else:
        module_title(buf, f"implicit-GEMM conv kernel {kernel_id} for group {group_id} (NHWC).")
    buf.line(
        f"# x [{p['N']}, {p['H']}, {p['W']}, {c}] * w [{n}, {kh_}, {kw_}, {1 if depthwise else c}] -> "
        f"{list(out_shape)}; M={m} N={n} K={k}"
    )
    for node in prologue:
        role = (
            "input scale"
            if window is None
            else ("max pool" if window.op_type == MAX_POOL_NHWC else "depthwise conv") + " on the input tiles"
        )
        buf.line(node_comment(node, f"prologue: {role}"))
    buf.line(node_comment(anchor, "anchor", op="Conv"))
    if sx_name:
        sp = shortcut_params(graph, anchor)
        buf.line(
            f"#   + shortcut: 1x1 conv of xs [{p['N']}, {sp['H']}, {sp['W']}, {sp['C']}] at stride "
            f"({sp['SH']}, {sp['SW']}), summed in a second K loop"
        )
    for node in epilogue:
        buf.line(node_comment(node, "epilogue"))
    if concat is not None:
        buf.line(
            f"#   {concat.id}: Concat {comment_text(concat.name)} (written in place, other inputs copied)"
        )
    if split is not None:
        buf.line(node_comment(split, "each part stored from its columns", op="Split"))
    module_imports(buf)
    config: dict[str, Any] = {**matmul_tile_config(m, n, k), "UPCAST": False}
    if window is not None:
        flat = False  # the depthwise prologue has its own loop over channel blocks
    if not flat and not depthwise:
        config["BLOCK_K"] = min(64, max(16, next_pow2(c)))
    segments = (
        tap_segments(graph.constants[w_name])
        if not (depthwise or flat or (window is not None and not pooled))
        and w_name in graph.constants
        and not pool_out
        else None
    )
    # Split-K (a tuning choice): the window positions × channel blocks shared among SPLIT_K
    # programs per output tile, for the convolutions whose tiles are too few to fill the GPU (batch
    # 1, late layers: 8 tiles of 64×64 for 49 pixels and 512 channels). Each program stores its
    # float32 partial tile; the last to arrive at its tile's counter sums them in order and runs
    # the epilogue, so the conv stays one launch. The plain window loop only, none of the forms
    # with their own loops (prologues, a shortcut's second loop, zero weight segments).
    splittable = (
        not (depthwise or flat or segments or sx_name or pooled)
        and window is None
        and "split_k" not in graph.disabled
    )
    flags: dict[str, Any] = {"UNROLL": False} if depthwise else {"SPLIT_K": 1} if splittable else {}
    config.update(flags)
    kernel_head(
        buf, fn, args + (["ws", "lock"] if splittable else []), config, m, n, k if flat else c, dtype, flags
    )
    regs: dict[str, str] = {}
    ohw = p["OH"] * p["OW"]

    def dot(a: str, b: str) -> None:
        emit_dot(buf, "acc", a, b, prec)

    padding = pad_geometry(graph, pad) if pad is not None else None
    # The stride between input channels in x: 1 (NHWC), or a plane (a padded NCHW source).
    cs = padding["H"] * padding["W"] if padding is not None else 1

    def source_pixel(ih: str, iw: str, img_: str) -> str:
        """Emit what maps conv-input pixel (ih, iw) to x: for a Pad prologue, the source pixel
        (sh, sw) and, constant mode, `inside` (not a filled pixel). Returns the pixel's offset."""
        if padding is None:
            return f"(({img_} * {p['H']} + {ih}) * {p['W']} + {iw}) * {c}"
        h0, w0 = padding["H"], padding["W"]
        buf.line(f"sh = {ih} - {padding['top']}")
        buf.line(f"sw = {iw} - {padding['left']}")
        if padding["mode"] == "reflect":
            for v, size in (("sh", h0), ("sw", w0)):
                buf.line(f"{v} = tl.where({v} < 0, -{v}, {v})")
                buf.line(f"{v} = tl.where({v} >= {size}, {2 * size - 2} - {v}, {v})")
        elif padding["mode"] == "edge":
            for v, size in (("sh", h0), ("sw", w0)):
                buf.line(f"{v} = tl.minimum(tl.maximum({v}, 0), {size - 1})")
        else:
            buf.line(f"inside = (sh >= 0) & (sh < {h0}) & (sw >= 0) & (sw < {w0})")
        return f"{img_} * {c * h0 * w0} + sh * {w0} + sw"

    def padded_load(offset: str, ok: str) -> None:
        """a_tile from x at `offset` (+ the channels), where `ok`; a constant Pad's value where the
        pixel is a filled one."""
        chan = "ci[None, :]" if cs == 1 else f"ci[None, :] * {cs}"
        if padding is None or padding["mode"] != "constant":
            buf.line(f"a_tile = tl.load(x + {offset} + {chan}, mask={ok}, other=0.0)")
            return
        fill = padding["value"]
        buf.line(f"a_tile = tl.load(x + {offset} + {chan}, mask={ok} & inside, other={fill})")
        if fill != "0.0":  # the conv's own padding (outside the padded tensor) stays 0
            buf.line(f"a_tile = tl.where({ok}, a_tile, 0.0).to(a_tile.dtype)")

    def window_position() -> None:
        """Window position t: the input pixel each output row reads, whether it is inside the
        image, and the offset of its channels (NHWC)."""
        buf.line(f"ih = ih0 + (t // {kw_}) * {p['DH']}")
        buf.line(f"iw = iw0 + (t % {kw_}) * {p['DW']}")
        buf.line(f"ok = row_ok & (ih >= 0) & (ih < {p['H']}) & (iw >= 0) & (iw < {p['W']})")
        buf.line(f"base = {source_pixel('ih', 'iw', 'img')}")
        if padding is not None and padding["mode"] == "constant":
            buf.line("inside = inside[:, None]")

    def depthwise_taps(loop: str) -> None:
        """Each output channel reads its own input channel: a [pixels, channels] tile of
        multiply-adds per window position t, channels contiguous in memory (BLOCK_K unused)."""
        buf.line(f"for t in {loop}:")
        with buf.indent():
            window_position()
            buf.line("x_ok = ok[:, None] & col_ok[None, :]")
            buf.line("xv = tl.where(x_ok, tl.load(x + base[:, None] + rn[None, :], mask=x_ok), 0.0)")
            buf.line(f"wv = tl.load(w + rn[None, :] * {kh_ * kw_} + t, mask=col_ok[None, :], other=0.0)")
            buf.line("acc = acc + xv.to(tl.float32) * wv.to(tl.float32)")

    def scale_tile(mask: str) -> None:
        buf.line(f"sc_tile = tl.load(sc + {scale_index}, mask={mask}, other=0.0)")
        buf.line("a_tile = (a_tile.to(tl.float32) * sc_tile.to(tl.float32)).to(a_tile.dtype)")

    def pooled_tile(ih: str, iw: str, ok: str) -> None:
        """a_tile at conv-input pixels (ih, iw): the max pool's output there (its window's maximum
        over x, -inf outside x), then its activation chain, rounded to the model's type as the
        stored tensor would be; 0 where (ih, iw) is outside the pooled tensor (the conv's padding)."""
        from opfuse.ir.support import pool_params

        d = pool_params(graph, window)  # type: ignore[arg-type]
        buf.line('pv = tl.full((BLOCK_M, BLOCK_K), float("-inf"), dtype=tl.float32)')
        buf.line(f"for pt in tl.static_range(0, {d['KH'] * d['KW']}):")
        with buf.indent():
            buf.line(f"ph = {ih} * {d['SH']} - {d['PH']} + (pt // {d['KW']}) * {d['DH']}")
            buf.line(f"pw = {iw} * {d['SW']} - {d['PW']} + (pt % {d['KW']}) * {d['DW']}")
            buf.line(f"p_ok = {ok} & (ph >= 0) & (ph < {d['H']}) & (pw >= 0) & (pw < {d['W']})")
            buf.line(
                f"pv = tl.maximum(pv, tl.load(x + ((img[:, None] * {d['H']} + ph) * {d['W']} + pw) * {c} + ci[None, :], "
                'mask=p_ok, other=float("-inf")).to(tl.float32))'
            )
        chain_regs = {**literals, window.outputs[0]: "pv"}  # type: ignore[union-attr]
        emit_nodes(buf, graph, prologue[1:], chain_regs, prefix="u")
        buf.line(f"a_tile = tl.where({ok}, {chain_regs[anchor.inputs[0]]}, 0.0).to(x.dtype.element_ty)")

    def store_pooled(ih: str, iw: str, ok: str) -> None:
        """The pooled tile, for the pool's other readers: stored where this program loads it at
        the centre tap, by the programs of the first column tile only."""
        slot = outputs.index(pool_out)
        buf.line(f"if t == {centre}:")
        with buf.indent():
            buf.line("if tl.program_id(1) == 0:")
            with buf.indent():
                buf.line(
                    f"tl.store(out{slot} + ((img[:, None] * {p['H']} + {ih}) * {p['W']} + {iw}) * {c} + ci[None, :], "
                    f"a_tile.to(out{slot}.dtype.element_ty), mask={ok})"
                )

    with buf.indent():
        if depthwise and small_index:
            buf.line("rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)")
        else:
            buf.line("rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)")
        buf.line("rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)")
        buf.line("rk = tl.arange(0, BLOCK_K)")
        buf.line(f"img = rm // {ohw}")
        buf.line(f"oh = (rm // {p['OW']}) % {p['OH']}")
        buf.line(f"ow = rm % {p['OW']}")
        buf.line(f"ih0 = oh * {p['SH']} - {p['PH']}")
        buf.line(f"iw0 = ow * {p['SW']} - {p['PW']}")
        buf.line(f"row_ok = rm < {m}")
        buf.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        if depthwise:
            buf.line(f"col_ok = rn < {n}")
            # Index arithmetic is int32 where every offset fits, else int64 with the window loop
            # always unrolled: with int64 offsets and a runtime loop, Triton 3.6 miscompiled this
            # kernel on the H200 (sm_90) at some tiles only (fp32 [64, 64] and [32/64, 32] with
            # 4 warps, fp16 [128, 64]): wrong sums in up to 1588 of 9216 outputs, right in the
            # interpreter. Unrolled (int32 or int64) and runtime-loop int32 were right at every
            # tile tried, fp32 and fp16 (tests/gpu sweeps the tuning candidates). With int32 the
            # unrolled loop (UNROLL) is a tuning choice: its loads issue together, but it holds
            # more registers.
            taps = kh_ * kw_
            if small_index:
                buf.line("if UNROLL:")
                with buf.indent():
                    depthwise_taps(f"tl.static_range(0, {taps})")
                buf.line("else:")
                with buf.indent():
                    depthwise_taps(f"range(0, {taps})")
            else:
                depthwise_taps(f"tl.static_range(0, {taps})")
        elif window is not None and not pooled:
            _window_prologue(buf, graph, window, prologue[1:], {**literals}, c, n, dot)
        elif flat:
            buf.line(f"for k0 in range(0, {k}, BLOCK_K):")
            with buf.indent():
                buf.line("kk = k0 + rk")
                buf.line(f"ci = kk % {c}")
                buf.line(f"kh = kk // {c * kw_}")
                buf.line(f"kw = (kk // {c}) % {kw_}")
                buf.line(f"ih = ih0[:, None] + kh[None, :] * {p['DH']}")
                buf.line(f"iw = iw0[:, None] + kw[None, :] * {p['DW']}")
                buf.line(
                    f"ok = row_ok[:, None] & (kk[None, :] < {k}) & (ih >= 0) & (ih < {p['H']}) & (iw >= 0) & (iw < {p['W']})"
                )
                padded_load(source_pixel("ih", "iw", "img[:, None]"), "ok")
                if scale:
                    scale_tile("ok")
                buf.line(
                    f"b_tile = tl.load(w + rn[None, :] * {k} + kk[:, None], mask=(kk[:, None] < {k}) & (rn[None, :] < {n}), other=0.0)"
                )
                dot("a_tile", "b_tile")
        else:

            def channel_block() -> None:
                buf.line("ci = c0 + rk")
                buf.line(f"a_ok = ok[:, None] & (ci[None, :] < {c})")
                if pooled:
                    pooled_tile("ih[:, None]", "iw[:, None]", "a_ok")
                    if pool_out:
                        store_pooled("ih[:, None]", "iw[:, None]", "a_ok")
                else:
                    padded_load("base[:, None]", "a_ok")
                if scale:
                    scale_tile("a_ok")
                buf.line(
                    f"b_tile = tl.load(w + rn[None, :] * {k} + t * {c} + ci[:, None], mask=(ci[:, None] < {c}) & (rn[None, :] < {n}), other=0.0)"
                )
                dot("a_tile", "b_tile")

            def window_body() -> None:
                window_position()
                buf.line(f"for c0 in range(0, {c}, BLOCK_K):")
                with buf.indent():
                    channel_block()

            if segments:
                # Output channels whose weights are zero outside a sub-window (a conv merged from
                # side-by-side branches: passes/concat_convs.py): a program runs only the window
                # rows and columns its tile's channels use (the union over the segments it touches).
                buf.line("n_lo = tl.program_id(1) * BLOCK_N")
                buf.line(f"n_hi = tl.minimum(n_lo + BLOCK_N, {n})")
                for j, (a, b, r0, r1, c0, c1) in enumerate(segments):
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
                        window_body()
            elif splittable:
                buf.line("if SPLIT_K == 1:")
                with buf.indent():
                    buf.line(f"for t in range(0, {kh_ * kw_}):")
                    with buf.indent():
                        window_body()
                buf.line("else:")
                with buf.indent():
                    # Step it of the (window position, channel block) loop, every SPLIT_K-th.
                    buf.line(f"blocks = tl.cdiv({c}, BLOCK_K)")
                    buf.line(f"for it in range(tl.program_id(2), {kh_ * kw_} * blocks, SPLIT_K):")
                    with buf.indent():
                        buf.line("t = it // blocks")
                        window_position()
                        buf.line("c0 = (it % blocks) * BLOCK_K")
                        channel_block()
            else:
                buf.line(f"for t in range(0, {kh_ * kw_}):")
                with buf.indent():
                    window_body()
        if sx_name:
            _shortcut_loop(buf, shortcut_params(graph, anchor), n, dot)
        if splittable:
            _split_k_reduction(buf)
    epilogue_indent = buf.indent() if splittable else contextlib.nullcontext()
    if splittable:
        with buf.indent():
            buf.line("if last:")
    with buf.indent(), epilogue_indent:
        buf.line("cols = rn[None, :]")
        buf.line(f"mask = row_ok[:, None] & (cols < {n})")
        buf.line(f"dst = rm[:, None] * {n} + cols")
        coords = {0: "img[:, None]", 1: "oh[:, None]", 2: "ow[:, None]", 3: "cols"}

        def index_of(name: str) -> tuple[str | None, str]:
            shape = graph.spec(name).shape
            if name == b_name:
                return "cols", "mask"
            if tuple(shape) == tuple(out_shape):
                return "dst", "mask"
            return broadcast_offset(shape, coords), "mask"

        emit_loads(buf, extra, index_of, regs)
        regs.update(literals)
        if b_name:
            buf.line(f"acc = acc + {regs[b_name]}")
        regs[anchor.outputs[0]] = "acc"
        for o in split.outputs if split is not None else []:
            regs[o] = "acc"
        emit_nodes(buf, graph, epilogue, regs)
        if split is not None:
            for i, name in enumerate(outputs):
                first, width = parts[name]
                buf.line(
                    f"tl.store(out{i} + rm[:, None] * {width} + cols - {first}, "
                    f"{regs[name]}.to(out{i}.dtype.element_ty), mask=mask & (cols >= {first}) & (cols < {first + width}))"
                )
        elif concat is None:
            emit_stores(buf, outputs, regs, "dst", skip={pool_out})
        else:
            _concat_stores(buf, graph, concat, copied, outputs, regs, views)
    if splittable:
        _split_k_launch(buf, fn, args, m, n)
    else:
        emit_launch(buf, fn, args, f'(triton.cdiv({m}, c["BLOCK_M"]), triton.cdiv({n}, c["BLOCK_N"]))')
    dw_inputs = [v for v in (dw_w, dw_b) if v]
    passed = [views[x].base if x in views else x for x in copied]
    shortcut_inputs = [sx_name, sw_name] if sx_name else []
    tensor_inputs = [
        x_name,
        w_name,
        *shortcut_inputs,
        *([scale] if scale else []),
        *dw_inputs,
        *extra,
        *passed,
    ]
    return KernelSource(kernel_id, "conv", buf.getvalue(), tensor_inputs, list(outputs), config)


def _split_k_reduction(buf: SourceBuffer) -> None:
    """SPLIT_K > 1: store this program's partial tile (float32) in its slot of `ws`, count it in at
    the tile's `lock`; the program that arrives last sums the SPLIT_K slots in order (the same sum
    whichever program is last), sets the counter back to 0 for the next launch and runs the
    epilogue (`last`). The barriers order every thread's store before the count, and the count
    before any thread's loads."""
    buf.line("if SPLIT_K > 1:")
    with buf.indent():
        buf.line("tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)")
        buf.line("part = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
        buf.line("slots = ws + tile.to(tl.int64) * SPLIT_K * BLOCK_M * BLOCK_N")
        buf.line('tl.store(slots + tl.program_id(2) * BLOCK_M * BLOCK_N + part, acc, cache_modifier=".cg")')
        buf.line("tl.debug_barrier()")
        buf.line('arrived = tl.atomic_add(lock + tile, 1, sem="acq_rel", scope="gpu")')
        buf.line("tl.debug_barrier()")
        buf.line("last = arrived == SPLIT_K - 1")
        buf.line("if last:")
        with buf.indent():
            buf.line("acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
            buf.line("for s in range(0, SPLIT_K):")
            with buf.indent():
                buf.line('acc += tl.load(slots + s * BLOCK_M * BLOCK_N + part, cache_modifier=".cg")')
            buf.line('tl.atomic_xchg(lock + tile, 0, sem="relaxed", scope="gpu")')
    buf.line("else:")
    with buf.indent():
        buf.line("last = True")


def _split_k_launch(buf: SourceBuffer, fn: str, args: list[str], m: int, n: int) -> None:
    """The module's `launch`, with the split-K scratch: per device and tiling, a float32 slot per
    (tile, split) and an int32 counter per tile, made once (the counters zeroed) and reused by every
    launch; the last program of a tile leaves its counter at 0 again. The scratch is the caller's
    (`scratch`: the Executor's dict, shared by its steps, which run one after another, so two plans
    running at once, or two CUDA graphs replayed on two streams, never share counters), else the
    module's (SCRATCH: a tuning worker, one launch at a time)."""
    buf.line()
    buf.line()
    buf.line("SCRATCH = {}")
    buf.line("USES_SCRATCH = True  # launch() takes `scratch`: the Executor passes its own")
    buf.line()
    buf.line()
    buf.line(f"def launch({', '.join(args)}, config=None, scratch=None):")
    with buf.indent():
        buf.line("c = CONFIG if config is None else config")
        buf.line("store = SCRATCH if scratch is None else scratch")
        buf.line(f'grid = (triton.cdiv({m}, c["BLOCK_M"]), triton.cdiv({n}, c["BLOCK_N"]), c["SPLIT_K"])')
        buf.line('key = (str(x.device), grid, c["BLOCK_M"] * c["BLOCK_N"])')
        buf.line("if key not in store:")
        with buf.indent():
            buf.line("import torch")
            buf.line("")
            buf.line("tiles = grid[0] * grid[1]")
            buf.line('slots = tiles * c["SPLIT_K"] * c["BLOCK_M"] * c["BLOCK_N"] if c["SPLIT_K"] > 1 else 1')
            buf.line(
                "store[key] = (torch.empty(slots, dtype=torch.float32, device=x.device), "
                "torch.zeros(tiles, dtype=torch.int32, device=x.device))"
            )
        buf.line("ws, lock = store[key]")
        buf.line(f"{fn}[grid]({', '.join(args)}, ws, lock, **c)")


def shortcut_params(graph: Graph, conv: Node) -> dict[str, int]:
    """The summed 1x1 shortcut of an `opfuse.ConvNHWC` (passes/shortcut_conv.py): its input's
    H, W and channels, and its strides."""
    _, h, w, c = graph.spec(conv.inputs[3]).shape
    sh, sw = (int(v) for v in conv.attrs["shortcut_strides"])
    return {"H": h, "W": w, "C": c, "SH": sh, "SW": sw}


def _shortcut_loop(buf: SourceBuffer, s: dict[str, int], n: int, dot: Callable[[str, str], None]) -> None:
    """The shortcut's K loop, after the conv's own: the channels of xs at the strided pixel
    (oh * SH, ow * SW) of each output row, times the shortcut's weight as [CO, C2], into the same
    accumulator. The pixel is inside xs for every output row (a 1x1 window without padding)."""
    c2 = s["C"]
    buf.line(f"s_base = ((img * {s['H']} + oh * {s['SH']}) * {s['W']} + ow * {s['SW']}) * {c2}")
    buf.line(f"for c0 in range(0, {c2}, BLOCK_K):")
    with buf.indent():
        buf.line("ci = c0 + rk")
        buf.line(f"a_ok = row_ok[:, None] & (ci[None, :] < {c2})")
        buf.line("a_tile = tl.load(xs + s_base[:, None] + ci[None, :], mask=a_ok, other=0.0)")
        buf.line(
            f"b_tile = tl.load(ws + rn[None, :] * {c2} + ci[:, None], mask=(ci[:, None] < {c2}) & (rn[None, :] < {n}), other=0.0)"
        )
        dot("a_tile", "b_tile")


def _concat_stores(
    buf: SourceBuffer,
    graph: Graph,
    concat: Node,
    copied: list[str],
    outputs: list[str],
    regs: dict[str, str],
    views: dict[str, Any],
) -> None:
    """The group's stores when it writes a channel Concat: its own value at its channel offset of
    the Concat's rows, and each other input (`copied`: one pointer `cat{j}` per distinct value)
    copied into its offset, the programs of one row block sharing its channels (a BLOCK_N block
    each, strided by the grid's width)."""
    width = graph.spec(concat.outputs[0]).shape[3]
    for i, name in enumerate(outputs):
        if name != concat.outputs[0]:
            buf.line(f"tl.store(out{i} + dst, {regs[name]}.to(out{i}.dtype.element_ty), mask=mask)")
            continue
        buf.line(f"row_dst = rm[:, None] * {width}")
        at = 0
        for x in (x for x in concat.inputs if x):
            cx = graph.spec(x).shape[3]
            at, offset = at + cx, at
            if x not in copied:  # the group's own value
                buf.line(
                    f"tl.store(out{i} + row_dst + {offset} + cols, {regs[x]}.to(out{i}.dtype.element_ty), mask=mask)"
                )
                continue
            if x in views:
                v = views[x]
                terms = [str(v.offset)] if v.offset else []
                coords = ("img[:, None]", "oh[:, None]", "ow[:, None]", "cc[None, :]")
                for coord, stride in zip(coords, v.strides, strict=True):
                    if stride:
                        terms.append(coord if stride == 1 else f"{coord} * {stride}")
                src = " + ".join(terms)
            else:
                src = f"rm[:, None] * {cx} + cc[None, :]"
            buf.line(f"for c0 in range(tl.program_id(1) * BLOCK_N, {cx}, tl.num_programs(1) * BLOCK_N):")
            with buf.indent():
                buf.line("cc = c0 + tl.arange(0, BLOCK_N)")
                buf.line(f"c_ok = row_ok[:, None] & (cc[None, :] < {cx})")
                buf.line(f"cv = tl.load(cat{copied.index(x)} + {src}, mask=c_ok, other=0.0)")
                buf.line(
                    f"tl.store(out{i} + row_dst + {offset} + cc[None, :], cv.to(out{i}.dtype.element_ty), mask=c_ok)"
                )


def _window_prologue(
    buf: SourceBuffer,
    graph: Graph,
    dw: Node,
    chain: list[Node],
    regs: dict[str, str],
    c: int,
    n: int,
    dot: Callable[[str, str], None],
) -> None:
    """A 1x1 conv's K loop whose input tiles are a depthwise conv's output (fp32 multiply-adds
    over the window) or a max pool's (the window's maximum; outside the input -inf), computed from
    their input `x` as they are needed, then the one-input activation after it (`chain`), rounded
    to the model's type as a stored tensor would be."""
    from opfuse.ir.support import pool_params

    pool = dw.op_type == MAX_POOL_NHWC
    d = pool_params(graph, dw) if pool else conv_params(graph, dw)
    fill = 'float("-inf")' if pool else "0.0"
    taps = d["KH"] * d["KW"]
    buf.line(f"for c0 in range(0, {c}, BLOCK_K):")
    with buf.indent():
        buf.line("ci = c0 + rk")
        buf.line(f"c_ok = ci < {c}")
        if pool:
            buf.line('dacc = tl.full((BLOCK_M, BLOCK_K), float("-inf"), dtype=tl.float32)')
        else:
            buf.line("dacc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)")
        buf.line(f"for t in tl.static_range(0, {taps}):")
        with buf.indent():
            buf.line(f"ih = oh * {d['SH']} - {d['PH']} + (t // {d['KW']}) * {d['DH']}")
            buf.line(f"iw = ow * {d['SW']} - {d['PW']} + (t % {d['KW']}) * {d['DW']}")
            buf.line(f"ok = row_ok & (ih >= 0) & (ih < {d['H']}) & (iw >= 0) & (iw < {d['W']})")
            buf.line("x_ok = ok[:, None] & c_ok[None, :]")
            buf.line(
                f"xv = tl.load(x + (((img * {d['H']} + ih) * {d['W']} + iw) * {c})[:, None] + ci[None, :], mask=x_ok, other={fill})"
            )
            if pool:
                buf.line("dacc = tl.maximum(dacc, xv.to(tl.float32))")
            else:
                buf.line(f"wv = tl.load(dw + ci * {taps} + t, mask=c_ok, other=0.0)")
                buf.line("dacc = dacc + xv.to(tl.float32) * wv[None, :].to(tl.float32)")
        if len(dw.inputs) > 2 and dw.inputs[2]:
            buf.line("dacc = dacc + tl.load(db + ci, mask=c_ok, other=0.0)[None, :].to(tl.float32)")
        regs[dw.outputs[0]] = "dacc"
        emit_nodes(buf, graph, chain, regs, prefix="u")
        last = chain[-1].outputs[0] if chain else dw.outputs[0]
        buf.line(
            f"a_tile = tl.where(row_ok[:, None] & c_ok[None, :], {regs[last]}, 0.0).to(x.dtype.element_ty)"
        )
        buf.line(
            f"b_tile = tl.load(w + rn[None, :] * {c} + ci[:, None], mask=c_ok[:, None] & (rn[None, :] < {n}), other=0.0)"
        )
        dot("a_tile", "b_tile")


MAX_TAP_SEGMENTS = 8


def tap_segments(w: np.ndarray) -> list[tuple[int, int, int, int, int, int]] | None:
    """For an NHWC weight [Cout, KH, KW, Cin] whose output channels use only part of the window:
    runs of output channels [a, b) with the window rows [r0, r1) and columns [c0, c1) outside which
    their weights are zero. None when every channel uses the whole window (or the runs are many)."""
    co, kh, kw = w.shape[0], w.shape[1], w.shape[2]
    if kh * kw == 1:
        return None
    used = np.any(w != 0, axis=3)  # [Cout, KH, KW]
    rows, cols = np.any(used, axis=2), np.any(used, axis=1)
    boxes = []
    for i in range(co):
        r, c = np.flatnonzero(rows[i]), np.flatnonzero(cols[i])
        # A channel of zeros needs no tap; it takes its neighbour's window (or the whole).
        box = (int(r[0]), int(r[-1]) + 1, int(c[0]), int(c[-1]) + 1) if r.size else None
        boxes.append(box)
    segments: list[tuple[int, int, int, int, int, int]] = []
    for i, box in enumerate(boxes):
        if box is None:
            box = segments[-1][2:] if segments else (0, kh, 0, kw)
        if segments and segments[-1][2:] == box:
            segments[-1] = (segments[-1][0], i + 1, *box)
        else:
            segments.append((i, i + 1, *box))
    if len(segments) > MAX_TAP_SEGMENTS or all(sg[2:] == (0, kh, 0, kw) for sg in segments):
        return None
    return segments
