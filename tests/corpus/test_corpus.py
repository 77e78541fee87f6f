"""The corpus's fixed subset (rows marked ci=True in bench/corpus/models.py), against expected.csv.

Each subset row is exported (the default exporter and TorchScript), compiled and verified in the
interpreter exactly as `make corpus` does, and compared with its line of bench/corpus/expected.csv:
the same status (a row that compiled and verified there still does; a row that failed there fails
the same way, until the file is rewritten), and the same number of launches. A row that moves,
either way, fails with the command that rewrites its lines. Each subset row's plan with every group
in its alternative form (what tuning on the GPU may choose) is run against onnxruntime too.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from bench.corpus import models
from bench.corpus.run import EXPECTED, EXPORTERS, read_rows, run_one

CI_ROWS = models.select(ci=True)
EXPECTED_ROWS = read_rows(EXPECTED)


def _rewrite_hint(name: str) -> str:
    return f"if the change is intended, rewrite the row's lines: make corpus ROWS={name}"


@functools.cache
def _built(name: str) -> tuple[Any, dict[str, Any]]:
    row = models.BY_NAME[name]
    if row.family == "timm" and importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (pip install -e '.[dev]')")
    return row.build()


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", [r.name for r in CI_ROWS])
def test_subset_row_matches_expected(name: str, exporter: str, tmp_path: Path) -> None:
    want = EXPECTED_ROWS.get((name, exporter))
    assert want is not None and want["status"] != "not_run", (
        f"{name} ({exporter}) has no result in bench/corpus/expected.csv: make corpus ROWS={name}"
    )
    row = models.BY_NAME[name]
    module, example = _built(name)
    # audit=False: the capture audit runs the plan twice more; the full corpus (make corpus) runs it.
    got = run_one(module, example, exporter, str(tmp_path), verify=not row.gpu_only_verify, audit=False)
    where = f"{name} ({exporter})"
    assert got["status"] == want["status"], (
        f"{where}: status {got['status']!r}, expected.csv says {want['status']!r}"
        + (f" (now: {got['error']})" if got.get("error") else "")
        + f"; {_rewrite_hint(name)}"
    )
    if want["status"] == "ok":
        assert got["verified"] is True
    if want["launches"]:
        launches, expected = int(got["launches"]), int(want["launches"])
        assert launches <= expected, (
            f"{where}: {launches} launches, expected.csv says {expected} (more kernels than before); "
            + _rewrite_hint(name)
        )
        assert launches == expected, (
            f"{where}: {launches} launches, fewer than the {expected} of expected.csv: an improvement "
            "the file does not hold yet; " + _rewrite_hint(name)
        )


@pytest.mark.parametrize("name", [r.name for r in CI_ROWS if not r.gpu_only_verify])
def test_subset_rows_alternative_forms_compute_what_onnxruntime_does(name: str, tmp_path: Path) -> None:
    """Tuning on the GPU runs a group's alternative form (the library's kernel and the epilogue's
    kernel, or its split form) where that measures faster; the CPU leg verifies the templates only.
    Every group of the row in its alternative at once (the default export), every output element
    against onnxruntime on random inputs, as a compile verifies its plan."""
    import onnx

    from bench.corpus.run import export, input_shapes
    from bench.kernels import plan_model, verify_alternatives
    from tests.builders import TEST_DEVICE

    module, example = _built(name)
    path = str(tmp_path / "model.onnx")
    export(module, example, path, "dynamo")
    proto = onnx.load(path)
    p = plan_model(proto, input_shapes(proto, example), "fp32")
    record = verify_alternatives(p, proto, TEST_DEVICE)
    assert record["passed"] and not record["rolled_back"], (
        f"{name}: the alternative forms' outputs differ from onnxruntime's: {record}"
    )


def test_registry_spans_the_families_and_the_subset_covers_each() -> None:
    names = [r.name for r in models.ROWS]
    assert len(names) == len(set(names))
    by_family = {f: [r for r in models.ROWS if r.family == f] for f in models.FAMILIES}
    assert len(models.ROWS) >= 150
    assert len(by_family["timm"]) >= 60 and len(by_family["transformers"]) >= 50
    assert len(by_family["torchvision"]) >= 20
    assert {r.family for r in CI_ROWS} == set(models.FAMILIES)
    assert 25 <= len(CI_ROWS) * len(EXPORTERS) <= 35
    assert all(r.name.startswith(r.family + "/") for r in models.ROWS)


def test_expected_file_lists_every_row_and_exporter_once() -> None:
    keys = set(EXPECTED_ROWS)
    want = {(r.name, e) for r in models.ROWS for e in EXPORTERS}
    missing = sorted(want - keys)
    assert not missing, f"rows missing from expected.csv (make corpus ROWS=...): {missing[:5]}"
    stale = sorted(keys - want)
    assert not stale, f"expected.csv has rows the registry lacks (rerun make corpus): {stale[:5]}"
    with open(EXPECTED, newline="") as f:
        order = [(r["model"], r["exporter"]) for r in csv.DictReader(f)]
    assert order == sorted(order), "expected.csv is not sorted: rewrite it with make corpus"


def test_select_names_globs_and_families() -> None:
    assert [r.name for r in models.select(["timm/test_vit"])] == ["timm/test_vit"]
    tv = models.select(["torchvision/*"])
    assert tv and all(r.family == "torchvision" for r in tv)
    assert models.select(["*/resnet18"], family="timm") == [models.BY_NAME["timm/resnet18"]]
    with pytest.raises(KeyError, match="no corpus row named timm/nope"):
        models.select(["timm/nope"])
    with pytest.raises(KeyError, match="family must be one of"):
        models.select(family="keras")
