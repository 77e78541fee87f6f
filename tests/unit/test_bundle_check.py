"""The re-render check of opfuse.bundle_check: every kernel of the snapshot models (every template
kind, the vendor variants' split forms too) renders again from its spec, through plan.json and
model.onnx as a bundle holds them, to the byte; any alteration of source, spec or plan is refused."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from typing import Any

import pytest

from bench.kernels import plan_model
from opfuse.bundle_check import check_kernels, model_constants
from opfuse.errors import BundleError
from opfuse.lowering import build_plan
from opfuse.runtime import plan as runtime_plan
from opfuse.runtime.bundle import fused_model
from opfuse.runtime.plan import Plan
from tests.builders import conv_bn_relu, residual_mlp
from tests.unit.test_kernel_snapshots import MODELS


def _bundle_parts(plan: Plan) -> tuple[dict[str, Any], dict[str, bytes], dict[str, Any]]:
    """plan.json, the kernels/ members and the constants, as a bundle's reader gets them."""
    plan_json = json.loads(json.dumps(plan.to_json(), indent=1))
    files = {f"kernels/{k.id}.py": k.source.encode() for k in plan.kernels.values()}
    return plan_json, files, model_constants(fused_model(plan))


def _vendor_plan(name: str) -> Plan | None:
    """The model's plan with every anchor group in its vendor variant (the split forms)."""
    build, precision, disabled = MODELS[name]
    model, shapes = build()
    p = plan_model(model, shapes or None, precision, disabled)
    variants = {g.id: "vendor" for g in p.fusion.groups}
    return build_plan(p.graph, p.fusion, precision, p.plan.inputs, p.plan.outputs, variants=variants)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_kernel_renders_again_from_its_spec_to_the_byte(name: str) -> None:
    build, precision, disabled = MODELS[name]
    model, shapes = build()
    plans = [plan_model(model, shapes or None, precision, disabled).plan, _vendor_plan(name)]
    for plan in plans:
        assert plan is not None and plan.kernels
        plan_json, files, constants = _bundle_parts(plan)
        sources = check_kernels(plan_json, files, constants)
        assert sources == {k.id: k.source for k in plan.kernels.values()}


@pytest.fixture(scope="module")
def mlp() -> Plan:
    return plan_model(residual_mlp(), {"x": [4, 32]}, "fp32").plan


def _refused(plan: Plan, alter: Any, message: str) -> None:
    plan_json, files, constants = _bundle_parts(plan)
    alter(plan_json, files)
    with pytest.raises(BundleError, match=message):
        check_kernels(plan_json, files, constants)


def test_a_line_added_to_a_kernel_file_is_refused(mlp: Plan) -> None:
    def plant(plan_json: dict[str, Any], files: dict[str, bytes]) -> None:
        files["kernels/k0.py"] += b"open('/tmp/planted', 'w').write('x')\n"

    _refused(mlp, plant, "kernel k0's source is not what this opfuse generates from its spec")


def test_a_kernel_file_no_plan_names_is_refused(mlp: Plan) -> None:
    _refused(mlp, lambda p, f: f.update({"kernels/k9.py": b"import os\n"}), "no kernel of its plan is")


def test_a_missing_spec_or_unknown_template_is_refused(mlp: Plan) -> None:
    _refused(mlp, lambda p, f: p["kernels"][0].pop("spec"), "spec is missing")
    _refused(mlp, lambda p, f: p["kernels"][0]["spec"].update(template="shellcode"), "template 'shellcode'")


@pytest.mark.parametrize(
    "where",
    ["kernel", "part_id", "node_id", "op_type"],
)
def test_identifiers_that_opfuse_does_not_generate_are_refused(mlp: Plan, where: str) -> None:
    """A newline in an id would end the comment it is written into: the next line would be code."""
    bad = "r0\nimport os; os.system('x')"

    def alter(plan_json: dict[str, Any], files: dict[str, bytes]) -> None:
        spec = plan_json["kernels"][0]["spec"]
        part = spec["part"]["v"]
        node = part["nodes"][0]["v"]
        if where == "kernel":
            spec["kernel"] = bad
        elif where == "part_id":
            part["id"] = bad
        elif where == "node_id":
            node["id"] = bad
        else:
            node["op_type"] = bad

    _refused(mlp, alter, "is not one opfuse generates")


def test_objects_of_unknown_types_and_dtypes_are_refused(mlp: Plan) -> None:
    def foreign_type(plan_json: dict[str, Any], files: dict[str, bytes]) -> None:
        plan_json["kernels"][0]["spec"]["part"]["v"]["match"] = {"$": "os.system", "v": {}}

    def object_array(plan_json: dict[str, Any], files: dict[str, bytes]) -> None:
        arr = {"$": "array", "dtype": "object", "shape": [1], "v": ["x"]}
        plan_json["kernels"][0]["spec"]["part"]["v"]["match"] = arr

    _refused(mlp, foreign_type, "unknown type 'os.system'")
    _refused(mlp, object_array, "dtype 'object'")


def test_a_spec_that_does_not_render_is_refused(mlp: Plan) -> None:
    def wrong_op(plan_json: dict[str, Any], files: dict[str, bytes]) -> None:
        plan_json["kernels"][0]["spec"]["part"]["v"]["nodes"][0]["v"]["inputs"] = ["no_such_value"]

    _refused(mlp, wrong_op, "does not render|not what this opfuse generates")


def test_plan_fields_other_than_the_spec_implies_are_refused(mlp: Plan) -> None:
    _refused(mlp, lambda p, f: p["kernels"][0].update(outputs=["x"]), "says outputs other than its spec")
    _refused(mlp, lambda p, f: p["kernels"][0].update(config={"BLOCK": "__import__('os')"}), "launch config")
    kernel_step = next(i for i, s in enumerate(mlp.to_json()["steps"]) if s["kind"] == "kernel")

    def rewire(plan_json: dict[str, Any], files: dict[str, bytes]) -> None:
        plan_json["steps"][kernel_step]["outputs"] = ["x"]

    def foreign_op(plan_json: dict[str, Any], files: dict[str, bytes]) -> None:
        op = next(s for s in plan_json["steps"] if s["kind"] == "op")
        op["op_type"] = "__import__('os').system"

    _refused(mlp, rewire, f"step {kernel_step} launches kernel")
    # The second MatMul as a library op (every node of the MLP is in a kernel with the rule on).
    with_op = plan_model(residual_mlp(), {"x": [4, 32]}, "fp32", disabled=("gemm_reduction",)).plan
    _refused(with_op, foreign_op, "that is no op name")


def test_a_value_shape_other_than_the_input_it_names_is_refused(mlp: Plan) -> None:
    """Kernels rendered for a bigger input than the one the runtime is fed would read past it."""

    def grow(plan_json: dict[str, Any], files: dict[str, bytes]) -> None:
        name = plan_json["inputs"][0]["name"]
        value = next(v for v in plan_json["values"] if v["name"] == name)
        value["shape"] = [d * 4 for d in value["shape"]]

    _refused(mlp, grow, "gives 'x' the shape")


def test_a_spec_reading_a_constant_the_bundle_lacks_is_refused() -> None:
    plan = plan_model(conv_bn_relu(), {"x": [2, 4, 8, 8]}, "fp32").plan
    plan_json, files, constants = _bundle_parts(plan)
    read = plan_json["kernels"][0]["spec"]["constants"]
    assert read, "the conv's spec reads its bias"
    fewer = copy.copy(constants)
    del fewer[read[0]]
    with pytest.raises(BundleError, match="constants the bundle does not hold"):
        check_kernels(plan_json, files, fewer)


def test_the_check_reads_the_plan_version_the_runtime_writes() -> None:
    from opfuse import bundle_check

    assert bundle_check.PLAN_VERSION == runtime_plan.PLAN_VERSION


def test_the_check_imports_neither_torch_nor_triton() -> None:
    """The API runs the check on every upload and never imports torch (DESIGN.md)."""
    code = (
        "import sys, opfuse.bundle_check\nprint(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_kernels_render_again_in_every_precision(precision: str) -> None:
    """A literal in a kernel (the LayerNorm's epsilon, 1e-5) is the constant's value in the
    compile's precision, as the bundle stores it: a bf16 bundle loads again."""
    plan = plan_model(residual_mlp(), {"x": [4, 32]}, precision).plan
    plan_json, files, constants = _bundle_parts(plan)
    assert check_kernels(plan_json, files, constants) == {k.id: k.source for k in plan.kernels.values()}
    if precision == "bf16":
        assert any("1.0013580322265625e-05" in k.source for k in plan.kernels.values())


def test_bfloat16_rounding_is_to_nearest_even_as_onnx_and_torch_round() -> None:
    import numpy as np
    import torch
    from onnx import helper, numpy_helper

    from opfuse.passes.precision import round_to_bfloat16

    rng = np.random.default_rng(7)
    x = np.concatenate(
        [
            rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4000),
            np.array([1e-5, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0, np.inf, -np.inf, 3.4e38], np.float32),
        ]
    ).astype(np.float32)
    got = round_to_bfloat16(x)
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(got, want)
    t = helper.make_tensor("t", 16, x.shape, x.tolist())  # what the bundle writer stores
    np.testing.assert_array_equal(numpy_helper.to_array(t).astype(np.float32), got)
    assert np.isnan(round_to_bfloat16(np.array([np.nan], np.float32)))[0]
