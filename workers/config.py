"""The worker's configuration: WorkerConfig, and how the command line (`python -m workers.worker`,
`opfuse worker`) and the environment make one."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from client.config import ConfigError, opfuse_home, read_key_file, resolve_url
from workers.devices import DeviceChoice, choose_device
from workers.limits import GiB, ModelLimits, default_job_memory_bytes

DESCRIPTION = (
    "The opfuse worker: claim a job over HTTP, run the pipeline in a killable child, heartbeat, upload."
)

DEFAULT_JOB_TIMEOUT_S = 1800.0
DEFAULT_API_RETRY_S = 120.0
PIPELINE_ARGV = (sys.executable, "-m", "workers.pipeline")


@dataclass
class WorkerConfig:
    api_url: str
    api_key: str
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    gpu: int | None = None
    device: DeviceChoice | None = None  # default: choose_device(gpu), probed at start
    job_timeout_s: float = DEFAULT_JOB_TIMEOUT_S
    # None: no limit. Default: min(32 GiB, 75% of the host's memory), a worker runs one job at once.
    job_memory_bytes: int | None = field(default_factory=default_job_memory_bytes)
    model_limits: ModelLimits = field(default_factory=ModelLimits)
    api_retry_s: float = DEFAULT_API_RETRY_S  # how long a job's API calls are retried in an outage
    once: bool = False
    idle_min_s: float = 0.5  # claim backoff while the queue is empty
    idle_max_s: float = 5.0
    heartbeat_s: float | None = None  # default: a third of the lease
    pipeline_argv: Sequence[str] = PIPELINE_ARGV
    # Fork each job's child from a forkserver that imported torch and opfuse once (a worker process
    # of its own: `opfuse worker` turns this on); else start `pipeline_argv` as a new process.
    forkserver: bool = False
    work_root: Path | None = None  # where per-job temp dirs go; default the system temp dir


def resolve_worker_key(key: str | None, key_file: str | None) -> str | None:
    """--key, then --key-file, then OPFUSE_WORKER_KEY, then $OPFUSE_HOME/worker_key."""
    if key:
        return key
    if key_file:
        return read_key_file(key_file)
    if os.environ.get("OPFUSE_WORKER_KEY"):
        return os.environ["OPFUSE_WORKER_KEY"]
    default = opfuse_home() / "worker_key"
    return read_key_file(default) if default.is_file() else None


def worker_config(
    api: str | None,
    key: str | None,
    key_file: str | None,
    worker_id: str | None,
    gpu: int | None,
    *,
    once: bool = False,
    job_timeout_s: float | None = None,
    job_memory_gb: float | None = None,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    api_retry_s: float | None = None,
) -> WorkerConfig:
    """A WorkerConfig from command-line values (None: the default), its device chosen (the GPU
    probed); ConfigError says what is missing or wrong."""
    job_timeout_s = DEFAULT_JOB_TIMEOUT_S if job_timeout_s is None else job_timeout_s
    api_retry_s = DEFAULT_API_RETRY_S if api_retry_s is None else api_retry_s
    api_url, _ = resolve_url(api)
    api_key = resolve_worker_key(key, key_file)
    if api_key is None:
        raise ConfigError(
            "no worker key: pass --key or --key-file, set OPFUSE_WORKER_KEY, or run where "
            f"{opfuse_home()}/worker_key exists (`opfuse serve` writes it)"
        )
    for flag, value in (("--job-timeout", job_timeout_s), ("--api-retry", api_retry_s)):
        if value <= 0:
            raise ConfigError(f"{flag} must be a positive number of seconds, got {value:g}")
    if job_memory_gb is not None and job_memory_gb < 0:
        raise ConfigError(f"--job-memory-gb must be 0 (no limit) or more, got {job_memory_gb:g}")
    if job_memory_gb and job_memory_gb < 2:
        raise ConfigError(
            f"--job-memory-gb {job_memory_gb:g} is too small: a job's process needs about 2 GB to "
            "load torch and triton; give 2 or more (0: no limit)"
        )
    limits = ModelLimits()
    for flag, count in (("--max-nodes", max_nodes), ("--max-depth", max_depth)):
        if count is not None and count < 1:
            raise ConfigError(f"{flag} must be at least 1, got {count}")
    limits = ModelLimits(
        max_nodes=max_nodes if max_nodes is not None else limits.max_nodes,
        max_depth=max_depth if max_depth is not None else limits.max_depth,
    )
    config = WorkerConfig(
        api_url=api_url,
        api_key=api_key,
        gpu=gpu,
        device=choose_device(gpu),
        once=once,
        forkserver=True,
        job_timeout_s=job_timeout_s,
        job_memory_bytes=default_job_memory_bytes()
        if job_memory_gb is None
        else int(job_memory_gb * GiB) or None,
        model_limits=limits,
        api_retry_s=api_retry_s,
    )
    if worker_id:
        config.worker_id = worker_id
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.worker", description=DESCRIPTION)
    parser.add_argument("--api", help="API URL (default: OPFUSE_API_URL or $OPFUSE_HOME/server.json)")
    parser.add_argument("--key", help="worker API key (scope worker)")
    parser.add_argument(
        "--key-file", help="file holding the worker API key (default $OPFUSE_HOME/worker_key)"
    )
    parser.add_argument("--worker-id", help="a name for this worker in the job records (default host-pid)")
    parser.add_argument("--gpu", type=int, help="GPU index to use (default: the first, or CPU if none)")
    parser.add_argument(
        "--once", action="store_true", help="run one job and exit (at once if none is queued)"
    )
    parser.add_argument(
        "--job-timeout", type=float, default=DEFAULT_JOB_TIMEOUT_S, help="wall-time limit per job, seconds"
    )
    parser.add_argument(
        "--job-memory-gb",
        type=float,
        default=None,
        help="memory limit of each job's process, GB (0: none; default: min(32, 75%% of the host's memory))",
    )
    parser.add_argument(
        "--max-nodes", type=int, help=f"largest model accepted, nodes ({ModelLimits.max_nodes})"
    )
    parser.add_argument(
        "--max-depth", type=int, help=f"deepest graph accepted, chained nodes ({ModelLimits.max_depth})"
    )
    parser.add_argument(
        "--api-retry",
        type=float,
        default=DEFAULT_API_RETRY_S,
        help="how long to retry a job's API calls while the API is unreachable, seconds",
    )
    return parser
