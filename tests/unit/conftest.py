"""Unit-test session hooks: the ONNX conformance table at the end of a run that included it."""

from __future__ import annotations

import sys

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    harness = sys.modules.get("tests.unit.conformance")
    outcomes = getattr(harness, "OUTCOMES", None)
    if harness is None or not outcomes:
        return
    terminalreporter.section("ONNX conformance (opfuse on the CPU)")
    terminalreporter.write_line(harness.format_table(outcomes))
