"""Time tuning candidates in a killable worker process, so that a generated kernel that crashes or
hangs scores infinity instead of taking the compiler down (TorchInductor's autotune process).

One worker serves a tuning session: a fresh interpreter (`python -m opfuse.tuning.pool`, never a
fork: the parent may hold a CUDA context) that imports torch once and times requests sent over a
socket pair. A worker that dies, or outlives a request's timeout, is killed; the next request
starts a new one. This module imports neither torch nor triton in the parent.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import IO, Any

DEFAULT_TIMEOUT_S = 30.0  # per candidate: covers a Triton compile on the GPU
START_TIMEOUT_S = 120.0  # python, torch and the CUDA context of a new worker
TIMERS = {"cuda": "opfuse.tuning.pool:cuda_graph_ms", "cpu": "opfuse.tuning.pool:wall_clock_ms"}

TensorShape = tuple[Sequence[int], str]  # (shape, dtype name as in TensorSpec)


@dataclass
class TimingRequest:
    """One candidate: a kernel module's source, the config passed to its `launch`, and the shapes
    and dtypes of its inputs then outputs (random inputs, empty outputs are made in the worker)."""

    source: str
    config: dict[str, Any]
    inputs: Sequence[TensorShape]
    outputs: Sequence[TensorShape]
    reps: int = 10  # 0: compile and run once, untimed (CompilePool)
    launch: bool = True  # with reps 0, False: compile only, nothing runs on the device


@dataclass
class Timing:
    """Milliseconds per launch; infinity with `error` when the candidate failed. `killed`: it took
    its worker down (crash, hang, broken CUDA context), which the caller should not try again.
    `fingerprint`: what the candidate computed (see `fingerprint`), from the same inputs for every
    config of one kernel, so configs that disagree can be told apart. `no_worker`: no worker could
    start to try it, which says nothing about the candidate (never cached, never held against it)."""

    ms: float
    error: str | None = None
    killed: bool = False
    fingerprint: tuple[float, ...] | None = None
    no_worker: bool = False

    @property
    def ok(self) -> bool:
        return math.isfinite(self.ms)


def cuda_graph_ms(fn: Callable[[], Any], reps: int = 10) -> float:
    """Device time of one launch: `reps` launches captured in a CUDA graph, replayed."""
    import torch

    from opfuse.runtime.graph_capture import graph_capture

    fn()  # compile and warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / reps


FINGERPRINT_CHUNK = 1 << 22  # elements per step: float64 temporaries of about 100 MB at most


def fingerprint(outputs: Sequence[Any]) -> tuple[float, ...]:
    """Per output: its L2 norm and two fixed random projections, in float64. Two configs of one
    kernel that compute the same function agree on these up to rounding; a tile computed wrong
    (a compiler bug at one config) moves the projections by about the norm of the error."""
    import torch

    values: list[float] = []
    for t in outputs:
        flat = t.reshape(-1)
        norm2 = 0.0
        proj = [0.0, 0.0]
        for i, start in enumerate(range(0, flat.numel(), FINGERPRINT_CHUNK)):  # bounded memory
            x = flat[start : start + FINGERPRINT_CHUNK].to(torch.float64)
            gen = torch.Generator(device=x.device).manual_seed(1234 + i)
            r = torch.randn((2, x.numel()), generator=gen, device=x.device, dtype=torch.float64)
            norm2 += float(x @ x)
            p0, p1 = (float(v) for v in r @ x)
            proj = [proj[0] + p0, proj[1] + p1]
        values += [math.sqrt(norm2) if norm2 == norm2 else math.nan, *proj]
    return tuple(values)


def fingerprints_agree(a: Sequence[float], b: Sequence[float], rtol: float) -> bool:
    """Whether two fingerprints (same kernel, same inputs) agree within `rtol` of the output norm."""
    if len(a) != len(b):
        return False
    for i in range(0, len(a), 3):
        scale = max(abs(a[i]), abs(b[i]), 1e-30)
        for x, y in zip(a[i : i + 3], b[i : i + 3], strict=True):
            if math.isnan(x) and math.isnan(y):
                continue
            if not abs(x - y) <= rtol * scale:  # NaN on one side fails
                return False
    return True


def wall_clock_ms(fn: Callable[[], Any], reps: int = 10) -> float:
    """Host time of one launch: for Triton's interpreter on the CPU, where launches are synchronous."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) * 1000.0 / reps


def child_env() -> dict[str, str]:
    """The environment of a worker process: this one's, with this process's import path first on
    PYTHONPATH (the folder holding this opfuse, then sys.path), so a worker imports the same opfuse
    and the same modules, also where opfuse is used from a source tree rather than installed."""
    env = dict(os.environ)
    # The folder holding this opfuse: three levels above opfuse/tuning/pool.py.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths: list[str] = []
    for entry in [here, *sys.path, *env.get("PYTHONPATH", "").split(os.pathsep)]:
        if entry and os.path.abspath(entry) not in paths:  # "" (the working folder): the child's own
            paths.append(os.path.abspath(entry))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _resolve(path: str) -> Callable[..., float]:
    module, _, name = path.partition(":")
    fn: Callable[..., float] = getattr(importlib.import_module(module), name)
    return fn


class TuningPool:
    """Times candidates in one worker process, replaced after a crash or a timeout.

    `device`: "cuda", "cuda:N" or "cpu" (Triton's interpreter). `timer`: "module:function" taking
    (launch, reps) and returning ms, imported in the worker (default by device: TIMERS). The worker
    starts on the first request; `close()` (or leaving a `with` block) ends it.
    """

    def __init__(
        self,
        device: str = "cuda",
        *,
        timeout_s: float | None = None,
        timer: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.device = device
        self.interpret = not device.startswith("cuda")
        self.timer = timer or TIMERS["cpu" if self.interpret else "cuda"]
        env_timeout = os.environ.get("OPFUSE_TUNE_TIMEOUT_S")
        self.timeout_s = timeout_s if timeout_s is not None else float(env_timeout or DEFAULT_TIMEOUT_S)
        self.start_timeout_s = start_timeout_s
        self.spawns = 0  # workers started so far: one, plus one per crash or timeout
        self.start_error: str | None = None  # set when a worker could not start: no more tries
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._stderr: IO[bytes] | None = None
        self._ready = False  # the worker said it has imported torch and started its CUDA context

    def __enter__(self) -> TuningPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The live worker's process id, None when there is none."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self, wait: bool = True) -> None:
        """Start the worker now rather than on the first request; raises RuntimeError if it cannot.
        With `wait=False` it starts in the background (its imports overlap the caller's work)."""
        # A worker that died before it said it was ready is not started again: waiting for it
        # reads why it died (the start error).
        if self._proc is None or (self._proc.poll() is not None and self._ready):
            self._spawn()
        if wait and not self._ready:
            self._await_ready()

    def _spawn(self) -> None:
        if self.start_error is not None:
            raise RuntimeError(self.start_error)
        self._discard()
        parent_end, child_end = multiprocessing.Pipe(duplex=True)
        self._stderr = tempfile.TemporaryFile(prefix="opfuse-tune-")  # noqa: SIM115 (lives with the worker)
        env = child_env()
        # Triton fixes interpreter or compiler when it is imported: decide before the worker starts.
        env["TRITON_INTERPRET"] = "1" if self.interpret else "0"
        self.spawns += 1
        # Same process group as the parent: whoever kills a compile job's group kills this too.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "opfuse.tuning.pool", str(child_end.fileno()), self.device, self.timer],
            stdin=subprocess.DEVNULL,
            stdout=self._stderr,
            stderr=self._stderr,
            env=env,
            pass_fds=(child_end.fileno(),),
        )
        child_end.close()
        self._conn = parent_end

    def _await_ready(self) -> None:
        assert self._conn is not None
        try:
            if not self._conn.poll(self.start_timeout_s):
                raise RuntimeError(f"no answer within {self.start_timeout_s:.0f} s")
            hello = self._conn.recv()
            if hello != ("ready",):
                raise RuntimeError(f"unexpected first message {hello!r}")
        except (RuntimeError, EOFError, OSError) as exc:
            why = f"{exc}; {self._why_dead()}"
            self._discard()
            self.start_error = f"the tuning worker could not start ({why})"
            raise RuntimeError(self.start_error) from exc
        self._ready = True

    def time(self, request: TimingRequest, timeout_s: float | None = None) -> Timing:
        """Time one candidate; never raises for anything the candidate does."""
        try:
            self.start()
        except RuntimeError as exc:
            return Timing(math.inf, str(exc), no_worker=True)
        assert self._conn is not None
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            self._conn.send(
                {
                    "source": request.source,
                    "config": dict(request.config),
                    "inputs": [(list(s), d) for s, d in request.inputs],
                    "outputs": [(list(s), d) for s, d in request.outputs],
                    "reps": request.reps,
                    "launch": request.launch,
                }
            )
            if not self._conn.poll(limit):
                self._discard()
                return Timing(math.inf, f"timed out after {limit:g} s; the worker was killed", killed=True)
            answer = self._conn.recv()
        except (EOFError, OSError):
            why = self._why_dead()
            self._discard()
            return Timing(math.inf, why, killed=True)
        kind, value, fatal = answer
        if kind == "ok":
            ms, prints = value
            return Timing(float(ms), fingerprint=None if prints is None else tuple(prints))
        if fatal:  # the worker has left: its CUDA context is unusable after this error
            self._discard()
        return Timing(math.inf, str(value), killed=bool(fatal))

    def close(self) -> None:
        if self._conn is not None and self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._conn.send(None)  # asks it to leave; _discard kills it if it does not
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(2.0)
        self._discard()

    def _why_dead(self) -> str:
        """The worker's exit (signal name or code) and the tail of what it wrote."""
        status = "still running"
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5.0)
            code = self._proc.poll()
            if code is not None and code < 0:
                status = (
                    f"killed by {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
                )
            elif code is not None:
                status = f"exited with status {code}"
        tail = ""
        if self._stderr is not None:
            self._stderr.seek(0, os.SEEK_END)
            self._stderr.seek(max(0, self._stderr.tell() - 8000))
            tail = _last_words(self._stderr.read().decode("utf-8", "replace"))
        return f"the tuning worker died ({status})" + (f": {tail}" if tail else "")

    def _discard(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
        if self._conn is not None:
            self._conn.close()
        if self._stderr is not None:
            self._stderr.close()
        self._proc, self._conn, self._stderr, self._ready = None, None, None, False


def compile_workers() -> int:
    """How many kernels compile at once: $OPFUSE_COMPILE_WORKERS, else half the usable cores (at
    most 16). Triton's compile is single-threaded CPU work; each worker holds a CUDA context."""
    env = os.environ.get("OPFUSE_COMPILE_WORKERS")
    if env:
        return max(1, int(env))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores // 2))


class CompilePool:
    """Compiles kernels in parallel: several workers, each running its share of the requests once
    (untimed), which leaves the binaries in Triton's on-disk cache for whoever launches them next
    (the timing worker, the compiler's own process). A request that fails or kills its worker is
    reported like a timed candidate, so the tuner never times it again.

    Kernels are compiled in request order (callers put what matters most first); after `deadline`
    (time.perf_counter()) the rest are left out (None).
    """

    def __init__(self, device: str = "cuda", workers: int | None = None) -> None:
        self.device = device
        self.workers = workers or compile_workers()
        self._pools: list[TuningPool] = []

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, n: int | None = None) -> None:
        """Start `n` workers (all by default) in the background: their imports and CUDA contexts
        overlap the caller's work until `run`."""
        while len(self._pools) < min(self.workers, n or self.workers):
            pool = TuningPool(self.device)
            with contextlib.suppress(RuntimeError):  # a worker that cannot start answers its requests
                pool.start(wait=False)
            self._pools.append(pool)

    def run(self, requests: Sequence[TimingRequest], deadline: float | None = None) -> list[Timing | None]:
        """Compile and run each request once; returns when all are done or the deadline passed."""
        return self.submit(requests, deadline).results()

    def submit(
        self, requests: Sequence[TimingRequest], deadline: float | None = None, launch: bool = True
    ) -> CompileJob:
        """Start compiling `requests` in the background, in order; returns at once. `launch=False`
        compiles without running anything on the device (Triton's warmup), so the GPU stays free
        for whoever times kernels meanwhile."""
        job = CompileJob(len(requests))
        if not requests:
            return job  # finished already
        self.start(min(self.workers, len(requests)))
        todo = list(enumerate(requests))
        todo.reverse()  # popped from the end: request order
        lock = threading.Lock()

        def serve(pool: TuningPool) -> None:
            try:
                while True:
                    with lock:
                        late = deadline is not None and time.perf_counter() > deadline
                        if not todo or late or job.cancelled:
                            return
                        i, request = todo.pop()
                    compile_only = TimingRequest(
                        request.source, request.config, request.inputs, request.outputs, 0, launch
                    )
                    timing = pool.time(compile_only)
                    if timing.no_worker:  # this worker cannot start: the request goes back to the others
                        with lock:
                            todo.append((i, request))
                        job.start_error = job.start_error or timing.error
                        return
                    job.set(i, timing)
            finally:
                job.worker_done()

        job.workers = len(self._pools)
        for pool in self._pools:
            threading.Thread(target=serve, args=(pool,), daemon=True).start()
        return job

    def close(self) -> None:
        for pool in self._pools:
            pool.close()
        self._pools.clear()


class CompileJob:
    """Requests compiling in CompilePool's workers. `wait(i)` blocks until request `i` is done, or
    until no worker will take it any more (the deadline passed): then it is None."""

    def __init__(self, n: int) -> None:
        self._results: list[Timing | None] = [None] * n
        self._done = [False] * n
        self._cond = threading.Condition()
        self.workers = 0
        self.cancelled = False  # no worker takes another request (those compiling finish)
        # Why a worker could not start (it took no request: those it would have taken went to the
        # others, or are left out, None, when no worker could start).
        self.start_error: str | None = None
        self._finished = n == 0

    def cancel(self) -> None:
        self.cancelled = True

    def set(self, i: int, timing: Timing) -> None:
        with self._cond:
            self._results[i], self._done[i] = timing, True
            self._cond.notify_all()

    def worker_done(self) -> None:
        with self._cond:
            self.workers -= 1
            if self.workers <= 0:
                self._finished = True
                self._cond.notify_all()

    def wait(self, i: int) -> Timing | None:
        with self._cond:
            self._cond.wait_for(lambda: self._done[i] or self._finished)
            return self._results[i]

    def results(self) -> list[Timing | None]:
        """Every request's outcome, once no worker is running (None: left out at the deadline)."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished)
            return list(self._results)


@contextlib.contextmanager
def _compile_only(module: Any, interpret: bool) -> Any:
    """While inside, a launch (`kernel[grid](...)`) of the module's Triton kernels compiles them
    (`warmup`) and runs nothing; under the interpreter there is nothing to compile, so it does
    nothing at all. Launching is switched on the kernels' classes, not by replacing the module's
    names: a @triton.jit helper that a kernel calls must stay what it is while the kernel compiles."""
    from triton.runtime.jit import KernelInterface

    def launch(self: Any, grid: Any) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            if not interpret:
                self.warmup(*args, grid=grid, **kwargs)

        return call

    classes = {type(fn) for fn in vars(module).values() if isinstance(fn, KernelInterface)}
    own = {cls: cls.__dict__.get("__getitem__") for cls in classes}
    try:
        for cls in classes:
            cls.__getitem__ = launch  # type: ignore[method-assign]
        yield
    finally:
        for cls, previous in own.items():
            if previous is None:
                del cls.__getitem__
            else:
                cls.__getitem__ = previous  # type: ignore[method-assign]


def _last_words(text: str) -> str:
    """What a dead worker wrote that says why: faulthandler's fatal error and the innermost frame
    (the candidate's code), else the last lines."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    fatal = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")]
    if fatal:
        i = fatal[-1]
        stack = next((j for j in range(i, len(lines)) if lines[j].startswith(("Current thread", "Stack"))), i)
        frame = next((ln for ln in lines[stack + 1 :] if ln.startswith("File ")), "")
        return f"{lines[i]} | {frame}"[:600]
    return " | ".join(lines[-4:])[-600:]


# --- the worker process ---------------------------------------------------------------------------


@dataclass
class _Worker:
    conn: Connection
    device: str
    timer: Callable[..., float]
    interpret: bool = field(init=False)

    def __post_init__(self) -> None:
        self.interpret = not self.device.startswith("cuda")

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            try:
                self.conn.send(("ok", self.measure(msg), False))
            except Exception as exc:  # out of resources, compile errors: this candidate loses
                fatal = self.cuda_broken(exc)
                first_line = (str(exc).strip().splitlines() or [""])[0]
                self.conn.send(("error", f"{type(exc).__name__}: {first_line}"[:600], fatal))
                if fatal:
                    return

    def measure(self, msg: dict[str, Any]) -> tuple[float, tuple[float, ...] | None]:
        """(ms per launch, fingerprint of the outputs; the inputs are the same for every config).
        A compile-only request (reps 0) is neither timed nor fingerprinted."""
        import torch

        from opfuse.runtime.kernels import load_kernel_module
        from opfuse.runtime.tensors import torch_dtype

        module = load_kernel_module(msg["source"], self.interpret)
        dev = torch.device(self.device)
        torch.manual_seed(0)
        ins = []
        compile_only = msg["reps"] == 0 and not msg.get("launch", True)
        for shape, dtype in msg["inputs"]:
            dt = torch_dtype(dtype)
            if compile_only:  # the values are never read: no kernel fills them
                ins.append(torch.empty(shape, dtype=dt, device=dev))
            elif dt.is_floating_point:
                ins.append(torch.randn(shape, device=dev).to(dt))
            else:
                ins.append(torch.randint(0, 4, shape, device=dev).to(dt))
        outs = [torch.empty(shape, dtype=torch_dtype(dtype), device=dev) for shape, dtype in msg["outputs"]]
        config = msg["config"]
        if compile_only:  # into Triton's disk cache
            with _compile_only(module, self.interpret):
                module.launch(*ins, *outs, config=config)
            return 0.0, None
        if msg["reps"] == 0:  # compile (into Triton's on-disk cache) and check that it runs
            module.launch(*ins, *outs, config=config)
            if not self.interpret:
                torch.cuda.synchronize()
            return 0.0, None
        ms = float(self.timer(lambda: module.launch(*ins, *outs, config=config), msg["reps"]))
        return ms, fingerprint(outs)

    def cuda_broken(self, exc: Exception) -> bool:
        """After an illegal address or a launch failure the context is lost for good."""
        if self.interpret:
            return False
        import torch

        if "CUDA error" in str(exc) or "illegal" in str(exc).lower():
            return True
        try:
            torch.cuda.synchronize()
        except Exception:
            return True
        return False


def _leave_when_orphaned(parent: int) -> None:
    """A worker whose compiler died would otherwise keep its GPU memory until its request ends."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _main(argv: list[str]) -> None:
    fd, device, timer_path = int(argv[0]), argv[1], argv[2]
    # A segfault leaves the crashing thread's Python stack in the stderr the parent reads.
    faulthandler.enable(all_threads=False)
    conn = Connection(fd)
    threading.Thread(target=_leave_when_orphaned, args=(os.getppid(),), daemon=True).start()
    timer = _resolve(timer_path)
    import torch
    import triton  # noqa: F401  (imported before "ready": the first candidate's time is its own)

    if device.startswith("cuda"):
        if ":" in device:
            torch.cuda.set_device(torch.device(device))
        torch.empty(1, device=device)  # the context starts here, not in the first candidate's time
    conn.send(("ready",))
    _Worker(conn, device, timer).serve()


if __name__ == "__main__":
    _main(sys.argv[1:])
