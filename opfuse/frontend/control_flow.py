"""Fold what is known at compile time, so that every shape is static and If nodes on shapes go away.

Once `input_shapes` bind every dim, Shape and Size of any tensor are constants, and so is all the
arithmetic exporters write on them (Gather, Concat, Slice, Transpose, Cast, ConstantOfShape, Equal,
...). ONNX shape inference only propagates values through some of those ops, so this folds them
(with the ONNX reference evaluator: numpy, no torch), and inlines each If whose condition that makes
a constant (TorchScript writes "If this dim is 1, Squeeze"). An If whose condition depends on run-time
data stays, to be refused as control flow.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from opfuse.frontend.static_values import runtime_values

DEFAULT_DOMAINS = ("", "ai.onnx")
# Rounds of fold, inline, infer: a nested If or a shape behind an If needs one more each.
MAX_ROUNDS = 16
# Only small values are folded here (shape arithmetic); the passes fold the big ones (weights) later.
FOLD_MAX_ELEMENTS = 1 << 16
NOT_FOLDED = frozenset({"If", "Loop", "Scan", "Constant"})
# Ops whose outputs are never larger than their inputs (times the rank): folded even when shape
# inference cannot tell their output shape (it depends on the data).
BOUNDED_BY_INPUT = frozenset({"NonZero", "Compress", "Unique"})

InferFn = Callable[[onnx.ModelProto], onnx.ModelProto]


def fold_compile_time_values(model: onnx.ModelProto, infer: InferFn) -> onnx.ModelProto:
    """The model with compile-time values folded into initializers and static Ifs inlined.

    `infer` is the frontend's shape inference (strict), run after every round that changed anything.
    """
    for _ in range(MAX_ROUNDS):
        changed = _constants_to_initializers(model)
        changed |= _fold_round(model)
        changed |= _inline_constant_ifs(model)
        if not changed:
            break
        del model.graph.value_info[:]
        model = infer(model)
    return model


def _constants_to_initializers(model: onnx.ModelProto) -> bool:
    g = model.graph
    kept, moved = [], False
    for node in g.node:
        attr = node.attribute[0] if len(node.attribute) == 1 else None
        if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS and attr is not None:
            value = _constant_value(attr)
            if value is not None:
                g.initializer.append(numpy_helper.from_array(value, node.output[0]))
                moved = True
                continue
        kept.append(node)
    if moved:
        del g.node[:]
        g.node.extend(kept)
    return moved


def _constant_value(attr: onnx.AttributeProto) -> np.ndarray | None:
    if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
        return numpy_helper.to_array(attr.t)
    if attr.name == "value_float":
        return np.array(attr.f, dtype=np.float32)
    if attr.name == "value_floats":
        return np.array(list(attr.floats), dtype=np.float32)
    if attr.name == "value_int":
        return np.array(attr.i, dtype=np.int64)
    if attr.name == "value_ints":
        return np.array(list(attr.ints), dtype=np.int64)
    return None  # sparse or string constants: left alone


def _fold_round(model: onnx.ModelProto) -> bool:
    """Fold every small node of compile-time inputs, and Shape/Size of statically shaped tensors."""
    g = model.graph
    runtime = runtime_values(model)
    shapes = _static_shapes(model)
    sizes = {init.name: int(np.prod(init.dims)) for init in g.initializer}
    graph_outputs = {vi.name for vi in g.output}
    to_fold: list[onnx.NodeProto] = []
    pending: set[str] = set()  # outputs of nodes already picked this round
    values: dict[str, np.ndarray] = {}
    for node in g.node:
        if node.domain not in DEFAULT_DOMAINS or node.op_type in NOT_FOLDED:
            continue
        outputs = [o for o in node.output if o]
        if any(o in runtime or o in graph_outputs for o in outputs):
            continue
        if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
            values.update(_shape_value(node, shapes[node.input[0]]))
            continue
        inputs = [x for x in node.input if x]
        known = all(x in sizes or x in values or x in pending for x in inputs)
        small_in = all(sizes.get(x, 0) <= FOLD_MAX_ELEMENTS for x in inputs)
        # Outputs must be known to be small: a ConstantOfShape of a huge constant shape is a memory
        # bomb in an untrusted model. Ops whose output is bounded by their input need no such proof.
        small_out = node.op_type in BOUNDED_BY_INPUT or all(
            o in shapes and int(np.prod(shapes[o])) <= FOLD_MAX_ELEMENTS for o in outputs
        )
        if known and small_in and small_out:
            to_fold.append(node)
            pending.update(outputs)
    if to_fold:
        values.update(_evaluate(model, to_fold, values))
    if not values:
        return False
    for name, value in values.items():
        g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    kept = [n for n in g.node if not any(o in values for o in n.output if o)]
    del g.node[:]
    g.node.extend(kept)
    return True


def _shape_value(node: onnx.NodeProto, shape: list[int]) -> dict[str, np.ndarray]:
    if node.op_type == "Size":
        return {node.output[0]: np.array(int(np.prod(shape)), dtype=np.int64)}
    rank = len(shape)
    attrs = {a.name: a.i for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return {node.output[0]: np.array(shape[start:end], dtype=np.int64)}


def _evaluate(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto], known: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Outputs of `nodes` (a topologically ordered set whose inputs are all known), or {} on failure."""
    from onnx.reference import ReferenceEvaluator

    inits = {init.name: init for init in model.graph.initializer}
    produced = {o for n in nodes for o in n.output if o}
    needed = sorted({x for n in nodes for x in n.input if x and x not in produced})
    feeds = {x: known[x] if x in known else numpy_helper.to_array(inits[x]) for x in needed}
    outputs = [o for n in nodes for o in n.output if o]
    graph = helper.make_graph(
        nodes,
        "fold",
        [
            helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for k, v in feeds.items()
        ],
        [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
    )
    sub = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    try:
        results = ReferenceEvaluator(sub).run(None, feeds)
    except Exception:
        return {}  # left to the passes (which fold with opfuse's own kernels) or refused later
    return {name: np.asarray(v) for name, v in zip(outputs, results, strict=True)}


def _inline_constant_ifs(model: onnx.ModelProto) -> bool:
    g = model.graph
    inits = {init.name: init for init in g.initializer}
    counter = itertools.count()
    new_nodes: list[onnx.NodeProto] = []
    done = False
    for node in g.node:
        if node.op_type != "If" or node.domain not in DEFAULT_DOMAINS or node.input[0] not in inits:
            new_nodes.append(node)
            continue
        cond = bool(numpy_helper.to_array(inits[node.input[0]]).reshape(-1)[0])
        branch = next(a.g for a in node.attribute if a.name == ("then_branch" if cond else "else_branch"))
        new_nodes += _inlined(branch, node, f"{node.name or 'if'}__inlined{next(counter)}", g)
        done = True
    if done:
        del g.node[:]
        g.node.extend(new_nodes)
    return done


def _inlined(
    branch: onnx.GraphProto, node: onnx.NodeProto, prefix: str, outer: onnx.GraphProto
) -> list[onnx.NodeProto]:
    """The branch's nodes, with the names it defines made unique, writing the If's outputs."""
    local = {o for n in branch.node for o in n.output if o} | {t.name for t in branch.initializer}
    rename = {name: f"{prefix}/{name}" for name in local}
    for init in branch.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(init)
        copy.name = rename[init.name]
        outer.initializer.append(copy)
    nodes = []
    for n in branch.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        # Names the branch does not define are values of the enclosing graph: they stay.
        copy.input[:] = [rename.get(x, x) for x in n.input]
        copy.output[:] = [rename.get(x, x) for x in n.output]
        copy.name = f"{prefix}/{n.name}" if n.name else ""
        nodes.append(copy)
    for vi, out in zip(branch.output, node.output, strict=True):
        if out:
            nodes.append(
                helper.make_node("Identity", [rename.get(vi.name, vi.name)], [out], name=f"{prefix}/out")
            )
    return nodes


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    g = model.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and tt.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
            if all(d >= 0 for d in dims):
                shapes[vi.name] = dims
    for init in g.initializer:
        shapes[init.name] = list(init.dims)
    return shapes
