"""Alembic migrations of the service's database (see service.db.upgrade_to_head)."""
