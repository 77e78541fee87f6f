"""`opfuse upload`, `submit`, `status`, `jobs` and `cancel`: models in, jobs queued and followed."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

from client import render
from client.commands.common import (
    ApiOpt,
    CLIError,
    DisableOpt,
    JobArg,
    JsonOpt,
    KeyOpt,
    Options,
    Precision,
    ShapeOpt,
    console,
    err_console,
    options,
    print_json,
    require_file,
)
from client.records import Job, Model
from client.render import escape
from client.sdk import OpfuseAPIError, OpfuseClient
from client.shapes import check_shapes_fit, parse_shapes


def register(app: typer.Typer) -> None:
    app.command()(upload)
    app.command()(submit)
    app.command()(status)
    app.command()(jobs)
    app.command()(cancel)


_MODEL_HELP = (
    "The ONNX file; external data files beside it (m.onnx.data) are packed and sent with it. "
    "A .zip of the model and its data files is sent as it is."
)
ModelPathArg = Annotated[Path | None, typer.Argument(help=_MODEL_HELP, show_default=False)]
NameOpt = Annotated[str | None, typer.Option(help="A name for the model (default: the file name).")]


def _upload(client: OpfuseClient, path: Path, name: str | None) -> Model:
    require_file(path, "model file")
    return client.upload_model(path, name)


def upload(
    ctx: typer.Context,
    model: Annotated[Path, typer.Argument(help=_MODEL_HELP, show_default=False)],
    name: NameOpt = None,
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Upload a model without starting a job; `opfuse submit --model-id ID` starts one later."""
    opts = options(ctx, api, key, json_out)
    with opts.client() as client:
        uploaded = _upload(client, model, name)
    if opts.json:
        print_json(uploaded)
        return
    out = console()
    out.print(render.models_table([uploaded]))
    dynamic = [str(i.name) for i in uploaded.inputs if i.dynamic]
    hint = " --shape " + " --shape ".join(f"{escape(n)}=..." for n in dynamic) if dynamic else ""
    out.print(f"start a job with `opfuse submit --model-id {escape(str(uploaded.id))}{hint}`", soft_wrap=True)


def wait_for(client: OpfuseClient, job: Job, opts: Options, timeout_s: float | None) -> Job:
    job_id = str(job.id)
    if opts.json:
        return client.wait_job(job_id, poll_s=0.5, timeout_s=timeout_s)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err_console(), transient=True) as bar:
        task = bar.add_task(f"job {job_id[:8]} queued", total=1.0)

        def on_update(j: Job) -> None:
            stage = f": {j.stage}" if j.stage and j.status == "running" else ""
            done = 1.0 if j.status == "succeeded" else float(j.progress or 0.0)
            bar.update(task, description=escape(f"job {job_id[:8]} {j.status}{stage}"), completed=done)

        try:
            return client.wait_job(job_id, poll_s=0.5, timeout_s=timeout_s, on_update=on_update)
        except KeyboardInterrupt:
            raise CLIError(
                f"stopped waiting; job {job_id} goes on on the server "
                f"(`opfuse status {job_id}`, `opfuse cancel {job_id}`)",
                130,
            ) from None


def submit(
    ctx: typer.Context,
    model: ModelPathArg = None,
    model_id: Annotated[
        str | None,
        typer.Option("--model-id", help="Fuse a model uploaded before (`opfuse upload`, `opfuse models`)."),
    ] = None,
    name: NameOpt = None,
    shape: ShapeOpt = None,
    precision: Annotated[Precision, typer.Option(help="Compute precision.")] = Precision.fp32,
    disable: DisableOpt = None,
    rtol: Annotated[float | None, typer.Option(help="Verification rtol (default: per precision).")] = None,
    atol: Annotated[float | None, typer.Option(help="Verification atol (default: per precision).")] = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Submitting again with the same key returns the same job.")
    ] = None,
    webhook_url: Annotated[str | None, typer.Option(help="URL the server calls when the job ends.")] = None,
    target: Annotated[
        str | None,
        typer.Option(help="Device kind to run on: any, cpu, or a GPU kind such as h200 (default: any)."),
    ] = None,
    wait: Annotated[bool, typer.Option(help="Follow the job with a progress bar until it ends.")] = False,
    timeout: Annotated[
        float | None, typer.Option(help="With --wait: give up after this many seconds.")
    ] = None,
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Upload a model (or name one with --model-id) and queue a fusion job.

    Exit code 1 if, with --wait, the job does not succeed.
    """
    opts = options(ctx, api, key, json_out)
    if (model is None) == (model_id is None):
        raise CLIError("give either a model file or --model-id ID (of `opfuse upload`), not both", 2)
    if model_id is not None and name is not None:
        raise CLIError("--name names a model being uploaded; --model-id's model keeps its name", 2)
    shapes = parse_shapes(shape or [])
    if model is not None:
        require_file(model, "model file")
    with opts.client() as client:
        uploaded = _upload(client, model, name) if model is not None else client.get_model(str(model_id))
        check_shapes_fit(shapes, uploaded.get("inputs") or [])
        job = client.create_job(
            str(uploaded.id),
            input_shapes=shapes,
            precision=precision.value,
            fusion_disable=disable or [],
            rtol=rtol,
            atol=atol,
            idempotency_key=idempotency_key,
            webhook_url=webhook_url,
            target=target,
        )
        if wait:
            job = wait_for(client, job, opts, timeout)
    if opts.json:
        print_json({"model": uploaded, "job": job})
    else:
        out = console()
        out.print(f"model [bold]{escape(str(uploaded.id))}[/] ({escape(str(uploaded.name))})")
        if wait:
            out.print(render.job_table(job, uploaded.name))
        else:
            job_id = escape(str(job.id))
            out.print(
                f"job [bold]{job_id}[/] queued; follow it with `opfuse status {job_id}`", soft_wrap=True
            )
    if wait and job.status != "succeeded":
        reason = job.error or "no reason given"
        typer.echo(f"opfuse: error: job {job.id} {job.status}: {render.strip_controls(reason)}", err=True)
        raise typer.Exit(1)


def model_names(client: OpfuseClient) -> dict[str, str]:
    """Model id -> name, for listings; empty if the models cannot be listed (the ids are shown)."""
    try:
        return {str(m.id): str(m.name) for m in client.list_models()}
    except OpfuseAPIError:
        return {}


def _model_name(client: OpfuseClient, model_id: str) -> str | None:
    try:
        return client.get_model(model_id).name
    except OpfuseAPIError:
        return None  # the job's model id is shown alone


def status(
    ctx: typer.Context, job: JobArg, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False
) -> None:
    """Show one job: status, stage, progress, timings, summary metrics, error."""
    opts = options(ctx, api, key, json_out)
    with opts.client() as client:
        found = client.get_job(job)
        name = None if opts.json else _model_name(client, str(found.model_id))
    if opts.json:
        print_json(found)
    else:
        console().print(render.job_table(found, name))


class SortKey(StrEnum):
    """`opfuse jobs --sort`: the API's order_by columns, largest first."""

    speedup = "speedup"
    created = "created"
    finished = "finished"
    latency = "latency"
    latency_before = "latency-before"
    kernels = "kernels"
    kernels_before = "kernels-before"
    memory = "memory"
    memory_before = "memory-before"


_ORDER_BY = {
    SortKey.speedup: "speedup",
    SortKey.created: "created_at",
    SortKey.finished: "finished_at",
    SortKey.latency: "latency_ms_after",
    SortKey.latency_before: "latency_ms_before",
    SortKey.kernels: "kernels_after",
    SortKey.kernels_before: "kernels_before",
    SortKey.memory: "peak_memory_after",
    SortKey.memory_before: "peak_memory_before",
}


def jobs(
    ctx: typer.Context,
    status: Annotated[str | None, typer.Option("--status", help="Only jobs in this status.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Only jobs of this model id.")] = None,
    sort: Annotated[
        SortKey | None,
        typer.Option(
            "--sort",
            help="Order by this, largest first; jobs without a value (not finished) last. "
            "latency, kernels and memory are after fusion (-before: before). Default: newest first.",
            show_default=False,
        ),
    ] = None,
    ascending: Annotated[bool, typer.Option("--ascending", help="With --sort: smallest first.")] = False,
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List jobs, newest first (or by --sort), with their model's name."""
    opts = options(ctx, api, key, json_out)
    if ascending and sort is None:
        raise CLIError("--ascending orders a --sort; add --sort KEY (e.g. --sort speedup)", 2)
    order_by = None if sort is None else ("" if ascending else "-") + _ORDER_BY[sort]
    with opts.client() as client:
        found = client.list_jobs(status=status, model_id=model, order_by=order_by)
        names = {} if opts.json else model_names(client)
    if opts.json:
        print_json(found)
    else:
        console().print(render.jobs_table(found, names))


def cancel(
    ctx: typer.Context, job: JobArg, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False
) -> None:
    """Cancel a job: a queued one at once, a running one at its next stage boundary."""
    opts = options(ctx, api, key, json_out)
    with opts.client() as client:
        found = client.cancel_job(job)
    if opts.json:
        print_json(found)
    elif found.done:
        console().print(f"job {escape(job)} is {escape(str(found.status))}")
    else:
        console().print(f"cancel requested; job {escape(job)} stops at its next stage boundary")
