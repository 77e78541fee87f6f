"""Attention-23 (the exporter's spelling of F.scaled_dot_product_attention at opset 23 and later)
written out the way older opsets write it, so the attention rule fuses it into one flash-attention
kernel like the older spelling:

    Softmax(Q @ Transpose(K) * scale [+ mask | + causal mask | Where(bool mask, ·, -inf)]) @ V

Only the plain form is written out: 4-D Q, K and V with the same number of heads, no past key or
value, no softcap, only the first output used, and at most one of an attention mask and is_causal.
Any other Attention runs as the library op, and the report says why.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node, TensorSpec
from opfuse.passes.rules import Rule

RULE = names.ATTENTION_OP
FLOAT_TYPES = ("float32", "float16")


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    if node.op_type != "Attention":
        return None
    return {"nodes": [node]}


# The attributes whose meaning the rewrite keeps (the others refuse it, with their names).
_WRITTEN_OUT_ATTRS = frozenset(
    {
        "is_causal",
        "scale",
        "softcap",
        "q_num_heads",
        "kv_num_heads",
        "qk_matmul_output_mode",
        "softmax_precision",
    }
)


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    ins = [*node.inputs, "", "", "", "", ""][:7]
    q, k, v, mask = ins[0], ins[1], ins[2], ins[3]
    shapes = [graph.spec(x).shape for x in (q, k, v)]
    if any(len(s) != 4 for s in shapes):
        return (
            "Q, K and V are not 4-D [batch, heads, sequence, head dim] (3-D inputs are written out unfused)"
        )
    if not shapes[0][1] == shapes[1][1] == shapes[2][1]:
        return "grouped-query attention (fewer key/value heads than query heads)"
    if any(ins[4:7]):
        return "a past key/value cache or nonpad_kv_seqlen"
    if any(o for o in node.outputs[1:]):
        return "the present key/value or the QK product output is used"
    unknown = sorted(set(node.attrs) - _WRITTEN_OUT_ATTRS)
    if unknown:  # e.g. opset 25's left/right_window_size: a window the written-out form lacks
        return f"attribute(s) {', '.join(unknown)}, which the written-out form does not compute"
    if float(node.attrs.get("softcap", 0.0)) != 0.0:
        return "softcap"
    if any(graph.spec(x).dtype not in FLOAT_TYPES for x in (q, k, v)):
        return "operands not of type float32 or float16"
    if mask and int(node.attrs.get("is_causal", 0)):
        return "both an attention mask and is_causal"
    if mask and graph.spec(mask).dtype not in (*FLOAT_TYPES, "bool"):
        return f"an attention mask of type {graph.spec(mask).dtype}"
    if mask and graph.spec(mask).dtype == "bool":
        known = graph.constants.get(mask)
        if known is None or not bool(np.all(np.any(known, axis=-1))):
            # Attention-23 gives 0 for a query whose keys are all masked; the written-out softmax
            # over -inf alone gives NaN.
            return "a boolean mask that may mask every key of a query (only a constant one that never does is written out)"
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    q, k, v = node.inputs[:3]
    mask = node.inputs[3] if len(node.inputs) > 3 else ""
    qs, ks = graph.spec(q), graph.spec(k)
    b, h, sq, d = qs.shape
    sk = ks.shape[2]
    dtype = qs.dtype
    np_dtype = np.float32 if dtype == "float32" else np.float16
    p = f"{node.id}_att"
    scores = (b, h, sq, sk)

    def value(name: str, shape: tuple[int, ...], dt: str = dtype) -> str:
        graph.values[name] = TensorSpec(name, dt, shape)
        return name

    def constant(name: str, arr: np.ndarray, dt: str = dtype) -> str:
        return graph.add_constant(name, arr, dt)

    scale = node.attrs.get("scale")
    scale = float(scale) if scale is not None else 1.0 / float(np.sqrt(d))
    n = [
        Node(f"{p}0", "Transpose", [k], [value(f"{p}_kt", (b, h, d, sk))], {"perm": [0, 1, 3, 2]}, node.name),
        Node(f"{p}1", "MatMul", [q, f"{p}_kt"], [value(f"{p}_qk", scores)], {}, node.name),
        Node(
            f"{p}2",
            "Mul",
            [f"{p}_qk", constant(f"{p}_scale", np.array(scale, dtype=np_dtype))],
            [value(f"{p}_s", scores)],
            {},
            node.name,
        ),
    ]
    s = f"{p}_s"
    if int(node.attrs.get("is_causal", 0)):
        # Upper-left aligned, as the operator defines it: query i sees keys 0..i.
        causal = np.where(np.tril(np.ones((sq, sk), dtype=bool)), 0.0, -np.inf).astype(np_dtype)
        n.append(
            Node(
                f"{p}3", "Add", [s, constant(f"{p}_causal", causal)], [value(f"{p}_m", scores)], {}, node.name
            )
        )
        s = f"{p}_m"
    elif mask and graph.spec(mask).dtype == "bool":
        fill = constant(f"{p}_fill", np.array(-np.inf, dtype=np_dtype))
        n.append(Node(f"{p}3", "Where", [mask, s, fill], [value(f"{p}_m", scores)], {}, node.name))
        s = f"{p}_m"
    elif mask:
        n.append(Node(f"{p}3", "Add", [s, mask], [value(f"{p}_m", scores)], {}, node.name))
        s = f"{p}_m"
    n.append(Node(f"{p}4", "Softmax", [s], [value(f"{p}_p", scores)], {"axis": -1}, node.name))
    n.append(Node(f"{p}5", "MatMul", [f"{p}_p", v], [node.outputs[0]], {}, node.name))
    graph.splice(graph.nodes.index(node), n, {node.id})


attention_op = Rule(
    RULE,
    _match,
    _check,
    _rewrite,
)
