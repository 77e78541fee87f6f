"""Webhooks on job end: checked at job creation, written to an outbox in the transaction that ends
the job, delivered by the API's background task, signed, retried with exponential backoff.

Body: `{"job_id", "status", "summary", "error"}` (JSON). Headers: `X-Opfuse-Timestamp` (Unix
seconds of this attempt), `X-Opfuse-Delivery` (the same on every retry of one delivery: deduplicate
on it), `X-Opfuse-Signature: sha256=<hex>` (HMAC-SHA256 of `<timestamp>.<delivery id>.<body>` with the
tenant's webhook secret, else the server's OPFUSE_WEBHOOK_SECRET), `X-Opfuse-Event: job.finished`.
A receiver checks the signature and refuses timestamps older than its window (client.webhooks.verify:
5 minutes), so a recorded delivery cannot be replayed later. Delivery is at least once.

Deliveries are independent tasks, a few per tenant at a time (Dispatcher): one tenant's slow or
hanging receivers never delay another tenant's delivery.

Targets on loopback, link-local, private or otherwise non-public addresses (including the IPv6 forms
that embed one: IPv4-mapped, 6to4, NAT64, Teredo, site-local) are refused at creation and again
before each attempt unless OPFUSE_WEBHOOK_ALLOW_PRIVATE=1. Each attempt resolves the host once and
connects to the address it checked (Host header and TLS SNI of the name), so DNS that changes
between the check and the connection (rebinding) cannot reach another address.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import ipaddress
import json
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.clock import utcnow
from service.errors import UnprocessableError
from service.logging import get_logger
from service.metrics import Metrics
from service.models import DeliveryStatus, Job, Tenant, WebhookDelivery
from service.settings import Settings

log = get_logger("webhooks")

SIGNATURE_HEADER = "X-Opfuse-Signature"
TIMESTAMP_HEADER = "X-Opfuse-Timestamp"
DELIVERY_HEADER = "X-Opfuse-Delivery"
EVENT_HEADER = "X-Opfuse-Event"
EVENT = "job.finished"
BATCH = 32
MAX_ERROR_CHARS = 500


class WebhookRefused(Exception):
    """The target is not allowed (the message says why)."""


def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (a seam for tests)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


_IETF_PROTOCOL_ASSIGNMENTS = ipaddress.ip_network("192.0.0.0/24")  # 192.0.0.8, 192.0.0.9, 192.0.0.10, ...
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_SITE_LOCAL = ipaddress.ip_network("fec0::/10")


def _why_not_public(address: str) -> str | None:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address):
        # Forms that carry an IPv4 address: judged by that address.
        if ip.ipv4_mapped is not None:
            return _why_not_public(str(ip.ipv4_mapped))
        if ip in _SIX_TO_FOUR:
            embedded = ip.sixtofour
            return None if embedded is None else _why_not_public(str(embedded))
        if any(ip in net for net in _NAT64):
            return "NAT64 (an IPv4 address behind a translator)"
        if ip.teredo is not None:
            return "Teredo"
        if ip in _SITE_LOCAL:
            return "site-local"
    elif ip in _IETF_PROTOCOL_ASSIGNMENTS:
        return "IETF protocol assignment (192.0.0.0/24)"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_private:
        return "private"
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved or not ip.is_global:
        return "not a public address"
    return None


def _host_and_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise WebhookRefused(f"webhook_url must be an http(s) URL with a host, not '{url}'")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise WebhookRefused(f"webhook_url has an invalid port: '{url}'") from None
    return host, port


def check_target(url: str, allow_private: bool = False) -> str:
    """Resolve the URL's host once and return the address to connect to; raise WebhookRefused
    unless every address it resolves to is public (any address, with `allow_private`)."""
    host, port = _host_and_port(url)
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError) as exc:
        raise WebhookRefused(f"webhook_url host '{host}' does not resolve ({exc})") from None
    if not addresses:
        raise WebhookRefused(f"webhook_url host '{host}' does not resolve")
    for address in addresses:
        why = None if allow_private else _why_not_public(address)
        if why is not None:
            raise WebhookRefused(
                f"webhook_url host '{host}' resolves to {address} ({why}); webhooks go to public "
                "addresses only (an operator can allow others with OPFUSE_WEBHOOK_ALLOW_PRIVATE=1)"
            )
    return addresses[0]


def tenant_secret(session: Session, tenant_id: int, settings: Settings) -> str | None:
    """The secret that signs this tenant's webhooks: its own, else the server's, else None."""
    own = session.scalar(select(Tenant.webhook_secret).where(Tenant.id == tenant_id))
    if own:
        return own
    return settings.webhook_secret.get_secret_value() if settings.webhook_secret else None


def check_url(url: str, settings: Settings) -> None:
    """422 when webhooks may not go to `url` (a non-public or unresolvable host). Resolves the
    host: call it before the request's transaction begins."""
    if settings.webhook_allow_private:
        return
    try:
        check_target(url, allow_private=False)
    except WebhookRefused as exc:
        raise UnprocessableError(str(exc)) from None


def check_secret(session: Session, tenant_id: int, settings: Settings) -> None:
    """422 when there is no secret to sign the tenant's webhooks with."""
    if tenant_secret(session, tenant_id, settings) is None:
        raise UnprocessableError(
            "webhook_url: this server has no secret to sign webhooks with; ask the operator to set "
            "OPFUSE_WEBHOOK_SECRET or an admin to create one for your tenant "
            "(POST /v1/admin/tenants/{tenant}/webhook-secret)"
        )


def payload(job: Job) -> str:
    from service.schemas import JobOut  # schemas import models; keep this module light to import

    out = JobOut.from_row(job)
    body = {
        "job_id": job.id,
        "status": job.status,
        "summary": out.summary.model_dump() if out.summary else None,
        "error": job.error,
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


def enqueue(session: Session, job: Job) -> None:
    """Put the job's end in the outbox (in the caller's transaction), if it has a webhook."""
    if job.webhook_url:
        session.add(
            WebhookDelivery(
                job_id=job.id,
                tenant_id=job.tenant_id,
                url=job.webhook_url,
                payload=payload(job),
                status=DeliveryStatus.PENDING.value,
                attempts=0,
                next_attempt_at=utcnow(),
            )
        )


def sign(secret: str, body: bytes, timestamp: int, delivery_id: str) -> str:
    """`sha256=<hex>`: HMAC-SHA256 of `<timestamp>.<delivery id>.<body>` (client.webhooks.verify
    checks it, and the timestamp's age)."""
    message = f"{timestamp}.{delivery_id}.".encode() + body
    return "sha256=" + hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


# -- delivery -----------------------------------------------------------------------------------


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


@dataclass(frozen=True)
class Attempt:
    delivery_id: str
    job_id: str
    tenant_id: int
    url: str
    body: bytes
    secret: str | None


@dataclass(frozen=True)
class Outcome:
    delivery_id: str
    error: str | None  # None: delivered


def take_due(
    session_factory: sessionmaker[Session],
    settings: Settings,
    limit: int = BATCH,
    free_slots: Callable[[int], int] | None = None,
) -> list[Attempt]:
    """Claim due deliveries (one transaction), at most `free_slots(tenant_id)` of each tenant (and
    none of a tenant with no free slot): each is pushed out of reach for the length of one attempt,
    so a crash mid-attempt means a retry later, not a loss."""
    now = utcnow()
    in_flight = timedelta(seconds=settings.webhook_timeout_seconds + 30)
    taken: dict[int, int] = {}
    attempts: list[Attempt] = []

    def free(tenant_id: int) -> int:
        return (limit if free_slots is None else free_slots(tenant_id)) - taken.get(tenant_id, 0)

    with session_factory.begin() as session:
        full: set[int] = set()
        while len(attempts) < limit:
            query = select(WebhookDelivery).where(
                WebhookDelivery.status == DeliveryStatus.PENDING.value,
                WebhookDelivery.next_attempt_at <= now,
            )
            if full:
                query = query.where(WebhookDelivery.tenant_id.not_in(full))
            due = session.scalars(
                query.order_by(WebhookDelivery.next_attempt_at)
                .limit(limit - len(attempts))
                .with_for_update(skip_locked=True)
            ).all()
            before = len(attempts)
            for delivery in due:
                if free(delivery.tenant_id) <= 0:
                    full.add(delivery.tenant_id)
                    continue
                taken[delivery.tenant_id] = taken.get(delivery.tenant_id, 0) + 1
                delivery.attempts += 1
                delivery.next_attempt_at = now + in_flight
                secret = tenant_secret(session, delivery.tenant_id, settings)
                attempts.append(
                    Attempt(
                        delivery.id,
                        delivery.job_id,
                        delivery.tenant_id,
                        delivery.url,
                        delivery.payload.encode(),
                        secret,
                    )
                )
            if len(attempts) == before:  # nothing more due, or only of tenants with no free slot
                break
    return attempts


def pinned_request(url: str, address: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """The URL with its host replaced by the checked `address`, the Host header of the original
    name, and (https) the name to send as SNI and to check the certificate against: the
    connection goes to the address that was checked, whatever the name resolves to later."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    literal = f"[{address}]" if ":" in address else address
    netloc = literal if parts.port is None else f"{literal}:{parts.port}"
    userinfo, _, host_header = parts.netloc.rpartition("@")  # no userinfo in Host
    if userinfo:
        netloc = f"{userinfo}@{netloc}"  # basic auth in the URL still goes (httpx sends it)
    extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
    return urlunsplit(parts._replace(netloc=netloc)), {"Host": host_header}, extensions


async def send(client: httpx.AsyncClient, attempt: Attempt, settings: Settings) -> Outcome:
    """One POST; the outcome's error says why it did not count as delivered."""
    if attempt.secret is None:
        return Outcome(attempt.delivery_id, "no webhook secret is configured (OPFUSE_WEBHOOK_SECRET)")
    try:
        address = await asyncio.to_thread(check_target, attempt.url, settings.webhook_allow_private)
    except WebhookRefused as exc:
        return Outcome(attempt.delivery_id, str(exc))
    url, host, extensions = pinned_request(attempt.url, address)
    timestamp = int(time.time())
    headers = {
        **host,
        "Content-Type": "application/json",
        SIGNATURE_HEADER: sign(attempt.secret, attempt.body, timestamp, attempt.delivery_id),
        TIMESTAMP_HEADER: str(timestamp),
        DELIVERY_HEADER: attempt.delivery_id,
        EVENT_HEADER: EVENT,
        "User-Agent": "opfuse-webhooks/1",
        # Pooled connections are keyed by address: one kept for another name on the same address
        # would carry that name's TLS session. A connection per attempt.
        "Connection": "close",
    }
    try:
        response = await client.post(
            url,
            content=attempt.body,
            headers=headers,
            timeout=settings.webhook_timeout_seconds,
            extensions=extensions,
        )
    except httpx.HTTPError as exc:
        return Outcome(attempt.delivery_id, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS])
    if 200 <= response.status_code < 300:
        return Outcome(attempt.delivery_id, None)
    return Outcome(attempt.delivery_id, f"the receiver answered HTTP {response.status_code}")


def record(session_factory: sessionmaker[Session], settings: Settings, outcomes: list[Outcome]) -> None:
    """Store the outcomes (one transaction): delivered, retry after a backoff, or failed for good."""
    now = utcnow()
    with session_factory.begin() as session:
        for outcome in outcomes:
            delivery = session.get(WebhookDelivery, outcome.delivery_id)
            if delivery is None:  # its job was deleted meanwhile
                continue
            fields = {"delivery_id": delivery.id, "job_id": delivery.job_id, "attempts": delivery.attempts}
            if outcome.error is None:
                delivery.status = DeliveryStatus.DELIVERED.value
                delivery.delivered_at = now
                delivery.last_error = None
                log.info("webhook delivered", extra=fields)
            elif delivery.attempts >= settings.webhook_max_attempts:
                delivery.status = DeliveryStatus.FAILED.value
                delivery.last_error = outcome.error
                log.warning("webhook failed; giving up", extra={**fields, "error": outcome.error})
            else:
                backoff = settings.webhook_backoff_seconds * 2 ** (delivery.attempts - 1)
                delivery.next_attempt_at = now + timedelta(seconds=backoff)
                delivery.last_error = outcome.error
                log.info("webhook failed; will retry", extra={**fields, "error": outcome.error})


class Dispatcher:
    """Sends deliveries as independent tasks: each is sent and recorded on its own, so a slow
    receiver delays nothing but its own delivery. At most OPFUSE_WEBHOOK_TENANT_CONCURRENCY are in
    flight per tenant (one tenant's hanging receivers hold only its own slots) and
    OPFUSE_WEBHOOK_MAX_IN_FLIGHT in all; a finished delivery frees its slot at once."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        settings: Settings,
        client: httpx.AsyncClient,
        metrics: Metrics | None = None,
    ) -> None:
        self.session_factory = session_factory
        self.settings = settings
        self.client = client
        self.metrics = metrics
        self.in_flight: dict[int, int] = {}  # tenant id -> deliveries being sent
        self.tasks: set[asyncio.Task[None]] = set()
        self.wake = asyncio.Event()  # a slot came free

    def _free_slots(self, tenant_id: int) -> int:
        return self.settings.webhook_tenant_concurrency - self.in_flight.get(tenant_id, 0)

    async def dispatch(self) -> list[asyncio.Task[None]]:
        """Start every due delivery that has a free slot; returns the tasks started."""
        room = self.settings.webhook_max_in_flight - len(self.tasks)
        if room <= 0:
            return []
        attempts = await asyncio.to_thread(
            take_due, self.session_factory, self.settings, min(room, BATCH), self._free_slots
        )
        started = []
        for attempt in attempts:
            self.in_flight[attempt.tenant_id] = self.in_flight.get(attempt.tenant_id, 0) + 1
            task = asyncio.create_task(self._deliver(attempt))
            self.tasks.add(task)
            started.append(task)
        return started

    async def _deliver(self, attempt: Attempt) -> None:
        try:
            outcome = await send(self.client, attempt, self.settings)
            await asyncio.to_thread(record, self.session_factory, self.settings, [outcome])
            if self.metrics is not None:
                self.metrics.webhooks.labels("delivered" if outcome.error is None else "error").inc()
        except Exception:  # the row comes due again after its in-flight time
            log.exception("webhook delivery failed", extra={"delivery_id": attempt.delivery_id})
        finally:
            left = self.in_flight.get(attempt.tenant_id, 1) - 1
            if left > 0:
                self.in_flight[attempt.tenant_id] = left
            else:
                self.in_flight.pop(attempt.tenant_id, None)
            self.tasks.discard(asyncio.current_task())  # type: ignore[arg-type]
            self.wake.set()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def deliver_due(
    session_factory: sessionmaker[Session],
    settings: Settings,
    client: httpx.AsyncClient,
    metrics: Metrics | None = None,
) -> int:
    """One round: start every due delivery that has a slot (each its own task), wait for them and
    return how many. (The API's task does not wait: see deliver_forever.)"""
    dispatcher = Dispatcher(session_factory, settings, client, metrics)
    started = await dispatcher.dispatch()
    await asyncio.gather(*started)
    return len(started)


async def deliver_forever(
    session_factory: sessionmaker[Session], settings: Settings, metrics: Metrics | None = None
) -> None:
    """The API's delivery task until cancelled: starts due deliveries every
    OPFUSE_WEBHOOK_INTERVAL_SECONDS, and at once whenever one ends (its slot is free)."""
    # Loading the CA bundle takes a while: once per process, off the event loop.
    ssl_context = await asyncio.to_thread(_ssl_context)
    # No proxies from the environment: the target checks above must be about the real peer.
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, verify=ssl_context) as client:
        dispatcher = Dispatcher(session_factory, settings, client, metrics)
        try:
            while True:
                dispatcher.wake.clear()
                try:
                    while len(await dispatcher.dispatch()) == BATCH:
                        pass  # a full batch: there may be more due right away
                except Exception:
                    log.exception("webhook delivery round failed; retrying next round")
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
                # that lands as its timeout fires, and the task would never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(settings.webhook_interval_seconds):
                        await dispatcher.wake.wait()
        finally:
            await dispatcher.close()
