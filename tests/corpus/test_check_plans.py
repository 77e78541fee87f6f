"""`python -m bench.corpus.run --check-plans`: rows of the CI subset exported and planned (no
compile, no kernel run) against expected.csv, and against a doctored copy of it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.corpus import models
from bench.corpus import run as cpu
from bench.corpus.plans import check_plans


def _checks(out: str) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(model, exporter) -> (the file's launches, planned launches, the check) from the printed lines."""
    found = {}
    for line in out.splitlines():
        parts = line.split(maxsplit=4)
        if len(parts) == 5 and parts[1] in cpu.EXPORTERS:
            found[(parts[0], parts[1])] = (parts[2], parts[3], parts[4])
    return found


def test_subset_rows_plan_the_launches_expected_csv_holds(capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec("timm") is None:  # not imported here: bench/zoo.py imports it
        pytest.skip("timm is not installed (pip install -e '.[dev]')")
    names = ["timm/test_resnet", "transformers/bert"]
    assert all(models.BY_NAME[n].ci for n in names)  # rows tests/corpus/test_corpus.py also compiles
    try:
        cpu.main(["--check-plans", "--rows", ",".join(names)])
        code: Any = 0
    except SystemExit as exc:  # 1: a row differs, told below
        code = exc.code
    out = capsys.readouterr().out
    got = _checks(out)
    expected = cpu.read_rows(cpu.EXPECTED)
    assert set(got) == {(n, e) for n in names for e in cpu.EXPORTERS}
    # Then what runs outside any group across them (ResNet's pools), and the rules' refusals.
    alone, refused = out.split("runs outside any group", 1)[1].split(
        "the fusion rules' most frequent refusals"
    )
    assert (
        "opfuse.AveragePoolNHWC" in alone
        and "row_reduction: merging would create a cycle through X" in refused
    )
    # Each op's line names the rows that run it most often outside any group.
    pools = next(line for line in alone.splitlines() if "opfuse.AveragePoolNHWC" in line)
    assert "timm/test_resnet[" in pools, pools
    for (name, exporter), (file_launches, planned, check) in got.items():
        assert file_launches == expected[(name, exporter)]["launches"]
        assert check == "ok", (
            f"{name} ({exporter}): {planned} launches planned, expected.csv says {file_launches} ({check}); "
            f"if the change is intended, rewrite the row's lines: make corpus ROWS={name}"
        )
    assert code in (0, None)


def test_a_row_the_file_records_differently_differs_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Independent of what opfuse plans today: a count no plan of the row comes near.
    rows = cpu.read_rows(cpu.EXPECTED)
    bert, vit_t = ("transformers/bert", "dynamo"), ("timm/test_vit", "torchscript")
    assert rows[vit_t]["status"] == "export_failed"  # skipped: never built, timm is not needed
    wrong = int(rows[bert]["launches"]) + 100
    doctored: dict[tuple[str, str], dict[str, Any]] = {
        bert: {**rows[bert], "launches": wrong},
        vit_t: rows[vit_t],
    }
    path = tmp_path / "expected.csv"
    cpu.write_rows(str(path), doctored)  # the other two lines left out: not in the file
    before = path.read_bytes()
    with pytest.raises(SystemExit) as exc:
        cpu.main(["--check-plans", "--rows", "transformers/bert,timm/test_vit", "--expected", str(path)])
    assert exc.value.code == 1
    out = capsys.readouterr().out
    got = _checks(out)
    file_launches, planned, check = got[bert]
    assert (file_launches, check) == (str(wrong), "differs") and 0 < int(planned) < wrong
    assert got[("transformers/bert", "torchscript")] == ("-", "-", "skipped (not in the file)")
    assert got[vit_t] == ("-", "-", "skipped (export_failed in the file)")
    assert got[("timm/test_vit", "dynamo")] == ("-", "-", "skipped (not in the file)")
    assert "0 ok, 1 differ, 0 failed, 3 skipped" in out
    assert "make corpus ROWS='transformers/bert'" in out
    assert path.read_bytes() == before  # only read


def test_a_row_that_cannot_be_built_fails_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    def build() -> Any:
        raise RuntimeError("no such model")

    row = models.Row("timm/broken", "timm", build)
    line = {"status": "ok", "launches": "5", "compute_nodes": "9"}
    rc = check_plans([row], ["dynamo"], {("timm/broken", "dynamo"): line})
    assert rc == 1
    check = _checks(capsys.readouterr().out)[("timm/broken", "dynamo")]
    assert check == ("5", "-", "error: building: RuntimeError: no such model")


def test_a_row_whose_alternative_form_cannot_be_generated_fails_the_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GEMM group's alternative (the library's GEMM, then the epilogue's pointwise kernel) is
    generated as tuning on the GPU would generate it; its fault is the row's error here."""
    import torch

    from opfuse.codegen import registry

    def generate_pointwise(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("no pointwise kernel")

    def build() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval(), {"x": torch.randn(4, 16)}

    row = models.Row("timm/linear", "timm", build)
    line = {"status": "ok", "launches": "1", "compute_nodes": "2"}
    rc = check_plans([row], ["dynamo"], {("timm/linear", "dynamo"): line})
    assert rc == 0 and _checks(capsys.readouterr().out)[("timm/linear", "dynamo")] == ("1", "1", "ok")
    monkeypatch.setattr(registry, "generate_pointwise", generate_pointwise)
    rc = check_plans([row], ["dynamo"], {("timm/linear", "dynamo"): line})
    assert rc == 1
    check = _checks(capsys.readouterr().out)[("timm/linear", "dynamo")]
    assert check[:2] == ("1", "-") and check[2].startswith(
        "error: RuntimeError: the alternative form of 1 group(s)"
    ), check
    assert "ValueError: no pointwise kernel" in check[2], check


def test_run_alternatives_runs_each_rows_alternative_forms_against_onnxruntime(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--run-alternatives: the conv group's library form (the library's conv, then its epilogue's
    kernel adding the bias) runs against onnxruntime; a wrong one fails the row."""
    import torch

    from opfuse import lowering  # builds the library form of a conv group

    def build() -> Any:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Sigmoid()).eval()
        return net, {"x": torch.randn(2, 3, 6, 6)}

    row = models.Row("timm/conv", "timm", build)
    line = {"status": "ok", "launches": "1", "compute_nodes": "2"}  # one kernel: the conv and its Sigmoid
    assert check_plans([row], ["dynamo"], {("timm/conv", "dynamo"): line}, run_alternatives=True) == 0
    check = _checks(capsys.readouterr().out)[("timm/conv", "dynamo")][2]
    assert check.startswith("ok (alternatives: relative L2 ") and float(check.split()[-1][:-1]) < 1e-4, check
    real = lowering.bias_to_epilogue

    def subtracted(graph: Any, anchor: Any, epilogue: list[Any]) -> Any:
        conv, ops = real(graph, anchor, epilogue)
        if ops and ops[0].op_type == "Add":  # the bias subtracted: a fault the check must see
            ops[0].op_type = "Sub"
        return conv, ops

    monkeypatch.setattr(lowering, "bias_to_epilogue", subtracted)
    assert check_plans([row], ["dynamo"], {("timm/conv", "dynamo"): line}, run_alternatives=True) == 1
    check = _checks(capsys.readouterr().out)[("timm/conv", "dynamo")][2]
    assert check.startswith("error: the alternative forms miss onnxruntime: alternatives: relative L2 "), (
        check
    )
    assert check.endswith(", rolled back c0"), check  # the verifier names the group whose form is wrong


def test_check_plans_needs_the_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="does not exist"):
        cpu.main(["--check-plans", "--rows", "transformers/bert", "--expected", str(tmp_path / "no.csv")])


def test_explain_counts_what_runs_alone_and_the_refusals_across_rows() -> None:
    from collections import Counter

    from bench.corpus.plans import Check, _reason, explain

    a = Check("m1", "dynamo", "ok", alone=Counter({"MatMul": 3, "Add": 1}), copies=4)
    a.refused[("gemm_epilogue", _reason("merging would create a cycle through node_linear_3 (Add)"))] += 2
    a.softmaxes.update({"MatMul Add Max Softmax": 1, "no MatMul": 1})
    b = Check("m2", "dynamo", "ok", alone=Counter({"MatMul": 2}), copies=0, bias_adds=3)
    b.softmaxes.update({"MatMul Add Max Softmax": 2})
    b.refused[("gemm_epilogue", _reason("merging would create a cycle through node_linear_17 (Add)"))] += 1
    lines: list[str] = []
    explain([a, b], lines.append)
    # Each op: launches, rows, then the rows with the most (row[exporter] launches).
    assert lines[1].split() == ["MatMul", "5", "2", "m1[d]", "3,", "m2[d]", "2"]
    assert lines[2].split() == ["Add", "1", "1", "m1[d]", "1"]
    assert lines[4].split(maxsplit=1) == ["3", "gemm_epilogue: merging would create a cycle through X (Add)"]
    # The runtime's uncounted copies: the total over the rows that make any, those rows, the most.
    assert lines[5].endswith("4 over 1 rows; the most: m1[d] 4"), lines[5]
    # Library convs with a bias run per op: the add kernel torch launches after each.
    assert lines[6].startswith("library convs with a bias") and lines[6].endswith(
        "3 over 1 rows; the most: m2[d] 3"
    )
    # Softmaxes outside attention groups: times, rows, the chain, the rows with the most.
    assert lines[7].startswith("Softmaxes outside attention groups")
    assert lines[8].split() == ["3", "2", "MatMul", "Add", "Max", "Softmax:", "m2[d]", "2,", "m1[d]", "1"]
    assert lines[9].split() == ["1", "1", "no", "MatMul:", "m1[d]", "1"]


def test_bias_adds_counts_the_per_op_library_convs_with_a_bias() -> None:
    """A conv with nothing fused after it stays the library's, its bias added by a kernel of its
    own; a conv group's library form adds the bias in its epilogue's kernel instead."""
    from onnx import helper

    from bench.kernels import alternatives_plan, bias_adds, plan_model
    from tests.unit.test_fusion import NHWC_ALWAYS, make_model

    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2"),
    ]
    inits = {
        "w1": rng.standard_normal((8, 4, 3, 3)),
        "b1": rng.standard_normal(8),
        "w2": rng.standard_normal((6, 8, 1, 1)),
        "b2": rng.standard_normal(6),
    }
    m = make_model(nodes, {"x": [1, 4, 5, 5]}, {"y": [1, 6, 5, 5]}, inits)
    p = plan_model(m, {"x": [1, 4, 5, 5]}, "fp32", NHWC_ALWAYS)
    assert bias_adds(p.plan) == 1  # conv2, lone: the library's conv and its add
    assert bias_adds(alternatives_plan(p, "fp32")) == 1  # conv1's library form adds its bias in the epilogue


def test_softmax_chains_names_the_score_chains_attention_does_not_take() -> None:
    """An attention whose scores take a mask add is one attention group: no chain. The same with
    XGLM's clamp after the add (`Max(scores, finfo.min)`) is not attention: the chain from the
    score MatMul names the Add and the Max; a Softmax over a projection's output names its MatMul
    directly; one with no MatMul near is said to have none."""
    from onnx import helper, numpy_helper

    from bench.kernels import plan_model, softmax_chains
    from tests.unit.test_attention import _attention_model, _shapes
    from tests.unit.test_fusion import make_model

    p = plan_model(_attention_model(mask="add"), _shapes("add"), "fp32")
    assert any(g.kind == "attention" for g in p.fusion.groups)
    assert softmax_chains(p) == {}

    clamped = _attention_model(mask="add")
    g = clamped.graph
    soft = next(i for i, n in enumerate(g.node) if n.op_type == "Softmax")
    g.node[soft].input[0] = "s2"
    g.node.insert(soft, helper.make_node("Max", ["s1", "low"], ["s2"]))
    g.initializer.append(numpy_helper.from_array(np.array(np.finfo(np.float32).min, dtype=np.float32), "low"))
    p = plan_model(clamped, _shapes("add"), "fp32")
    assert not any(g.kind == "attention" for g in p.fusion.groups)
    assert softmax_chains(p) == {"MatMul Add Max Softmax": 1}

    n = helper.make_node
    rng = np.random.default_rng(4)
    nodes = [
        n("MatMul", ["x", "w"], ["h"]),
        n("Softmax", ["h"], ["y"], axis=-1),
        n("Exp", ["x"], ["e"]),
        n("Softmax", ["e"], ["z"], axis=-1),
    ]
    m = make_model(nodes, {"x": [2, 8]}, {"y": [2, 8], "z": [2, 8]}, {"w": rng.standard_normal((8, 8))})
    assert softmax_chains(plan_model(m, {"x": [2, 8]}, "fp32")) == {"MatMul Softmax": 1, "no MatMul": 1}
