"""A value read through a chain of layout ops that includes a constant Pad or a Gather by constant
indices: fusion/pad_gather.py plans it, codegen/index_map.py writes its loads.

Strided views (ir/views.py) cover Transpose, Reshape and Slice where the elements keep one
stride per dim. A Pad breaks that (its border holds no element of the buffer), and so does a
Reshape of a padded value (the rows of a relative-position shift: pad, flatten, pad, reshape,
slice), and so does a Gather by constant indices no stride describes (the dynamo exporter's
adaptive pooling: overlapping windows, clamped). An IndexMap keeps the chain as steps, and the
kernel walks an element's coordinates back through them, each Pad masking the lanes in its border
to its value, each Gather loading the coordinate from its index table (a kernel input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The ops a step can be (their ONNX spellings map onto these).
STEP_OPS = ("reshape", "transpose", "slice", "pad", "expand", "gather")


@dataclass
class IndexStep:
    """One layout op, from its output's coordinates back to its input's."""

    op: str  # one of STEP_OPS
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    perm: tuple[int, ...] = ()  # transpose: output axis i is input axis perm[i]
    starts: tuple[int, ...] = ()  # slice: input coordinate = output coordinate * step + start, per axis
    steps: tuple[int, ...] = ()
    begins: tuple[int, ...] = ()  # pad: input coordinate = output coordinate - begin, per axis
    value: float = 0.0  # pad: the border's value
    # gather: the output's axes axis .. axis + len(index_shape) - 1 are the index table's; the
    # input coordinate on `axis` is the table's entry there. `table`: the constant's name.
    axis: int = 0
    table: str = ""
    index_shape: tuple[int, ...] = ()


@dataclass
class IndexMap:
    """A kernel input of `shape` computed from the contiguous buffer `base` (of `base_shape`) by
    `steps`, the nearest to the kernel first."""

    base: str
    base_shape: tuple[int, ...]
    shape: tuple[int, ...]
    steps: tuple[IndexStep, ...]

    def extent(self) -> int:
        """One past the farthest element of `base` a load may read."""
        return math.prod(self.base_shape)

    def tables(self) -> list[str]:
        """The index tables its Gathers read, nearest to the kernel first."""
        return [s.table for s in self.steps if s.op == "gather"]
