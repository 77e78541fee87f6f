"""`opfuse download`, `opfuse profile` and `opfuse compare`: a finished job's bundle, where its time
went, and jobs side by side. (`opfuse report` lives in client.cli: its --trace renders with opfuse.views.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from client.commands.common import ApiOpt, CLIError, JobArg, JsonOpt, KeyOpt, console, options, print_json
from client.commands.jobs import model_names
from client.records import Job, Report
from client.render import escape
from client.render_profile import INTERPRETER_NOTE, compare_table, profile_tables
from client.sdk import OpfuseAPIError


def register(app: typer.Typer) -> None:
    app.command()(download)
    app.command()(profile)
    app.command()(compare)


def download(
    ctx: typer.Context,
    job: JobArg,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Where to save the bundle (default: JOB.opfuse.zip)."),
    ] = None,
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Download a finished job's bundle (checked against the server's sha256 and signature)."""
    opts = options(ctx, api, key, json_out)
    dest = output or Path(f"{job}.opfuse.zip")
    with opts.client() as client:
        got = client.download_artifact(job, dest)
    if opts.json:
        print_json({"path": str(got.path), "sha256": got.sha256, "size_bytes": got.size_bytes})
    else:
        console().print(
            f"saved {escape(str(got.path))} ({got.size_bytes} bytes, sha256 {got.sha256[:16]}…); "
            f"run it with `opfuse run {escape(str(got.path))} --inputs inputs.npz`"
        )


def profile(
    ctx: typer.Context,
    job: JobArg,
    top: Annotated[
        int, typer.Option("--top", "-n", help="Show the N largest steps of each table; 0: all.", min=0)
    ] = 20,
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Where a finished job's time went, largest first, before and after fusion.

    Like trtexec's --dumpProfile: the original model op by op, then the fused plan kernel by
    kernel (groups and the ops left unfused), each with its time, share, bytes and bound.
    """
    opts = options(ctx, api, key, json_out)
    with opts.client() as client:
        found = client.get_report(job)
    profile_json = found.get("profile") or {}
    if opts.json:
        print_json({"before": profile_json.get("ops") or [], "after": profile_json.get("after") or []})
        return
    if not found.ops:
        raise CLIError(f"job {job}'s report has no per-op profile", 1)
    out = console()
    for table in profile_tables(found, top or None):
        out.print(table)
    if found.on_interpreter:
        out.print(f"[yellow]note:[/] {INTERPRETER_NOTE}")


def compare(
    ctx: typer.Context,
    jobs: Annotated[list[str], typer.Argument(help="Two or more job ids.", show_default=False)],
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Jobs side by side: latency, launches, peak memory, verification, fused groups."""
    opts = options(ctx, api, key, json_out)
    if len(jobs) < 2:
        raise CLIError("compare needs two or more job ids, e.g. `opfuse compare JOB_A JOB_B`", 2)
    pairs: list[tuple[Job, Report | None, str | None]] = []
    with opts.client() as client:
        names = model_names(client)
        for job_id in jobs:
            found = client.get_job(job_id)
            report = None
            if found.status == "succeeded":
                try:
                    report = client.get_report(job_id)
                except OpfuseAPIError as exc:
                    if exc.status != 404:
                        raise
            pairs.append((found, report, names.get(str(found.model_id))))
    if opts.json:
        print_json([{"job": j, "report": r, "model_name": n} for j, r, n in pairs])
    else:
        console().print(compare_table(pairs))
