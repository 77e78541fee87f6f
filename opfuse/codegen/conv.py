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
from typing import Any

import numpy as np

from opfuse.codegen.conv_fragments import (
    TapInput,
    concat_stores,
    depthwise_taps,
    pad_geometry,
    padded_load,
    shortcut_loop,
    shortcut_params,
    source_pixel,
    split_k_launch,
    split_k_reduction,
    tap_segments,
    window_position,
    window_prologue,
)
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
from opfuse.codegen.source import SourceBuffer, comment_text
from opfuse.graph import Graph, Node
from opfuse.ir.ops import MAX_POOL_NHWC, NHWC_CONV, has_shortcut, is_depthwise
from opfuse.ir.queries import next_pow2
from opfuse.ir.support import INT32_INDEX_LIMIT, centre_tap, conv_params, input_scale_operands


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
    tap = TapInput(p, padding)

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
                    depthwise_taps(buf, tap, f"tl.static_range(0, {taps})")
                buf.line("else:")
                with buf.indent():
                    depthwise_taps(buf, tap, f"range(0, {taps})")
            else:
                depthwise_taps(buf, tap, f"tl.static_range(0, {taps})")
        elif window is not None and not pooled:
            window_prologue(buf, graph, window, prologue[1:], {**literals}, c, n, dot)
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
                padded_load(buf, tap, source_pixel(buf, tap, "ih", "iw", "img[:, None]"), "ok")
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
                    padded_load(buf, tap, "base[:, None]", "a_ok")
                if scale:
                    scale_tile("a_ok")
                buf.line(
                    f"b_tile = tl.load(w + rn[None, :] * {k} + t * {c} + ci[:, None], mask=(ci[:, None] < {c}) & (rn[None, :] < {n}), other=0.0)"
                )
                dot("a_tile", "b_tile")

            def window_body() -> None:
                window_position(buf, tap)
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
                        window_position(buf, tap)
                        buf.line("c0 = (it % blocks) * BLOCK_K")
                        channel_block()
            else:
                buf.line(f"for t in range(0, {kh_ * kw_}):")
                with buf.indent():
                    window_body()
        if sx_name:
            shortcut_loop(buf, shortcut_params(graph, anchor), n, dot)
        if splittable:
            split_k_reduction(buf)
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
            concat_stores(buf, graph, concat, copied, outputs, regs, views)
    if splittable:
        split_k_launch(buf, fn, args, m, n)
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
