"""`opfuse serve`: the API server in this process plus one worker child talking to it over HTTP.

Shutdown order matters: on Ctrl-C / SIGTERM the worker stops first (it hands its running job back
to the queue through the API), then the server. The service is imported only here, so the SDK and
the worker never need fastapi or sqlalchemy.
"""

from __future__ import annotations

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

WORKER_STOP_GRACE_S = 15.0


class EmbeddedWorker:
    """The local worker process: started once the API answers /readyz, stopped before the API."""

    def __init__(self, home: Path, gpu: int | None) -> None:
        self.home = home
        self.gpu = gpu
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopped = False

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
        with self._lock:
            if self._stopped:
                return
            # Its own session: a terminal's Ctrl-C reaches us first, and we stop it before the API.
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        on_ready()

    def stop(self, grace_s: float = WORKER_STOP_GRACE_S) -> None:
        """SIGTERM the worker (it fails its running job as retryable), SIGKILL after `grace_s`."""
        with self._lock:
            self._stopped = True
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _chain_stop_signals(worker: EmbeddedWorker) -> None:
    """Put the worker's stop in front of the server's own signal handlers (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        server_handler = signal.getsignal(sig)
        if not callable(server_handler):
            continue

        def handler(
            signum: int,
            frame: FrameType | None,
            _server: Callable[[int, FrameType | None], Any] = server_handler,
        ) -> None:
            # Stopping the worker needs the API alive, so it runs on a thread while the server
            # keeps serving; the server's handler runs after the worker is gone.
            def stop_then_forward() -> None:
                worker.stop()
                _server(signum, frame)

            threading.Thread(target=stop_then_forward, name="stop-worker", daemon=True).start()

        signal.signal(sig, handler)


def serve_embedded(
    *,
    host: str | None,
    port: int | None,
    home: Path | None,
    with_worker: bool,
    gpu: int | None,
    json_out: bool = False,
) -> int:
    """Run the API (and a worker) until Ctrl-C / SIGTERM. Returns the exit code."""
    try:
        from service.server import ServerStartError, run_server
        from service.settings import Settings
    except ImportError as exc:
        print(
            f"opfuse: error: the server needs the service extras ({exc.name} is missing); "
            "install them with `pip install -e '.[service]'` (or `make venv`)",
            file=sys.stderr,
        )
        return 2
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if home is not None:
        overrides["home"] = home
    settings = Settings(**overrides)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # our /readyz polls are not news
    console = Console(stderr=True, highlight=False)
    worker = EmbeddedWorker(settings.home, gpu)

    def on_started() -> None:
        # server.json holds the real port (OPFUSE_PORT=0 binds a free one).
        url = _read_server_url(settings.home) or f"http://127.0.0.1:{settings.port}"

        def ready() -> None:
            if json_out:
                info = {
                    "url": url,
                    "home": str(settings.home),
                    "api_key_file": str(settings.home / "api_key"),
                }
                print(json.dumps(info), flush=True)
                return
            console.print(
                f"[bold green]opfuse is up[/] at {escape(url)}\n"
                f"  API key: {escape(str(settings.home / 'api_key'))} (the CLI reads it when run from this"
                f" directory, or with OPFUSE_HOME={escape(str(settings.home))})\n"
                "  next: [bold]opfuse submit model.onnx --shape x=1x3x224x224 --wait[/]\n"
                + ("" if with_worker else "  no local worker (--no-worker): start one with `opfuse worker`\n")
                + "  stop: Ctrl-C"
            )

        if with_worker:
            _chain_stop_signals(worker)
            worker.start_when_ready(url, ready)
        else:
            ready()

    try:
        run_server(settings, on_started=on_started)
    except ServerStartError as exc:
        print(f"opfuse: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        worker.stop()
    return 0


def _read_server_url(home: Path) -> str | None:
    try:
        info = json.loads((home / "server.json").read_text())
    except (OSError, ValueError):
        return None
    url = info.get("url") if isinstance(info, dict) else None
    return url.rstrip("/") if isinstance(url, str) and url else None
