"""Fixtures of the reliability tests: per test module a fresh database (SQLite, and PostgreSQL from
OPFUSE_TEST_POSTGRES_URL: a new database, dropped at the end), a real API server on it, a user key,
and a pool of real worker processes per test. Every process started is stopped at teardown.

With OPFUSE_REQUIRE_POSTGRES=1 an unset or unreachable PostgreSQL fails the PostgreSQL half instead
of skipping it. The closing summary prints the figures (faults survived, jobs run, bad inputs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from client.sdk import OpfuseClient
from tests.postgres import create_postgres_database, drop_postgres_database, reachable_postgres

from .harness import FIGURES, ApiServer, WorkerPool

# Short leases, so an expiry takes seconds (5, not less: two cores run the server, four workers and
# their children at once, and a heartbeat must not miss a lease for want of CPU); no rate limit
# (the tests poll a lot).
BASE_SETTINGS = {
    "OPFUSE_LEASE_SECONDS": "5",
    "OPFUSE_MAX_ATTEMPTS": "3",
    "OPFUSE_REQUEUE_INTERVAL_SECONDS": "0.5",
    "OPFUSE_RATE_LIMIT_PER_MIN": "0",
}


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh, empty database for this module (the server migrates it at start)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'opfuse.db'}"
        return
    server_url = reachable_postgres()
    url = create_postgres_database(server_url, prefix="opfuse_rel")
    try:
        yield url
    finally:
        drop_postgres_database(server_url, url)


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiServer]:
    """The API server for this module; a module sets SERVER_SETTINGS to override BASE_SETTINGS."""
    settings = {**BASE_SETTINGS, **getattr(request.module, "SERVER_SETTINGS", {})}
    api = ApiServer(home=tmp_path_factory.mktemp("home"), database_url=database_url, settings=settings)
    try:
        api.start()
        yield api
    finally:
        api.stop()


@pytest.fixture(scope="module")
def user_key(server: ApiServer) -> str:
    return server.make_key("default")


@pytest.fixture
def user(server: ApiServer, user_key: str) -> Iterator[OpfuseClient]:
    with server.client(user_key) as client:
        yield client


@pytest.fixture
def workers(server: ApiServer, tmp_path: Path) -> Iterator[WorkerPool]:
    pool = WorkerPool(server, tmp_path)
    try:
        yield pool
    finally:
        pool.stop_all()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES.jobs_run or FIGURES.faults or FIGURES.bad_inputs or FIGURES.uploads or FIGURES.fuzz_requests:
        terminalreporter.write_sep("=", "reliability")
        terminalreporter.write_line(FIGURES.summary())
