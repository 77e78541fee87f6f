"""`opfuse serve`: the API server and one worker, each a child process, the worker talking to the
server over HTTP.

Shutdown order matters: on Ctrl-C / SIGTERM the worker stops first (it hands its running job back
to the queue through the API), then the server. Neither is imported here (client imports nothing
of ours: tests/unit/test_layering.py), so the SDK and the CLI never need fastapi or torch.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape

from client.config import ConfigError, opfuse_home, read_key_file, resolve_url

WORKER_STOP_GRACE_S = 15.0
WORKER_RESTART_MIN_S = 1.0
WORKER_RESTART_MAX_S = 30.0
WORKER_HEALTHY_S = 60.0  # a worker that ran this long restarts after the shortest backoff again


def _say(message: str) -> None:
    """One line on stderr, beside the server's and the worker's logs."""
    print(f"opfuse serve: {message}", file=sys.stderr, flush=True)


class EmbeddedWorker:
    """The local worker process: started once the API answers /readyz, started again (with backoff)
    whenever it dies, stopped before the API."""

    def __init__(self, home: Path, gpu: int | None) -> None:
        self.home = home
        self.gpu = gpu
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._stop_event = threading.Event()
        self.started_at = 0.0
        self.restarts = 0

    def start_when_ready(self, url: str, on_ready: Callable[[], None]) -> None:
        threading.Thread(
            target=self._start, args=(url, on_ready), name="embedded-worker", daemon=True
        ).start()

    def _start(self, url: str, on_ready: Callable[[], None]) -> None:
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and not self._stopped:
            try:
                if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        argv = [
            sys.executable,
            "-m",
            "workers.worker",
            "--api",
            url,
            "--key-file",
            str(self.home / "worker_key"),
        ]
        if self.gpu is not None:
            argv += ["--gpu", str(self.gpu)]
        if not self._launch(argv):
            return
        on_ready()
        self._supervise(argv)

    def _launch(self, argv: list[str]) -> bool:
        with self._lock:
            if self._stopped:
                return False
            # Its own session: a terminal's Ctrl-C reaches us first, and we stop it before the API.
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
            self.started_at = time.monotonic()
            return True

    def _supervise(self, argv: list[str]) -> None:
        """Start the worker again whenever it dies (killed, out of memory, a crash), after a backoff
        that doubles up to WORKER_RESTART_MAX_S (back to the start once one ran a while). Exit code
        2 (its key or configuration was refused) is not retried: it would fail the same way."""
        backoff = WORKER_RESTART_MIN_S
        while True:
            proc = self.proc
            assert proc is not None
            code = proc.wait()
            if self._stopped:
                return
            if code == 2:
                _say(
                    "the local worker exited with code 2 (its key or configuration was refused); not restarting it"
                )
                return
            if time.monotonic() - self.started_at > WORKER_HEALTHY_S:
                backoff = WORKER_RESTART_MIN_S
            self.restarts += 1
            _say(
                f"the local worker exited with code {code}; restarting it in {backoff:g} s "
                f"(restart {self.restarts})"
            )
            if self._stop_event.wait(backoff) or not self._launch(argv):
                return
            backoff = min(backoff * 2, WORKER_RESTART_MAX_S)

    def stop(self, grace_s: float = WORKER_STOP_GRACE_S) -> None:
        """SIGTERM the worker (it fails its running job as retryable), SIGKILL after `grace_s`."""
        with self._lock:
            self._stopped = True
            self._stop_event.set()
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# The packages `python -m service` imports: without them there is no server to start.
SERVICE_EXTRAS = ("fastapi", "uvicorn", "sqlalchemy", "alembic")
SERVER_START_TIMEOUT_S = 120.0


class EmbeddedServer:
    """The API server process (`python -m service serve`), in its own session: a terminal's Ctrl-C
    reaches this process only, which stops the worker before the server."""

    def __init__(self, home: Path, host: str | None, port: int | None) -> None:
        self.home = home
        env = {**os.environ, "OPFUSE_HOME": str(home)}
        if host is not None:
            env["OPFUSE_HOST"] = host
        if port is not None:
            env["OPFUSE_PORT"] = str(port)
        self._started_at = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_ready(self, stopping: threading.Event) -> str | None:
        """The server's URL once it answers /readyz; None if it exited (it said why on stderr) or
        we are stopping first."""
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline and not stopping.is_set() and self.proc.poll() is None:
            url = self._fresh_url()
            if url is not None:
                try:
                    if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
            stopping.wait(0.1)
        return None

    def _fresh_url(self) -> str | None:
        """server.json's URL once this server wrote it (not one a server before it left)."""
        try:
            if (self.home / "server.json").stat().st_mtime < self._started_at - 1.0:
                return None
        except OSError:
            return None
        return _read_server_url(self.home)

    def stop(self, grace_s: float = WORKER_STOP_GRACE_S) -> int:
        """SIGTERM the server (it finishes its requests), SIGKILL after `grace_s`; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def _missing_service_extra() -> str | None:
    """The first package the server needs that is not installed (found, not imported)."""
    return next((name for name in SERVICE_EXTRAS if importlib.util.find_spec(name) is None), None)


def serve_embedded(
    *,
    host: str | None,
    port: int | None,
    home: Path | None,
    with_worker: bool,
    gpu: int | None,
    json_out: bool = False,
) -> int:
    """Run the API (and a worker) until Ctrl-C / SIGTERM. Returns the exit code.

    Both are processes of their own (`python -m service serve`, `python -m workers.worker`): the
    CLI imports neither, so the SDK and the CLI need neither fastapi nor torch."""
    missing = _missing_service_extra()
    if missing is not None:
        print(
            f"opfuse: error: the server needs the service extras ({missing} is missing); "
            "install them with `pip install -e '.[service]'` (or `make venv`)",
            file=sys.stderr,
        )
        return 2
    state_dir = (home or opfuse_home()).expanduser().absolute()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # our /readyz polls are not news
    console = Console(stderr=True, highlight=False)
    stopping = threading.Event()
    previous = _on_stop_signals(stopping)
    server = EmbeddedServer(state_dir, host, port)
    worker = EmbeddedWorker(state_dir, gpu)
    try:
        url = server.wait_ready(stopping)
        if url is None:
            if stopping.is_set():
                return 0
            code = server.stop()
            if code == 0:
                print("opfuse: error: the server did not come up in time", file=sys.stderr)
            return code or 1

        def ready() -> None:
            if json_out:
                info = {"url": url, "home": str(state_dir), "api_key_file": str(state_dir / "api_key")}
                print(json.dumps(info), flush=True)
                return
            console.print(
                f"[bold green]opfuse is up[/] at {escape(url)}\n"
                f"  API key: {escape(str(state_dir / 'api_key'))} (the CLI reads it when run from this"
                f" directory, or with OPFUSE_HOME={escape(str(state_dir))})\n"
                "  next: [bold]opfuse submit model.onnx --shape x=1x3x224x224 --wait[/]\n"
                + ("" if with_worker else "  no local worker (--no-worker): start one with `opfuse worker`\n")
                + "  stop: Ctrl-C"
            )

        if with_worker:
            worker.start_when_ready(url, ready)
        else:
            ready()
        while not stopping.is_set() and server.proc.poll() is None:
            stopping.wait(0.5)
    finally:
        # The worker first: it hands its running job back to the queue through the API.
        worker.stop()
        code = server.stop()
        _restore_signals(previous)
    return 0 if stopping.is_set() else code


def _on_stop_signals(stopping: threading.Event) -> dict[int, Any]:
    """SIGINT and SIGTERM set `stopping` (main thread only); the handlers they replace."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):

        def handler(signum: int, frame: FrameType | None) -> None:
            stopping.set()

        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _read_server_url(home: Path) -> str | None:
    try:
        info = json.loads((home / "server.json").read_text())
    except (OSError, ValueError):
        return None
    url = info.get("url") if isinstance(info, dict) else None
    return url.rstrip("/") if isinstance(url, str) and url else None


def run_worker_process(
    api: str | None, key: str | None, key_file: Path | None, options: dict[str, Any], *, once: bool
) -> int:
    """`opfuse worker`: becomes the worker program (`python -m workers.worker`, by exec); returns
    only if that fails.

    The server's URL and the worker key are found here first, so what is missing is one line
    (ConfigError); the key reaches the worker in its environment, never on its command line.
    `options`: the worker's own flags (None: its default). The process is replaced, not forked:
    a signal sent to `opfuse worker` (SIGTERM, Ctrl-C, SIGKILL) reaches the worker itself, and no
    worker outlives the process its supervisor knows."""
    url, _ = resolve_url(api)
    worker_key = key or (read_key_file(key_file) if key_file else None) or os.environ.get("OPFUSE_WORKER_KEY")
    if not worker_key:
        default = opfuse_home() / "worker_key"
        if not default.is_file():
            raise ConfigError(
                "no worker key: pass --key or --key-file, set OPFUSE_WORKER_KEY, or run where "
                f"{opfuse_home()}/worker_key exists (`opfuse serve` writes it)"
            )
        worker_key = read_key_file(default)
    argv = [sys.executable, "-m", "workers.worker", "--api", url]
    for flag, value in options.items():
        if value is not None:
            argv += [flag, str(value)]
    if once:
        argv.append("--once")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, {**os.environ, "OPFUSE_WORKER_KEY": worker_key})
