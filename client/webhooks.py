"""Verify an opfuse webhook on the receiving side (standard library only).

    from client.webhooks import WebhookVerificationError, verify

    try:
        delivery_id = verify(secret, request_body, request_headers)
    except WebhookVerificationError as exc:
        return 400, str(exc)
    if seen_before(delivery_id):  # deliveries are at least once: deduplicate on the id
        return 200
    ...

The signature is `X-Opfuse-Signature: sha256=<hex>`, HMAC-SHA256 with the webhook secret of
`<X-Opfuse-Timestamp>.<X-Opfuse-Delivery>.<raw body>`. A delivery whose timestamp is further than
`window_seconds` (5 minutes) from the receiver's clock is refused, so a recorded delivery cannot be
replayed later; within the window, the delivery id deduplicates.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping

SIGNATURE_HEADER = "X-Opfuse-Signature"
TIMESTAMP_HEADER = "X-Opfuse-Timestamp"
DELIVERY_HEADER = "X-Opfuse-Delivery"
REPLAY_WINDOW_SECONDS = 300


class WebhookVerificationError(Exception):
    """The request is not a valid, fresh opfuse webhook (the message says why)."""


def signature(secret: str, body: bytes, timestamp: str, delivery_id: str) -> str:
    message = f"{timestamp}.{delivery_id}.".encode() + body
    return "sha256=" + hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def _header(headers: Mapping[str, str], name: str) -> str:
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    raise WebhookVerificationError(f"the request has no {name} header: not an opfuse webhook")


def verify(
    secret: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    window_seconds: float = REPLAY_WINDOW_SECONDS,
    now: float | None = None,
) -> str:
    """Check an incoming webhook: its signature over timestamp, delivery id and body, and that its
    timestamp is within `window_seconds` of `now` (default: this machine's clock). Returns the
    delivery id (deduplicate on it); raises WebhookVerificationError otherwise."""
    timestamp = _header(headers, TIMESTAMP_HEADER)
    delivery_id = _header(headers, DELIVERY_HEADER)
    given = _header(headers, SIGNATURE_HEADER)
    if not hmac.compare_digest(given.encode(), signature(secret, body, timestamp, delivery_id).encode()):
        raise WebhookVerificationError(
            f"the {SIGNATURE_HEADER} does not match: the body, timestamp or delivery id was changed, "
            "or the secret is not this tenant's webhook secret"
        )
    try:
        sent = int(timestamp)
    except ValueError:
        raise WebhookVerificationError(f"{TIMESTAMP_HEADER} is not a Unix time: {timestamp!r}") from None
    age = (time.time() if now is None else now) - sent
    if abs(age) > window_seconds:
        raise WebhookVerificationError(
            f"the webhook was signed {age:.0f} s from now, outside the {window_seconds:g} s window: "
            "a replay, or this machine's clock is off"
        )
    return delivery_id
