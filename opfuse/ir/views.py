"""What fusion hands codegen about values read in place: strided views of a buffer, and an
attention match (its Q, Kᵀ, V and output views)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opfuse.ir.graph import Node


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
