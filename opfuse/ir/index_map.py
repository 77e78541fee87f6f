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
from dataclasses import dataclass, replace

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

    def rows(self) -> IndexMap | None:
        """The same map over rows: every step's last axis dropped, where no step touches the last
        axis (its size the same throughout, neither moved, sliced, padded nor gathered), so that
        an element's place in `base` is its row's place times the last size, plus its column.
        A window partition (a Pad, Reshapes and a Transpose of the tokens, the channels left
        alone) is one: a GEMM loads each A row's K elements from one place (codegen/gemm.py).
        None where a step touches the last axis, or a shape would be left without an axis."""
        last = self.shape[-1] if self.shape else -1
        if len(self.base_shape) < 2 or len(self.shape) < 2 or self.base_shape[-1] != last:
            return None
        steps: list[IndexStep] = []
        for s in self.steps:
            if (
                len(s.in_shape) < 2
                or len(s.out_shape) < 2
                or s.in_shape[-1] != last
                or s.out_shape[-1] != last
            ):
                return None
            fields: dict[str, object] = {"in_shape": s.in_shape[:-1], "out_shape": s.out_shape[:-1]}
            if s.op == "transpose":
                if s.perm[-1] != len(s.perm) - 1:
                    return None
                fields["perm"] = s.perm[:-1]
            elif s.op == "slice":
                if s.starts[-1] != 0 or s.steps[-1] != 1:
                    return None
                fields.update(starts=s.starts[:-1], steps=s.steps[:-1])
            elif s.op == "pad":
                if s.begins[-1] != 0:
                    return None
                fields["begins"] = s.begins[:-1]
            elif s.op == "gather" and (
                s.axis >= len(s.in_shape) - 1 or s.axis + len(s.index_shape) >= len(s.out_shape)
            ):
                return None
            steps.append(replace(s, **fields))  # type: ignore[arg-type]
        return IndexMap(self.base, self.base_shape[:-1], self.shape[:-1], tuple(steps))
