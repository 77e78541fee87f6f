"""Webhooks on job end: checked at job creation, written to an outbox in the transaction that ends
the job, delivered by the API's background task, signed, retried with exponential backoff.

Body: `{"job_id", "status", "summary", "error"}` (JSON). Headers: `X-Opfuse-Signature:
sha256=<hex>` (HMAC-SHA256 of the body with the tenant's webhook secret, else the server's
OPFUSE_WEBHOOK_SECRET), `X-Opfuse-Delivery` (the same on every retry of one delivery: deduplicate
on it), `X-Opfuse-Event: job.finished`. Delivery is at least once.

Targets on loopback, link-local, private or otherwise non-public addresses are refused (at creation
and again before each attempt, since DNS can change) unless OPFUSE_WEBHOOK_ALLOW_PRIVATE=1.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import json
import socket
import ssl
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

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


def _why_not_public(address: str) -> str | None:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_private:
        return "private"
    if ip.is_multicast or ip.is_unspecified or ip.is_reserved or not ip.is_global:
        return "not a public address"
    return None


def check_target(url: str) -> None:
    """Raise WebhookRefused unless every address of the URL's host is public."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise WebhookRefused(f"webhook_url must be an http(s) URL with a host, not '{url}'")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError) as exc:
        raise WebhookRefused(f"webhook_url host '{host}' does not resolve ({exc})") from None
    for address in addresses:
        why = _why_not_public(address)
        if why is not None:
            raise WebhookRefused(
                f"webhook_url host '{host}' resolves to {address} ({why}); webhooks go to public "
                "addresses only (an operator can allow others with OPFUSE_WEBHOOK_ALLOW_PRIVATE=1)"
            )


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
        check_target(url)
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


def sign(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


# -- delivery -----------------------------------------------------------------------------------


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


@dataclass(frozen=True)
class Attempt:
    delivery_id: str
    job_id: str
    url: str
    body: bytes
    secret: str | None


@dataclass(frozen=True)
class Outcome:
    delivery_id: str
    error: str | None  # None: delivered


def take_due(session_factory: sessionmaker[Session], settings: Settings, limit: int = BATCH) -> list[Attempt]:
    """Claim due deliveries (one transaction): each is pushed out of reach for the length of one
    attempt, so a crash mid-attempt means a retry later, not a loss."""
    now = utcnow()
    in_flight = timedelta(seconds=settings.webhook_timeout_seconds + 30)
    with session_factory.begin() as session:
        due = session.scalars(
            select(WebhookDelivery)
            .where(
                WebhookDelivery.status == DeliveryStatus.PENDING.value,
                WebhookDelivery.next_attempt_at <= now,
            )
            .order_by(WebhookDelivery.next_attempt_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()
        attempts = []
        for delivery in due:
            delivery.attempts += 1
            delivery.next_attempt_at = now + in_flight
            secret = tenant_secret(session, delivery.tenant_id, settings)
            attempts.append(
                Attempt(delivery.id, delivery.job_id, delivery.url, delivery.payload.encode(), secret)
            )
    return attempts


async def send(client: httpx.AsyncClient, attempt: Attempt, settings: Settings) -> Outcome:
    """One POST; the outcome's error says why it did not count as delivered."""
    if attempt.secret is None:
        return Outcome(attempt.delivery_id, "no webhook secret is configured (OPFUSE_WEBHOOK_SECRET)")
    if not settings.webhook_allow_private:
        try:
            await asyncio.to_thread(check_target, attempt.url)
        except WebhookRefused as exc:
            return Outcome(attempt.delivery_id, str(exc))
    headers = {
        "Content-Type": "application/json",
        SIGNATURE_HEADER: sign(attempt.secret, attempt.body),
        DELIVERY_HEADER: attempt.delivery_id,
        EVENT_HEADER: EVENT,
        "User-Agent": "opfuse-webhooks/1",
    }
    try:
        response = await client.post(
            attempt.url, content=attempt.body, headers=headers, timeout=settings.webhook_timeout_seconds
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


async def deliver_due(
    session_factory: sessionmaker[Session],
    settings: Settings,
    client: httpx.AsyncClient,
    metrics: Metrics | None = None,
) -> int:
    """One round: send every due delivery (concurrently) and record the outcomes; returns how many."""
    attempts = await asyncio.to_thread(take_due, session_factory, settings)
    if not attempts:
        return 0
    outcomes = await asyncio.gather(*(send(client, a, settings) for a in attempts))
    await asyncio.to_thread(record, session_factory, settings, list(outcomes))
    if metrics is not None:
        for outcome in outcomes:
            metrics.webhooks.labels("delivered" if outcome.error is None else "error").inc()
    return len(attempts)


async def deliver_forever(
    session_factory: sessionmaker[Session], settings: Settings, metrics: Metrics | None = None
) -> None:
    """The API's delivery task: a round every OPFUSE_WEBHOOK_INTERVAL_SECONDS until cancelled."""
    # Loading the CA bundle takes a while: once per process, off the event loop.
    ssl_context = await asyncio.to_thread(_ssl_context)
    # No proxies from the environment: the target checks above must be about the real peer.
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, verify=ssl_context) as client:
        while True:
            try:
                while await deliver_due(session_factory, settings, client, metrics) == BATCH:
                    pass  # a full batch: there may be more due right away
            except Exception:
                log.exception("webhook delivery round failed; retrying next round")
            await asyncio.sleep(settings.webhook_interval_seconds)
