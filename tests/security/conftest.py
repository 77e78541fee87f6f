"""The security suite runs against the service's fixtures: SQLite and a real PostgreSQL, and
`api_url`, the app served over real HTTP for the CLI."""

from __future__ import annotations

from tests.service.conftest import *  # noqa: F403
