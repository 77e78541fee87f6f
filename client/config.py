"""Find which opfuse server to talk to and with which key: flags, then the environment
(OPFUSE_API_URL, OPFUSE_API_KEY), then the local server's files in $OPFUSE_HOME (default ./.opfuse).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

__all__ = ["ConfigError", "Connection", "discover", "opfuse_home", "read_key_file", "resolve_url"]

NO_SERVER = "no server found: start one with `make run` / `opfuse serve`, or pass --api and --key"


class ConfigError(Exception):
    """Nothing says which server to use, or with which key. The message says how to fix it."""


@dataclass(frozen=True)
class Connection:
    api_url: str
    api_key: str
    source: str  # where the URL came from, for error messages ("--api", "OPFUSE_API_URL", a file)


def opfuse_home() -> Path:
    return Path(os.environ.get("OPFUSE_HOME") or ".opfuse")


def _local_url(url: str) -> str:
    """A server bound to all interfaces is reached on loopback."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host in ("0.0.0.0", "::", "[::]"):
        netloc = "127.0.0.1" + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return url


def _read_server_url(home: Path) -> str | None:
    path = home / "server.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); restart the server or pass --api") from None
    url = info.get("url") if isinstance(info, dict) else None
    if not isinstance(url, str) or not url:
        raise ConfigError(f'{path} has no "url"; restart the server or pass --api')
    return _local_url(url)


def read_key_file(path: str | os.PathLike[str]) -> str:
    """An API key stored alone in a file (surrounding whitespace ignored)."""
    path = Path(path)
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(f"key file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path} ({exc})") from None
    if not key:
        raise ConfigError(f"key file {path} is empty")
    return key


def resolve_url(api_url: str | None = None) -> tuple[str, str]:
    """The server URL and where it came from: --api, then OPFUSE_API_URL, then $OPFUSE_HOME/server.json."""
    if api_url:
        return api_url.rstrip("/"), "--api"
    if os.environ.get("OPFUSE_API_URL"):
        return os.environ["OPFUSE_API_URL"].rstrip("/"), "OPFUSE_API_URL"
    home = opfuse_home()
    url = _read_server_url(home)
    if not url:
        raise ConfigError(NO_SERVER)
    return url.rstrip("/"), str(home / "server.json")


def discover(api_url: str | None = None, api_key: str | None = None) -> Connection:
    """Resolve the server URL and API key; raises ConfigError saying what to pass when none is found."""
    url, source = resolve_url(api_url)
    home = opfuse_home()
    key = api_key or os.environ.get("OPFUSE_API_KEY")
    if not key and (home / "api_key").is_file():
        key = read_key_file(home / "api_key")
    if not key:
        raise ConfigError(
            f"no API key for {url}: pass --key, set OPFUSE_API_KEY, or run where {home}/api_key "
            "exists (`opfuse serve` writes it)"
        )
    return Connection(api_url=url, api_key=key, source=source)
