"""Pointwise fusion and BN folding: kernel counts, generated source, and outputs vs onnxruntime."""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.codegen import emitters
from opfuse.errors import BundleError
from tests.builders import TEST_DEVICE, conv_bn_relu, residual_mlp

RNG = np.random.default_rng(1234)


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(o) for o in sess.run(None, feeds)]


def rel_l2(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref.astype(np.float64)))


def make_model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, list[int]],
    outputs: dict[str, list[int]],
    inits: dict[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in outputs.items()],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in (inits or {}).items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m


def check_against_ort(
    model: onnx.ModelProto,
    shapes: dict[str, list[int]],
    precision: str = "fp32",
    fusion_disable: tuple[str, ...] = (),
    tune_budget_s: float | None = None,
) -> opfuse.CompiledModel:
    """Compile, verify, then run on fresh random input: every output element against onnxruntime.
    `tune_budget_s=0` keeps the planned template kernels (on the GPU, tuning may pick the vendor's)."""
    cm = opfuse.compile(
        model,
        input_shapes=shapes,
        precision=precision,
        device=TEST_DEVICE,
        fusion_disable=fusion_disable,
        tune_budget_s=tune_budget_s,
    )
    assert cm.report["verification"]["passed"] is True
    feeds = {k: RNG.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    outs = cm.run(feeds)
    refs = ort_run(model, feeds)
    tol = 1e-4 if precision == "fp32" else 2e-2
    for o, ref in zip(model.graph.output, refs, strict=True):
        assert outs[o.name].shape == ref.shape
        assert np.all(np.isfinite(outs[o.name]))
        assert rel_l2(outs[o.name], ref) <= tol, o.name
    return cm


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_residual_mlp_fuses_gelu_and_skip_layernorm(precision: str) -> None:
    cm = check_against_ort(residual_mlp(), {"x": [4, 32]}, precision)
    r = cm.report
    # MatMul+bias+GELU in one GEMM kernel; the second MatMul computed on the tiles of the row
    # kernel that adds its bias and the residual and runs the LayerNorm (written out).
    assert r["kernels"] == {"before": 19, "after": 2}
    groups = {tuple(g["nodes"]): g["kind"] for g in r["fusion"]["groups"]}
    assert (
        groups[("fc1", "fc1_bias", "gelu_scale", "gelu_erf", "gelu_add1", "gelu_mul", "gelu_half")] == "gemm"
    )
    ln = (
        "fc2_bias",
        "residual",
        "ln_mean",
        "ln_sub",
        "ln_pow",
        "ln_var",
        "ln_eps",
        "ln_sqrt",
        "ln_div",
        "ln_scale",
        "ln_shift",
    )
    assert groups[("fc2", *ln)] == "rowwise"
    gelu = next(k for k in cm.plan.kernels.values() if "tl.erf" in k.source)
    assert "tl.dot(" in gelu.source and "tl.load(in0 + cols" in gelu.source  # bias broadcast over rows
    row = next(k for k in cm.plan.kernels.values() if k.kind == "rowwise")
    assert row.source.count("tl.sum(") == 2 and row.source.count("tl.store(") == 1
    assert row.source.count("tl.dot(") == 2  # the GEMM (and its UPCAST twin for the interpreter)


# Dense convolutions stay NCHW in fp32 on the GPU (passes/layout.py); tests of the channels-last
# region in fp32 switch that off, so they test the same plan on either device.
NHWC_ALWAYS = ("fp32_dense_nchw",)


def test_conv_bn_relu_folds_batchnorm() -> None:
    cm = check_against_ort(conv_bn_relu(), {"x": [2, 4, 8, 8]}, fusion_disable=NHWC_ALWAYS)
    # BN folded into the conv weights, Relu in the epilogue of the implicit-GEMM conv kernel.
    assert cm.report["kernels"] == {"before": 3, "after": 1}
    assert cm.report["fusion"]["passes"]["fired"] == {"fold_batchnorm": 1, "channels_last": 1}
    (k,) = cm.plan.kernels.values()
    assert k.kind == "conv" and "tl.maximum(" in k.source


def test_batchnorm_fold_says_why_not() -> None:
    m = conv_bn_relu()
    m.graph.node.append(helper.make_node("Sigmoid", ["c"], ["side"], name="side_use"))
    m.graph.output.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, ["batch", 8, 8, 8]))
    cm = check_against_ort(m, {"x": [2, 4, 8, 8]}, fusion_disable=NHWC_ALWAYS)
    nf = [x for x in cm.report["fusion"]["not_fused"] if x["rule"] == "fold_batchnorm"]
    assert nf and "also used elsewhere" in nf[0]["reason"] and nf[0]["nodes"] == ["conv", "bn"]
    # It still fuses: as a per-channel x*a + b in the Relu's kernel.
    assert cm.report["fusion"]["passes"]["fired"] == {"batchnorm_to_affine": 1, "channels_last": 1}


BROADCASTS = [
    ([2, 3, 4, 5], [5]),  # bias over the last dim
    ([2, 3, 4, 5], [3, 1, 1]),  # per-channel
    ([2, 3, 4, 5], [2, 1, 4, 1]),  # general strides
    ([2, 3, 4, 5], [1]),  # scalar tensor input
    ([6, 7], [6, 1]),  # per-row
]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("xshape, bshape", BROADCASTS)
def test_broadcasting_pointwise_chain(xshape: list[int], bshape: list[int], precision: str) -> None:
    nodes = [
        helper.make_node("Mul", ["x", "b"], ["t0"]),
        helper.make_node("Add", ["t0", "x"], ["t1"]),
        helper.make_node("Sigmoid", ["t1"], ["t2"]),
        helper.make_node("Mul", ["t1", "t2"], ["y"]),  # SiLU
    ]
    m = make_model(nodes, {"x": xshape, "b": bshape}, {"y": xshape})
    cm = check_against_ort(m, {"x": xshape, "b": bshape}, precision)
    assert cm.report["kernels"] == {"before": 4, "after": 1}
    (kernel,) = cm.plan.kernels.values()
    assert kernel.source.count("tl.store(") == 1 and kernel.source.count("tl.load(") == 2


def test_intermediate_used_outside_is_a_second_output() -> None:
    nodes = [
        helper.make_node("Add", ["x", "b"], ["t0"]),
        helper.make_node("Relu", ["t0"], ["t1"]),
        helper.make_node("Tanh", ["t1"], ["y"]),
        helper.make_node("Transpose", ["t0"], ["s"], perm=[1, 0]),
    ]
    m = make_model(nodes, {"x": [4, 8]}, {"y": [4, 8], "s": [8, 4]}, inits={"b": RNG.standard_normal(8)})
    cm = check_against_ort(m, {"x": [4, 8]})
    (kernel,) = cm.plan.kernels.values()
    assert kernel.outputs == ["t0", "y"]
    assert cm.report["kernels"] == {"before": 3, "after": 1}  # the Transpose is a view


UNARY_CASES: list[tuple[str, dict[str, float]]] = [
    ("Relu", {}),
    ("Sigmoid", {}),
    ("Tanh", {}),
    ("Erf", {}),
    ("Exp", {}),
    ("Neg", {}),
    ("Abs", {}),
    ("Softplus", {}),
    ("LeakyRelu", {"alpha": 0.1}),
    ("Elu", {"alpha": 0.7}),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
    ("HardSwish", {}),
    ("Identity", {}),
]


@pytest.mark.parametrize("op, attrs", UNARY_CASES)
def test_each_unary_op_in_a_fused_chain(op: str, attrs: dict[str, float]) -> None:
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["t0"]),
        helper.make_node(op, ["t0"], ["t1"], **attrs),
        helper.make_node("Add", ["t1", "x"], ["y"]),
    ]
    m = make_model(nodes, {"x": [3, 50]}, {"y": [3, 50]}, inits={"s": np.array([3.0])})
    cm = check_against_ort(m, {"x": [3, 50]})
    assert len(cm.plan.kernels) == 1


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5, -1.0, 1.7])
def test_pow_with_constant_exponents(exponent: float) -> None:
    nodes = [
        helper.make_node("Abs", ["x"], ["a"]),
        helper.make_node("Add", ["a", "one"], ["t0"]),
        helper.make_node("Pow", ["t0", "e"], ["t1"]),
        helper.make_node("Sub", ["t1", "x"], ["y"]),
    ]
    m = make_model(
        nodes, {"x": [4, 16]}, {"y": [4, 16]}, inits={"one": np.array(1.0), "e": np.array(exponent)}
    )
    cm = check_against_ort(m, {"x": [4, 16]})
    assert len(cm.plan.kernels) == 1


def test_clip_max_min_div_sqrt_reciprocal_fuse() -> None:
    nodes = [
        helper.make_node("Clip", ["x", "lo", "hi"], ["c"]),
        helper.make_node("Max", ["c", "x2"], ["m"]),
        helper.make_node("Min", ["m", "hi"], ["m2"]),
        helper.make_node("Abs", ["m2"], ["a"]),
        helper.make_node("Add", ["a", "hi"], ["a1"]),
        helper.make_node("Sqrt", ["a1"], ["s"]),
        helper.make_node("Reciprocal", ["s"], ["r"]),
        helper.make_node("Div", ["r", "x2"], ["y"]),
    ]
    m = make_model(
        nodes, {"x": [5, 9], "x2": [5, 9]}, {"y": [5, 9]}, inits={"lo": np.array(-0.5), "hi": np.array(0.8)}
    )
    cm = check_against_ort(m, {"x": [5, 9], "x2": [5, 9]})
    assert cm.report["kernels"] == {"before": 8, "after": 1}


def test_disabling_the_pointwise_rule_fuses_nothing() -> None:
    cm = opfuse.compile(
        residual_mlp(),
        {"x": [2, 32]},
        device=TEST_DEVICE,
        fusion_disable=["pointwise", "row_reduction", "gemm_epilogue", "attention", "fold_batchnorm"],
    )
    assert cm.report["kernels"] == {"before": 19, "after": 19}
    assert cm.plan.kernels == {}


def test_model_text_never_runs_and_appears_only_escaped(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = f'"""\nimport os; open({str(marker)!r}, "w")\n#\r\u2028x'
    nodes = [
        helper.make_node("Add", ["x", "x"], ["t0"], name=evil),
        helper.make_node("Relu", ["t0"], ["y"], name=evil + "2"),
    ]
    m = make_model(nodes, {"x": [2, 3]}, {"y": [2, 3]})
    cm = check_against_ort(m, {"x": [2, 3]})
    (kernel,) = cm.plan.kernels.values()
    tree = ast.parse(kernel.source)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "os" not in names and "open" not in names
    assert "import os" not in "\n".join(
        line for line in kernel.source.splitlines() if not line.startswith("#")
    )
    assert not marker.exists()
    cm.save(tmp_path / "b.zip")
    opfuse.load(tmp_path / "b.zip", device=TEST_DEVICE).run(
        {"x": RNG.standard_normal((2, 3)).astype(np.float32)}
    )
    assert not marker.exists()


def test_failing_group_is_found_by_bisection_and_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # A deliberately wrong Erf: the GELU group must be rolled back, the others kept.
    monkeypatch.setitem(emitters._UNARY, "Erf", "(tl.erf({0}) * 1.5)")
    cm = check_against_ort(residual_mlp(), {"x": [4, 32]})
    v = cm.report["verification"]
    assert v["passed"] is True and len(v["rolled_back"]) == 1
    rolled = v["rolled_back"][0]
    assert all(g["id"] != rolled for g in cm.report["fusion"]["groups"])
    assert cm.report["kernels"]["after"] == 2 - 1 + 7
    assert any("rolled back" in nf["reason"] for nf in cm.report["fusion"]["not_fused"])


def test_bundle_round_trip_and_errors(tmp_path: Path) -> None:
    cm = opfuse.compile(residual_mlp(), {"x": [3, 32]}, device=TEST_DEVICE)
    path = tmp_path / "m.opfuse.zip"
    cm.save(path)
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        assert {"manifest.json", "model.onnx", "plan.json", "report.json"} <= names
        assert {f"kernels/{k}.py" for k in cm.plan.kernels} <= names
        fused = onnx.load_from_string(z.read("model.onnx"))
    assert sum(1 for n in fused.graph.node if n.domain == "ai.opfuse" and n.op_type == "FusedKernel") == 2
    loaded = opfuse.load(path, device=TEST_DEVICE)
    x = RNG.standard_normal((3, 32)).astype(np.float32)
    np.testing.assert_array_equal(loaded.run({"x": x})["y"], cm.run({"x": x})["y"])
    assert loaded.report["kernels"] == cm.report["kernels"]

    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(bad, "w") as out:
        for item in z.namelist():
            data = z.read(item)
            if item == "manifest.json":
                data = data.replace(b'"version": 2', b'"version": 99')  # BUNDLE_VERSION
            out.writestr(item, data)
    with pytest.raises(BundleError, match="version 99"):
        opfuse.load(bad, device=TEST_DEVICE)
    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    with pytest.raises(BundleError, match="cannot open"):
        opfuse.load(tmp_path / "junk.zip", device=TEST_DEVICE)
    with pytest.raises(opfuse.ModelError, match="compiled for"):
        loaded.run({"x": np.ones((5, 32), np.float32)})


def test_unfoldable_batchnorm_fuses_with_relu_as_affine() -> None:
    c = 6
    nodes = [
        helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["bn"], epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["y"]),
    ]
    inits = {
        "s": 1 + RNG.standard_normal(c) * 0.1,
        "b": RNG.standard_normal(c),
        "m": RNG.standard_normal(c),
        "v": 0.5 + RNG.random(c),
    }
    m = make_model(nodes, {"x": [2, c, 5, 5]}, {"y": [2, c, 5, 5]}, inits)
    cm = check_against_ort(m, {"x": [2, c, 5, 5]})
    assert cm.report["kernels"] == {"before": 2, "after": 1}
    assert cm.report["fusion"]["passes"]["fired"] == {"batchnorm_to_affine": 1}


def test_where_with_a_bool_mask_fuses() -> None:
    nodes = [
        helper.make_node("Greater", ["x", "t"], ["c"]),
        helper.make_node("Mul", ["x", "t"], ["xs"]),
        helper.make_node("Where", ["c", "xs", "x"], ["w"]),
        helper.make_node("Sigmoid", ["w"], ["y"]),
    ]
    m = make_model(nodes, {"x": [4, 9]}, {"y": [4, 9]}, {"t": np.array(0.3)})
    cm = check_against_ort(m, {"x": [4, 9]})
    assert cm.report["kernels"] == {"before": 4, "after": 1}  # the bool mask is computed in the kernel too


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_transpose_and_reshape_become_index_arithmetic(precision: str) -> None:
    from onnx import numpy_helper

    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),  # [2, 5, 4] -> [2, 4, 5]
        helper.make_node("Reshape", ["z", "shape"], ["zr"]),  # [40] -> [2, 4, 5]
        helper.make_node("Add", ["xt", "zr"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    m = make_model(nodes, {"x": [2, 5, 4], "z": [40]}, {"y": [2, 4, 5]})
    m.graph.initializer.append(numpy_helper.from_array(np.array([2, 4, 5], dtype=np.int64), "shape"))
    cm = check_against_ort(m, {"x": [2, 5, 4], "z": [40]}, precision)
    (k,) = cm.plan.kernels.values()
    assert k.inputs == ["x", "z"]  # read straight from the buffers behind the layout ops
    assert [s.kind for s in cm.plan.steps] == ["kernel"]
    (g,) = cm.report["fusion"]["groups"]
    assert sorted(g["layout_folded"]) == ["Reshape#n1", "Transpose#n0"]


def test_verification_falls_back_when_onnxruntime_cannot_run_the_model() -> None:
    # onnxruntime has no bfloat16 Mul on the CPU: the unfused float32 plan is the reference then.
    nodes = [helper.make_node("Mul", ["x", "x"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "bf16",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [4, 8])],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    cm = opfuse.compile(m, {"x": [4, 8]}, device=TEST_DEVICE)
    v = cm.report["verification"]
    assert v["passed"] is True and v["reference"] == "opfuse-unfused-fp32-cpu"
    assert "onnxruntime could not run" in v["reference_note"]


def test_inputs_of_the_wrong_kind_are_refused() -> None:
    cm = opfuse.compile(residual_mlp(), {"x": [2, 32]}, device=TEST_DEVICE)
    with pytest.raises(opfuse.ModelError, match="takes float32"):
        cm.run({"x": np.ones((2, 32), dtype=np.int64)})


def test_group_ids_are_unique_across_kinds() -> None:
    # A GEMM group and a pointwise group, each the first of its kind.
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Relu", ["h"], ["y"]),
        helper.make_node("Sigmoid", ["z"], ["s"]),
        helper.make_node("Mul", ["s", "z"], ["u"]),
    ]
    m = make_model(
        nodes, {"x": [4, 8], "z": [4, 8]}, {"y": [4, 8], "u": [4, 8]}, {"w": RNG.standard_normal((8, 8))}
    )
    cm = check_against_ort(m, {"x": [4, 8], "z": [4, 8]})
    kinds = {g["id"]: g["kind"] for g in cm.report["fusion"]["groups"]}
    assert sorted(kinds.values()) == ["gemm", "pointwise"]
    assert len(kinds) == 2


def test_gather_by_constant_consecutive_indices_becomes_a_view() -> None:
    """q, k, v picked out of a packed projection (PyTorch MultiheadAttention's export): Gathers
    with constant indices become Slices (views); a non-consecutive Gather stays and says why."""
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["packed"]),  # [3, 4, 8]
        helper.make_node("Gather", ["packed", "i0"], ["q"], axis=0),  # scalar index
        helper.make_node("Gather", ["packed", "i1"], ["k"], axis=0),  # negative index
        helper.make_node("Gather", ["packed", "i2"], ["v"], axis=1),  # a run of 2, 2-D indices
        helper.make_node("Gather", ["packed", "i3"], ["w"], axis=2, name="shuffle"),  # not a run
        helper.make_node("Add", ["q", "k"], ["qk"]),
        helper.make_node("Relu", ["qk"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [12, 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [3, 1, 2, 8]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 4, 2]),
        ],
        initializer=[
            numpy_helper.from_array(np.array([3, 4, 8], dtype=np.int64), "shape"),
            numpy_helper.from_array(np.array(0, dtype=np.int64), "i0"),
            numpy_helper.from_array(np.array(-2, dtype=np.int64), "i1"),
            numpy_helper.from_array(np.array([[1, 2]], dtype=np.int64), "i2"),
            numpy_helper.from_array(np.array([5, 1], dtype=np.int64), "i3"),
        ],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    cm = check_against_ort(m, {"x": [12, 8]})
    assert cm.report["fusion"]["passes"]["fired"]["gather_to_slice"] == 3
    gathers = [s for s in cm.plan.steps if s.op_type == "Gather"]
    assert [s.label for s in gathers] == ["shuffle"]
    reasons = [n["reason"] for n in cm.report["fusion"]["not_fused"] if n["rule"] == "gather_to_slice"]
    assert reasons == ["the indices are not consecutive"]


def test_group_norm_rewrite_says_why_not() -> None:
    # Reshape -> InstanceNormalization with its own (non-unit) scale -> Reshape: not a GroupNorm.
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["r"]),
        helper.make_node("InstanceNormalization", ["r", "g", "b"], ["n"], name="inorm"),
        helper.make_node("Reshape", ["n", "s2"], ["y"]),
    ]
    inits = {
        "s1": np.array([2, 4, -1]),
        "s2": np.array([2, 8, 3, 3]),
        "g": RNG.uniform(0.5, 1.5, 4),
        "b": np.zeros(4),
    }
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 3, 3])],
        initializer=[
            numpy_helper.from_array(v.astype(np.int64 if k.startswith("s") else np.float32), k)
            for k, v in inits.items()
        ],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    cm = check_against_ort(m, {"x": [2, 8, 3, 3]})
    reasons = [n["reason"] for n in cm.report["fusion"]["not_fused"] if n["rule"] == "group_norm"]
    assert reasons == ["the InstanceNormalization has its own scale or bias"]


def test_rotate_half_says_why_not() -> None:
    # Concat(-x[..., 2:], x[..., :3]) on a last axis of 6: not the two halves.
    nodes = [
        helper.make_node("Slice", ["x", "s_hi", "e_hi", "ax"], ["hi"]),
        helper.make_node("Neg", ["hi"], ["nhi"]),
        helper.make_node("Slice", ["x", "s_lo", "e_lo", "ax"], ["lo"]),
        helper.make_node("Concat", ["nhi", "lo"], ["y"], axis=-1, name="cat"),
    ]
    ints = {"s_hi": [2], "e_hi": [6], "s_lo": [0], "e_lo": [3], "ax": [-1]}
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 7])],
        initializer=[numpy_helper.from_array(np.array(v, dtype=np.int64), k) for k, v in ints.items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    cm = check_against_ort(m, {"x": [2, 3, 6]})
    reasons = [n["reason"] for n in cm.report["fusion"]["not_fused"] if n["rule"] == "rotate_half"]
    assert reasons == ["the slices are not the two halves of the last axis"]


def test_gemm_epilogue_pulls_in_a_side_input_computed_only_for_it() -> None:
    """y = relu(x @ w + z * c): z * c is read only by the epilogue, so it is computed there; when
    it is also a graph output it keeps its own kernel."""
    for side_output in (False, True):
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Mul", ["z", "c"], ["zc"], name="side"),
            helper.make_node("Add", ["h", "zc"], ["a"]),
            helper.make_node("Relu", ["a"], ["y"]),
        ]
        outputs = {"y": [4, 8], **({"zc": [4, 8]} if side_output else {})}
        inits = {"w": RNG.standard_normal((16, 8)), "c": RNG.standard_normal(8)}
        m = make_model(nodes, {"x": [4, 16], "z": [4, 8]}, outputs, inits)
        cm = check_against_ort(m, {"x": [4, 16], "z": [4, 8]})
        (gemm,) = [g for g in cm.report["fusion"]["groups"] if g["kind"] == "gemm"]
        assert ("side" in gemm["nodes"]) is not side_output
        assert cm.report["kernels"]["after"] == (2 if side_output else 1)


def test_identical_layers_generate_one_kernel_for_triton_and_the_tuner() -> None:
    """Two identical blocks (same ops, same shapes, different weights and node names): their kernels
    have the same jitted function at the same line, which is Triton's compile-cache key, and the
    same tuning signature. Which nodes each kernel covers is kept, at the end of its module."""
    from opfuse.tuning.cache import kernel_signature

    nodes, inits = [], {}
    for i in range(2):
        x, y = ("x" if i == 0 else "y0"), f"y{i}"
        nodes += [
            helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"block{i}/MatMul"),
            helper.make_node("Add", [f"h{i}", f"b{i}"], [f"s{i}"], name=f"block{i}/Add"),
            helper.make_node("Relu", [f"s{i}"], [y], name=f"block{i}/Relu"),
        ]
        inits |= {f"w{i}": RNG.standard_normal((16, 16)) * 0.3, f"b{i}": RNG.standard_normal(16)}
    model = make_model(nodes, {"x": [4, 16]}, {"y1": [4, 16]}, inits)
    cm = check_against_ort(model, {"x": [4, 16]})
    kernels = list(cm.plan.kernels.values())
    assert len(kernels) == 2

    def jitted(source: str) -> tuple[int, str]:
        lines = source.split("\n")
        start = next(i for i, line in enumerate(lines) if line.startswith("@triton.jit"))
        end = next(i for i in range(start + 2, len(lines)) if lines[i].startswith("def "))
        return start, "\n".join(lines[start:end])

    assert jitted(kernels[0].source) == jitted(kernels[1].source)
    assert kernel_signature(kernels[0]) == kernel_signature(kernels[1])
    for k, block in zip(kernels, ("block0", "block1"), strict=True):
        assert k.source.startswith("# Generated by opfuse")
        tail = k.source.split("# What this kernel computes:")[1]
        assert f"{block}/MatMul" in tail and f"{block}/Relu" in tail


# --- Local response normalization -----------------------------------------------------------------


def lrn_model(
    size: int,
    written_out: bool = True,
    conv: bool = False,
    pads: tuple[int, int] | None = None,
    shape: tuple[int, int, int, int] = (2, 7, 5, 6),
) -> onnx.ModelProto:
    """x (or Conv(x)) -> LRN -> Relu. Written out as torch.onnx exports nn.LocalResponseNorm:
    Mul(a, a) -> Reshape [N, 1, C, H, W] -> Pad the channels -> AveragePool [size, 1, 1] ->
    Reshape back -> Mul alpha -> Add k -> Pow beta -> Div(a, .); `pads` default to torch's
    (size // 2, (size - 1) // 2). Or the native ONNX LRN node."""
    n, c, h, w = shape
    before, after = pads if pads is not None else (size // 2, (size - 1) // 2)
    floats = {"alpha": np.array(0.37), "k": np.array(1.3), "beta": np.array(0.6)}
    ints = {
        "lift": np.array([n, 1, c, h, w]),
        "pads": np.array([0, 0, before, 0, 0, 0, 0, after, 0, 0]),
        "back": np.array([n, c, h, w]),
    }
    nodes = []
    a = "x"
    if conv:
        floats |= {"w": RNG.standard_normal((c, c, 3, 3)) * 0.3, "b": RNG.standard_normal(c) * 0.1}
        nodes.append(helper.make_node("Conv", ["x", "w", "b"], ["a"], name="conv", pads=[1, 1, 1, 1]))
        a = "a"
    if written_out:
        nodes += [
            helper.make_node("Mul", [a, a], ["sq"], name="square"),
            helper.make_node("Reshape", ["sq", "lift"], ["sq5"], name="lift"),
            helper.make_node("Pad", ["sq5", "pads"], ["padded"], name="pad", mode="constant"),
            helper.make_node(
                "AveragePool",
                ["padded"],
                ["avg5"],
                name="pool",
                kernel_shape=[size, 1, 1],
                strides=[1, 1, 1],
                count_include_pad=1,
            ),
            helper.make_node("Reshape", ["avg5", "back"], ["avg"], name="back"),
            helper.make_node("Mul", ["avg", "alpha"], ["scaled"], name="alpha"),
            helper.make_node("Add", ["scaled", "k"], ["shifted"], name="k"),
            helper.make_node("Pow", ["shifted", "beta"], ["denom"], name="beta"),
            helper.make_node("Div", [a, "denom"], ["normed"], name="div"),
        ]
    else:
        nodes.append(
            helper.make_node("LRN", [a], ["normed"], name="lrn", size=size, alpha=0.37, beta=0.6, bias=1.3)
        )
    nodes.append(helper.make_node("Relu", ["normed"], ["y"], name="relu"))
    graph = helper.make_graph(
        nodes,
        "lrn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        initializer=[numpy_helper.from_array(v.astype(np.float32), k) for k, v in floats.items()]
        + [numpy_helper.from_array(v.astype(np.int64), k) for k, v in ints.items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m


def lrn_kernel(cm: opfuse.CompiledModel) -> str:
    """The source of the one kernel that computes the LRN."""
    (source,) = [k.source for k in cm.plan.kernels.values() if "LRN" in k.source]
    return source


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("size", [3, 5])
def test_written_out_lrn_is_one_kernel_with_its_relu(size: int, precision: str) -> None:
    cm = check_against_ort(lrn_model(size), {"x": [2, 7, 5, 6]}, precision)
    assert cm.report["fusion"]["passes"]["fired"].get("local_response_norm") == 1
    assert cm.report["kernels"]["after"] == 1
    source = lrn_kernel(cm)
    # NCHW: a neighbouring channel is one plane (5 * 6 elements) away; size - 1 window loads.
    assert source.count("# channel ") == size - 1
    assert "(offs - 30)" in source and "(offs + 30)" in source and "mask=mask & (" in source
    assert "# Relu" in source
    off = check_against_ort(lrn_model(size), {"x": [2, 7, 5, 6]}, precision, ("local_response_norm",))
    assert not any("LRN" in k.source for k in off.plan.kernels.values())
    assert off.report["kernels"]["after"] == 4  # Pad, AveragePool, Mul/Add/Pow, Div with Relu


def test_written_out_lrn_of_even_size_stays_written_out() -> None:
    # torch pads an even window (2, 1): one channel earlier than ONNX LRN's (1, 2).
    cm = check_against_ort(lrn_model(4), {"x": [2, 7, 5, 6]})
    assert "local_response_norm" not in cm.report["fusion"]["passes"]["fired"]
    reasons = [n["reason"] for n in cm.report["fusion"]["not_fused"] if n["rule"] == "local_response_norm"]
    assert reasons and "padded (2, 1), ONNX LRN's is (1, 2)" in reasons[0]
    assert not any("LRN" in k.source for k in cm.plan.kernels.values())
    # Padded as ONNX LRN's window, the same size is the same function, and one kernel.
    cm = check_against_ort(lrn_model(4, pads=(1, 2)), {"x": [2, 7, 5, 6]})
    assert cm.report["fusion"]["passes"]["fired"].get("local_response_norm") == 1
    assert lrn_kernel(cm).count("# channel ") == 3


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("size", [3, 5])
def test_native_lrn_is_one_kernel(size: int, precision: str) -> None:
    cm = check_against_ort(lrn_model(size, written_out=False), {"x": [2, 7, 5, 6]}, precision)
    assert cm.report["kernels"] == {"before": 2, "after": 1}
    assert lrn_kernel(cm).count("# channel ") == size - 1
    off = check_against_ort(
        lrn_model(size, written_out=False), {"x": [2, 7, 5, 6]}, precision, ("channel_window",)
    )
    assert off.plan.kernels == {} or not any("LRN" in k.source for k in off.plan.kernels.values())


def test_native_lrn_of_even_size_matches_the_per_op_kernel() -> None:
    # onnxruntime refuses even LRN sizes: the per-op kernel (tested against the ONNX reference in
    # test_ops_extended) is the reference.
    model = lrn_model(4, written_out=False)
    feeds = {"x": RNG.standard_normal((2, 7, 5, 6)).astype(np.float32)}
    got = opfuse.compile(model, input_shapes={"x": [2, 7, 5, 6]}, device=TEST_DEVICE, verify=False)
    want = opfuse.compile(
        model,
        input_shapes={"x": [2, 7, 5, 6]},
        device=TEST_DEVICE,
        verify=False,
        fusion_disable=["channel_window"],
    )
    assert got.report["kernels"]["after"] == 1 and "LRN" not in str(want.plan.kernels)
    assert rel_l2(got.run(feeds)["y"], want.run(feeds)["y"].astype(np.float64)) <= 1e-5


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("written_out", [True, False])
def test_lrn_after_a_conv_runs_channels_last(written_out: bool, precision: str) -> None:
    model = lrn_model(5, written_out=written_out, conv=True)
    cm = check_against_ort(model, {"x": [2, 7, 5, 6]}, precision, NHWC_ALWAYS)
    ops = [s.op_type for s in cm.plan.steps if s.kind == "op" and s.launches]
    assert "LRN" not in ops and "opfuse.LRNNHWC" not in ops
    source = lrn_kernel(cm)
    # NHWC: the channels are the contiguous last axis, a neighbour one element away.
    assert "opfuse.LRNNHWC" in source and "(offs - 2)" in source and "(offs + 2)" in source
    assert "offs % 7" in source


def test_lrn_input_computed_before_it_is_written_by_another_kernel() -> None:
    # r = Relu(x); y = LRN(r) + r: the LRN reads r at neighbouring channels, so r is not computed
    # in the LRN's kernel (which still takes the Add), and the planner says why.
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("LRN", ["r"], ["n"], name="lrn", size=3, alpha=0.5, beta=0.75, bias=1.0),
        helper.make_node("Add", ["n", "r"], ["y"], name="residual"),
    ]
    m = make_model(nodes, {"x": [2, 6, 4, 4]}, {"y": [2, 6, 4, 4]})
    cm = check_against_ort(m, {"x": [2, 6, 4, 4]})
    groups = [g["nodes"] for g in cm.report["fusion"]["groups"]]
    assert groups == [["lrn", "residual"]] and cm.report["kernels"]["after"] == 2
    reasons = [n["reason"] for n in cm.report["fusion"]["not_fused"] if n["rule"] == "pointwise"]
    assert any("reads its input at neighbouring channels" in r for r in reasons)
