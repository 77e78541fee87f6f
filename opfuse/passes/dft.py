"""`merge_dfts`: a multi-dimensional Fourier transform is one transform, of a real signal where the
model pads its imaginary parts with zeros.

ONNX's DFT transforms one axis, so an exporter writes `torch.fft.fftn(x, dim=(1, 2))` (FNet's
token mixing) as a DFT per axis; and a real signal passed to a complex transform as
Concat(x[..., None], zeros) along the pairs' axis. Each DFT is a cast to float32, a library FFT
and a cast back, and the Concat a kernel of its own: seven launches and three intermediate
tensors for one 2-D transform. As one `opfuse.DFTN` node over the chain's axes, the transform is
one library call (a single multi-dimensional FFT plan), its intermediate kept in float32, and the
zero imaginary parts are never written: the signal's [..., 1] real part is what it reads.

Made where every DFT of the chain is a full (not one-sided) transform of the same direction over
a constant axis, at its own length, each one's output read by the next alone and no model output.
A lone DFT of a zero-padded real signal reads the real part too (an ONNX DFT takes [..., 1]) and
stays a DFT. The transforms along different axes commute, so the order of the chain is kept only
for the report; rounding differs from the chain's (one float32 pass, where the model rounds to its
type between the axes), and verification compares the result with the original model's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from opfuse.frontend import rule_registry as names
from opfuse.graph import Graph, Node
from opfuse.ir.ops import DFTN
from opfuse.passes.rules import Rule

RULE = names.MERGE_DFTS


def dft_axis(graph: Graph, node: Node) -> int | None:
    """The DFT's axis, normalized against its input's rank (the trailing pairs' axis included):
    DFT-20's third input, or DFT-17's attribute (default 1); None where it is not a constant."""
    rank = len(graph.spec(node.inputs[0]).shape)
    if len(node.inputs) > 2 and node.inputs[2]:
        value = graph.constants.get(node.inputs[2])
        if value is None or np.asarray(value).size != 1:
            return None
        axis = int(np.asarray(value).reshape(-1)[0])
    else:
        axis = int(node.attrs.get("axis", 1))
    return axis + rank if axis < 0 else axis


def _only_reader(graph: Graph, value: str) -> Node | None:
    """The one node reading `value`, where it has one and `value` is no model output."""
    readers = graph.consumers().get(value, [])
    if len(readers) != 1 or value in {o.name for o in graph.outputs}:
        return None
    return readers[0]


def _zero_padded(graph: Graph, concat: Node | None) -> str | None:
    """x where `concat` is Concat(x, zeros) along the pairs' axis, x's last axis of size 1 (a real
    signal written as complex pairs with zero imaginary parts); else None."""
    if concat is None or concat.op_type != "Concat" or len(concat.inputs) != 2:
        return None
    rank = len(graph.spec(concat.outputs[0]).shape)
    if int(concat.attrs.get("axis", 0)) % rank != rank - 1:
        return None
    real, imag = concat.inputs
    zeros = graph.constants.get(imag)
    if zeros is None or np.any(np.asarray(zeros) != 0) or real in graph.constants:
        return None
    if graph.spec(real).shape[-1] != 1 or _only_reader(graph, concat.outputs[0]) is None:
        return None
    return real


def _match(graph: Graph, node: Node) -> dict[str, Any] | None:
    """Anchored on the last DFT of a chain (whose output no DFT alone reads): the DFTs before it,
    each read by the next alone, and a Concat of a real signal with zeros before the first."""
    if node.op_type != "DFT" or not node.inputs or not node.inputs[0]:
        return None
    after = _only_reader(graph, node.outputs[0])
    if after is not None and after.op_type == "DFT" and after.inputs[0] == node.outputs[0]:
        return None  # a later DFT anchors the chain
    producers = graph.producers()
    chain = [node]
    while (p := producers.get(chain[0].inputs[0])) is not None and p.op_type == "DFT":
        if _only_reader(graph, p.outputs[0]) is not chain[0]:
            break
        chain.insert(0, p)
    concat = producers.get(chain[0].inputs[0])
    real = _zero_padded(graph, concat)
    if len(chain) == 1 and real is None:
        return None
    return {"chain": chain, "concat": concat if real is not None else None, "real": real,
            "nodes": [*([concat] if real is not None else []), *chain]}  # fmt: skip


def _check(graph: Graph, node: Node, m: dict[str, Any]) -> str | None:
    chain: list[Node] = m["chain"]
    axes = []
    for d in chain:
        shape = graph.spec(d.inputs[0]).shape
        axis = dft_axis(graph, d)
        if axis is None:
            return "a DFT's axis is not a constant"
        if not 0 <= axis < len(shape) - 1:
            return f"a DFT's axis {axis} is not an axis of the signal"
        if int(d.attrs.get("onesided", 0)):
            return "a DFT is one-sided (half the spectrum)"
        if len(d.inputs) > 1 and d.inputs[1]:
            length = graph.constants.get(d.inputs[1])
            if length is None or int(np.asarray(length).reshape(-1)[0]) != shape[axis]:
                return "a DFT pads or cuts its axis to a dft_length of its own"
        axes.append(axis)
    if len(set(axes)) != len(axes):
        return "two DFTs of the chain transform one axis"
    if len({int(d.attrs.get("inverse", 0)) for d in chain}) != 1:
        return "the chain mixes forward and inverse transforms"
    m["axes"] = axes
    return None


def _rewrite(graph: Graph, node: Node, m: dict[str, Any]) -> None:
    chain: list[Node] = m["chain"]
    signal = m["real"] or chain[0].inputs[0]
    removed = {n.id for n in m["nodes"]}
    first = graph.nodes.index(m["nodes"][0])
    if len(chain) == 1:  # the real signal, read by the DFT itself
        new = Node(
            f"{node.id}_real",
            "DFT",
            [signal, *node.inputs[1:]],
            list(node.outputs),
            dict(node.attrs),
            node.name,
        )
    else:
        attrs = {"axes": m["axes"], "inverse": int(node.attrs.get("inverse", 0))}
        new = Node(f"{node.id}_merged", DFTN, [signal], list(node.outputs), attrs, node.name)
    graph.splice(first, [new], removed)


merge_dfts = Rule(RULE, _match, _check, _rewrite)
