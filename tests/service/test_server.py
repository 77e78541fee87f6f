"""Settings from the environment, and `run_server` as the CLI runs it: a real process, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]

SERVE = """
import sys
from service.server import run_server
from service.settings import Settings
run_server(Settings(), on_started=lambda: print("STARTED", flush=True))
print("RETURNED", flush=True)
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "triton"})
ours = sorted(m for m in sys.modules if m.startswith("opfuse.") and not m.startswith("opfuse.frontend"))
print("IMPORTED", heavy, ours, flush=True)
"""


def test_settings_come_from_opfuse_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OPFUSE_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("OPFUSE_PORT", "9001")
    monkeypatch.setenv("OPFUSE_MAX_ATTEMPTS", "5")
    settings = Settings()
    assert settings.home == tmp_path / "h"
    assert settings.database_url == f"sqlite:///{tmp_path / 'h' / 'opfuse.db'}"
    assert settings.tmp_dir == tmp_path / "h" / "tmp"
    assert (settings.port, settings.max_attempts, settings.lease_seconds) == (9001, 5, 60)
    assert settings.max_upload_bytes == 1024**3
    monkeypatch.setenv("OPFUSE_DATABASE_URL", "postgresql+psycopg://db/opfuse")
    assert Settings().database_url == "postgresql+psycopg://db/opfuse"


def test_run_server_serves_until_sigterm_without_torch(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "OPFUSE_HOME": str(home), "OPFUSE_PORT": "0", "OPFUSE_DATABASE_URL": ""}
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "STARTED"
        info = json.loads((home / "server.json").read_text())
        key = (home / "api_key").read_text().strip()
        assert httpx.get(f"{info['url']}/healthz").status_code == 200
        models = httpx.get(f"{info['url']}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert models.status_code == 200
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "RETURNED" in out
    # The API server never imports torch or triton, and of opfuse only the frontend (and its errors).
    assert "IMPORTED [] ['opfuse.errors']" in out
    assert not (home / "server.json").exists()
    for line in err.strip().splitlines():
        json.loads(line)  # every log line is one JSON object


def test_python_m_service_migrates_and_makes_keys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sqlalchemy.orm import Session

    from service.__main__ import main
    from service.auth import find_key
    from service.db import make_engine

    url = f"sqlite:///{tmp_path / 'deploy.db'}"
    monkeypatch.setenv("OPFUSE_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("OPFUSE_DATABASE_URL", url)
    assert main(["migrate"]) == 0
    assert main(["create-key", "--tenant", "team-x", "--scope", "worker"]) == 0
    key = capsys.readouterr().out.strip()
    engine = make_engine(url)
    with Session(engine) as session:
        found = find_key(session, key)
        assert found is not None and found[0].scope == "worker" and found[1].name == "team-x"
    engine.dispose()
    assert main(["create-key", "--tenant", "Not Valid"]) == 2
