"""Window geometry, as the templates that slide a 2-D window write it: a conv's taps, a pool's,
and the depthwise conv or pool a conv computes on its input tiles (its prologue).

A `Window` is the input's size and the kernel's shape, strides, padding and dilation; its
methods write the Triton expressions of a tap: the input pixel a window position reads and
whether it is inside the input (outside it is the padding).
"""

from __future__ import annotations

from dataclasses import dataclass

from opfuse.codegen.source import SourceBuffer
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import AVERAGE_POOL_NHWC
from opfuse.ir.support import pool_params


@dataclass(frozen=True)
class Window:
    h: int  # the input's height and width
    w: int
    kh: int  # the kernel's height and width
    kw: int
    sh: int  # strides
    sw: int
    ph: int  # top and left padding
    pw: int
    dh: int  # dilations
    dw: int

    @classmethod
    def of(cls, p: dict[str, int]) -> Window:
        """The window of `ir.support.conv_params` or `pool_params`."""
        return cls(p["H"], p["W"], p["KH"], p["KW"], p["SH"], p["SW"], p["PH"], p["PW"], p["DH"], p["DW"])

    @property
    def taps(self) -> int:
        return self.kh * self.kw

    def origin(self, oh: str, ow: str) -> tuple[str, str]:
        """The input pixel of the window's first tap for output pixel (oh, ow)."""
        return f"{oh} * {self.sh} - {self.ph}", f"{ow} * {self.sw} - {self.pw}"

    def tap(self, origin: tuple[str, str], t: str) -> tuple[str, str]:
        """The input pixel of window position `t` (row-major over the kernel) from `origin`."""
        return f"{origin[0]} + ({t} // {self.kw}) * {self.dh}", f"{origin[1]} + ({t} % {self.kw}) * {self.dw}"

    def inside(self, ih: str, iw: str) -> str:
        """Whether input pixel (ih, iw) is inside the input (else the window's padding)."""
        return f"({ih} >= 0) & ({ih} < {self.h}) & ({iw} >= 0) & ({iw} < {self.w})"

    def emit_tap(
        self, buf: SourceBuffer, origin: tuple[str, str], t: str, rows_ok: str, names: tuple[str, str, str]
    ) -> None:
        """`names` = (ih, iw, ok): window position `t`'s input pixel, and `rows_ok` where it is
        inside the input."""
        ih, iw, ok = names
        th, tw = self.tap(origin, t)
        buf.line(f"{ih} = {th}")
        buf.line(f"{iw} = {tw}")
        buf.line(f"{ok} = {rows_ok} & {self.inside(ih, iw)}")


def counted_region(p: dict[str, int], pool: Node) -> tuple[int, int, int, int]:
    """(top, bottom, left, right): the input rows [top, bottom) and columns [left, right) whose taps
    an average pool divides by. count_include_pad=1: the padded input, without the ceil_mode
    overhang past the end pads (onnxruntime's count); 0: the input alone."""
    if int(pool.attrs.get("count_include_pad", 0)) == 1:
        return -p["PH"], p["H"] + p["PH_END"], -p["PW"], p["W"] + p["PW_END"]
    return 0, p["H"], 0, p["W"]


def windows_inside(p: dict[str, int], counted: tuple[int, int, int, int]) -> bool:
    """Whether every tap of every output pixel's window lies inside `counted` (then each window
    counts all its taps: a constant divisor)."""
    top, bottom, left, right = counted
    last_row = (p["OH"] - 1) * p["SH"] - p["PH"] + (p["KH"] - 1) * p["DH"]
    last_col = (p["OW"] - 1) * p["SW"] - p["PW"] + (p["KW"] - 1) * p["DW"]
    return -p["PH"] >= top and -p["PW"] >= left and last_row < bottom and last_col < right


@dataclass(frozen=True)
class PoolTaps:
    """A max or average pool computed tap by tap, by the pool template and by a conv on its input
    tiles alike (so a conv's tile is the one the pool's kernel would store). An average pool's
    divisor is onnxruntime's count (`counted_region`, `windows_inside`)."""

    window: Window
    counted: tuple[int, int, int, int] | None = None  # an average pool's counted region; None: a max pool
    constant: bool = True  # every window lies inside `counted`: the divisor is the window's taps

    @classmethod
    def of(cls, graph: Graph, pool: Node) -> PoolTaps:
        p = pool_params(graph, pool)
        if pool.op_type != AVERAGE_POOL_NHWC:
            return cls(Window.of(p))
        counted = counted_region(p, pool)
        return cls(Window.of(p), counted, windows_inside(p, counted))

    @property
    def average(self) -> bool:
        return self.counted is not None

    @property
    def fill(self) -> str:
        """What a tap outside the input loads: -inf never wins a maximum, 0 adds nothing to a sum."""
        return "0.0" if self.average else 'float("-inf")'

    def emit_start(self, buf: SourceBuffer, acc: str, block: str, count: str, count_shape: str) -> None:
        """The [BLOCK_M, `block`] accumulator `acc` (pixels by channels), and an average pool's
        per-pixel tap counter `count` (of shape `count_shape`, the shape of the taps' pixel
        coordinates) where windows count different taps."""
        if not self.average:
            buf.line(f'{acc} = tl.full((BLOCK_M, {block}), float("-inf"), dtype=tl.float32)')
            return
        buf.line(f"{acc} = tl.zeros((BLOCK_M, {block}), dtype=tl.float32)")
        if not self.constant:
            buf.line(f"{count} = tl.zeros({count_shape}, dtype=tl.float32)")

    def emit_tap(self, buf: SourceBuffer, acc: str, value: str, count: str, ih: str, iw: str) -> None:
        """`value` (loaded with `fill` outside the input) into `acc`; an average pool counts the
        tap at input pixel (ih, iw) if it lies inside the counted region."""
        if not self.average:
            buf.line(f"{acc} = tl.maximum({acc}, {value}.to(tl.float32))")
            return
        buf.line(f"{acc} = {acc} + {value}.to(tl.float32)")
        if not self.constant:
            assert self.counted is not None
            top, bottom, left, right = self.counted
            buf.line(
                f"{count} += (({ih} >= {top}) & ({ih} < {bottom}) & ({iw} >= {left}) & ({iw} < {right})).to(tl.float32)"
            )

    def emit_mean(self, buf: SourceBuffer, acc: str, count: str) -> None:
        """An average pool's sum divided by its taps (`count`: the counter, broadcast to `acc`)."""
        if self.average:
            buf.line(
                f"{acc} = {acc} / {float(self.window.taps)!r}"
                if self.constant
                else f"{acc} = {acc} / {count}"
            )
