"""`opfuse report` and `opfuse status` print what models and workers wrote (node names, reasons,
errors): terminal escape sequences and rich markup in them are shown as text, never acted on.

The report is stored through the real worker API and fetched by the real CLI over HTTP."""

from __future__ import annotations

import copy

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from client.cli import app as cli_app
from tests.service.conftest import Keys, create_job
from tests.service.test_worker import REPORT, Worker, bundle

TITLE = "\x1b]0;pwned\x07"  # OSC: sets the terminal's title
MARKUP = "[red]x[/red]"
CLEAR = "\x1b[2J"  # CSI: clears the screen
C1_CSI = "\x9b31m"  # the one-byte CSI of C1
BIDI = "evil\u202etxt.exe"
# Anything that starts a control sequence, in any form.
FORBIDDEN = ("\x1b", "\x07", "\x9b", "\u202e", "\x00")


@pytest.fixture
def database_url(sqlite_database_url: str) -> str:
    return sqlite_database_url  # what is printed does not depend on the database


def _hostile_report() -> dict:
    report = copy.deepcopy(REPORT)
    report["device"] = {"kind": "cpu-interpreter", "name": CLEAR + "cpu"}
    report["precision"] = MARKUP
    report["fusion"] = {
        "groups": [
            {
                "id": "g0",
                "kind": TITLE,
                "rule": MARKUP,
                "nodes": [TITLE, MARKUP, C1_CSI, BIDI],
                "kernel": "k0",
            }
        ],
        "not_fused": [{"rule": "pointwise", "nodes": [TITLE], "reason": f"because {MARKUP}{CLEAR}"}],
    }
    report["verification"] = {
        "passed": True,
        "reference": TITLE,
        "outputs": {MARKUP + TITLE: {"max_abs_err": 0.0}},
    }
    return report


def _cli(api_url: str, key: str, *args: str) -> str:
    result = CliRunner().invoke(cli_app, [*args, "--api", api_url, "--key", key], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return result.output


def _assert_inert(output: str) -> None:
    for char in FORBIDDEN:
        assert char not in output, (char, output)


def test_report_shows_escape_sequences_and_markup_as_text(
    client: TestClient, keys: Keys, model: dict, api_url: str
) -> None:
    job = create_job(client, keys.user, model["id"])
    worker = Worker(client, keys.worker)
    token = worker.claim().json()["lease_token"]
    assert worker.artifact(job["id"], token, bundle()).status_code in (200, 201, 204)
    assert worker.complete(job["id"], token, _hostile_report()).status_code == 200

    output = _cli(api_url, keys.user, "report", job["id"])
    _assert_inert(output)
    assert MARKUP in output  # printed literally, not turned into red "x"
    assert "\\x1b]0;pwned\\x07" in output  # visible, so a person sees what the model held
    assert "\\x9b31m" in output and "evil\\u202etxt.exe" in output and "\\x1b[2J" in output


def test_status_shows_a_hostile_error_as_text(
    client: TestClient, keys: Keys, model: dict, api_url: str
) -> None:
    job = create_job(client, keys.user, model["id"])
    worker = Worker(client, keys.worker)
    token = worker.claim().json()["lease_token"]
    assert worker.fail(job["id"], token, error=f"bad node {TITLE}{MARKUP}{C1_CSI}").status_code == 200
    output = _cli(api_url, keys.user, "status", job["id"])
    _assert_inert(output)
    assert MARKUP in output and "\\x1b]0;pwned\\x07" in output


@pytest.mark.parametrize(
    "text", [TITLE, MARKUP, CLEAR, C1_CSI, BIDI, "tab\there\nnewline\x7f", "ok [b]", "é ü 中"]
)
def test_escape_leaves_no_control_character_and_keeps_plain_text(text: str) -> None:
    from client.render import escape  # here: older versions had no such function

    shown = escape(text)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c == "\u202e" for c in shown)
    if text.isprintable() and "[" not in text:
        assert shown == text
