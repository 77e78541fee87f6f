"""`gather_prologue` (opfuse/fusion/rules/gather_prologue.py): a transformer's embedding lookup
computed on the tiles of the row kernel that adds the position embeddings and normalizes."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.errors import InputError
from opfuse.frontend import rule_registry as names
from tests.builders import TEST_DEVICE, claimed, planned, refusals, weights

n = helper.make_node
RULE = f"{names.ROW_REDUCTION}+{names.GATHER_PROLOGUE}"
VOCAB, HIDDEN = 50, 48


def embeddings(
    rows: tuple[int, ...] = (2, 7),
    hidden: int = HIDDEN,
    residual: bool = False,
    axis: int = 0,
    rms: bool = False,
    ids_type: int = TensorProto.INT64,
) -> onnx.ModelProto:
    """y = LayerNorm(table[ids] + pos) (BERT's embeddings). `residual`: the looked-up rows are
    also added to the normalized ones, as a pre-norm decoder's residual stream reads them.
    `rms`: RMSNorm written out (LLaMA), no position embeddings. `axis` 1: a Gather of columns."""
    table = weights(VOCAB, hidden, seed=1) if axis == 0 else weights(hidden, VOCAB, seed=1)
    shape = [*rows, hidden]
    nodes = [n("Gather", ["table", "ids"], ["e"], name="embed", axis=axis)]
    inits = {"table": table, "gamma": 1.0 + weights(hidden, seed=3)}
    if rms:
        inits["two"], inits["eps"] = np.array(2.0), np.array(1e-6)
        nodes += [
            n("Pow", ["e", "two"], ["sq"], name="square"),
            n("ReduceMean", ["sq", "last"], ["ms"], name="mean", keepdims=1),
            n("Add", ["ms", "eps"], ["mse"], name="eps"),
            n("Sqrt", ["mse"], ["rms"], name="sqrt"),
            n("Div", ["e", "rms"], ["en"], name="normalize"),
            n("Mul", ["en", "gamma"], ["y"], name="scale"),
        ]
    else:
        inits["pos"], inits["beta"] = weights(rows[-1], hidden, seed=2), weights(hidden, seed=4)
        nodes += [
            n("Add", ["e", "pos"], ["s"], name="position"),
            n("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
        ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    if residual:
        outputs.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, shape))
    opset = 18
    graph = helper.make_graph(
        nodes,
        "embeddings",
        [helper.make_tensor_value_info("ids", ids_type, list(rows))],
        outputs,
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()]
        + [numpy_helper.from_array(np.array([-1], dtype=np.int64), "last")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _check(model: onnx.ModelProto, rows: tuple[int, ...], precision: str = "fp32") -> opfuse.CompiledModel:
    """Compiled, verified, and every output element against onnxruntime on ids across the table,
    negative ones (counted from the end) among them."""
    cm = opfuse.compile(model, input_shapes={"ids": list(rows)}, precision=precision, device=TEST_DEVICE)
    assert cm.report["verification"]["passed"] is True
    assert not cm.report["verification"]["rolled_back"]
    dtype = np.int64 if model.graph.input[0].type.tensor_type.elem_type == TensorProto.INT64 else np.int32
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    tol = 1e-5 if precision == "fp32" else 2e-2
    for seed in range(2):
        ids = np.random.default_rng(seed).integers(-VOCAB, VOCAB, size=rows).astype(dtype)
        wants = sess.run(None, {"ids": ids})
        outs = cm.run({"ids": ids})
        for o, want in zip(model.graph.output, wants, strict=True):
            assert outs[o.name].shape == want.shape
            np.testing.assert_allclose(outs[o.name], want, rtol=tol, atol=tol)
    return cm


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("rows", [(2, 7), (3, 16)])
def test_the_lookup_is_computed_on_the_row_kernels_tiles(precision: str, rows: tuple[int, ...]) -> None:
    model = embeddings(rows)
    _, plan = planned(model)
    assert claimed(plan) == [("rowwise", RULE, ["embed", "position", "ln"])]
    cm = _check(model, rows, precision)
    assert cm.report["kernels"]["after"] == 1
    (k,) = cm.plan.kernels.values()
    assert "prologue: the table's rows looked up on the tiles" in k.source
    assert "INDEX_CHECKS = [(" in k.source


def test_a_pre_norm_decoders_lookup_is_stored_beside_its_norm() -> None:
    """The residual stream reads the looked-up rows too: the row kernel stores them as well, and
    an int32 index and RMSNorm written out take the same path."""
    rows = (2, 9)
    model = embeddings(rows, residual=True, rms=True, ids_type=TensorProto.INT32)
    _, plan = planned(model)
    (g,) = [g for g in plan.groups if g.rule == RULE]
    assert g.outputs == ["y", "e"] or sorted(g.outputs) == ["e", "y"]
    cm = _check(model, rows)
    assert cm.report["kernels"]["after"] == 1


def _lookup_then(
    table_shape: list[int], row_op: onnx.NodeProto, rows: tuple[int, ...] = (2, 7)
) -> onnx.ModelProto:
    out = [*rows, *table_shape[1:]]
    graph = helper.make_graph(
        [n("Gather", ["table", "ids"], ["e"], name="embed"), row_op],
        "lookup",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, list(rows))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        initializer=[numpy_helper.from_array(weights(*table_shape, seed=1).astype(np.float32), "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def test_refusals_say_why() -> None:
    softmax_last = n("Softmax", ["e"], ["y"], name="softmax", axis=-1)
    _, plan = planned(_lookup_then([VOCAB, 4, 12], softmax_last))
    assert refusals(plan, names.GATHER_PROLOGUE) == [
        (["embed", "softmax"], "the Gather does not take whole rows of a 2-D table")
    ]
    softmax_rows = n("Softmax", ["e"], ["y"], name="softmax", axis=1)
    _, plan = planned(_lookup_then([VOCAB, HIDDEN], softmax_rows))
    assert refusals(plan, names.GATHER_PROLOGUE) == [
        (["embed", "softmax"], "the row kernel does not reduce over the table's rows")
    ]
    _, plan = planned(embeddings(), disabled=(names.GATHER_PROLOGUE,))
    assert all(names.GATHER_PROLOGUE not in rule for _, rule, _ in claimed(plan))
    cm = _check(_lookup_then([VOCAB, 4, 12], softmax_last), (2, 7))  # runs as the library Gather
    assert cm.report["kernels"]["after"] == 2 and cm.plan.steps[0].op_type == "Gather"


def test_an_index_out_of_range_is_the_library_gathers_error_on_the_cpu() -> None:
    rows = (2, 7)
    model = embeddings(rows)
    cm = opfuse.compile(model, input_shapes={"ids": list(rows)}, device="cpu")
    assert any(names.GATHER_PROLOGUE in g["rule"] for g in cm.report["fusion"]["groups"])
    ids = np.random.default_rng(0).integers(0, VOCAB, size=rows).astype(np.int64)
    ids[1, 3] = VOCAB
    with pytest.raises(InputError, match=f"index {VOCAB} is out of range for axis 0 of size {VOCAB}"):
        cm.run({"ids": ids})


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_every_tuning_candidate_config_looks_up_the_right_rows(precision: str) -> None:
    """The row kernel at its GPU config and at each tuning candidate (rows per program), on fresh
    ids each time: every element of both outputs against onnxruntime."""
    from opfuse.runtime.executor import Executor
    from opfuse.tuning.candidates import candidates

    rows = (3, 11)
    model = embeddings(rows, residual=True)
    cm = _check(model, rows, precision)
    (k,) = cm.plan.kernels.values()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    tol = 1e-5 if precision == "fp32" else 2e-2
    ex = Executor(cm.plan, TEST_DEVICE)
    tried = [{}, *candidates(k)]
    assert len(tried) > 1
    for cand in tried:
        ex.configs[k.id] = {**k.config, **cand}
        ids = rng.integers(-VOCAB, VOCAB, size=rows).astype(np.int64)
        outs = ex.run({"ids": ids})
        for o, want in zip(model.graph.output, sess.run(None, {"ids": ids}), strict=True):
            np.testing.assert_allclose(outs[o.name], want, rtol=tol, atol=tol, err_msg=f"{o.name} at {cand}")


def test_every_lookup_the_row_kernel_reads_is_on_its_tiles() -> None:
    """RoBERTa's embeddings: the word rows by token ids and the position rows by position ids
    computed at run time, added and normalized: one kernel, both lookups on its tiles, and either
    index out of range is the library Gather's error on the CPU."""
    rows, positions = (2, 7), 9
    graph = helper.make_graph(
        [
            n("Gather", ["table", "ids"], ["e"], name="word"),
            n("Gather", ["pos_table", "pos_ids"], ["p"], name="position"),
            n("Add", ["e", "p"], ["s"], name="sum"),
            n("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
        ],
        "roberta_embeddings",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, list(rows)),
            helper.make_tensor_value_info("pos_ids", TensorProto.INT64, list(rows)),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*rows, HIDDEN])],
        initializer=[
            numpy_helper.from_array(v.astype(np.float32), k)
            for k, v in {
                "table": weights(VOCAB, HIDDEN, seed=1),
                "pos_table": weights(positions, HIDDEN, seed=2),
                "gamma": 1.0 + weights(HIDDEN, seed=3),
                "beta": weights(HIDDEN, seed=4),
            }.items()
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    _, plan = planned(model)
    assert claimed(plan) == [("rowwise", RULE, ["word", "position", "sum", "ln"])]
    shapes = {"ids": list(rows), "pos_ids": list(rows)}
    cm = opfuse.compile(model, input_shapes=shapes, device=TEST_DEVICE)
    assert cm.report["kernels"]["after"] == 1 and not cm.report["verification"]["rolled_back"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    for _ in range(2):
        feeds = {
            "ids": rng.integers(-VOCAB, VOCAB, size=rows).astype(np.int64),
            "pos_ids": rng.integers(-positions, positions, size=rows).astype(np.int64),
        }
        (want,) = sess.run(None, feeds)
        np.testing.assert_allclose(cm.run(feeds)["y"], want, rtol=1e-5, atol=1e-5)
    if TEST_DEVICE == "cpu":
        feeds["pos_ids"][0, 0] = positions
        with pytest.raises(
            InputError, match=f"index {positions} is out of range for axis 0 of size {positions}"
        ):
            cm.run(feeds)
