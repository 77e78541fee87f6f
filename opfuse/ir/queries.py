"""Graph queries every stage asks, and use-def lookups computed once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from opfuse.ir.graph import Graph, Node


def prod(dims: Sequence[int]) -> int:
    return int(np.prod(dims, dtype=np.int64))


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape)))


def scalar_constant(graph: Graph, name: str) -> float | None:
    """The value of a one-element constant, if it is one."""
    arr = graph.constants.get(name)
    if arr is None or arr.size != 1:
        return None
    return float(np.asarray(arr, dtype=np.float64).reshape(()))


class UseDef:
    """The producer and the readers of every value of a graph, computed once.

    A snapshot: for a stage that reads the graph without changing it (the fusion planner, codegen,
    coverage). A pass that rewrites nodes takes a new one after each rewrite (`Graph.producers()`
    and `Graph.consumers()` recompute on every call)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._producers = graph.producers()
        self._consumers = graph.consumers()
        self._outputs = frozenset(o.name for o in graph.outputs)

    def producer(self, value: str) -> Node | None:
        """The node that computes `value`; None for a graph input or a constant."""
        return self._producers.get(value)

    def consumers(self, value: str) -> list[Node]:
        """The nodes that read `value`, in graph order (a node reading it twice appears twice)."""
        return self._consumers.get(value, [])

    def is_output(self, value: str) -> bool:
        return value in self._outputs

    def sole_consumer(self, value: str) -> Node | None:
        """The one node reading `value`, where it has one reader and is no graph output."""
        users = self.consumers(value)
        return users[0] if len(users) == 1 and not self.is_output(value) else None
