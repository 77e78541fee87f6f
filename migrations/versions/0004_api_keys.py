"""API keys that can be listed, recognised, expired and revoked; the `platform` scope.

Adds `prefix` (the key's first characters, for recognition), `expires_at`, `last_used_at` and
`revoked_at` to `api_keys`, and allows scope `platform` (the operator, separate from a tenant's
`admin`). Keys made before this revision have no prefix. Existing `admin` keys stay `admin`: from
now on they manage their own tenant only.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of what the models declared at this revision; migrations never import app code.
OLD_SCOPES = "'user', 'worker', 'admin'"
NEW_SCOPES = "'user', 'worker', 'admin', 'platform'"


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("prefix", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("expires_at", _utc(), nullable=True))
        batch.add_column(sa.Column("last_used_at", _utc(), nullable=True))
        batch.add_column(sa.Column("revoked_at", _utc(), nullable=True))
        batch.drop_constraint(batch.f("ck_api_keys_scope"), type_="check")
        batch.create_check_constraint(batch.f("ck_api_keys_scope"), sa.text(f"scope IN ({NEW_SCOPES})"))


def downgrade() -> None:
    # A platform key cannot exist at the old revision: it becomes its tenant's admin key.
    op.execute(sa.text("UPDATE api_keys SET scope = 'admin' WHERE scope = 'platform'"))
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint(batch.f("ck_api_keys_scope"), type_="check")
        batch.create_check_constraint(batch.f("ck_api_keys_scope"), sa.text(f"scope IN ({OLD_SCOPES})"))
        batch.drop_column("revoked_at")
        batch.drop_column("last_used_at")
        batch.drop_column("expires_at")
        batch.drop_column("prefix")
