"""`python -m service`: run the API server alone, migrate the database, or make an API key
(settings from OPFUSE_* variables). For deployments: see docs/deploy.md."""

from __future__ import annotations

import argparse
import re
import sys

from sqlalchemy.orm import Session

from service.auth import create_key, get_or_create_tenant
from service.db import make_engine, upgrade_to_head
from service.models import Scope
from service.schemas import TENANT_PATTERN
from service.server import ServerStartError, serve
from service.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="run the API server (the default; no worker)")
    commands.add_parser("migrate", help="upgrade the database (OPFUSE_DATABASE_URL) to the latest schema")
    key = commands.add_parser("create-key", help="make an API key and print it (shown once)")
    key.add_argument("--tenant", default="default", help="tenant name (created if new; default: default)")
    key.add_argument(
        "--scope", choices=[s.value for s in Scope], default=Scope.USER.value, help="default: user"
    )
    return parser


def migrate(settings: Settings) -> None:
    upgrade_to_head(settings.database_url, settings.legacy_blob_dir)
    print("database is at the latest schema", file=sys.stderr)


def make_key(settings: Settings, tenant: str, scope: Scope) -> str:
    upgrade_to_head(settings.database_url, settings.legacy_blob_dir)
    engine = make_engine(settings.database_url)
    try:
        with Session(engine) as session, session.begin():
            return create_key(session, get_or_create_tenant(session, tenant), scope)
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings()
    try:
        if args.command == "migrate":
            migrate(settings)
        elif args.command == "create-key":
            if not re.fullmatch(TENANT_PATTERN, args.tenant):
                print("opfuse: tenant names are lowercase letters, digits, '_', '.', '-'", file=sys.stderr)
                return 2
            print(make_key(settings, args.tenant, Scope(args.scope)))
        else:
            serve(settings)
    except ServerStartError as exc:
        print(f"opfuse: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
