"""The graph every stage works on once shapes are static: values are names with a dtype and a
shape (`TensorSpec`), nodes carry generated ids, constants are numpy arrays.

`opfuse.graph.graph_from_onnx` builds one from a checked, specialized ONNX model.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opfuse.errors import ModelError


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "float32", "float16", "int64", "bool", ...
    shape: tuple[int, ...]
    # An integer graph input that indexes a tensor (Gather's indices, ...): its values must stay
    # below this for the model to be valid; the random inputs of compile-time runs do.
    high: int | None = field(default=None, compare=False)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> TensorSpec:
        return TensorSpec(name=str(d["name"]), dtype=str(d["dtype"]), shape=tuple(int(x) for x in d["shape"]))


@dataclass
class Node:
    id: str  # generated ("n0", "n1", ...): the only identifier codegen ever sees
    op_type: str
    inputs: list[str]  # "" marks a missing optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # the model's node name: reports only, never code


@dataclass
class Graph:
    nodes: list[Node]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    constants: dict[str, np.ndarray]
    values: dict[str, TensorSpec]
    # Rules the job switched off (fusion.disable) that codegen reads: "split_k".
    disabled: set[str] = field(default_factory=set)

    def producers(self) -> dict[str, Node]:
        return {out: n for n in self.nodes for out in n.outputs if out}

    def consumers(self) -> dict[str, list[Node]]:
        uses: dict[str, list[Node]] = {}
        for n in self.nodes:
            for name in n.inputs:
                if name:
                    uses.setdefault(name, []).append(n)
        return uses

    def spec(self, name: str) -> TensorSpec:
        try:
            return self.values[name]
        except KeyError:
            raise ModelError(
                f"value {name!r} has no inferred shape and type; opfuse needs every shape static"
            ) from None

    def add_constant(self, name: str, array: np.ndarray, dtype: str) -> str:
        """A constant a rewrite makes: its array and its spec (`dtype`, the array's shape)."""
        self.constants[name] = array
        self.values[name] = TensorSpec(name, dtype, tuple(array.shape))
        return name

    def reshape_node(
        self, node_id: str, src: str, shape: tuple[int, ...], out: str, name: str = "", target: str = ""
    ) -> Node:
        """A Reshape of `src` to `shape` writing `out` (its spec and the shape constant, `target`
        or `<node_id>_shape`, are added); the caller places the node."""
        target = self.add_constant(target or f"{node_id}_shape", np.array(shape, dtype=np.int64), "int64")
        self.values[out] = TensorSpec(out, self.spec(src).dtype, tuple(shape))
        return Node(node_id, "Reshape", [src, target], [out], {}, name)

    def splice(self, at: int, new: list[Node], removed: set[str]) -> None:
        """A rewrite's nodes: `new` inserted before position `at` (so every consumer of their
        outputs still comes after), then the nodes whose ids are in `removed` dropped."""
        self.nodes[at:at] = new
        self.nodes[:] = [n for n in self.nodes if n.id not in removed]

    def iter_nodes(self) -> Iterator[Node]:
        return iter(self.nodes)

    def copy(self) -> Graph:
        """A copy whose nodes, specs and constant table change independently of this graph's; the
        constant arrays themselves are shared (passes replace constants, never write into them),
        which saves copying every weight (hundreds of MB for a transformer) per copy."""
        memo: dict[int, Any] = {id(arr): arr for arr in self.constants.values()}
        return copy.deepcopy(self, memo)
