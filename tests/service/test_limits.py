"""Limits on requests: JSON body size (413), the time a body may take to arrive (408), request rate
per API key and queued jobs per tenant (429 with Retry-After)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import MutableMapping
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.app import create_app
from service.check_budget import CheckBudget
from service.settings import Settings

from .conftest import Keys, bearer, client_with, create_job

CLAIM = {"worker_id": "w", "device": "cpu"}


@pytest.fixture
def database_url(sqlite_database_url: str) -> str:
    return sqlite_database_url  # the limits are the API's, whatever the database


def test_json_bodies_over_the_limit_are_413(keys: Keys, model: dict, settings: Settings) -> None:
    big = {"model_id": model["id"], "input_shapes": {"x": [8, 4]}, "fusion": {"disable": ["x" * 100] * 20}}
    with client_with(settings, max_json_bytes=1000) as client:
        declared = client.post("/v1/jobs", json=big, headers=bearer(keys.user))
        assert declared.status_code == 413
        assert "OPFUSE_MAX_JSON_BYTES" in declared.json()["detail"]

        def chunked():  # no Content-Length: counted as it arrives
            data = json.dumps(big).encode()
            for i in range(0, len(data), 100):
                yield data[i : i + 100]

        headers = {**bearer(keys.user), "Content-Type": "application/json"}
        assert client.post("/v1/jobs", content=chunked(), headers=headers).status_code == 413
        small = {"model_id": model["id"], "input_shapes": {"x": [8, 4]}}
        assert client.post("/v1/jobs", json=small, headers=bearer(keys.user)).status_code == 202
        # The limit holds for every body that is not a streamed upload, whatever its content type.
        octets = {**bearer(keys.user), "Content-Type": "application/octet-stream"}
        assert client.post("/v1/jobs", content=b"\0" * 2000, headers=octets).status_code == 413


async def _call(
    app: FastAPI, method: str, path: str, headers: dict[str, str]
) -> list[MutableMapping[str, Any]]:
    """Send a request whose body never arrives straight to the ASGI app."""
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
        "state": {},
    }
    await asyncio.wait_for(app(scope, receive, send), 20)
    return sent


def test_a_body_that_does_not_arrive_in_time_is_408(keys: Keys, settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"request_timeout_seconds": 0.2}), run_migrations=False)
    for path, content_type in (("/v1/jobs", "application/json"), ("/v1/models", "application/octet-stream")):
        headers = {**bearer(keys.user), "Content-Type": content_type, "Content-Length": "1000"}
        sent = asyncio.run(_call(app, "POST", path, headers))
        assert sent[0]["status"] == 408, path
        assert "OPFUSE_REQUEST_TIMEOUT_SECONDS" in json.loads(sent[1]["body"])["detail"]
    app.state.engine.dispose()


def test_request_rate_per_key_is_limited_with_retry_after(keys: Keys, settings: Settings) -> None:
    with client_with(settings, rate_limit_per_min=3) as client:
        for _ in range(3):
            assert client.get("/v1/models", headers=bearer(keys.user)).status_code == 200
        limited = client.get("/v1/models", headers=bearer(keys.user))
        assert limited.status_code == 429
        assert int(limited.headers["retry-after"]) >= 1
        assert "OPFUSE_RATE_LIMIT_PER_MIN" in limited.json()["detail"]
        assert client.get("/v1/models", headers=bearer(keys.other)).status_code == 200  # per key
        for _ in range(5):  # worker keys poll by design
            assert client.post("/v1/worker/claim", json=CLAIM, headers=bearer(keys.worker)).status_code == 204


def test_queued_jobs_per_tenant_are_limited(
    client: TestClient, keys: Keys, model: dict, settings: Settings
) -> None:
    with client_with(settings, max_queued_jobs_per_tenant=2) as limited:
        first = create_job(limited, keys.user, model["id"])
        create_job(limited, keys.user, model["id"])
        body = {"model_id": model["id"], "input_shapes": {"x": [8, 4]}}
        full = limited.post("/v1/jobs", json=body, headers=bearer(keys.user))
        assert full.status_code == 429
        assert "2 jobs queued" in full.json()["detail"] and full.headers["retry-after"] == "30"
        limited.post(f"/v1/jobs/{first['id']}/cancel", headers=bearer(keys.user))
        assert limited.post("/v1/jobs", json=body, headers=bearer(keys.user)).status_code == 202


def test_model_checks_share_a_byte_budget() -> None:
    budget = CheckBudget(limit=100)
    held: list[int] = []  # the sizes being checked now (a model over the budget counts as all of it)
    most, done = 0, []
    lock = threading.Lock()

    def check(size: int) -> None:
        nonlocal most
        with budget.hold(size):
            with lock:
                held.append(min(size, 100))
                most = max(most, sum(held))
            time.sleep(0.02)
            with lock:
                held.remove(min(size, 100))
                done.append(size)

    threads = [threading.Thread(target=check, args=(size,)) for size in (60, 60, 30, 500, 10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert most <= 100 and sorted(done) == [10, 30, 60, 60, 500]
