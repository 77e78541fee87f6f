"""`opfuse models` (list), `opfuse models show ID` and `opfuse models delete ID`."""

from __future__ import annotations

from typing import Annotated

import typer

from client import render
from client.commands.common import ApiOpt, JsonOpt, KeyOpt, console, options, print_json
from client.render import escape

models_app = typer.Typer(
    name="models",
    help="List uploaded models (inputs with their dynamic dims), show or delete one.",
    invoke_without_command=True,
)

ModelArg = Annotated[str, typer.Argument(help="The model id (from `opfuse models`).", show_default=False)]


def register(app: typer.Typer) -> None:
    app.add_typer(models_app)


@models_app.callback()
def models(ctx: typer.Context, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False) -> None:
    """List uploaded models; `opfuse models delete ID` deletes one."""
    opts = options(ctx, api, key, json_out)
    ctx.obj = opts  # the subcommand sees these flags too
    if ctx.invoked_subcommand is None:
        models_list(ctx)


@models_app.command("list")
def models_list(
    ctx: typer.Context, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False
) -> None:
    """List uploaded models, newest first."""
    opts = options(ctx, api, key, json_out)
    with opts.client() as client:
        found = client.list_models()
    if opts.json:
        print_json(found)
    else:
        console().print(render.models_table(found))


@models_app.command("show")
def models_show(
    ctx: typer.Context, model: ModelArg, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False
) -> None:
    """Show one model: name, sha256, size, opset, inputs and outputs."""
    opts = options(ctx, api, key, json_out)
    with opts.client() as client:
        found = client.get_model(model)
    if opts.json:
        print_json(found)
    else:
        console().print(render.models_table([found]))
        console().print(f"sha256 {escape(str(found.sha256))}")


@models_app.command("delete")
def models_delete(
    ctx: typer.Context, model: ModelArg, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False
) -> None:
    """Delete a model, its finished jobs and its stored bytes.

    Refused (409) while a job of it is queued or running: cancel those first.
    """
    opts = options(ctx, api, key, json_out)
    with opts.client() as client:
        client.delete_model(model)
    if opts.json:
        print_json({"deleted": model})
    else:
        console().print(f"deleted model {escape(model)} and its finished jobs")
