"""Linear projections that read the same input (attention's Q, K, V) become one wider GEMM
followed by a Split: one launch instead of three, and a better-shaped product at small batch."""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.rules import NotFired, RuleLog, node_label

MERGE_RULE = names.MERGE_PROJECTIONS


def _projection(graph: Graph, mm: Node) -> tuple[Node | None, str] | None:
    """(bias Add or None, the value the projection produces) for a MatMul by a constant 2-D weight."""
    if (
        mm.op_type != "MatMul"
        or mm.inputs[1] not in graph.constants
        or graph.constants[mm.inputs[1]].ndim != 2
    ):
        return None
    users = graph.consumers().get(mm.outputs[0], [])
    n = graph.constants[mm.inputs[1]].shape[1]
    if len(users) == 1 and users[0].op_type == "Add" and mm.outputs[0] not in {o.name for o in graph.outputs}:
        add = users[0]
        bias = add.inputs[1] if add.inputs[0] == mm.outputs[0] else add.inputs[0]
        if bias in graph.constants and graph.constants[bias].shape in ((n,),):
            return add, add.outputs[0]
    return None, mm.outputs[0]


def merge_projections(graph: Graph, log: RuleLog) -> None:
    by_input: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.op_type == "MatMul" and n.inputs[0] not in graph.constants and _projection(graph, n) is not None:
            by_input.setdefault(n.inputs[0], []).append(n)
    for x, mms in by_input.items():
        if len(mms) < 2:
            continue
        infos = [_projection(graph, mm) for mm in mms]
        with_bias = [i for i in infos if i is not None and i[0] is not None]
        if 0 < len(with_bias) < len(mms):
            log.not_fired.append(
                NotFired(
                    MERGE_RULE, [node_label(m) for m in mms], "some projections have a bias and some do not"
                )
            )
            continue
        weights = [graph.constants[mm.inputs[1]] for mm in mms]
        if len({w.dtype for w in weights}) != 1 or len({w.shape[0] for w in weights}) != 1:
            log.not_fired.append(
                NotFired(MERGE_RULE, [node_label(m) for m in mms], "weights differ in type or depth")
            )
            continue
        _merge(graph, x, mms, infos)  # type: ignore[arg-type]
        log.fired[MERGE_RULE] = log.fired.get(MERGE_RULE, 0) + 1


def _merge(graph: Graph, x: str, mms: list[Node], infos: list[tuple[Node | None, str]]) -> None:
    first = mms[0]
    sizes = [graph.constants[mm.inputs[1]].shape[1] for mm in mms]
    w = np.concatenate([graph.constants[mm.inputs[1]] for mm in mms], axis=1)
    out_shape = (*graph.spec(x).shape[:-1], int(sum(sizes)))
    dtype = graph.spec(first.outputs[0]).dtype
    names: dict[str, Any] = {k: f"{first.id}_merged_{k}" for k in ("w", "mm", "b", "sum", "sizes")}
    graph.constants[names["w"]] = w
    graph.values[names["w"]] = TensorSpec(names["w"], graph.spec(first.inputs[1]).dtype, tuple(w.shape))
    graph.values[names["mm"]] = TensorSpec(names["mm"], dtype, out_shape)
    new: list[Node] = [
        Node(f"{first.id}q", "MatMul", [x, names["w"]], [names["mm"]], {}, "+".join(m.name for m in mms))
    ]
    split_in = names["mm"]
    adds = [info[0] for info in infos]
    if all(a is not None for a in adds):
        biases = []
        for mm, add in zip(mms, adds, strict=True):
            assert add is not None
            bias = add.inputs[1] if add.inputs[0] == mm.outputs[0] else add.inputs[0]
            biases.append(graph.constants[bias])
        b = np.concatenate(biases)
        graph.constants[names["b"]] = b
        graph.values[names["b"]] = TensorSpec(names["b"], graph.spec(first.inputs[1]).dtype, tuple(b.shape))
        graph.values[names["sum"]] = TensorSpec(names["sum"], dtype, out_shape)
        new.append(
            Node(
                f"{first.id}r",
                "Add",
                [names["mm"], names["b"]],
                [names["sum"]],
                {},
                "+".join(a.name for a in adds if a is not None),
            )
        )
        split_in = names["sum"]
    graph.constants[names["sizes"]] = np.asarray(sizes, dtype=np.int64)
    graph.values[names["sizes"]] = TensorSpec(names["sizes"], "int64", (len(sizes),))
    outs = [info[1] for info in infos]
    new.append(
        Node(f"{first.id}s", "Split", [split_in, names["sizes"]], outs, {"axis": -1}, "merged projections")
    )
    removed = {m.id for m in mms} | {a.id for a in adds if a is not None}
    # The merged nodes go where the last projection was, so every consumer still comes after.
    last = max(i for i, n in enumerate(graph.nodes) if n.id in removed)
    graph.splice(last + 1, new, removed)
