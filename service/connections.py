"""Limits on connections, below HTTP requests (uvicorn's h11 protocol with two additions):

- the request line and headers must arrive within `header_timeout` seconds of the connection's
  start, or of the first byte of a later request on a kept-alive connection → 408 and closed
  (uvicorn itself only times out idle keep-alive connections, never slow headers);
- one client address may hold at most `max_per_client` connections at once; the next one gets 503
  with Retry-After at once and is closed (0: no limit).

Headers are limited to MAX_HEADER_BYTES (h11 answers 400 past it). The refusals are written raw:
no request was parsed, so there is no ASGI request to answer.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 16 * 1024
# A refused connection stays open this long after its answer (reading and dropping what comes),
# so that a client still sending its request reads the answer instead of a reset.
LINGER_SECONDS = 1.0


def _raw_response(status: int, reason: str, detail: str, extra: str = "") -> bytes:
    body = json.dumps({"detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


def guarded_h11(max_per_client: int, header_timeout: float) -> type[H11Protocol]:
    """An H11Protocol class with the limits above; each class counts its own connections (one
    class per server)."""
    open_by_client: dict[str, int] = {}

    class GuardedH11Protocol(H11Protocol):
        _address: str | None = None  # counted in open_by_client while set
        _header_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            address = self.client[0] if self.client else ""
            if max_per_client and open_by_client.get(address, 0) >= max_per_client:
                self._refuse(
                    _raw_response(
                        503,
                        "Service Unavailable",
                        f"too many connections from this address: at most {max_per_client} at once "
                        "(OPFUSE_MAX_CONNECTIONS_PER_CLIENT); close some and retry",
                        "retry-after: 1\r\n",
                    )
                )
                return
            open_by_client[address] = open_by_client.get(address, 0) + 1
            self._address = address
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            if self._address is not None:
                left = open_by_client.get(self._address, 1) - 1
                if left > 0:
                    open_by_client[self._address] = left
                else:
                    open_by_client.pop(self._address, None)
                self._address = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # dropped: the answer is out, the connection closes soon
            if not self._in_request():
                self._arm_header_timer()  # the first bytes of a request: its headers are on the clock
            super().data_received(data)
            if self._in_request():
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._in_request():  # a pipelined request's headers were already in
                self._cancel_header_timer()

        def _in_request(self) -> bool:
            """A request's headers are in and its response is not complete yet."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._in_request() or self.transport.is_closing():
                return
            self._refuse(
                _raw_response(
                    408,
                    "Request Timeout",
                    f"the request line and headers did not arrive within {header_timeout:g} s "
                    "(OPFUSE_HEADER_TIMEOUT_SECONDS); send the request again",
                )
            )

        def _refuse(self, response: bytes) -> None:
            self._refused = True
            self._cancel_header_timer()
            if self.conn.our_state is not h11.ERROR:
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
            self.transport.write(response)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self.transport.close)

    return GuardedH11Protocol
