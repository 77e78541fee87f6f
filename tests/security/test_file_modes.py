"""The SQLite file (with tenants' webhook secrets) was world-readable when OPFUSE_HOME existed
already: the server's folders are now 0700 and its files 0600 whatever the umask and whatever was
there before: the database and its -wal/-shm, the tmp folder, server.json, the key files."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.bootstrap import ensure_local_keys, write_server_info
from service.settings import Settings


@pytest.fixture
def database_url(sqlite_database_url: str) -> str:
    return sqlite_database_url  # file modes are a SQLite matter


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o000)  # the worst case: whatever is created is world-writable unless restricted
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _database(settings: Settings) -> Path:
    return Path(settings.database_url.removeprefix("sqlite:///"))


def _check_private(settings: Settings) -> None:
    home = settings.home
    assert _mode(home) == 0o700
    assert _mode(settings.tmp_dir) == 0o700
    database = _database(settings)
    for suffix in ("", "-wal", "-shm"):
        companion = database.with_name(database.name + suffix)
        if companion.exists():
            assert _mode(companion) == 0o600, companion
    assert _database(settings).exists()
    for name in ("api_key", "worker_key", "server.json"):
        assert _mode(home / name) == 0o600, name
    # Nothing in the home is readable by others, whatever it is.
    for path in home.rglob("*"):
        assert _mode(path) & 0o077 == 0, (path, oct(_mode(path)))


def test_an_existing_open_home_and_database_are_made_private(settings: Settings, loose_umask: None) -> None:
    home = settings.home
    database = _database(settings)
    assert database.parent == home and database.exists()  # the fixture's migrated copy
    os.chmod(home, 0o755)
    os.chmod(database, 0o644)
    for suffix in ("-wal", "-shm"):
        companion = database.with_name(database.name + suffix)
        companion.touch()
        os.chmod(companion, 0o666)

    ensure_local_keys(settings)
    write_server_info(settings, port=8123)
    with TestClient(create_app(settings, run_migrations=False)) as client:
        assert client.get("/readyz").status_code == 200
    _check_private(settings)


def test_a_new_home_is_private_from_the_start(tmp_path: Path, loose_umask: None) -> None:
    settings = Settings(_env_file=None, home=tmp_path / "fresh" / "home")  # type: ignore[call-arg]
    ensure_local_keys(settings)
    write_server_info(settings, port=8124)
    with TestClient(create_app(settings, run_migrations=False)) as client:
        assert client.get("/readyz").status_code == 200
    _check_private(settings)
    assert _mode(_database(settings)) == 0o600
