"""The `opfuse` command line: run a local server, submit models, follow jobs, fetch reports and
bundles, and compile or run bundles locally. `--json` on any command prints JSON only to stdout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from typer.core import TyperGroup

from client import render
from client.config import ConfigError, discover
from client.render import escape, strip_controls
from client.sdk import TERMINAL_STATUSES, Job, OpfuseAPIError, OpfuseClient, OpfuseClientError
from client.shapes import ShapeSpecError, check_shapes_fit, parse_shapes
from opfuse.errors import OpfuseError

__all__ = ["app", "main"]


class CLIError(Exception):
    """A user-facing failure: one line on stderr and a non-zero exit code (2: bad usage)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def _die(message: str, code: int = 1) -> NoReturn:
    # The message may quote a model or the server: no control character reaches the terminal.
    typer.echo(f"opfuse: error: {strip_controls(message)}", err=True)
    raise typer.Exit(code)


class OpfuseGroup(TyperGroup):
    """Turns the errors users cause (bad input, 4xx answers, missing files) into one stderr line."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CLIError as exc:
            _die(exc.message, exc.code)
        except (ShapeSpecError, ConfigError) as exc:
            _die(str(exc), 2)
        except OpfuseAPIError as exc:
            _die(f"{exc.detail} (HTTP {exc.status})")
        except (OpfuseClientError, OpfuseError) as exc:
            _die(str(exc))
        except OSError as exc:
            if exc.filename is not None:
                _die(f"{exc.filename}: {exc.strerror or exc}")
            _die(str(exc))
        except KeyboardInterrupt:
            _die("interrupted", 130)


app = typer.Typer(
    name="opfuse",
    cls=OpfuseGroup,
    help="opfuse: fuse ONNX models into verified Triton kernels, as a service or locally.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


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


@dataclass
class Options:
    api: str | None = None
    key: str | None = None
    json: bool = False


@app.callback()
def _root(ctx: typer.Context, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False) -> None:
    ctx.obj = Options(api=api, key=key, json=json_out)


def _options(ctx: typer.Context, api: str | None, key: str | None, json_out: bool) -> Options:
    """The command's own flags win over the ones given before the command name."""
    root = ctx.find_root().obj
    base = root if isinstance(root, Options) else Options()
    return Options(api=api or base.api, key=key or base.key, json=json_out or base.json)


def _client(opts: Options) -> OpfuseClient:
    conn = discover(opts.api, opts.key)
    return OpfuseClient(conn.api_url, conn.api_key)


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def _err_console() -> Console:
    return Console(stderr=True, highlight=False)


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def _require_file(path: Path, what: str) -> None:
    if not path.exists():
        raise CLIError(f"{what} {path} does not exist", 2)
    if not path.is_file():
        raise CLIError(f"{what} {path} is not a file", 2)


# -- server and worker ---------------------------------------------------------------------------


@app.command()
def serve(
    ctx: typer.Context,
    host: Annotated[
        str | None, typer.Option(help="Interface to bind (default: OPFUSE_HOST or 127.0.0.1).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port (default: OPFUSE_PORT or 8000).")] = None,
    home: Annotated[
        Path | None,
        typer.Option(help="State directory: database, blobs, keys (default: OPFUSE_HOME or ./.opfuse)."),
    ] = None,
    worker: Annotated[bool, typer.Option("--worker/--no-worker", help="Also run one local worker.")] = True,
    gpu: Annotated[int | None, typer.Option(help="GPU index for the local worker.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the API server here, with one local worker process. Ctrl-C stops both.

    With --json, one line {"url", "home", "api_key_file"} goes to stdout once the server is up.
    """
    from client.embedded import serve_embedded

    json_mode = _options(ctx, None, None, json_out).json
    code = serve_embedded(host=host, port=port, home=home, with_worker=worker, gpu=gpu, json_out=json_mode)
    raise typer.Exit(code)


@app.command("worker")
def worker_command(
    ctx: typer.Context,
    api: ApiOpt = None,
    key: Annotated[
        str | None, typer.Option("--key", help="Worker key (scope worker) (default: OPFUSE_WORKER_KEY).")
    ] = None,
    key_file: Annotated[
        Path | None,
        typer.Option("--key-file", help="File holding the worker key (default: $OPFUSE_HOME/worker_key)."),
    ] = None,
    worker_id: Annotated[
        str | None, typer.Option("--worker-id", help="Name in job records (default: host-pid).")
    ] = None,
    gpu: Annotated[
        int | None,
        typer.Option(
            help="GPU index this worker owns; run one worker per GPU (default: the first GPU, else CPU)."
        ),
    ] = None,
    once: Annotated[bool, typer.Option(help="Run one job and exit (at once if the queue is empty).")] = False,
    job_timeout: Annotated[
        float | None,
        typer.Option(help="Wall-time limit per job, seconds (default 1800).", show_default=False),
    ] = None,
    job_memory_gb: Annotated[
        float | None,
        typer.Option(
            help="Memory limit of each job's process, GB; 0: none (default: min(32, 75% of the host's memory)).",
            show_default=False,
        ),
    ] = None,
    max_nodes: Annotated[
        int | None, typer.Option(help="Refuse models with more nodes than this (default 50000).")
    ] = None,
    max_depth: Annotated[
        int | None, typer.Option(help="Refuse graphs deeper than this many chained nodes (default 10000).")
    ] = None,
    api_retry: Annotated[
        float | None,
        typer.Option(
            help="Keep retrying a job's API calls this long while the API is down, seconds (default 120).",
            show_default=False,
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run a worker: claim jobs from the API and fuse them on this machine's GPU (or CPU).

    It needs only the API URL and a worker-scope key, so it runs on any host that reaches the API.
    Its logs are JSON lines on stderr (with or without --json); nothing goes to stdout.
    """
    from client.embedded import run_worker_process

    opts = _options(ctx, api, None, False)
    options = {
        "--worker-id": worker_id,
        "--gpu": gpu,
        "--job-timeout": job_timeout,
        "--job-memory-gb": job_memory_gb,
        "--max-nodes": max_nodes,
        "--max-depth": max_depth,
        "--api-retry": api_retry,
    }
    raise typer.Exit(run_worker_process(opts.api, key, key_file, options, once=once))


# -- models and jobs -----------------------------------------------------------------------------


def _wait_for(client: OpfuseClient, job: Job, opts: Options, timeout_s: float | None) -> Job:
    job_id = str(job["id"])
    if opts.json:
        return client.wait_job(job_id, poll_s=0.5, timeout_s=timeout_s)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=_err_console(), transient=True) as bar:
        task = bar.add_task(f"job {job_id[:8]} queued", total=1.0)

        def on_update(j: Job) -> None:
            status = str(j.get("status"))
            stage = j.get("stage")
            label = f"job {job_id[:8]} {status}" + (f": {stage}" if stage and status == "running" else "")
            done = 1.0 if status == "succeeded" else float(j.get("progress") or 0.0)
            bar.update(task, description=escape(label), completed=done)

        try:
            return client.wait_job(job_id, poll_s=0.5, timeout_s=timeout_s, on_update=on_update)
        except KeyboardInterrupt:
            raise CLIError(
                f"stopped waiting; job {job_id} goes on on the server "
                f"(`opfuse status {job_id}`, `opfuse cancel {job_id}`)",
                130,
            ) from None


@app.command()
def submit(
    ctx: typer.Context,
    model: Annotated[
        Path,
        typer.Argument(
            help="The ONNX file to fuse; external data files beside it (m.onnx.data) are packed and sent "
            "with it. A .zip of the model and its data files is sent as it is.",
            show_default=False,
        ),
    ],
    name: Annotated[str | None, typer.Option(help="A name for the model (default: the file name).")] = None,
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
    """Upload a model and queue a fusion job (exit code 1 if, with --wait, the job does not succeed)."""
    opts = _options(ctx, api, key, json_out)
    shapes = parse_shapes(shape or [])
    _require_file(model, "model file")
    with _client(opts) as client:
        uploaded = client.upload_model(model, name)
        check_shapes_fit(shapes, uploaded.get("inputs") or [])
        job = client.create_job(
            str(uploaded["id"]),
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
            job = _wait_for(client, job, opts, timeout)
    if opts.json:
        _print_json({"model": uploaded, "job": job})
    else:
        console = _console()
        console.print(f"model [bold]{escape(str(uploaded['id']))}[/] ({escape(str(uploaded.get('name')))})")
        if wait:
            console.print(render.job_table(job))
        else:
            job_id = escape(str(job["id"]))
            console.print(f"job [bold]{job_id}[/] queued; follow it with `opfuse status {job_id}`")
    if wait and job.get("status") != "succeeded":
        reason = job.get("error") or "no reason given"
        typer.echo(f"opfuse: error: job {job['id']} {job.get('status')}: {reason}", err=True)
        raise typer.Exit(1)


@app.command()
def status(
    ctx: typer.Context, job: JobArg, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False
) -> None:
    """Show one job: status, stage, progress, timings, summary metrics, error."""
    opts = _options(ctx, api, key, json_out)
    with _client(opts) as client:
        found = client.get_job(job)
    if opts.json:
        _print_json(found)
    else:
        _console().print(render.job_table(found))


@app.command()
def jobs(
    ctx: typer.Context,
    status: Annotated[str | None, typer.Option("--status", help="Only jobs in this status.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Only jobs of this model id.")] = None,
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List jobs, newest first."""
    opts = _options(ctx, api, key, json_out)
    with _client(opts) as client:
        found = client.list_jobs(status=status, model_id=model)
    if opts.json:
        _print_json(found)
    else:
        _console().print(render.jobs_table(found))


@app.command()
def models(ctx: typer.Context, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False) -> None:
    """List uploaded models."""
    opts = _options(ctx, api, key, json_out)
    with _client(opts) as client:
        found = client.list_models()
    if opts.json:
        _print_json(found)
    else:
        _console().print(render.models_table(found))


def _write_text(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a temporary file beside it, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _trace_text(found: Mapping[str, Any]) -> str:
    from opfuse.views.trace import render_trace

    return json.dumps(render_trace(found), default=str)


@app.command()
def report(
    ctx: typer.Context,
    job: JobArg,
    html: Annotated[
        bool, typer.Option("--html", help="Save the report as one HTML page (works offline); see -o.")
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="With --html: where to save it (default: JOB.report.html)."),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            help="Save one inference before and after fusion as a Chrome/Perfetto trace (JSON) here.",
            show_default=False,
        ),
    ] = None,
    api: ApiOpt = None,
    key: KeyOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show a finished job's report: summary, fusion groups, what was not fused and why, verification.

    --html saves the page the server renders (GET /v1/jobs/JOB/report.html); --trace renders a trace
    for chrome://tracing or ui.perfetto.dev from the report.
    """
    opts = _options(ctx, api, key, json_out)
    if output is not None and not html:
        raise CLIError("-o/--output names the file of --html; add --html (or use --trace FILE)", 2)
    html_path = (output or Path(f"{job}.report.html")) if html else None
    with _client(opts) as client:
        found = client.get_report(job)
        # The SDK has no call for the page: it is the same authenticated GET as the JSON report's.
        page = client._request("GET", f"/v1/jobs/{job}/report.html").text if html_path else None
    saved: dict[str, str] = {}
    if html_path is not None and page is not None:
        _write_text(html_path, page)
        saved["html"] = str(html_path)
    if trace is not None:
        _write_text(trace, _trace_text(found))
        saved["trace"] = str(trace)
    if opts.json:
        _print_json(saved if saved else found)
    elif saved:
        console = _console()
        if "html" in saved:
            console.print(f"saved {escape(saved['html'])}; open it in a browser (it needs no network)")
        if "trace" in saved:
            console.print(f"saved {escape(saved['trace'])}; open it in chrome://tracing or ui.perfetto.dev")
    else:
        render.print_report(_console(), found)


@app.command()
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
    """Download a finished job's bundle (checked against the server's sha256)."""
    opts = _options(ctx, api, key, json_out)
    dest = output or Path(f"{job}.opfuse.zip")
    with _client(opts) as client:
        got = client.download_artifact(job, dest)
    if opts.json:
        _print_json({"path": str(got.path), "sha256": got.sha256, "size_bytes": got.size_bytes})
    else:
        _console().print(
            f"saved {escape(str(got.path))} ({got.size_bytes} bytes, sha256 {got.sha256[:16]}…); "
            f"run it with `opfuse run {escape(str(got.path))} --inputs inputs.npz`"
        )


@app.command()
def cancel(
    ctx: typer.Context, job: JobArg, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False
) -> None:
    """Cancel a job: a queued one at once, a running one at its next stage boundary."""
    opts = _options(ctx, api, key, json_out)
    with _client(opts) as client:
        found = client.cancel_job(job)
    if opts.json:
        _print_json(found)
    elif found.get("status") in TERMINAL_STATUSES:
        _console().print(f"job {escape(job)} is {escape(str(found.get('status')))}")
    else:
        _console().print(f"cancel requested; job {escape(job)} stops at its next stage boundary")


# -- local, no server ----------------------------------------------------------------------------


def _prepare_device(device: Device | None) -> None:
    """Refuse --device cuda without a GPU; on the CPU, turn on Triton's interpreter before triton loads."""
    if device is not Device.cpu:
        import torch

        if torch.cuda.is_available():
            return
        if device is Device.cuda:
            raise CLIError("--device cuda: torch sees no CUDA device on this machine; use --device cpu", 2)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _progress_bar(enabled: bool) -> tuple[Progress | None, Callable[[str, float], None] | None]:
    if not enabled:
        return None, None
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=_err_console(),
        transient=True,
    )
    task = bar.add_task("loading", total=1.0)

    def update(stage: str, progress: float) -> None:
        bar.update(task, description=stage, completed=progress)

    return bar, update


@app.command("compile")
def compile_command(
    ctx: typer.Context,
    model: Annotated[
        Path,
        typer.Argument(
            help="The ONNX file; external data files beside it (m.onnx.data) are read from its folder.",
            show_default=False,
        ),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Where to write the bundle (.zip).", show_default=False)
    ],
    shape: ShapeOpt = None,
    precision: Annotated[Precision, typer.Option(help="Compute precision.")] = Precision.fp32,
    device: Annotated[
        Device | None, typer.Option(help="cuda, or cpu (Triton interpreter) (default: cuda if present).")
    ] = None,
    disable: DisableOpt = None,
    rtol: Annotated[float | None, typer.Option(help="Verification rtol (default: per precision).")] = None,
    atol: Annotated[float | None, typer.Option(help="Verification atol (default: per precision).")] = None,
    html_out: Annotated[
        Path | None,
        typer.Option(
            "--html", help="Also save the report as one HTML page (works offline) here.", show_default=False
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Fuse a model on this machine, no server: compile, verify, save the bundle, print a summary."""
    opts = _options(ctx, None, None, json_out)
    shapes = parse_shapes(shape or [])
    _require_file(model, "model file")
    _prepare_device(device)
    import opfuse

    bar, progress = _progress_bar(not opts.json)
    try:
        if bar is not None:
            bar.start()
        cm = opfuse.compile(
            str(model),
            input_shapes=shapes,
            precision=precision.value,
            device=device.value if device else None,
            fusion_disable=disable or [],
            rtol=rtol,
            atol=atol,
            progress=progress,
        )
        cm.save(output)
    except (OpfuseError, OSError):
        raise  # the model's own fault or a file's: one line that says what to do (OpfuseGroup)
    except Exception as exc:  # never a traceback: one paragraph, and whose fault it is
        first = (str(exc).strip().splitlines() or [""])[0][:500]
        raise CLIError(
            f"internal error: compiling {model} hit a bug in opfuse ({type(exc).__name__}: {first}). "
            "The model may be fine: please report this with the model and the command line"
        ) from None
    finally:
        if bar is not None:
            bar.stop()
    if html_out is not None:
        from opfuse.views.html import render_html

        report_json = json.loads(json.dumps(cm.report, default=str))
        sources = {k.id: k.source for k in cm.plan.kernels.values()}
        _write_text(html_out, render_html(report_json, sources, title=model.name))
    if opts.json:
        _print_json(
            {"bundle": str(output), "report": cm.report} | ({"html": str(html_out)} if html_out else {})
        )
    else:
        console = _console()
        render.print_report(console, cm.report, full=False)
        console.print(
            f"saved {escape(str(output))}; run it with `opfuse run {escape(str(output))} --inputs inputs.npz`"
        )
        if html_out is not None:
            console.print(f"saved {escape(str(html_out))}; open it in a browser (it needs no network)")


def _load_inputs(path: Path) -> dict[str, Any]:
    import numpy as np

    _require_file(path, "inputs file")
    try:
        with np.load(path, allow_pickle=False) as data:
            if not hasattr(data, "files"):
                raise CLIError(
                    f"{path} holds one array; save the inputs with np.savez(path, name=array, ...)", 2
                )
            return {name: data[name] for name in data.files}
    except (ValueError, OSError) as exc:
        raise CLIError(f"cannot read {path} as an .npz of input arrays ({exc})", 2) from None


@app.command("run")
def run_command(
    ctx: typer.Context,
    bundle: Annotated[
        Path, typer.Argument(help="A bundle from `opfuse compile` or `opfuse download`.", show_default=False)
    ],
    inputs: Annotated[
        Path,
        typer.Option(
            "--inputs", "-i", help=".npz with one array per model input (np.savez).", show_default=False
        ),
    ],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Save the outputs to this .npz.")
    ] = None,
    device: Annotated[Device | None, typer.Option(help="cuda or cpu (default: the bundle's target).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run a bundle on inputs from an .npz; print the outputs' names and shapes, optionally save them."""
    import numpy as np

    import opfuse

    opts = _options(ctx, None, None, json_out)
    _require_file(bundle, "bundle")
    arrays = _load_inputs(inputs)
    _prepare_device(device)
    cm = opfuse.load(bundle, device=device.value if device else None)
    outputs = cm.run(arrays)  # inputs that do not fit raise ModelError, which says how
    outputs = {name: np.asarray(value) for name, value in outputs.items()}
    if output is not None:
        np.savez(output, **outputs)
    if opts.json:
        described: Mapping[str, Any] = {
            name: {"dtype": str(v.dtype), "shape": list(v.shape)} for name, v in outputs.items()
        }
        _print_json({"outputs": described, "saved_to": str(output) if output else None})
    else:
        console = _console()
        console.print(render.outputs_table(outputs))
        if output is not None:
            console.print(f"saved {escape(str(output))}")


# -- API keys (admin) -----------------------------------------------------------------------------

keys_app = typer.Typer(
    name="keys",
    help="List, make and revoke API keys (needs an admin key: its own tenant; a platform key: any tenant).",
    no_args_is_help=True,
)
app.add_typer(keys_app)

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
    opts = _options(ctx, api, key, json_out)
    with _client(opts) as client:
        found = client.list_keys(tenant=tenant)
    if opts.json:
        _print_json(found)
    else:
        _console().print(render.keys_table(found))


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
    opts = _options(ctx, api, key, json_out)
    expires_at = datetime.now(UTC) + _parse_duration(expires_in) if expires_in is not None else None
    with _client(opts) as client:
        made = client.create_key(scope=scope, tenant=tenant, expires_at=expires_at)
    if opts.json:
        _print_json(made)
        return
    typer.echo(made.get("key", ""))
    expiry = f", expires {render.escape(str(made.get('expires_at')))}" if made.get("expires_at") else ""
    _err_console().print(
        f"key {made.get('id')} ({escape(str(made.get('scope')))} of tenant {escape(str(made.get('tenant')))}"
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
    opts = _options(ctx, api, key, json_out)
    with _client(opts) as client:
        revoked = client.revoke_key(key_id)
    if opts.json:
        _print_json(revoked)
    else:
        _console().print(f"revoked key {revoked.get('id')} ({escape(str(revoked.get('prefix') or '-'))}…)")


@app.command()
def version(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """Print the opfuse version."""
    import opfuse

    if _options(ctx, None, None, json_out).json:
        _print_json({"version": opfuse.__version__})
    else:
        typer.echo(f"opfuse {opfuse.__version__}")


def main() -> None:
    """Console-script entry point (`opfuse`)."""
    app(prog_name="opfuse")


if __name__ == "__main__":
    main()
