"""`merge_dfts` (opfuse/passes/dft.py): a chain of DFTs over different axes is one opfuse.DFTN
node, and a real signal padded with zero imaginary parts is read as the real signal."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.ir.ops import DFTN
from opfuse.passes.dft import merge_dfts
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model

n = helper.make_node
SHAPE = [2, 6, 8]


def chain(
    axes: tuple[int, ...] = (2, 1),
    real: bool = True,
    inverse: tuple[int, ...] = (),
    onesided: int = 0,
    length: int | None = None,
    also_out: bool = False,
    opset: int = 20,
) -> onnx.ModelProto:
    """DFTs of x [2, 6, 8] over `axes` in turn, as the default exporter writes fftn: the signal
    Concat(x[..., None], 0) (`real`) or x's [2, 6, 8, 2] pairs; `inverse` per DFT; `onesided`: the
    first one-sided, of x[..., None]; `length`: the
    first's dft_length; `also_out`: the first's output a model output too. opset 17 writes the
    axis as an attribute, 20 as the third input."""
    inits: dict[str, np.ndarray] = {"one": np.array([-1])}
    nodes = []
    if onesided:  # a one-sided transform reads the real signal itself
        nodes.append(n("Unsqueeze", ["x", "one"], ["s0"]))
        inputs = {"x": SHAPE}
    elif real:
        inits["zeros"] = np.zeros([*SHAPE, 1])
        nodes += [n("Unsqueeze", ["x", "one"], ["xr"]), n("Concat", ["xr", "zeros"], ["s0"], axis=-1)]
        inputs = {"x": SHAPE}
    else:
        nodes.append(n("Identity", ["x"], ["s0"]))
        inputs = {"x": [*SHAPE, 2]}
    for i, axis in enumerate(axes):
        attrs = {"inverse": inverse[i] if inverse else 0, "onesided": onesided if i == 0 else 0}
        ins = [f"s{i}", "len" if length and i == 0 else ""]
        if opset >= 20:
            inits[f"axis{i}"] = np.array(axis)
            ins.append(f"axis{i}")
        else:
            attrs["axis"] = axis
        nodes.append(n("DFT", ins, [f"s{i + 1}"], name=f"dft{i}", **attrs))
    if length:
        inits["len"] = np.array(length)
    out = list(SHAPE)
    if length:
        out[axes[0]] = length
    if onesided:
        out[axes[0]] = out[axes[0]] // 2 + 1
    outs = {f"s{len(axes)}": [*out, 2]}
    if also_out:
        outs["s1"] = [*out, 2]
    return tiny_model(nodes, inputs, outs, inits, opset=opset)


@pytest.mark.parametrize(
    ("axes", "real", "inverse", "opset"),
    [
        ((2, 1), True, (), 20),  # FNet's fftn(dim=(1, 2)) of a real signal
        ((2, 1), True, (), 17),  # DFT-17: the axis an attribute
        ((0, 1, 2), False, (1, 1, 1), 20),  # an inverse transform of complex pairs over every axis
        ((-2, -3), False, (), 20),  # negative axes
    ],
)
def test_a_chain_of_dfts_is_one_transform_over_its_axes(
    axes: tuple[int, ...], real: bool, inverse: tuple[int, ...], opset: int
) -> None:
    model = chain(axes, real, inverse, opset=opset)
    graph = graph_of(model)
    log = run_pass(graph, merge_dfts)
    assert log.fired == {names.MERGE_DFTS: 1}
    (dft,) = [x for x in graph.nodes if "DFT" in x.op_type]
    assert dft.op_type == DFTN
    rank = len(SHAPE) + 1
    assert dft.attrs["axes"] == [a % rank for a in axes] and dft.attrs["inverse"] == (1 if inverse else 0)
    assert "Concat" not in ops(graph)
    assert graph.spec(dft.inputs[0]).shape[-1] == (1 if real else 2)
    assert_computes_as_onnxruntime(model, graph)


def test_a_lone_dft_of_a_zero_padded_real_signal_reads_the_real_signal() -> None:
    model = chain((1,))
    graph = graph_of(model)
    assert run_pass(graph, merge_dfts).fired == {names.MERGE_DFTS: 1}
    assert ops(graph) == ["Unsqueeze", "DFT"]
    assert graph.nodes[1].inputs[0] == "xr"
    assert_computes_as_onnxruntime(model, graph)


def test_a_concat_of_nonzero_imaginary_parts_stays() -> None:
    model = chain((1,))
    for init in model.graph.initializer:
        if init.name == "zeros":
            init.float_data[:] = []
            init.raw_data = np.full([*SHAPE, 1], 0.5, dtype=np.float32).tobytes()
    graph = graph_of(model)
    assert not run_pass(graph, merge_dfts).fired
    assert "Concat" in ops(graph)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (chain(onesided=1), "one-sided"),
        (chain(length=10), "dft_length"),
        (chain(inverse=(0, 1)), "mixes forward and inverse"),
        (chain((1, 1)), "two DFTs of the chain transform one axis"),
    ],
)
def test_what_cannot_merge_stays_and_says_why(model: onnx.ModelProto, why: str) -> None:
    graph = graph_of(model)
    log = run_pass(graph, merge_dfts)
    assert not log.fired and ops(graph).count("DFT") == 2
    (refusal,) = [x for x in log.not_fired if x.rule == names.MERGE_DFTS]
    assert why in refusal.reason and refusal.nodes[-1] == "dft1"
    assert_computes_as_onnxruntime(model, graph)


def test_a_dft_output_read_elsewhere_ends_the_chain() -> None:
    """The first DFT's output is a model output too: it stays written, and the second DFT alone is
    no chain; the first still reads the real signal."""
    model = chain(also_out=True)
    graph = graph_of(model)
    assert run_pass(graph, merge_dfts).fired == {names.MERGE_DFTS: 1}
    assert [x for x in ops(graph) if "DFT" in x] == ["DFT", "DFT"]
    assert "Concat" not in ops(graph)
    assert_computes_as_onnxruntime(model, graph)
