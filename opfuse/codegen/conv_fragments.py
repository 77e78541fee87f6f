"""Pieces of the NHWC conv template (codegen/conv.py) that stand on their own: a Pad prologue's
geometry, the shortcut's second K loop, the Concat stores, the
window prologue (a depthwise conv or a pool on the input tiles) and the zero-weight tap segments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from opfuse.codegen.epilogue import emit_nodes
from opfuse.codegen.source import SourceBuffer, channel_run, float_literal, guarded_load, power_run
from opfuse.codegen.window import PoolTaps, Window
from opfuse.graph import Graph, Node
from opfuse.ir.ops import NHWC_POOLS
from opfuse.ir.support import conv_params, pad_per_dim


def pad_geometry(graph: Graph, pad: Node, nhwc: bool = False) -> dict[str, Any]:
    """A 4-D Pad of the spatial axes only, as a conv prologue reads it: the source's H and W, the
    top and left pads, the mode, a constant Pad's value as a literal, and whether the source is
    NHWC (`nhwc`: a Pad in the channels-last region) or NCHW (a Pad before the region's
    Transpose). The region's Transpose to NHWC alone (layout_prologue) reads its NCHW source
    unpadded: mode "nchw"."""
    shape = graph.spec(pad.inputs[0]).shape
    if pad.op_type == "Transpose":
        h, w = shape[2:]
        return {"H": h, "W": w, "top": 0, "left": 0, "mode": "nchw", "value": "0.0", "nhwc": False}
    (h, w), axes = (shape[1:3], (1, 2)) if nhwc else (shape[2:], (2, 3))
    per_dim = pad_per_dim(graph, pad)
    assert per_dim is not None  # checked by the planner (fusion.anchors.pad_prologue_reason)
    value = 0.0
    if len(pad.inputs) > 2 and pad.inputs[2]:
        value = float(np.asarray(graph.constants[pad.inputs[2]]).reshape(()))
    return {
        "H": h,
        "W": w,
        "top": per_dim[axes[0]][0],
        "left": per_dim[axes[1]][0],
        "mode": str(pad.attrs.get("mode", "constant")),
        "value": float_literal(value),
        "nhwc": nhwc,
    }


def shortcut_params(graph: Graph, conv: Node) -> dict[str, int]:
    """The summed 1x1 shortcut of an `opfuse.ConvNHWC` (passes/shortcut_conv.py): its input's
    H, W and channels, and its strides."""
    _, h, w, c = graph.spec(conv.inputs[3]).shape
    sh, sw = (int(v) for v in conv.attrs["shortcut_strides"])
    return {"H": h, "W": w, "C": c, "SH": sh, "SW": sw}


def shortcut_loop(
    buf: SourceBuffer, s: dict[str, int], n: int, dot: Callable[[str, str], None], split: bool = False
) -> None:
    """The shortcut's K loop, after the conv's own: the channels of xs at the strided pixel
    (oh * SH, ow * SW) of each output row, times the shortcut's weight as [CO, C2], into the same
    accumulator. The pixel is inside xs for every output row (a 1x1 window without padding).
    `split` (SPLIT_K > 1): this program's channel blocks only, every SPLIT_K-th."""
    c2 = s["C"]
    buf.line(f"s_base = ((img * {s['H']} + oh * {s['SH']}) * {s['W']} + ow * {s['SW']}) * {c2}")
    blocks = (
        f"range(tl.program_id(2) * BLOCK_K, {c2}, SPLIT_K * BLOCK_K)" if split else f"range(0, {c2}, BLOCK_K)"
    )
    buf.line(f"for c0 in {blocks}:")
    with buf.indent():
        buf.line("ci = c0 + rk")
        buf.line(f"a_ok = row_ok[:, None] & (ci[None, :] < {c2})")
        buf.line(
            f"a_tile = {guarded_load('xs', 's_base[:, None] + ci[None, :]', 'a_ok', run=channel_run(c2))}"
        )
        ws_ok = f"(ci[:, None] < {c2}) & (rn[None, :] < {n})"
        buf.line(
            f"b_tile = {guarded_load('ws', f'rn[None, :] * {c2} + ci[:, None]', ws_ok, run=power_run(c2), axis=0)}"
        )
        dot("a_tile", "b_tile")


def concat_stores(
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
                run = power_run(v.offset, *v.strides[:3]) if v.strides[3] == 1 else 1
            else:
                src, run = f"rm[:, None] * {cx} + cc[None, :]", power_run(cx)
            buf.line(f"for c0 in range(tl.program_id(1) * BLOCK_N, {cx}, tl.num_programs(1) * BLOCK_N):")
            with buf.indent():
                buf.line("cc = c0 + tl.arange(0, BLOCK_N)")
                buf.line(f"c_ok = row_ok[:, None] & (cc[None, :] < {cx})")
                buf.line(f"cv = {guarded_load(f'cat{copied.index(x)}', src, 'c_ok', run=run)}")
                buf.line(
                    f"tl.store(out{i} + row_dst + {offset} + cc[None, :], cv.to(out{i}.dtype.element_ty), mask=c_ok)"
                )


def window_prologue(
    buf: SourceBuffer,
    graph: Graph,
    dw: Node,
    chain: list[Node],
    regs: dict[str, str],
    c: int,
    n: int,
    dot: Callable[[str, str], None],
) -> None:
    """A 1x1 conv's K loop (stride 1, unpadded: its pixels are the prologue's) whose input tiles
    are a depthwise conv's output (fp32 multiply-adds over the window) or a pool's (`PoolTaps`:
    the window's maximum, or its average), computed from their input `x` as they are needed, then
    the one-input activation after it (`chain`), rounded to the model's type as a stored tensor
    would be."""
    pool = PoolTaps.of(graph, dw) if dw.op_type in NHWC_POOLS.values() else None
    d = pool.window if pool is not None else Window.of(conv_params(graph, dw))
    fill = pool.fill if pool is not None else "0.0"
    taps = d.taps
    buf.line(f"for c0 in range(0, {c}, BLOCK_K):")
    with buf.indent():
        buf.line("ci = c0 + rk")
        buf.line(f"c_ok = ci < {c}")
        if pool is not None:
            pool.emit_start(buf, "dacc", "BLOCK_K", "dcount", "(BLOCK_M,)")
        else:
            buf.line("dacc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)")
        buf.line(f"for t in tl.static_range(0, {taps}):")
        with buf.indent():
            d.emit_tap(buf, d.origin("oh", "ow"), "t", "row_ok", ("ih", "iw", "ok"))
            buf.line("x_ok = ok[:, None] & c_ok[None, :]")
            x_at = f"(((img * {d.h} + ih) * {d.w} + iw) * {c})[:, None] + ci[None, :]"
            buf.line(f"xv = {guarded_load('x', x_at, 'x_ok', fill, channel_run(c))}")
            if pool is not None:
                pool.emit_tap(buf, "dacc", "xv", "dcount", "ih", "iw")
            else:
                buf.line(f"wv = {guarded_load('dw', f'ci * {taps} + t', 'c_ok')}")
                buf.line("dacc = dacc + xv.to(tl.float32) * wv[None, :].to(tl.float32)")
        if pool is not None:
            pool.emit_mean(buf, "dacc", "dcount[:, None]")
        if len(dw.inputs) > 2 and dw.inputs[2]:
            buf.line(f"dacc = dacc + {guarded_load('db', 'ci', 'c_ok')}[None, :].to(tl.float32)")
        regs[dw.outputs[0]] = "dacc"
        emit_nodes(buf, graph, chain, regs, prefix="u")
        last = chain[-1].outputs[0] if chain else dw.outputs[0]
        buf.line(
            f"a_tile = tl.where(row_ok[:, None] & c_ok[None, :], {regs[last]}, 0.0).to(x.dtype.element_ty)"
        )
        w_ok = f"c_ok[:, None] & (rn[None, :] < {n})"
        buf.line(
            f"b_tile = {guarded_load('w', f'rn[None, :] * {c} + ci[:, None]', w_ok, run=power_run(c), axis=0)}"
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


# -- the tap and padded-load fragments: how the template reads x at a window position ------------


@dataclass(frozen=True)
class TapInput:
    """What the NHWC conv template reads its input through: the conv's geometry (`conv_params`)
    and a Pad prologue's or an NCHW source's (`pad_geometry`; None: x is the conv's own NHWC
    input)."""

    p: dict[str, int]
    padding: dict[str, Any] | None = None
    # x a window of channels of a wider NHWC buffer (the kernel's x pointer moved to its first
    # channel, `offset`): the buffer's channels, each pixel's stride. 0: x's own channels.
    pixel_stride: int = 0
    offset: int = 0

    @property
    def window(self) -> Window:
        return Window.of(self.p)

    @property
    def channel_stride(self) -> int:
        """The stride between input channels in x: 1 (NHWC), or a plane (a padded NCHW source)."""
        if self.padding is None or self.padding["nhwc"]:
            return 1
        return self.padding["H"] * self.padding["W"]


def source_pixel(buf: SourceBuffer, tap: TapInput, ih: str, iw: str, img_: str) -> str:
    """Emit what maps conv-input pixel (ih, iw) to x: for a Pad prologue, the source pixel
    (sh, sw) and, constant mode, `inside` (not a filled pixel). Returns the pixel's offset."""
    p, c, padding = tap.p, tap.p["C"], tap.padding
    if padding is None:
        return f"(({img_} * {p['H']} + {ih}) * {p['W']} + {iw}) * {tap.pixel_stride or c}"
    h0, w0 = padding["H"], padding["W"]
    if padding["mode"] == "nchw":  # the NCHW source itself: pixel (ih, iw) of channel 0
        return f"{img_} * {c * h0 * w0} + {ih} * {w0} + {iw}"
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
    if padding["nhwc"]:
        return f"(({img_} * {h0} + sh) * {w0} + sw) * {c}"
    return f"{img_} * {c * h0 * w0} + sh * {w0} + sw"


def padded_load(buf: SourceBuffer, tap: TapInput, offset: str, ok: str, blocked: bool = False) -> None:
    """a_tile from x at `offset` (+ the channels), where `ok`; a constant Pad's value where the
    pixel is a filled one. `blocked`: the channels `ci` are a block from a multiple of BLOCK_K
    (not a flattened K's), so without a Pad the loads run along them (`contiguous_run`)."""
    cs, padding = tap.channel_stride, tap.padding
    chan = "ci[None, :]" if cs == 1 else f"ci[None, :] * {cs}"
    if padding is None or padding["mode"] != "constant":
        run = contiguous_run(tap) if blocked else 1
        buf.line(f"a_tile = {guarded_load('x', f'{offset} + {chan}', ok, run=run)}")
        return
    fill = padding["value"]
    buf.line(f"read_ok = {ok} & inside")
    buf.line(f"a_tile = {guarded_load('x', f'{offset} + {chan}', 'read_ok', fill)}")
    if fill != "0.0":  # the conv's own padding (outside the padded tensor) stays 0
        buf.line(f"a_tile = tl.where({ok}, a_tile, 0.0).to(a_tile.dtype)")


def contiguous_run(tap: TapInput) -> int:
    """The run of contiguous channels a tap's [pixels, channels] loads may claim (`in_bounds`):
    NHWC input, read directly or through an NHWC Pad (which moves whole pixels), channels at
    stride 1."""
    if tap.channel_stride != 1:
        return 1
    if tap.padding is not None:
        return channel_run(tap.p["C"])
    if tap.pixel_stride:  # runs aligned in the wider buffer: its channels and the window's start too
        return power_run(tap.p["C"], tap.pixel_stride, tap.offset)
    return channel_run(tap.p["C"])


def window_position(buf: SourceBuffer, tap: TapInput) -> None:
    """Window position t: the input pixel each output row reads, whether it is inside the
    image, and the offset of its channels (NHWC)."""
    tap.window.emit_tap(buf, ("ih0", "iw0"), "t", "row_ok", ("ih", "iw", "ok"))
    padding = tap.padding
    buf.line(f"base = {source_pixel(buf, tap, 'ih', 'iw', 'img')}")
    if padding is not None and padding["mode"] == "constant":
        buf.line("inside = inside[:, None]")


def depthwise_taps(buf: SourceBuffer, tap: TapInput, loop: str) -> None:
    """Each output channel reads its own input channel: a [pixels, channels] tile of
    multiply-adds per window position t, channels contiguous in memory (BLOCK_K unused)."""
    buf.line(f"for t in {loop}:")
    with buf.indent():
        window_position(buf, tap)
        buf.line("x_ok = ok[:, None] & col_ok[None, :]")
        padding = tap.padding
        if padding is not None and padding["mode"] == "constant":  # an NHWC Pad's filled pixels
            fill = padding["value"]
            buf.line("read_ok = x_ok & inside")
            buf.line(f"xv = {guarded_load('x', 'base[:, None] + rn[None, :]', 'read_ok', fill)}")
            if fill != "0.0":  # the conv's own padding (outside the padded tensor) stays 0
                buf.line("xv = tl.where(x_ok, xv, 0.0).to(xv.dtype)")
        else:
            buf.line(
                f"xv = {guarded_load('x', 'base[:, None] + rn[None, :]', 'x_ok', run=contiguous_run(tap))}"
            )
        taps = tap.p["KH"] * tap.p["KW"]
        buf.line(f"wv = {guarded_load('w', f'rn[None, :] * {taps} + t', 'col_ok[None, :]')}")
        buf.line("acc = acc + xv.to(tl.float32) * wv.to(tl.float32)")
