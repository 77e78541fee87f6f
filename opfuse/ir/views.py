"""What fusion hands codegen about values read in place: strided views of a buffer, and an
attention match (its Q, Kᵀ, V and output views)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from opfuse.ir.graph import Node
from opfuse.ir.queries import contiguous_strides


@dataclass
class StridedView:
    base: str  # the materialized buffer (contiguous) that is actually read
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    scale: float = 1.0  # product of scalar Mul/Div folded on the way
    nodes: list[Node] = field(default_factory=list)  # the layout/scale nodes this view replaces
    offset: int = 0  # elements from the start of `base` (a Split output starts inside its input)
    # Ids of `nodes` that stay in the plan (their outputs have other readers): not absorbed.
    kept: set[str] = field(default_factory=set)

    def reads_in_order(self, base_elements: int) -> bool:
        """Whether the view reads all of its base in the base's own order (a reshape of it, the
        layout ops composing to the identity): element i of the view is element i of the base."""
        if self.offset or self.scale != 1.0 or self.kept or int(np.prod(self.shape)) != base_elements:
            return False
        want = contiguous_strides(self.shape)
        return all(e == 1 or s == w for e, s, w in zip(self.shape, self.strides, want, strict=True))

    def channel_window(self) -> int:
        """The channels of the wider NHWC buffer each pixel of this 4-D view steps over, where the
        view is a window of that buffer's channels (a channel Split or Slice of it); 0 where it
        is not one, or is the buffer's own order."""
        if len(self.shape) != 4 or len(self.strides) != 4 or self.scale != 1.0:
            return 0
        _, h, w, c = self.shape
        xc = int(self.strides[2])
        want = (h * w * xc, w * xc, xc, 1)
        if xc <= c or any(n > 1 and s != e for n, s, e in zip(self.shape, self.strides, want, strict=True)):
            return 0
        return xc

    def owned(self) -> list[Node]:
        """The layout nodes a kernel reading through this view replaces (they leave the plan)."""
        return [n for n in self.nodes if n.id not in self.kept]


@dataclass
class AttentionMatch:
    q: StridedView
    k: StridedView  # the Kᵀ view: [B, H, D, Sk]
    v: StridedView
    out: StridedView
    scale: float
    mask: str = ""  # additive mask [.., Sq, Sk]
    cond: str = ""  # boolean keep-mask for Where(cond, scores, fill)
    fill: float = 0.0
    nan_guard: bool = False
    nodes: list[Node] = field(default_factory=list)
    # Q (Kᵀ) read from the inputs of the Concat along the head dim that made it (a partial
    # rotary's rotated and passed-through halves): one view per input, in Q's (Kᵀ's) layout over
    # that input's slice of the head dim, in order. Empty: Q (Kᵀ) is read through `q` (`k`).
    q_parts: list[StridedView] = field(default_factory=list)
    k_parts: list[StridedView] = field(default_factory=list)
    # One-input pointwise ops on the output (scalar constants aside: LeViT's Hardswish before
    # its projection), computed on the output tile before it is stored through `out`.
    epilogue: list[Node] = field(default_factory=list)

    def inputs(self) -> list[str]:
        """The buffers the kernel reads, in its arguments' order: Q (or its parts), Kᵀ (or its
        parts), V, then the mask and the keep-mask where present."""
        q = [p.base for p in self.q_parts] or [self.q.base]
        k = [p.base for p in self.k_parts] or [self.k.base]
        return [*q, *k, self.v.base, *(x for x in (self.mask, self.cond) if x)]
