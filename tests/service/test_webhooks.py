"""Webhooks: targets checked at job creation, signed deliveries from the outbox to a real HTTP
receiver, retries with exponential backoff, nothing lost across a restart."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from service import webhooks
from service.clock import utcnow
from service.db import make_engine, make_session_factory
from service.models import WebhookDelivery
from service.settings import Settings

from .conftest import Keys, bearer, client_with, create_job
from .test_worker import REPORT, Worker, bundle

SECRET = "test-webhook-secret"  # conftest's OPFUSE_WEBHOOK_SECRET


class Receiver:
    """A real HTTP server on loopback that answers with scripted statuses and keeps what it got."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.received: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/opfuse"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver([])
    yield r
    r.close()


@pytest.fixture
def loopback_ok(settings: Settings) -> Iterator[TestClient]:
    with client_with(settings, webhook_allow_private=True, webhook_backoff_seconds=30) as test_client:
        yield test_client


def deliver(settings: Settings, **overrides: object) -> int:
    """One delivery round, as the API's background task runs it."""
    settings = settings.model_copy(update={"webhook_allow_private": True, **overrides})
    engine = make_engine(settings.database_url)

    async def round_() -> int:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await webhooks.deliver_due(make_session_factory(engine), settings, client)

    try:
        return asyncio.run(round_())
    finally:
        engine.dispose()


def deliveries(settings: Settings) -> list[WebhookDelivery]:
    engine = make_engine(settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            return list(session.scalars(select(WebhookDelivery)))
    finally:
        engine.dispose()


def make_due(settings: Settings) -> None:
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            connection.execute(
                update(WebhookDelivery).values(next_attempt_at=utcnow() - timedelta(seconds=1))
            )
    finally:
        engine.dispose()


def valid(headers: dict[str, str], body: bytes, secret: str = SECRET) -> bool:
    signed = f"{headers['x-opfuse-timestamp']}.{headers['x-opfuse-delivery']}.".encode() + body
    expected = "sha256=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["x-opfuse-signature"], expected)


def fail_job(client: TestClient, keys: Keys, job_id: str) -> None:
    worker = Worker(client, keys.worker)
    token = worker.claim().json()["lease_token"]
    assert worker.fail(job_id, token, error="unsupported op Loop").status_code == 200


def test_targets_must_be_public(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {
        "loop.example": ["127.0.0.1"],
        "v6loop.example": ["::1"],
        "metadata.example": ["169.254.169.254"],
        "lan.example": ["93.184.216.34", "10.1.2.3"],  # one private address is enough to refuse
        "mapped.example": ["::ffff:192.168.0.1"],
        "cgnat.example": ["100.64.0.1"],
        "public.example": ["93.184.216.34"],
    }

    def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answers[host]

    monkeypatch.setattr(webhooks, "resolve", resolve)
    expected = {
        "loop.example": "(loopback)",
        "v6loop.example": "(loopback)",
        "metadata.example": "(link-local)",
        "lan.example": "10.1.2.3 (private)",
        "mapped.example": "(private)",
        "cgnat.example": "(not a public address)",
        "nowhere.example": "does not resolve",
    }
    for host, reason in expected.items():
        with pytest.raises(webhooks.WebhookRefused, match=reason.replace("(", r"\(").replace(")", r"\)")):
            webhooks.check_target(f"https://{host}/hook")
    webhooks.check_target("https://public.example/hook")


def test_job_creation_refuses_private_targets_unless_allowed(
    client: TestClient, keys: Keys, model: dict, settings: Settings
) -> None:
    body = {"model_id": model["id"], "input_shapes": {"x": [8, 4]}, "webhook_url": "http://127.0.0.1:9/hook"}
    refused = client.post("/v1/jobs", json=body, headers=bearer(keys.user))
    assert refused.status_code == 422
    assert "resolves to 127.0.0.1 (loopback)" in refused.json()["detail"]
    assert "OPFUSE_WEBHOOK_ALLOW_PRIVATE" in refused.json()["detail"]
    with client_with(settings, webhook_allow_private=True) as allowed:
        assert allowed.post("/v1/jobs", json=body, headers=bearer(keys.user)).status_code == 202
    with client_with(settings, webhook_allow_private=True, webhook_secret=None) as unsigned:
        response = unsigned.post("/v1/jobs", json=body, headers=bearer(keys.user))
        assert response.status_code == 422 and "OPFUSE_WEBHOOK_SECRET" in response.json()["detail"]


def test_signed_delivery_retried_with_exponential_backoff(
    loopback_ok: TestClient, keys: Keys, model: dict, settings: Settings, receiver: Receiver
) -> None:
    receiver.statuses = [500, 503]
    job = create_job(loopback_ok, keys.user, model["id"], webhook_url=receiver.url)
    fail_job(loopback_ok, keys, job["id"])

    backoff = {"webhook_backoff_seconds": 30}
    assert deliver(settings, **backoff) == 1  # → 500
    (row,) = deliveries(settings)
    assert (
        row.status == "pending" and row.attempts == 1 and row.last_error == "the receiver answered HTTP 500"
    )
    assert timedelta(seconds=25) < row.next_attempt_at - utcnow() <= timedelta(seconds=30)
    assert deliver(settings, **backoff) == 0  # not due yet
    make_due(settings)
    assert deliver(settings, **backoff) == 1  # → 503; the next wait doubles
    (row,) = deliveries(settings)
    assert timedelta(seconds=55) < row.next_attempt_at - utcnow() <= timedelta(seconds=60)
    make_due(settings)
    assert deliver(settings, **backoff) == 1  # → 200
    (row,) = deliveries(settings)
    assert (row.status, row.attempts, row.last_error) == ("delivered", 3, None)

    assert len(receiver.received) == 3
    for headers, body in receiver.received:
        assert valid(headers, body)
        assert headers["x-opfuse-delivery"] == row.id and headers["x-opfuse-event"] == "job.finished"
        assert headers["content-type"] == "application/json"
    assert json.loads(receiver.received[0][1]) == {
        "job_id": job["id"],
        "status": "failed",
        "summary": None,
        "error": "unsupported op Loop",
    }


def test_gives_up_after_max_attempts(
    loopback_ok: TestClient, keys: Keys, model: dict, settings: Settings, receiver: Receiver
) -> None:
    receiver.statuses = [500] * 5
    job = create_job(loopback_ok, keys.user, model["id"], webhook_url=receiver.url)
    fail_job(loopback_ok, keys, job["id"])
    for _ in range(2):
        assert deliver(settings, webhook_max_attempts=2, webhook_backoff_seconds=0) == 1
    assert deliver(settings, webhook_max_attempts=2, webhook_backoff_seconds=0) == 0
    (row,) = deliveries(settings)
    assert (row.status, row.attempts) == ("failed", 2)


def test_a_restart_loses_no_delivery_and_tenant_secrets_sign(
    keys: Keys, model: dict, settings: Settings, receiver: Receiver
) -> None:
    with client_with(settings, webhook_allow_private=True) as before:
        rotated = before.post("/v1/admin/tenants/default/webhook-secret", headers=bearer(keys.admin))
        assert rotated.status_code == 201
        secret = rotated.json()["webhook_secret"]
        job = create_job(before, keys.user, model["id"], webhook_url=receiver.url)
        worker = Worker(before, keys.worker)
        token = worker.claim().json()["lease_token"]
        worker.artifact(job["id"], token, bundle())
        assert worker.complete(job["id"], token, REPORT).status_code == 200
    # That server stopped before delivering (its round is once an hour); the next one delivers.
    assert receiver.received == []
    with client_with(settings, webhook_allow_private=True, webhook_interval_seconds=0.05):
        deadline = time.monotonic() + 10
        while not receiver.received and time.monotonic() < deadline:
            time.sleep(0.05)
    (headers, body), *_ = receiver.received
    assert valid(headers, body, secret) and not valid(headers, body)
    payload = json.loads(body)
    assert payload["status"] == "succeeded" and payload["summary"]["speedup"] == 2.0
