"""The security suite runs against the service's fixtures: SQLite and a real PostgreSQL; `api_url`
serves the app over real HTTP for the CLI."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from service.app import create_app
from service.settings import Settings
from tests.service.conftest import *  # noqa: F403
from tests.service.conftest import Keys


@pytest.fixture
def api_url(settings: Settings, keys: Keys) -> Iterator[str]:
    """The app served by uvicorn in a thread on a free port, on the test's database."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings, run_migrations=False), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
