"""`opfuse keys list|create|revoke`: API keys (an admin key: its own tenant; a platform key: any)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer

from client import render
from client.commands.common import (
    ApiOpt,
    CLIError,
    JsonOpt,
    KeyOpt,
    console,
    err_console,
    options,
    print_json,
)
from client.render import escape


def register(app: typer.Typer) -> None:
    app.add_typer(keys_app)


keys_app = typer.Typer(
    name="keys",
    help="List, make and revoke API keys (needs an admin key: its own tenant; a platform key: any tenant).",
    no_args_is_help=True,
)

TenantOpt = Annotated[
    str | None,
    typer.Option(
        "--tenant", help="The tenant (default: your key's; others need a platform key).", show_default=False
    ),
]
_DURATION_UNITS = {"m": 60, "h": 3600, "d": 86400}


def _parse_duration(text: str) -> timedelta:
    """`30d`, `12h`, `90m` as a timedelta; CLIError (usage) otherwise."""
    unit = text[-1:].lower()
    number = text[:-1]
    if unit not in _DURATION_UNITS or not number.isdigit() or int(number) <= 0:
        raise CLIError(f"--expires-in {text!r}: give a positive number and a unit, e.g. 30d, 12h or 90m", 2)
    return timedelta(seconds=int(number) * _DURATION_UNITS[unit])


@keys_app.command("list")
def keys_list(
    ctx: typer.Context,
    tenant: TenantOpt = None,
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List API keys, newest first: id, prefix, tenant, scope, created, last used, expiry, revoked."""
    opts = options(ctx, api, key, json_out)
    with opts.client() as client:
        found = client.list_keys(tenant=tenant)
    if opts.json:
        print_json(found)
    else:
        console().print(render.keys_table(found))


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    scope: Annotated[
        str,
        typer.Option(
            "--scope", help="user, admin (its tenant's keys), worker or platform (platform key only)."
        ),
    ] = "user",
    tenant: TenantOpt = None,
    expires_in: Annotated[
        str | None, typer.Option("--expires-in", help="Refuse the key after this long: 30d, 12h, 90m.")
    ] = None,
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Make an API key and print it: it is shown this once (only its hash is stored)."""
    opts = options(ctx, api, key, json_out)
    expires_at = datetime.now(UTC) + _parse_duration(expires_in) if expires_in is not None else None
    with opts.client() as client:
        made = client.create_key(scope=scope, tenant=tenant, expires_at=expires_at)
    if opts.json:
        print_json(made)
        return
    typer.echo(made.key or "")
    expiry = f", expires {escape(str(made.get('expires_at')))}" if made.get("expires_at") else ""
    err_console().print(
        f"key {made.id} ({escape(str(made.scope))} of tenant {escape(str(made.tenant))}"
        f"{expiry}): store it now, it is not shown again"
    )


@keys_app.command("revoke")
def keys_revoke(
    ctx: typer.Context,
    key_id: Annotated[
        int, typer.Argument(help="The key's id (from `opfuse keys list`).", show_default=False)
    ],
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Revoke an API key: every request with it is refused (401) from now on."""
    opts = options(ctx, api, key, json_out)
    with opts.client() as client:
        revoked = client.revoke_key(key_id)
    if opts.json:
        print_json(revoked)
    else:
        console().print(f"revoked key {revoked.id} ({escape(str(revoked.prefix or '-'))}…)")
