"""Every command and code snippet in README.md and docs/ is checked, so the docs cannot drift from
the code: each `opfuse ...` line of a ```console or ```sh block is parsed by the real CLI (an
unknown command or flag, a missing argument or a value of the wrong type fails), each `curl` line
names a route the API serves with that method (its OpenAPI schema), and each ```python
block runs against a real `opfuse serve` (API and worker processes, a temp OPFUSE_HOME) in a folder
holding the files the snippets name.

Every `opfuse` line also runs (but `serve` and `worker`, which run until stopped: PARSE_ONLY),
in-process against that server, each in a folder of its own holding what the docs' commands name:
tiny stand-ins under the docs' model names (mlp.onnx, resnet.onnx, bert.onnx), what the docs'
`python -c` lines make (lin.onnx with its .data by torch.onnx.export, in.npz, x.npy), bundles.
The placeholder ids (`9a0e...`, `4f1c...`, `<job-id>`) stand for a job the worker finished and
its model; a command that deletes, cancels or revokes gets an object made for it (a model, a job
no worker here takes, a key) and its effect is checked.
Every run must exit 0 without a traceback and write the files it names (`-o`, `--html`, `--trace`).

A ```python block whose first line is a comment naming a file of the repository (`# opfuse/x.py`)
is an excerpt of that file: its lines must be in the file, in order (a `...` line skips ahead).

A block that cannot run here says so on the line before its fence, with a reason:
`<!-- snippet: skip: REASON -->` (never run), or `<!-- snippet: needs cuda: REASON -->` (run
only where torch sees a GPU). Their number is capped: a new one needs a reason good enough to
raise the cap.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer

import client.cli as cli
from client.sdk import OpfuseAPIError
from client.webhooks import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, signature
from tests.serving import opfuse_serve
from tests.unit.test_cli import small_mlp

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_MARKED = 5

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"<!--\s*snippet:\s*(skip|needs cuda)\s*:\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    lang: str
    code: str
    marker: str | None
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _snippets() -> list[Snippet]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = _MARKER.search(before)
            found.append(
                Snippet(
                    path,
                    text.count("\n", 0, m.start()) + 1,
                    m.group(1),
                    m.group(2),
                    marker.group(1) if marker else None,
                    marker.group(2) if marker else "",
                )
            )
    return found


SNIPPETS = _snippets()


def test_marked_blocks_say_why_and_stay_few() -> None:
    marked = [s for s in SNIPPETS if s.marker]
    assert all(s.reason for s in marked), [s.where for s in marked if not s.reason]
    assert len(marked) <= MAX_MARKED, [f"{s.where}: {s.reason}" for s in marked]
    # A marker that does not sit right above a fence is a typo that would hide nothing.
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("<!--") and "snippet:" in line:
                assert _MARKER.search(line), f"{path.name}:{i + 1}: malformed marker {line!r}"
                assert i + 1 < len(lines) and lines[i + 1].startswith("```"), f"{path.name}:{i + 1}"


# -- console and sh blocks: every opfuse command line parses ---------------------------------------


def _shell_lines(snippet: Snippet) -> list[str]:
    """The command lines of a block: continuations joined; in a console block, the `$ ` lines and
    the indented lines of a loop they start (the rest is output)."""
    joined: list[str] = []
    for raw in snippet.code.replace("\\\n", " ").splitlines():
        line = raw.rstrip()
        if snippet.lang == "console":
            if line.startswith("$ "):
                joined.append(line[2:])
            elif line.startswith("  ") and line.strip().startswith("opfuse "):
                joined.append(line.strip())
        else:
            joined.append(line)
    return joined


def _opfuse_argv(line: str) -> list[str] | None:
    """The arguments of an `opfuse` command on this shell line (None when it runs something else).
    Shell variables stand for a number (loop counters) or a word; `<job-id>` for a word; the line
    ends at a pipe, redirection, `&`, `;` or comment."""
    if not re.match(r"\s*(\w+=\S*\s+)*opfuse(\s|$)", line):
        return None
    line = re.sub(r"\$\(([^)]*)\)", "host", line)
    line = re.sub(r"\$\{?(i|gpu)\}?\b", "0", line)
    line = re.sub(r"\$\{?\w+\}?", "value", line)
    line = re.sub(r"<([\w-]+)>", r"\1", line)
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    tokens = list(lex)
    while tokens and re.fullmatch(r"\w+=\S*", tokens[0]):
        tokens.pop(0)  # VAR=value before the command
    if not tokens or tokens[0] != "opfuse":
        return None
    argv = []
    for token in tokens[1:]:
        if token and all(c in "|&;<>()" for c in token):
            break
        argv.append(token)
    return argv


def _parse(argv: list[str]) -> None:
    """Parse `opfuse ARGV` down to its last subcommand, as the CLI would, without running it."""
    # typer carries its own copy of click: a group is what resolves subcommands.
    command: Any = typer.main.get_command(cli.app)
    ctx = command.make_context("opfuse", list(argv))
    while hasattr(command, "resolve_command"):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            return
        name, sub, args = command.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        ctx = sub.make_context(name, args, parent=ctx)
        command = sub


COMMANDS = [
    pytest.param(argv, id=f"{s.where}: opfuse {' '.join(argv)}"[:120])
    for s in SNIPPETS
    if s.lang in ("console", "sh", "")
    for line in _shell_lines(s)
    if (argv := _opfuse_argv(line)) is not None
]


def test_the_docs_show_commands() -> None:
    assert len(COMMANDS) > 40  # the extraction itself works: the docs show this many


@pytest.mark.parametrize("argv", COMMANDS)
def test_opfuse_command_line_parses(argv: list[str]) -> None:
    try:
        _parse(argv)
    except Exception as exc:  # typer's UsageError, BadParameter, NoSuchOption, ...
        message = exc.format_message() if hasattr(exc, "format_message") else repr(exc)
        pytest.fail(f"opfuse {' '.join(argv)}: {message}")


# -- curl lines: the route and method exist ---------------------------------------------------------


def _curl_request(line: str) -> tuple[str, str] | None:
    """(method, path) of a `curl` command line; None when the line runs something else."""
    if not re.match(r"\s*(\w+=\S*\s+)*curl\s", line):
        return None
    tokens = shlex.split(line, comments=True)
    method, url = "", ""
    for i, token in enumerate(tokens):
        if token in ("-X", "--request"):
            method = tokens[i + 1]
        elif token in ("-d", "--data", "--data-binary") and not method:
            method = "POST"
        elif re.search(r"/(v1/|healthz|readyz|metrics)", token):
            url = token
    path = re.sub(r"^(\$\w+|\w+://[^/]+)", "", url).split("?")[0]
    return (method or "GET").lower(), path


CURLS = [
    pytest.param(request, id=f"{s.where}: {request[0].upper()} {request[1]}")
    for s in SNIPPETS
    if s.lang in ("console", "sh", "")
    for line in _shell_lines(s)
    if (request := _curl_request(line)) is not None
]


@pytest.fixture(scope="module")
def api_routes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """The API's routes (OpenAPI paths) and their methods."""
    from service.app import create_app
    from service.settings import Settings

    home = tmp_path_factory.mktemp("routes")
    settings = Settings(_env_file=None, home=home, database_url=f"sqlite:///{home / 'x.db'}")  # type: ignore[call-arg]
    schema = create_app(settings, run_migrations=False).openapi()
    return {path: set(ops) for path, ops in schema["paths"].items()}


def test_the_docs_show_curl_lines() -> None:
    assert len(CURLS) > 15


@pytest.mark.parametrize("request_line", CURLS)
def test_curl_line_names_a_route(request_line: tuple[str, str], api_routes: dict[str, set[str]]) -> None:
    method, path = request_line
    concrete = re.sub(r"\$\{?\w+\}?", "X", path)
    for route, methods in api_routes.items():
        if re.fullmatch(
            re.sub(r"\{\w+\}", "[^/]+", re.escape(route).replace(r"\{", "{").replace(r"\}", "}")), concrete
        ):
            assert method in methods, f"{method.upper()} {path}: {route} takes {sorted(methods)}"
            return
    pytest.fail(f"{method.upper()} {path}: the API has no such route")


# -- python blocks: run against a real server --------------------------------------------------------


@dataclass
class Served:
    url: str
    home: Path
    workdir: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`opfuse serve` (the API and one worker) on a free port, the way the docs start it."""
    workdir = tmp_path_factory.mktemp("docs")
    home = workdir / ".opfuse"
    with opfuse_serve(workdir, home) as (_, url, _log):
        for name in ("model.onnx", "mlp.onnx"):  # what the snippets upload: x[batch, 512] → y
            small_mlp(workdir / name, 512)
        yield Served(url, home, workdir)


def _namespace(served: Served) -> dict[str, Any]:
    """The names the snippets take as given: the user's key, an input array, a webhook delivery."""
    secret = "whsec-docs"
    raw_body = b'{"job_id": "j1", "status": "succeeded", "summary": null, "error": null}'
    now = str(int(time.time()))
    return {
        "__name__": "__snippet__",
        "api_key": (served.home / "api_key").read_text().strip(),
        "array": np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32),
        "secret": secret,
        "raw_body": raw_body,
        "request_headers": {
            TIMESTAMP_HEADER: now,
            DELIVERY_HEADER: "delivery-1",
            SIGNATURE_HEADER: signature(secret, raw_body, now, "delivery-1"),
        },
    }


def _excerpt_of(snippet: Snippet) -> Path | None:
    first = snippet.code.split("\n", 1)[0].strip()
    m = re.fullmatch(r"#\s*([\w./-]+\.py)", first)
    return ROOT / m.group(1) if m and (ROOT / m.group(1)).is_file() else None


EXCERPTS = [pytest.param(s, id=s.where) for s in SNIPPETS if s.lang == "python" and _excerpt_of(s)]
PYTHON = [pytest.param(s, id=s.where) for s in SNIPPETS if s.lang == "python" and not _excerpt_of(s)]

# Doc commands that are parsed but not run, and why: every other command the docs show runs below.
# A new entry needs a reason as good as these.
PARSE_ONLY = {
    "serve": "runs the API and a worker until stopped: the `served` fixture starts `opfuse serve` itself",
    "worker": "polls an API until stopped (the docs' hosts are not this one): `opfuse serve` runs the fixture's",
}
RUNS = [p for p in COMMANDS if p.values[0] and p.values[0][0] not in PARSE_ONLY]  # type: ignore[index]


def test_only_long_running_commands_only_parse() -> None:
    shown = {p.values[0][0] for p in COMMANDS if p.values[0]}  # type: ignore[index]
    assert shown - {p.values[0][0] for p in RUNS} == set(PARSE_ONLY)  # type: ignore[index]
    assert len(PARSE_ONLY) <= 2, PARSE_ONLY


def _save(
    path: Path, nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any], **kw: Any
) -> None:
    import onnx
    from onnx import helper

    model = helper.make_model(
        helper.make_graph(nodes, path.stem, inputs, outputs, inits),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 9
    onnx.save(model, path, **kw)


def _stand_ins(folder: Path) -> None:
    """Tiny models under the names the docs' commands use, with the inputs those commands shape:
    mlp.onnx and model.onnx x[batch, 512]; resnet.onnx input[batch, 3, 224, 224] (one strided
    conv); bert.onnx input_ids and attention_mask [batch, 128] (int64); the README's inputs.npz.
    (lin.onnx, in.npz and x.npy are made by the docs' own `python -c` lines.)"""
    from onnx import TensorProto, numpy_helper
    from onnx.helper import make_node, make_tensor_value_info

    rng = np.random.default_rng(7)
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    for name in ("mlp.onnx", "model.onnx"):
        small_mlp(folder / name, 512)
    kernel = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3, "k")
    half = numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half")
    _save(
        folder / "resnet.onnx",
        [
            make_node("Conv", ["input", "k"], ["c"], strides=[8, 8], kernel_shape=[3, 3]),
            make_node("Relu", ["c"], ["r"]),
            make_node("Mul", ["r", "half"], ["output"]),
        ],
        [make_tensor_value_info("input", f32, ["batch", 3, 224, 224])],
        [make_tensor_value_info("output", f32, ["batch", 4, 28, 28])],
        [kernel, half],
    )
    _save(
        folder / "bert.onnx",
        [
            make_node("Cast", ["input_ids"], ["ids"], to=f32),
            make_node("Cast", ["attention_mask"], ["mask"], to=f32),
            make_node("Mul", ["ids", "mask"], ["masked"]),
            make_node("Mul", ["masked", "half"], ["hidden"]),
        ],
        [make_tensor_value_info(n, i64, ["batch", 128]) for n in ("input_ids", "attention_mask")],
        [make_tensor_value_info("hidden", f32, ["batch", 128])],
        [half],
    )
    np.savez(folder / "inputs.npz", x=rng.standard_normal((8, 512)).astype(np.float32))


def _sdk(served: Served, key: str | None = None) -> Any:
    from client.sdk import OpfuseClient

    return OpfuseClient(served.url, key or (served.home / "api_key").read_text().strip())


@pytest.fixture(scope="module")
def finished(served: Served) -> dict[str, str]:
    """A job that succeeded on the served worker, and its model: the ids the docs' placeholders
    stand for."""
    with _sdk(served) as sdk:
        model = sdk.upload_model(served.workdir / "mlp.onnx")
        job = sdk.create_job(str(model.id), input_shapes={"x": [8, 512]})
        job = sdk.wait_job(str(job.id), poll_s=0.5, timeout_s=600)
    assert job.status == "succeeded", job.error
    return {"9a0e...": str(job.id), "7c41...": str(job.id), "job-id": str(job.id), "4f1c...": str(model.id)}


# The docs' `python -c` lines that make the files their next commands use (console blocks).
PYTHON_LINES = [
    line for s in SNIPPETS if s.lang == "console" for line in _shell_lines(s) if line.startswith("python -c ")
]


@pytest.fixture(scope="module")
def files(served: Served, finished: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the commands name: the stand-in models, what the docs' `python -c` lines make, and
    the bundles the commands run (mlp.opfuse.zip compiled here for x[2, 512] like docs/cli.md;
    model.opfuse.zip the finished job's, downloaded like the README)."""
    import opfuse

    folder = tmp_path_factory.mktemp("files")
    _stand_ins(folder)
    assert len(PYTHON_LINES) >= 3, PYTHON_LINES
    for line in PYTHON_LINES:  # torch.onnx.export's lin.onnx + lin.onnx.data, in.npz, x.npy
        done = subprocess.run(
            [sys.executable, *shlex.split(line)[1:]], cwd=folder, capture_output=True, text=True
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, f"{line}\n{done.stderr[-3000:]}"
    assert {"lin.onnx", "lin.onnx.data", "in.npz", "x.npy"} <= {p.name for p in folder.iterdir()}
    opfuse.compile(str(folder / "mlp.onnx"), input_shapes={"x": [2, 512]}, device="cpu").save(
        folder / "mlp.opfuse.zip"
    )
    with _sdk(served) as sdk:
        sdk.download_artifact(finished["job-id"], folder / "model.opfuse.zip")
    return folder


def _fresh(argv: list[str], finished: dict[str, str], served: Served, workdir: Path) -> tuple[list[str], Any]:
    """The command with the docs' placeholders bound, and a check of its effect (given its stdout).
    Commands that delete, cancel or revoke get an object of their own, so no order matters."""
    sdk = _sdk(served)
    words = [a for a in argv if not a.startswith("-")]
    ids = dict(finished)
    check: Any = lambda output: None  # noqa: E731
    if words[:2] == ["models", "delete"]:
        model = small_mlp(workdir / "doomed.onnx", 512)
        model.doc_string = workdir.name  # other bytes: a model of its own
        (workdir / "doomed.onnx").write_bytes(model.SerializeToString())
        doomed = str(sdk.upload_model(workdir / "doomed.onnx").id)
        assert doomed != finished["4f1c..."]
        ids["4f1c..."] = doomed

        def check(output: str) -> None:
            with pytest.raises(OpfuseAPIError) as gone:
                sdk.get_model(doomed)
            assert gone.value.status == 404

    elif words[:1] == ["cancel"]:
        # No worker here serves an H200: the job stays queued until canceled.
        queued = str(sdk.create_job(finished["4f1c..."], {"x": [8, 512]}, target="h200").id)
        ids["9a0e..."] = queued

        def check(output: str) -> None:
            assert sdk.get_job(queued).status == "canceled"

    elif words[:2] == ["keys", "revoke"]:
        key = sdk.create_key()
        ids[words[2]] = str(key.id)

        def check(output: str) -> None:
            with _sdk(served, key.key) as revoked, pytest.raises(OpfuseAPIError) as refused:
                revoked.list_models()
            assert refused.value.status == 401

    elif words[:2] == ["keys", "create"]:

        def check(output: str) -> None:
            made = output.strip().splitlines()[0]  # stdout: the key alone
            assert made.startswith("opf_"), output
            if "worker" not in argv:  # a user or admin key reads its tenant's models
                with _sdk(served, made) as fresh:
                    fresh.list_models()

    elif words[:1] == ["submit"] and "--wait" not in argv:

        def check(output: str) -> None:
            queued = re.search(r"job (\S+) queued", output)
            assert queued, output
            try:  # free the one worker for the jobs that wait
                sdk.cancel_job(queued.group(1))
            except OpfuseAPIError:
                pass  # it finished first

    def checked(output: str) -> None:
        try:
            check(output)
        finally:
            sdk.close()

    return [ids.get(a, a) for a in argv], checked


def _written(args: list[str]) -> list[str]:
    """The files the command says it writes (-o, --html FILE, --trace FILE)."""
    flags = ("-o", "--output", "--html", "--trace")  # `report --html` alone is a flag
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a in flags and not args[i + 1].startswith("-")]


@pytest.mark.e2e
@pytest.mark.parametrize("argv", RUNS)
def test_opfuse_command_line_runs(
    argv: list[str],
    served: Served,
    finished: dict[str, str],
    files: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each command runs in a folder of its own holding the files the docs name, against the
    served API (its key and URL from $OPFUSE_HOME, as a user's local server)."""
    import shutil

    from typer.testing import CliRunner

    for var in ("OPFUSE_API_URL", "OPFUSE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPFUSE_HOME", str(served.home))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what the CLI sets itself on a machine without a GPU
    shutil.copytree(files, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    args, check = _fresh(list(argv), finished, served, tmp_path)
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, f"opfuse {' '.join(args)}: {result.output}"
    assert "Traceback" not in result.output
    for name in _written(args):
        assert (tmp_path / name).is_file(), f"opfuse {' '.join(args)} wrote no {name}"
    if args[:1] == ["run"] and "-o" in args:
        _outputs_match_onnxruntime(tmp_path, args)
    check(result.stdout)


def _outputs_match_onnxruntime(folder: Path, args: list[str]) -> None:
    import onnxruntime as ort

    inputs = dict(np.load(folder / args[args.index("--inputs" if "--inputs" in args else "-i") + 1]))
    want = ort.InferenceSession(str(folder / "mlp.onnx")).run(None, inputs)[0]
    got = np.load(folder / args[args.index("-o") + 1])["y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("snippet", EXCERPTS)
def test_python_excerpt_matches_its_file(snippet: Snippet) -> None:
    path = _excerpt_of(snippet)
    assert path is not None
    source = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    at = 0
    for line in snippet.code.splitlines()[1:]:
        wanted = line.strip()
        if not wanted or wanted in ("...", "# ..."):
            continue
        try:
            at = source.index(wanted, at) + 1
        except ValueError:
            pytest.fail(f"{snippet.where}: {path.relative_to(ROOT)} has no line {wanted!r} (after line {at})")


@pytest.mark.e2e
@pytest.mark.parametrize("snippet", PYTHON)
def test_python_snippet_runs(snippet: Snippet, served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    if snippet.marker == "skip":
        pytest.skip(snippet.reason)
    if snippet.marker == "needs cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip(snippet.reason)
    for var in ("OPFUSE_API_URL", "OPFUSE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPFUSE_HOME", str(served.home))
    monkeypatch.chdir(served.workdir)
    # The one rewrite: the snippets' local server is the test's (its port is a free one).
    code = snippet.code.replace("http://127.0.0.1:8000", served.url)
    exec(compile(code, snippet.where, "exec"), _namespace(served))  # our own docs
