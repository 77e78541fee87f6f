"""Building generated source safely: an indented buffer and comment escaping."""

from __future__ import annotations

import math


class SourceBuffer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.level = 0

    def line(self, text: str = "") -> None:
        self.lines.append(("    " * self.level + text) if text else "")

    def indent(self) -> _Indent:
        return _Indent(self)

    def getvalue(self) -> str:
        return "\n".join(self.lines) + "\n"


class _Indent:
    def __init__(self, buf: SourceBuffer) -> None:
        self.buf = buf

    def __enter__(self) -> None:
        self.buf.level += 1

    def __exit__(self, *exc: object) -> None:
        self.buf.level -= 1


def comment_text(text: str, limit: int = 80) -> str:
    """Model-supplied text made safe for one comment line: ASCII escapes, no line breaks."""
    escaped = text.encode("unicode_escape").decode("ascii")
    escaped = "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in escaped)
    if len(escaped) > limit:
        escaped = escaped[: limit - 3] + "..."
    return escaped


def in_bounds(offset: str, mask: str, run: int = 1, axis: int = 1) -> str:
    """A gather's `offset` where `mask` holds, else 0: a masked-off lane (a window tap in the
    padding, a channel past C, a row past the batch) addresses the tensor's first element, never
    memory outside it. Masked lanes are not read, but Triton's pipelined loads on Hopper were seen
    issuing their addresses: compute-sanitizer found a conv's tap load reading one element past a
    32 MiB input, and in a compile that address was unmapped (an illegal memory access).

    The select hides from Triton that a tile's offsets run contiguously along one axis, so each
    lane was loaded alone (`ld.global.b16` in the PTX of a depthwise conv, 4x slower than cuDNN on
    the H200). `run` > 1 tells it again: along `axis` of the 2-D tile the offsets come in runs of
    `run` consecutive elements, each starting at a multiple of `run`. The caller guarantees it
    (`channel_run`, `power_run`); a run whose mask is off is all 0, and loads nothing."""
    safe = f"tl.where({mask}, {offset}, 0)"
    if run <= 1:
        return safe
    hint = f"[1, {run}]" if axis == 1 else f"[{run}, 1]"
    return f"tl.max_contiguous(tl.multiple_of({safe}, {hint}), {hint})"


def guarded_load(ptr: str, offset: str, mask: str, other: str = "0.0", run: int = 1, axis: int = 1) -> str:
    """`tl.load` of `ptr + offset` on the lanes of `mask` (`other` elsewhere) whose every lane,
    masked-off ones too, addresses inside the tensor (`in_bounds`, with its `run` and `axis`).

    The form of every masked load inside a loop a kernel runs: Triton pipelines those on the
    GPU (cp.async on Hopper), which issues the addresses of masked-off lanes as well; a tile's
    lanes past the last row, column or K step then address memory past the tensor, an illegal
    memory access where that is unmapped. The interpreter's bounds checks hold every such load to
    this (runtime/bounds.py)."""
    return f"tl.load({ptr} + {in_bounds(offset, mask, run, axis)}, mask={mask}, other={other})"


def power_run(*values: int) -> int:
    """The largest power of two up to 8 dividing every value (0 divides by anything)."""
    run = 8
    while run > 1 and any(v % run for v in values):
        run //= 2
    return run


def channel_run(channels: int) -> int:
    """The run `in_bounds` may claim for a [pixels, channels] tile of NHWC offsets `pixel *
    channels + c`, c from a tile start that is a multiple of 8: the largest power of two up to 8
    (16 bytes of fp16) dividing the channel count; 1 where none does."""
    return power_run(channels)


def float_literal(value: float) -> str:
    """A finite float as Python source. Callers pass non-finite values as tensors instead."""
    if not math.isfinite(value):
        raise ValueError("non-finite constants are passed as tensors, not literals")
    return repr(float(value))


def fixed_header(source: str) -> str:
    """The kernel's first comment line stays on top; the rest of its leading comments (the ONNX
    nodes it covers, shapes) move to the end of the module.

    Triton keys its compile cache on the jitted function's source *and its line number*: with a
    header of fixed length, the identical kernels of repeated layers (a transformer's 12 blocks)
    have one key, compile once and share one tuning-cache entry.
    """
    lines = source.rstrip("\n").split("\n")
    head = 0
    while head < len(lines) and lines[head].startswith("#"):
        head += 1
    if head <= 1:
        return source
    moved = lines[1:head]
    out = [lines[0], *lines[head:], "", "# What this kernel computes:", *moved]
    return "\n".join(out) + "\n"
