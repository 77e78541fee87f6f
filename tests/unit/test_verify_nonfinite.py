"""Verification where the reference is NaN (or ±inf) everywhere on the usual random inputs.

transformers/helium's reference is NaN everywhere on token ids 0-3 (a row fully masked, softmax of
all -inf): NaN against NaN compared nothing and passed, and a fused attention that gave finite
values there was rolled back to match the NaN. The verifier draws other inputs (integer inputs
across a wider range, within the tables they index) before it passes or rolls back anything; an
output that stays non-finite everywhere is no pass, and no group is rolled back for it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.graph import TensorSpec
from opfuse.verify.compare import compare_outputs
from opfuse.verify.reference import WIDER_INT_HIGHS, describe_draw, int_high, random_inputs
from opfuse.verify.rollback import VACUOUS_RETRIES, VERIFY_TRIALS
from tests.builders import TEST_DEVICE

B, S, D, VOCAB = 2, 8, 16, 64


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: dict[str, list[int]],
    inits: dict[str, np.ndarray],
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "t",
        inputs,
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in outputs.items()],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m


def _attention(mask_nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray], x: str = "e") -> list[Any]:
    """Single-head self-attention of `x` [B, S, D] under the additive key mask `m` [B, S] that
    `mask_nodes` compute: a batch entry whose every key is masked softmaxes a row of -inf (NaN)."""
    rng = np.random.default_rng(0)
    inits.update(
        wv=(rng.standard_normal((D, D)) / 4).astype(np.float32),
        ax1=np.array([1], np.int64),
        scale=np.array(D**-0.5, np.float32),
    )
    n = helper.make_node
    return [
        *mask_nodes,
        n("Unsqueeze", ["m", "ax1"], ["m3"]),
        n("Transpose", [x], ["xt"], perm=[0, 2, 1]),
        n("MatMul", [x, "xt"], ["sc"]),
        n("Mul", ["sc", "scale"], ["ss"]),
        n("Add", ["ss", "m3"], ["sm"]),
        n("Softmax", ["sm"], ["p"], axis=-1),
        n("MatMul", [x, "wv"], ["v"]),
        n("MatMul", ["p", "v"], ["y"]),
    ]


def _embedded_attention(ids_type: int = TensorProto.INT64, cast: bool = False, vocab: int = VOCAB) -> Any:
    """Token ids -> embedding rows -> attention, each key masked where its id is below 4 (the
    mask's own table: -inf for ids 0-3). On ids 0-3 every key is masked: NaN everywhere. With
    `cast`, the ids reach both Gathers through a Cast, so the frontend knows no bound for them."""
    rng = np.random.default_rng(1)
    mask = np.zeros(vocab, np.float32)
    mask[:4] = -np.inf
    inits = {"table": (rng.standard_normal((vocab, D)) / 2).astype(np.float32), "mask_table": mask}
    idx = "ids64" if cast else "ids"
    pre = [helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64)] if cast else []
    nodes = [
        *pre,
        helper.make_node("Gather", ["table", idx], ["e"]),
        helper.make_node("Gather", ["mask_table", idx], ["m"]),
    ]
    nodes = _attention(nodes, inits)
    ids = helper.make_tensor_value_info("ids", ids_type, [B, S])
    return _model(nodes, [ids], {"y": [B, S, D]}, inits)


def _masked_by_comparison() -> Any:
    """Attention over float `x`, each key masked where the integer `ids` (which index nothing:
    no bound is known for them) is below 4: NaN everywhere on ids 0-3."""
    inits: dict[str, np.ndarray] = {
        "four": np.array(4, np.int64),
        "ninf": np.array(-np.inf, np.float32),
        "zero": np.array(0.0, np.float32),
    }
    mask = [
        helper.make_node("Less", ["ids", "four"], ["small"]),
        helper.make_node("Where", ["small", "ninf", "zero"], ["m"]),
    ]
    nodes = _attention(mask, inits, x="x")
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, S, D]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, [B, S]),
    ]
    return _model(nodes, inputs, {"y": [B, S, D]}, inits)


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def _counted_reference_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, np.ndarray]]:
    from opfuse.verify.reference import OnnxRuntimeReference

    feeds_seen: list[dict[str, np.ndarray]] = []
    run = OnnxRuntimeReference.run

    def counted(self: OnnxRuntimeReference, feeds: Any) -> dict[str, np.ndarray]:
        feeds_seen.append(dict(feeds))
        return run(self, feeds)

    monkeypatch.setattr(OnnxRuntimeReference, "run", counted)
    return feeds_seen


def test_a_reference_nan_on_token_ids_0_to_3_is_checked_on_ids_across_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check compares finite values, drawn within the embedding table, and passes with the
    attention fused; before, it compared nothing and passed ("nothing compared")."""
    model = _embedded_attention()
    narrow = {"ids": np.random.default_rng(2).integers(0, 4, (B, S))}
    assert np.isnan(_ort(model, narrow)["y"]).all()  # the model does what this test is about
    seen = _counted_reference_runs(monkeypatch)
    cm = opfuse.compile(model, {"ids": [B, S]}, device=TEST_DEVICE, tune_budget_s=0)
    v = cm.report["verification"]
    y = v["outputs"]["y"]
    assert v["passed"] is True and y["passed"] is True and "reason" not in y, v
    assert v["rolled_back"] == [] and 0 < y["rel_l2_err"] <= y["rtol"], v
    assert "checked on inputs drawn with " + describe_draw(1) in v["note"], v["note"]
    assert [g["kind"] for g in cm.report["fusion"]["groups"]] == ["attention"]
    # Every reference the checks compared against was finite, on ids across the table.
    compared = [f for f in seen if np.isfinite(_ort(model, f)["y"]).all()]
    assert len(compared) >= VERIFY_TRIALS and max(int(f["ids"].max()) for f in compared) >= 4
    assert all(int(f["ids"].max()) < VOCAB for f in seen)
    rng = np.random.default_rng(3)
    for _ in range(3):  # the compiled model, element by element, on ids across the table
        feeds = {"ids": rng.integers(0, VOCAB, (B, S))}
        ref = _ort(model, feeds)["y"]
        assert np.isfinite(ref).all()
        np.testing.assert_allclose(cm.run(feeds)["y"], ref, rtol=1e-4, atol=1e-5)


def test_integers_that_index_nothing_are_drawn_wider_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """ids only compared with 4: below 4 (level 0, and level 1's fresh draw) every key is
    masked; below 16 (level 2) the reference is finite, and every later draw stays there."""
    model = _masked_by_comparison()
    seen = _counted_reference_runs(monkeypatch)
    cm = opfuse.compile(model, {"x": [B, S, D], "ids": [B, S]}, device=TEST_DEVICE, tune_budget_s=0)
    v = cm.report["verification"]
    y = v["outputs"]["y"]
    assert v["passed"] is True and y["passed"] is True and "reason" not in y and v["rolled_back"] == [], v
    assert "checked on inputs drawn with " + describe_draw(2) in v["note"], v["note"]
    highs = [int(f["ids"].max()) for f in seen]
    # Two draws below 4 computed ahead; for the first, level 1 (below 4 again), then level 2
    # (below 16); for the second, level 2 at once. Nothing is drawn past 16.
    assert len(highs) == VERIFY_TRIALS + 3 and max(highs[:3]) < 4 <= highs[3] < WIDER_INT_HIGHS[1], highs
    assert highs[4] < WIDER_INT_HIGHS[1], highs
    rng = np.random.default_rng(4)
    for _ in range(3):
        feeds = {
            "x": rng.standard_normal((B, S, D)).astype(np.float32),
            "ids": rng.integers(4, WIDER_INT_HIGHS[1], (B, S)),
        }
        ref = _ort(model, feeds)["y"]
        assert np.isfinite(ref).all()
        np.testing.assert_allclose(cm.run(feeds)["y"], ref, rtol=1e-4, atol=1e-5)


def _sanitizing_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every generated kernel writes 0 for NaN (as a fused attention may compute finite values
    where the reference's softmax of all -inf is NaN)."""
    from opfuse.runtime import executor as ex

    run_step = ex.Executor._run_step

    def sanitized(self: ex.Executor, i: int, step: Any, env: dict[str, Any], arena: bool = False) -> None:
        run_step(self, i, step, env, arena)
        if step.kind == "kernel":
            for o in step.outputs:
                if env[o].is_floating_point():
                    env[o].nan_to_num_(0.0)

    monkeypatch.setattr(ex.Executor, "_run_step", sanitized)


def test_an_output_nan_on_every_input_is_no_pass_and_rolls_nothing_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """y = sqrt(-(x*x) - 1) is NaN on every input; z is finite. The fused kernel gives 0 where the
    reference has NaN: before, y's group was rolled back to match the NaN. Now every retry
    leaves y NaN, so y compared nothing: the compile is not a pass, says why, and keeps its
    groups; z is compared and passes."""
    rng = np.random.default_rng(5)
    n = helper.make_node
    nodes = [
        n("Mul", ["x", "x"], ["xx"]),
        n("Neg", ["xx"], ["nx"]),
        n("Sub", ["nx", "one"], ["neg"]),
        n("Sqrt", ["neg"], ["y"]),
        n("Mul", ["x", "s"], ["xs"]),
        n("Add", ["xs", "t"], ["xt"]),
        n("Tanh", ["xt"], ["z"]),
    ]
    inits = {
        "one": np.array(1.0, np.float32),
        "s": rng.standard_normal(32).astype(np.float32),
        "t": rng.standard_normal(32).astype(np.float32),
    }
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])
    model = _model(nodes, [x], {"y": [4, 32], "z": [4, 32]}, inits)
    _sanitizing_kernels(monkeypatch)
    seen = _counted_reference_runs(monkeypatch)
    cm = opfuse.compile(model, {"x": [4, 32]}, device=TEST_DEVICE, tune_budget_s=0)
    v = cm.report["verification"]
    assert v["passed"] is False and v["rolled_back"] == [], v
    y, z = v["outputs"]["y"], v["outputs"]["z"]
    assert y["passed"] is False and y["reason"].startswith("nothing compared: the reference is NaN"), y
    assert z["passed"] is True and "reason" not in z and z["rel_l2_err"] <= z["rtol"], z
    assert "nothing compared on output(s) 'y'" in v["note"], v["note"]
    assert f"on each of {1 + VACUOUS_RETRIES} input draws" in v["note"], v["note"]
    # The retries once, then no more: the two draws computed ahead and one retry per level.
    assert len(seen) == VERIFY_TRIALS + VACUOUS_RETRIES, len(seen)
    assert cm.report["kernels"]["after"] < cm.report["kernels"]["before"]
    feeds = {"x": rng.standard_normal((4, 32)).astype(np.float32)}
    np.testing.assert_allclose(cm.run(feeds)["z"], _ort(model, feeds)["z"], rtol=1e-4, atol=1e-5)


def test_draws_the_reference_refuses_are_passed_over() -> None:
    """The ids reach the table through a Cast, so no bound is known for them: draws past the
    table's 8 rows make onnxruntime raise (index out of range). Those draws are passed over;
    every draw left is NaN everywhere, so the compile ends unverified, and why, not with an error."""
    model = _embedded_attention(TensorProto.INT32, cast=True, vocab=8)
    cm = opfuse.compile(model, {"ids": [B, S]}, device=TEST_DEVICE, tune_budget_s=0)
    v = cm.report["verification"]
    assert v["passed"] is False and v["rolled_back"] == [], v
    assert v["outputs"]["y"]["reason"].startswith("nothing compared"), v
    assert "nothing compared on output(s) 'y'" in v["note"], v["note"]
    feeds = {"ids": np.random.default_rng(6).integers(0, 8, (B, S)).astype(np.int32)}
    ref = _ort(model, feeds)["y"]
    out = cm.run(feeds)["y"]
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isnan(out), ~finite)  # NaN rows stay NaN
    np.testing.assert_allclose(out[finite], ref[finite], rtol=1e-4, atol=1e-5)


def test_wider_draws_stay_inside_the_tables_the_inputs_index() -> None:
    rng = np.random.default_rng(7)
    specs = [
        TensorSpec("ids", "int64", (64,), high=50),  # a Gather's table of 50 rows
        TensorSpec("tiny", "int64", (64,), high=2),
        TensorSpec("free", "int32", (64,)),
        TensorSpec("byte", "int8", (64,)),
        TensorSpec("x", "float32", (3,)),
    ]
    assert [int_high(s) for s in specs[:4]] == [4, 2, 4, 4]  # the usual draw, as before
    for level in range(1, VACUOUS_RETRIES + 1):
        free = WIDER_INT_HIGHS[level - 1]
        assert [int_high(s, level) for s in specs[:4]] == [50, 2, free, min(free, 128)], level
        feeds = random_inputs(specs, rng, level)
        assert feeds["ids"].max() < 50 and feeds["tiny"].max() < 2 and feeds["byte"].max() < 128
        assert feeds["free"].dtype == np.int32 and feeds["free"].max() < free and feeds["free"].min() >= 0
    assert random_inputs(specs, rng, 4)["free"].max() >= 256  # 64 draws below 4096
    assert describe_draw(0) == "integer inputs below 4"


def test_a_reference_with_no_finite_element_compares_nothing_whatever_the_output() -> None:
    """Not "NaN where the reference has none": the fused output's finite values there are no
    evidence either way. ±inf everywhere compares nothing either."""
    nan = np.full((2, 5), np.nan, np.float32)
    for out in (nan.copy(), np.zeros_like(nan)):
        c = compare_outputs(out, nan, rtol=1e-4, atol=1e-5)
        assert (
            not c.compared and not c.passed and c.reason.startswith("nothing compared: the reference is NaN")
        )
    inf = np.full((2, 5), np.inf, np.float32)
    inf[0] = -np.inf
    inf[1, 0] = np.nan
    c = compare_outputs(np.zeros_like(inf), inf, rtol=1e-4, atol=1e-5)
    assert not c.compared and not c.passed and "non-finite" in c.reason
    partly = inf.copy()
    partly[1, 1] = 1.0  # one finite element: compared as before
    c = compare_outputs(partly.copy(), partly, rtol=1e-4, atol=1e-5)
    assert c.compared and c.passed and c.reason == ""
