"""Webhooks one tenant cannot abuse: its hanging receivers never delay another tenant's delivery
(independent deliveries, a few in flight per tenant), a signature covers timestamp and delivery id
(a replay outside the window is refused by the documented receiver check), the connection goes to
the address that was checked (DNS rebinding), and every non-public address form is refused."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from client.webhooks import WebhookVerificationError, verify
from service import webhooks
from service.db import make_engine, make_session_factory
from service.models import WebhookDelivery
from service.settings import Settings
from tests.service.conftest import Keys, client_with, create_job, upload
from tests.service.onnx_models import mlp, to_bytes
from tests.service.test_worker import Worker

SECRET = "test-webhook-secret"  # conftest's OPFUSE_WEBHOOK_SECRET
HANG_S = 8.0  # how long the hanging receiver holds each request (the old delay per round)


class Receiver:
    """A real HTTP server on 127.0.0.1 that keeps what it got; `hang` makes it hold each request
    (at most HANG_S) and counts how many it holds at once."""

    def __init__(self, hang: bool = False) -> None:
        self.received: list[tuple[float, dict[str, str], bytes]] = []
        self.holding = 0
        self.most_held = 0
        self.release = threading.Event()
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with lock:
                    receiver.received.append((time.monotonic(), headers, body))
                    receiver.holding += 1
                    receiver.most_held = max(receiver.most_held, receiver.holding)
                if hang:
                    receiver.release.wait(HANG_S)
                with lock:
                    receiver.holding -= 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for receiver in made:
        receiver.close()


def _end_job(worker: Worker, client: TestClient) -> None:
    claimed = worker.claim()
    assert claimed.status_code == 200, claimed.text
    job = claimed.json()["job"]
    assert (
        worker.fail(job["id"], claimed.json()["lease_token"], error="unsupported op Loop").status_code == 200
    )


def test_hanging_receivers_of_one_tenant_do_not_delay_another(
    settings: Settings, keys: Keys, receivers: list[Receiver]
) -> None:
    hanging = Receiver(hang=True)
    fast = Receiver()
    receivers += [hanging, fast]
    overrides = {
        "webhook_allow_private": True,
        "webhook_interval_seconds": 0.1,
        "webhook_timeout_seconds": HANG_S + 5,
        "webhook_tenant_concurrency": 4,
    }
    with client_with(settings, **overrides) as client:
        worker = Worker(client, keys.worker)
        mine = upload(client, keys.user, to_bytes(mlp()))
        theirs = upload(client, keys.other, to_bytes(mlp()))
        for _ in range(20):  # tenant default: 20 jobs whose receiver hangs
            create_job(client, keys.user, mine["id"], webhook_url=hanging.url)
            _end_job(worker, client)
        deadline = time.monotonic() + 10
        while hanging.holding < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hanging.holding == 4, "the hanging receiver never got its deliveries"
        delays: list[float] = []
        for _ in range(3):  # tenant other, while default's receivers hang
            create_job(client, keys.other, theirs["id"], webhook_url=fast.url)
            ended = time.monotonic()
            _end_job(worker, client)
            while len(fast.received) < len(delays) + 1 and time.monotonic() < ended + HANG_S + 10:
                time.sleep(0.02)
            assert len(fast.received) == len(delays) + 1, "the other tenant's delivery never arrived"
            delays.append(fast.received[-1][0] - ended)
        most_held = hanging.most_held
        hanging.release.set()
    print(
        f"other tenant's delivery while 20 receivers hang: slowest {max(delays):.2f} s "
        f"(of {[round(d, 2) for d in delays]}); the hanging tenant held at most {most_held} at once"
    )
    assert max(delays) < 2.0, delays  # before: a round waited for the slowest receiver (10-21 s)
    assert most_held <= 4, most_held  # per-tenant concurrency


def test_the_signature_covers_timestamp_and_delivery_id(
    settings: Settings, keys: Keys, receivers: list[Receiver]
) -> None:
    receiver = Receiver()
    receivers.append(receiver)
    with client_with(settings, webhook_allow_private=True) as client:
        model = upload(client, keys.user, to_bytes(mlp()))
        create_job(client, keys.user, model["id"], webhook_url=receiver.url)
        _end_job(Worker(client, keys.worker), client)
    _deliver_once(settings.model_copy(update={"webhook_allow_private": True}))
    ((_, headers, body),) = receiver.received
    sent = int(headers["x-opfuse-timestamp"])
    assert abs(sent - time.time()) < 60
    assert verify(SECRET, body, headers) == headers["x-opfuse-delivery"]
    # A recorded delivery replayed after the window is refused, even though nothing was changed.
    with pytest.raises(WebhookVerificationError, match="window"):
        verify(SECRET, body, headers, now=sent + 301)
    assert verify(SECRET, body, headers, now=sent + 299)
    # A fresh timestamp (or another delivery id) on the recorded body breaks the signature.
    for name, value in (("x-opfuse-timestamp", str(int(time.time()))), ("x-opfuse-delivery", "0" * 32)):
        if headers[name] == value:
            continue
        with pytest.raises(WebhookVerificationError, match="does not match"):
            verify(SECRET, body, {**headers, name: value})
    with pytest.raises(WebhookVerificationError, match="does not match"):
        verify(SECRET, body + b" ", headers)
    with pytest.raises(WebhookVerificationError, match="does not match"):
        verify("another-secret", body, headers)
    missing = {k: v for k, v in headers.items() if k != "x-opfuse-timestamp"}
    with pytest.raises(WebhookVerificationError, match="X-Opfuse-Timestamp"):
        verify(SECRET, body, missing)


def _deliver_once(settings: Settings) -> list[WebhookDelivery]:
    engine = make_engine(settings.database_url)

    async def round_() -> int:
        async with httpx.AsyncClient(trust_env=False) as http:
            return await webhooks.deliver_due(make_session_factory(engine), settings, http)

    try:
        assert asyncio.run(round_()) == 1
        with make_session_factory(engine)() as session:
            return list(session.scalars(select(WebhookDelivery)))
    finally:
        engine.dispose()


def test_dns_rebinding_cannot_reach_a_checked_out_address(
    settings: Settings, keys: Keys, receivers: list[Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attacker's name answers a public address to the service's lookups and 127.0.0.1 to any
    lookup after them ('localhost' resolves to 127.0.0.1 at the system resolver). The delivery
    must connect to the address that was checked, never to the loopback receiver."""
    receiver = Receiver()
    receivers.append(receiver)
    lookups: list[str] = []

    def rebinding(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["93.184.216.34"]  # public, as the check sees it

    monkeypatch.setattr(webhooks, "resolve", rebinding)
    url = f"http://localhost:{receiver.port}/hook"
    with client_with(settings) as client:  # private targets refused (the default)
        model = upload(client, keys.user, to_bytes(mlp()))
        create_job(client, keys.user, model["id"], webhook_url=url)
        _end_job(Worker(client, keys.worker), client)
    (row,) = _deliver_once(settings.model_copy(update={"webhook_timeout_seconds": 1.0}))
    assert receiver.received == [], "the delivery reached 127.0.0.1 through a name checked as public"
    assert row.status == "pending" and row.last_error, row.last_error  # it went to the checked address
    assert lookups == ["localhost", "localhost"]  # once at creation, once for the attempt


def test_the_connection_goes_to_the_resolved_address_with_the_name_as_host(
    settings: Settings, keys: Keys, receivers: list[Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = Receiver()
    receivers.append(receiver)
    monkeypatch.setattr(webhooks, "resolve", lambda host, port: ["127.0.0.1"])
    url = f"http://hooks.example.invalid:{receiver.port}/hook"  # a name no real resolver answers
    allowed = settings.model_copy(update={"webhook_allow_private": True})
    with client_with(allowed) as client:
        model = upload(client, keys.user, to_bytes(mlp()))
        create_job(client, keys.user, model["id"], webhook_url=url)
        _end_job(Worker(client, keys.worker), client)
    (row,) = _deliver_once(allowed)
    assert row.status == "delivered", row.last_error
    ((_, headers, _body),) = receiver.received
    assert headers["host"] == f"hooks.example.invalid:{receiver.port}"


@pytest.mark.parametrize(
    "address",
    [
        "192.0.0.8",
        "192.0.0.9",
        "192.0.0.170",
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
        "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
        "2002:a00:1::1",  # 6to4 of 10.0.0.1
        "fec0::1",  # site-local
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b::a9fe:a9fe",
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "::7f00:1",  # IPv4-compatible
        "::",
        "ff02::1",
        "100.64.0.1",
    ],
)
def test_every_non_public_address_form_is_refused(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhooks, "resolve", lambda host, port: ["93.184.216.34", address])
    with pytest.raises(webhooks.WebhookRefused, match=address.replace(".", r"\.")):
        webhooks.check_target("https://hooks.example/hook")


def test_public_addresses_and_their_6to4_forms_are_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    for address in ("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "2002:5db8:d822::1"):
        monkeypatch.setattr(webhooks, "resolve", lambda host, port, a=address: [a])
        webhooks.check_target("https://hooks.example/hook")


def test_an_https_target_is_pinned_with_its_name_as_sni_and_host() -> None:
    url, host, extensions = webhooks.pinned_request("https://user@hooks.example:8443/a/b?c=1", "2606:2800::1")
    assert url == "https://user@[2606:2800::1]:8443/a/b?c=1"
    assert host == {"Host": "hooks.example:8443"} and extensions == {"sni_hostname": "hooks.example"}
    url, host, extensions = webhooks.pinned_request("http://hooks.example/x", "93.184.216.34")
    assert (url, host, extensions) == ("http://93.184.216.34/x", {"Host": "hooks.example"}, {})
