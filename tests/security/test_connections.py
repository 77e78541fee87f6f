"""Connections and bodies, against the real server (`python -m service serve` in a subprocess, raw
sockets on loopback): a body is never read before its request is authenticated, JSON bodies are
small, a stalled body or slow headers are cut, and one address holds a bounded number of
connections. The server's memory is read from /proc/<pid>/status."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.settings import MiB, Settings
from tests.service.conftest import Keys, bearer

HEADER_TIMEOUT_S = 1.0
BODY_IDLE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 8


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server(settings: Settings, keys: Keys, tmp_path: Path) -> Iterator[Server]:
    port = _free_port()
    env = {
        **os.environ,
        "OPFUSE_HOME": str(settings.home),
        "OPFUSE_DATABASE_URL": settings.database_url,
        "OPFUSE_PORT": str(port),
        "OPFUSE_LOG_LEVEL": "WARNING",
        "OPFUSE_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT_S),
        "OPFUSE_BODY_IDLE_TIMEOUT_SECONDS": str(BODY_IDLE_TIMEOUT_S),
        "OPFUSE_MAX_CONNECTIONS_PER_CLIENT": str(MAX_CONNECTIONS),
        "OPFUSE_KEEP_ALIVE_SECONDS": "60",
        "OPFUSE_AUTH_FAILURES_PER_MIN": "0",
        "OPFUSE_WEBHOOK_INTERVAL_SECONDS": "3600",
    }
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service", "serve"], env=env, stdout=out, stderr=out)
    server = Server(proc, port, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_response(sock: socket.socket, timeout_s: float) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response from the socket (status, headers, body), within `timeout_s`."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes the connection within `timeout_s` (reading and dropping the rest)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def _head(method: str, path: str, length: int | None, key: str | None) -> bytes:
    kind = "application/octet-stream" if path.startswith("/v1/models") else "application/json"
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {kind}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_body_without_a_valid_key_is_refused_before_it_is_read(server: Server, keys: Keys) -> None:
    big = 16 * MiB
    cases = [
        ("POST", "/v1/jobs", None),  # no key: JSON routes
        ("POST", "/v1/worker/jobs/x/complete", "opf_made-up"),  # a wrong key
        ("POST", "/v1/models?name=m", None),  # the streamed uploads
        ("PUT", "/v1/worker/jobs/x/artifact", "opf_made-up"),
    ]
    with server.connect() as warm:  # warm up the refusal path once before measuring
        warm.sendall(_head("POST", "/v1/jobs", big, None))
        assert _read_response(warm, 10)[0] == 401
    before = server.rss_bytes()
    waited = []
    for _round in range(2):
        sockets = [server.connect() for _ in range(MAX_CONNECTIONS - 1)]
        try:
            for i, sock in enumerate(sockets):
                method, path, key = cases[i % len(cases)]
                started = time.monotonic()
                sock.sendall(_head(method, path, big, key))
                status, headers, body = _read_response(sock, 5)  # at once: no body byte was sent
                waited.append(time.monotonic() - started)
                assert status == 401, body
                assert headers.get("connection") == "close", headers
                assert "API key" in json.loads(body)["detail"], body
                assert _closed(sock, 5), "the server kept the connection of a refused request open"
        finally:
            for sock in sockets:
                sock.close()
    grown = server.rss_bytes() - before
    print(
        f"refused before the body: slowest answer {max(waited) * 1000:.0f} ms; RSS grew {grown / MiB:.1f} MiB"
    )
    assert max(waited) < 3
    # The old server held up to 16 MiB per connection waiting for these bodies.
    assert grown < 8 * MiB, grown
    # The same request with a valid key is read (and refused for its size, not its key).
    with server.connect() as sock:
        sock.sendall(_head("POST", "/v1/jobs", 2 * MiB, keys.user))
        status, _, body = _read_response(sock, 10)
        assert status == 413 and b"OPFUSE_MAX_JSON_BYTES" in body


def test_json_bodies_are_small_except_a_workers_report(server: Server, keys: Keys) -> None:
    padded = {"lease_token": "t", "report": {"pad": "x" * (2 * MiB)}}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        job = {"model_id": "m", "input_shapes": {"x": [1]}, "fusion": {"disable": ["x" * 1000] * 1100}}
        refused = http.post("/v1/jobs", json=job, headers=bearer(keys.user))  # 1.1 MB
        assert refused.status_code == 413 and "OPFUSE_MAX_JSON_BYTES" in refused.json()["detail"]
        # A worker's report may be bigger (its own limit); the job does not exist: 404, not 413.
        report = http.post("/v1/worker/jobs/nope/complete", json=padded, headers=bearer(keys.worker))
        assert report.status_code == 404, report.text
        # The same body under a user key is held to the JSON limit.
        user = http.post("/v1/worker/jobs/nope/complete", json=padded, headers=bearer(keys.user))
        assert user.status_code == 413, user.text
        huge = {"lease_token": "t", "report": {"pad": "x" * (17 * MiB)}}
        over = http.post("/v1/worker/jobs/nope/complete", json=huge, headers=bearer(keys.worker))
        assert over.status_code == 413 and "OPFUSE_MAX_REPORT_BYTES" in over.json()["detail"]


def test_a_stalled_body_and_slow_headers_are_cut(server: Server, keys: Keys) -> None:
    for method, path in (("POST", "/v1/jobs"), ("POST", "/v1/models?name=m")):
        with server.connect() as sock:
            started = time.monotonic()
            sock.sendall(_head(method, path, 1000, keys.user) + b'{"model_id": ')  # then nothing
            status, _, body = _read_response(sock, BODY_IDLE_TIMEOUT_S + 10)
            took = time.monotonic() - started
            assert status == 408 and b"OPFUSE_BODY_IDLE_TIMEOUT_SECONDS" in body, body
            assert BODY_IDLE_TIMEOUT_S * 0.9 <= took < BODY_IDLE_TIMEOUT_S + 5, took
            print(f"stalled body ({path}) cut after {took:.2f} s")
    # Headers sent a byte at a time, each well within any idle timeout: cut at the header deadline.
    with server.connect() as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.settimeout(0.2)
        answer = b""
        for byte in b"X-Slow: " + b"a" * 200:
            try:
                sock.sendall(bytes([byte]))
                answer += sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if answer:
                break
            assert time.monotonic() - started < HEADER_TIMEOUT_S + 10, "slow headers were never cut"
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"OPFUSE_HEADER_TIMEOUT_SECONDS" in answer or _closed(sock, 5)
        assert took < HEADER_TIMEOUT_S + 5, took
        print(f"slow headers cut after {took:.2f} s")
    # A connection that sends nothing at all is closed too.
    with server.connect() as sock:
        started = time.monotonic()
        sock.settimeout(HEADER_TIMEOUT_S + 10)
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408") and _closed(sock, 5)
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 5


def test_one_address_holds_a_bounded_number_of_connections(server: Server) -> None:
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):  # kept alive after one request each
            sock = server.connect()
            held.append(sock)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _read_response(sock, 10)[0] == 200
        with server.connect() as extra:
            started = time.monotonic()
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, headers, body = _read_response(extra, 5)
            assert status == 503 and "retry-after" in headers, body
            assert b"OPFUSE_MAX_CONNECTIONS_PER_CLIENT" in body
            assert time.monotonic() - started < 3
            assert _closed(extra, 5)
        held.pop().close()  # one fewer: a new connection is served again
        deadline = time.monotonic() + 10
        while True:
            with server.connect() as again:
                again.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                if _read_response(again, 5)[0] == 200:
                    break
            assert time.monotonic() < deadline, "a closed connection was never given back"
            time.sleep(0.1)
        for sock in held:  # the held ones still work
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _read_response(sock, 10)[0] == 200
    finally:
        for sock in held:
            sock.close()
