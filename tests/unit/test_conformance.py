"""The ONNX conformance suite through opfuse on the CPU: every case passes, or is refused as expected.

About 1,900 node test cases from the installed onnx package (see tests/unit/conformance.py for how a
case is judged). The per-op table is printed at the end of the session (tests/unit/conftest.py);
docs/ops.md is generated from the same run with `python -m tests.unit.conformance_report`.
"""

from __future__ import annotations

import pytest

from tests.unit.conformance import KNOWN_FAILURES, OUTCOMES, load_cases, run_case


def _params() -> list[object]:
    params: list[object] = []
    for name in load_cases():
        marks = []
        if name in KNOWN_FAILURES:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[name]))
        params.append(pytest.param(name, id=name, marks=marks))
    return params


@pytest.mark.parametrize("name", _params())
def test_conformance_case(name: str) -> None:
    outcome = run_case(load_cases()[name])
    OUTCOMES.append(outcome)
    assert outcome.status != "failed", outcome.detail
