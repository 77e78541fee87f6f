"""Request rate limits per API key: a token bucket per key, in this API process.

A key may make `per_minute` requests in a burst, refilled at `per_minute / 60` a second. With
several API replicas behind a load balancer each has its own buckets (a key gets up to N times the
rate in all); that bounds abuse without shared state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from service.errors import TooManyRequestsError


class RateLimiter:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._buckets: dict[int, tuple[float, float]] = {}  # key id -> (tokens, when)
        self._lock = threading.Lock()

    def take(self, key_id: int) -> None:
        """Spend one token of `key_id`'s bucket, or raise 429 with Retry-After."""
        if self.per_minute <= 0:
            return
        rate = self.per_minute / 60.0
        now = self._clock()
        with self._lock:
            tokens, when = self._buckets.get(key_id, (float(self.per_minute), now))
            tokens = min(float(self.per_minute), tokens + (now - when) * rate)
            if tokens < 1.0:
                self._buckets[key_id] = (tokens, now)
                raise TooManyRequestsError(
                    f"too many requests with this API key: the limit is {self.per_minute} a minute "
                    "(OPFUSE_RATE_LIMIT_PER_MIN); retry after the time in the Retry-After header",
                    (1.0 - tokens) / rate,
                )
            self._buckets[key_id] = (tokens - 1.0, now)


class FailedAuthLimiter:
    """Failed authentications per client address: `per_minute` wrong keys in a burst, refilled at
    `per_minute / 60` a second. An address with none left gets 429 before its key is even looked
    up (a right key too), so keys cannot be guessed at the speed of the server."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, when)
        self._lock = threading.Lock()

    def _tokens(self, address: str, now: float) -> float:
        tokens, when = self._buckets.get(address, (float(self.per_minute), now))
        return min(float(self.per_minute), tokens + (now - when) * self.per_minute / 60.0)

    def check(self, address: str) -> None:
        """Raise 429 with Retry-After if `address` has used up its failed attempts."""
        if self.per_minute <= 0:
            return
        now = self._clock()
        with self._lock:
            tokens = self._tokens(address, now)
            if tokens >= 1.0:
                if tokens >= self.per_minute:
                    self._buckets.pop(address, None)  # full again: forget the address
                return
        raise TooManyRequestsError(
            f"too many failed authentications from this address: the limit is {self.per_minute} a "
            "minute (OPFUSE_AUTH_FAILURES_PER_MIN); check the API key and retry after the time in the "
            "Retry-After header",
            (1.0 - tokens) * 60.0 / self.per_minute,
        )

    def failed(self, address: str) -> None:
        """Count one failed authentication of `address`."""
        if self.per_minute <= 0:
            return
        now = self._clock()
        with self._lock:
            self._buckets[address] = (max(0.0, self._tokens(address, now) - 1.0), now)
