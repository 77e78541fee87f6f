"""`opfuse serve` (the API server and a local worker, here) and `opfuse worker` (a worker for any API).

Both start programs as processes (client.embedded); the CLI imports neither the service nor the worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from client.commands.common import ApiOpt, JsonOpt, options


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command("worker")(worker_command)


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

    json_mode = options(ctx, None, None, json_out).json
    code = serve_embedded(host=host, port=port, home=home, with_worker=worker, gpu=gpu, json_out=json_mode)
    raise typer.Exit(code)


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

    opts = options(ctx, api, None, False)
    flags = {
        "--worker-id": worker_id,
        "--gpu": gpu,
        "--job-timeout": job_timeout,
        "--job-memory-gb": job_memory_gb,
        "--max-nodes": max_nodes,
        "--max-depth": max_depth,
        "--api-retry": api_retry,
    }
    raise typer.Exit(run_worker_process(opts.api, key, key_file, flags, once=once))
