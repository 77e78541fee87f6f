"""Run the API server: migrate, make the local keys, write server.json, serve with uvicorn.

`run_server(settings, on_started)` blocks until SIGINT/SIGTERM, then shuts down cleanly and returns
(it does not re-raise the signal), so the caller can stop what it started in `on_started`
(`opfuse serve` starts its worker there).
"""

from __future__ import annotations

import ctypes
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI

from service.app import create_app
from service.bootstrap import ensure_local_keys, remove_server_info, write_server_info
from service.connections import MAX_HEADER_BYTES, guarded_h11
from service.logging import configure_logging, get_logger
from service.settings import Settings

log = get_logger("server")


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD_BYTES = 1 << 20


def return_large_buffers_to_the_os() -> None:
    """Serve allocations of 1 MiB and more (uploaded models, their protobufs) from mmap, so that
    freeing one gives the memory back. By default glibc raises this threshold after the first big
    free and keeps later big buffers in per-thread arenas: concurrent uploads of 20 MB models then
    leave the server hundreds of MB bigger. (Only where the C library is glibc.)"""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        return


class ServerStartError(Exception):
    """The server cannot start (e.g. its port is taken); the message says what to change."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port); raises ServerStartError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServerStartError(
            f"cannot listen on {host}:{port} ({exc.strerror}); stop the other server or choose another "
            "port with OPFUSE_PORT"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_started is not None:
            self._on_started()


def _ignore(_sig: int, _frame: FrameType | None) -> None:
    return None


@contextmanager
def _quiet_after_shutdown() -> Iterator[None]:
    """uvicorn re-raises the signal that stopped it once it is done; make that a no-op here so
    run_server returns normally, then put the caller's handlers back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _ignore) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def server_config(app: FastAPI, settings: Settings) -> uvicorn.Config:
    """How uvicorn serves the API: h11 with the connection limits of service.connections (slow
    headers → 408, connections per client address), idle keep-alive connections closed after
    OPFUSE_KEEP_ALIVE_SECONDS, headers at most MAX_HEADER_BYTES."""
    return uvicorn.Config(
        app,
        http=guarded_h11(settings.max_connections_per_client, settings.header_timeout_seconds),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=settings.keep_alive_seconds,  # type: ignore[arg-type]
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
    )


def run_server(settings: Settings, on_started: Callable[[], None] | None = None) -> None:
    """Serve the API on settings.host:port until SIGINT/SIGTERM; `on_started` runs once it accepts
    connections (server.json is written by then)."""
    configure_logging(settings.log_level)
    return_large_buffers_to_the_os()
    ensure_local_keys(settings)  # migrates the database first
    sock = bind_socket(settings.host, settings.port)
    port = sock.getsockname()[1]
    config = server_config(create_app(settings, run_migrations=False), settings)
    server = _Server(config, on_started)
    write_server_info(settings, port)
    log.info("serving", extra={"url": f"http://{settings.host}:{port}", "home": str(settings.home)})
    try:
        with _quiet_after_shutdown():
            server.run(sockets=[sock])
    finally:
        sock.close()
        remove_server_info(settings)
        log.info("stopped")


def serve(settings: Settings | None = None) -> None:
    """`python -m service`: run the server with settings from the environment."""
    run_server(settings or Settings())
