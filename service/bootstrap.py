"""First start of a local server: tenant `default`, its platform (operator) and worker keys in files
under $OPFUSE_HOME (mode 0600), and `server.json` so the CLI finds the server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sqlalchemy.orm import Session

from service.auth import create_key, find_key, get_or_create_tenant, revoke
from service.db import make_engine, upgrade_to_head
from service.file_modes import private_dir
from service.models import Scope
from service.settings import Settings

DEFAULT_TENANT = "default"
ADMIN_KEY_FILE = "api_key"
WORKER_KEY_FILE = "worker_key"
SERVER_INFO_FILE = "server.json"


def write_private_file(path: Path, content: str) -> None:
    """Replace `path` atomically with `content`, readable by the owner only (0600 from creation)."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_key(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def _ensure_key(session: Session, path: Path, scope: Scope) -> str:
    """The key in `path` if the database knows it (live, same scope, tenant default); else a new one
    (a live key of another scope in the file, e.g. the `admin` key of an older version, is revoked)."""
    key = _read_key(path)
    if key is not None:
        found = find_key(session, key)
        if found is not None and found[0].scope == scope.value and found[1].name == DEFAULT_TENANT:
            return key
        if found is not None:
            revoke(session, found[0])
    key = create_key(session, get_or_create_tenant(session, DEFAULT_TENANT), scope)
    write_private_file(path, key + "\n")
    return key


def ensure_local_keys(settings: Settings) -> tuple[str, str]:
    """Migrate the database, then return (platform key, worker key) of tenant `default`, creating
    them and their files ($OPFUSE_HOME/api_key, $OPFUSE_HOME/worker_key) when needed. The local
    server's key is the platform admin: its owner runs the server and makes keys for any tenant."""
    private_dir(settings.home)  # also when it exists: it holds the database and the keys
    upgrade_to_head(settings.database_url, settings.legacy_blob_dir)
    engine = make_engine(settings.database_url)
    try:
        with Session(engine) as session, session.begin():
            admin_key = _ensure_key(session, settings.home / ADMIN_KEY_FILE, Scope.PLATFORM)
            worker_key = _ensure_key(session, settings.home / WORKER_KEY_FILE, Scope.WORKER)
    finally:
        engine.dispose()
    return admin_key, worker_key


def server_url(host: str, port: int) -> str:
    # A server bound to every interface is reached on loopback.
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def write_server_info(settings: Settings, port: int | None = None) -> Path:
    """Write $OPFUSE_HOME/server.json `{"url": ...}`; `port` overrides settings.port (port 0 binds)."""
    path = settings.home / SERVER_INFO_FILE
    info = {"url": server_url(settings.host, settings.port if port is None else port), "pid": os.getpid()}
    write_private_file(path, json.dumps(info) + "\n")
    return path


def remove_server_info(settings: Settings) -> None:
    """Remove server.json if this process wrote it (a newer server's file is left alone)."""
    path = settings.home / SERVER_INFO_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(info, dict) and info.get("pid") == os.getpid():
        path.unlink(missing_ok=True)
