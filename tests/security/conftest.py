"""The security suite runs against the service's fixtures: SQLite and a real PostgreSQL."""

from tests.service.conftest import *  # noqa: F403
