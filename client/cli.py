"""The `opfuse` command line: run a local server, submit models, follow jobs, fetch reports and
bundles, and compile, run or time bundles locally. `--json` on any command prints JSON only to stdout.

The commands that talk to a server live in client.commands (one module per group); this module
assembles the app and keeps the commands that run the library here (`compile`, `run`, `bench`, and
`report`, whose --trace renders with opfuse.views): the layering contract lets only client.cli
import opfuse.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from typer.core import TyperGroup

from client import render
from client.commands import jobs, keys, models, results, server
from client.commands.common import (
    ApiOpt,
    CLIError,
    Device,
    DisableOpt,
    JobArg,
    JsonOpt,
    KeyOpt,
    Options,
    Precision,
    ShapeOpt,
    connect_from_discovery,
    console,
    err_console,
    options,
    print_json,
    require_file,
    write_text,
)
from client.config import ConfigError
from client.inputs import bind_inputs, read_inputs
from client.records import Report
from client.render import escape, strip_controls
from client.render_profile import INTERPRETER_NOTE, bench_table
from client.sdk import OpfuseAPIError, OpfuseClient, OpfuseClientError
from client.shapes import ShapeSpecError, parse_shapes
from opfuse.errors import OpfuseError

__all__ = ["CLIError", "Options", "app", "main"]


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


def _client(opts: Options) -> OpfuseClient:
    """How the commands reach the API (tests replace it to point at their own server)."""
    return connect_from_discovery(opts)


@app.callback()
def _root(ctx: typer.Context, api: ApiOpt = None, key: KeyOpt = None, json_out: JsonOpt = False) -> None:
    # `_client` is looked up at each call, so a replaced one is the one every command uses.
    ctx.obj = Options(api=api, key=key, json=json_out, connect=lambda opts: _client(opts))


for _module in (server, jobs, models, results, keys):
    _module.register(app)


def _trace_text(found: Report) -> str:
    from opfuse.views.trace import render_trace

    return json.dumps(render_trace(found.raw), default=str)


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
    opts = options(ctx, api, key, json_out)
    if output is not None and not html:
        raise CLIError("-o/--output names the file of --html; add --html (or use --trace FILE)", 2)
    html_path = (output or Path(f"{job}.report.html")) if html else None
    with opts.client() as client:
        found = client.get_report(job)
        page = client.get_report_html(job) if html_path else None
    saved: dict[str, str] = {}
    if html_path is not None and page is not None:
        write_text(html_path, page)
        saved["html"] = str(html_path)
    if trace is not None:
        write_text(trace, _trace_text(found))
        saved["trace"] = str(trace)
    if opts.json:
        print_json(saved if saved else found)
    elif saved:
        out = console()
        if "html" in saved:
            out.print(f"saved {escape(saved['html'])}; open it in a browser (it needs no network)")
        if "trace" in saved:
            out.print(f"saved {escape(saved['trace'])}; open it in chrome://tracing or ui.perfetto.dev")
    else:
        render.print_report(console(), found)


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
        console=err_console(),
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
    opts = options(ctx, None, None, json_out)
    shapes = parse_shapes(shape or [])
    require_file(model, "model file")
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
        write_text(html_out, render_html(report_json, sources, title=model.name))
    if opts.json:
        print_json(
            {"bundle": str(output), "report": cm.report} | ({"html": str(html_out)} if html_out else {})
        )
    else:
        out = console()
        render.print_report(out, cm.report, full=False)
        out.print(
            f"saved {escape(str(output))}; run it with `opfuse run {escape(str(output))} --inputs inputs.npz`"
        )
        if html_out is not None:
            out.print(f"saved {escape(str(html_out))}; open it in a browser (it needs no network)")


_INPUTS_HELP = ".npz with one array per model input (np.savez), or an .npy for a model with one input."


@app.command("run")
def run_command(
    ctx: typer.Context,
    bundle: Annotated[
        Path, typer.Argument(help="A bundle from `opfuse compile` or `opfuse download`.", show_default=False)
    ],
    inputs: Annotated[Path, typer.Option("--inputs", "-i", help=_INPUTS_HELP, show_default=False)],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Save the outputs to this .npz.")
    ] = None,
    device: Annotated[Device | None, typer.Option(help="cuda or cpu (default: the bundle's target).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run a bundle on inputs from an .npz (or an .npy for a one-input model); print the outputs'
    names and shapes, optionally save them."""
    import numpy as np

    import opfuse

    opts = options(ctx, None, None, json_out)
    require_file(bundle, "bundle")
    loaded = read_inputs(inputs)
    _prepare_device(device)
    cm = opfuse.load(bundle, device=device.value if device else None)
    arrays = bind_inputs(loaded, cm.inputs, inputs)
    outputs = cm.run(arrays)  # inputs that do not fit raise ModelError, which says how
    outputs = {name: np.asarray(value) for name, value in outputs.items()}
    if output is not None:
        np.savez(output, **outputs)
    if opts.json:
        described: Mapping[str, Any] = {
            name: {"dtype": str(v.dtype), "shape": list(v.shape)} for name, v in outputs.items()
        }
        print_json({"outputs": described, "saved_to": str(output) if output else None})
    else:
        out = console()
        out.print(render.outputs_table(outputs))
        if output is not None:
            out.print(f"saved {escape(str(output))}")


def _time_runs(cm: Any, arrays: dict[str, Any], warmup: int, iterations: int) -> dict[str, Any]:
    """Wall time of `cm.run` per iteration; on the GPU the inputs sit on the device first and each
    run is synchronized, so the time is the model's, not the copies'."""
    import time

    import numpy as np
    import torch

    on_cuda = str(cm.device).startswith("cuda")
    feeds: dict[str, Any] = arrays
    if on_cuda:
        feeds = {k: torch.from_numpy(np.ascontiguousarray(v)).to(cm.device) for k, v in arrays.items()}
    for _ in range(warmup):
        cm.run(feeds)
    times = []
    for _ in range(iterations):
        if on_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        cm.run(feeds)
        if on_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000.0)
    p50, p90, p99 = (float(np.percentile(times, q)) for q in (50, 90, 99))
    return {"latency_ms": {"p50": p50, "p90": p90, "p99": p99, "mean": float(np.mean(times))}}


@app.command("bench")
def bench_command(
    ctx: typer.Context,
    bundle: Annotated[
        Path, typer.Argument(help="A bundle from `opfuse compile` or `opfuse download`.", show_default=False)
    ],
    inputs: Annotated[
        Path | None,
        typer.Option("--inputs", "-i", help=_INPUTS_HELP + " Default: random inputs of the bundle's shapes."),
    ] = None,
    warmup: Annotated[int, typer.Option(help="Untimed runs first.", min=0)] = 10,
    iterations: Annotated[int, typer.Option("--iterations", "-n", help="Timed runs.", min=1)] = 100,
    device: Annotated[Device | None, typer.Option(help="cuda or cpu (default: the bundle's target).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Time a bundle on this machine: warm-up runs, then p50/p90/p99 latency over the iterations.

    Random inputs are timed with opfuse's protocol (CUDA events, the CUDA graph where it
    captures); given inputs by synchronized wall time per run. On the CPU the kernels run in
    Triton's interpreter: the times say nothing about speed there.
    """
    import opfuse

    opts = options(ctx, None, None, json_out)
    require_file(bundle, "bundle")
    loaded = read_inputs(inputs) if inputs is not None else None
    _prepare_device(device)
    cm = opfuse.load(bundle, device=device.value if device else None)
    on_cuda = str(cm.device).startswith("cuda")
    if loaded is None:
        measured = dict(cm.benchmark(iters=iterations, warmup=warmup)["after"])
        method = (
            "CUDA events" + (", CUDA graph" if measured.get("cuda_graph") else "") if on_cuda else "wall time"
        )
    else:
        measured = _time_runs(cm, bind_inputs(loaded, cm.inputs, inputs or bundle), warmup, iterations)
        method = "synchronized wall time per run" if on_cuda else "wall time per run"
    result = {
        "bundle": str(bundle),
        "device": str(cm.device),
        "inputs": str(inputs) if inputs is not None else "random",
        "warmup": warmup,
        "iterations": iterations,
        "method": method,
        "latency_ms": measured.get("latency_ms"),
        "peak_memory_bytes": measured.get("peak_memory_bytes"),
        "note": None if on_cuda else INTERPRETER_NOTE,
    }
    if opts.json:
        print_json(result)
    else:
        console().print(bench_table(f"bench {escape(bundle.name)}", result))


@app.command()
def version(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """Print the opfuse version."""
    import opfuse

    if options(ctx, None, None, json_out).json:
        print_json({"version": opfuse.__version__})
    else:
        typer.echo(f"opfuse {opfuse.__version__}")


def main() -> None:
    """Console-script entry point (`opfuse`)."""
    app(prog_name="opfuse")


if __name__ == "__main__":
    main()
