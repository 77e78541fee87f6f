"""What every `opfuse` command shares: the global options, the connection to the API, the option
types, the consoles, JSON output, and the one-line error users see."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from client.config import discover
from client.records import Record
from client.sdk import OpfuseClient


class CLIError(Exception):
    """A user-facing failure: one line on stderr and a non-zero exit code (2: bad usage)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def connect_from_discovery(opts: Options) -> OpfuseClient:
    """The SDK client for the server and key the flags, the environment or $OPFUSE_HOME name."""
    conn = discover(opts.api, opts.key)
    return OpfuseClient(conn.api_url, conn.api_key)


@dataclass
class Options:
    api: str | None = None
    key: str | None = None
    json: bool = False
    # How commands reach the API; the root command sets it (tests point it at their own server).
    connect: Callable[[Options], OpfuseClient] = connect_from_discovery

    def client(self) -> OpfuseClient:
        return self.connect(self)


def options(ctx: typer.Context, api: str | None, key: str | None, json_out: bool) -> Options:
    """The command's own flags win over the ones given before the command name (or its group's:
    a context inherits its parent's `obj`)."""
    base = ctx.obj if isinstance(ctx.obj, Options) else Options()
    return Options(api=api or base.api, key=key or base.key, json=json_out or base.json, connect=base.connect)


class Precision(StrEnum):
    fp32 = "fp32"
    tf32 = "tf32"
    fp16 = "fp16"
    bf16 = "bf16"


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


ApiOpt = Annotated[
    str | None,
    typer.Option(
        "--api", help="API URL (default: OPFUSE_API_URL, else $OPFUSE_HOME/server.json)", show_default=False
    ),
]
KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--key", help="API key (default: OPFUSE_API_KEY, else $OPFUSE_HOME/api_key)", show_default=False
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only (to stdout).")]
ShapeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--shape",
        "-s",
        help="Input shape NAME=DIMxDIMx..., e.g. x=1x3x224x224; repeat per input. Needed for dynamic dims.",
        show_default=False,
    ),
]
DisableOpt = Annotated[
    list[str] | None,
    typer.Option("--disable", help="A fusion rule to switch off; repeat for several.", show_default=False),
]
JobArg = Annotated[str, typer.Argument(help="The job id.", show_default=False)]


def console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def err_console() -> Console:
    return Console(stderr=True, highlight=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Record):
        return value.raw  # the JSON the server sent, as it sent it
    return str(value)


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=_jsonable))


def require_file(path: Path, what: str) -> None:
    if not path.exists():
        raise CLIError(f"{what} {path} does not exist", 2)
    if not path.is_file():
        raise CLIError(f"{what} {path} is not a file", 2)


def write_text(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a temporary file beside it, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
