"""Which device a worker runs its jobs on: `--gpu N` (one worker per GPU), the first GPU, or the CPU.

The worker process itself never initializes CUDA: a short probe subprocess lists the GPUs torch
sees, and each job's child gets `CUDA_VISIBLE_DEVICES` set to the worker's one GPU, so it sees it
as `cuda:0` and cannot touch the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from client.config import ConfigError

_PROBE = """
import json, torch
names = []
if torch.cuda.is_available():
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(json.dumps(names))
"""
PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DeviceChoice:
    """`device` is what the worker reports at claim time ("cuda:1 (NVIDIA H200)" or "cpu");
    `visible_devices` is the child's CUDA_VISIBLE_DEVICES (None: CPU only)."""

    device: str
    visible_devices: str | None

    @property
    def is_cuda(self) -> bool:
        return self.visible_devices is not None

    def child_env(self, base: dict[str, str]) -> dict[str, str]:
        """The environment of a job's child: only this worker's GPU visible, or none at all."""
        env = dict(base)
        if self.visible_devices is None:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU worker's child must not grab a GPU by accident
            env.setdefault("TRITON_INTERPRET", "1")  # no GPU: the kernels run in Triton's interpreter
        else:
            env["CUDA_VISIBLE_DEVICES"] = self.visible_devices
        return env


def _may_have_gpus() -> bool:
    # No NVIDIA device nodes and no CUDA_VISIBLE_DEVICES: skip the probe (it imports torch, seconds).
    return (
        os.path.exists("/dev/nvidiactl")
        or os.path.exists("/dev/dxg")
        or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
    )


def probe_gpus(timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """The names of the GPUs torch sees here, in CUDA order (empty when there are none)."""
    if not _may_have_gpus():
        return []
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    try:
        names = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return []
    return [str(n) for n in names] if isinstance(names, list) else []


def _visible_ids() -> list[str] | None:
    """This process's CUDA_VISIBLE_DEVICES as a list (None: unset, every GPU is visible)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def choose_device(gpu: int | None, gpu_names: list[str] | None = None) -> DeviceChoice:
    """The device for `--gpu N` (None: the first GPU, else the CPU); ConfigError for a GPU that
    does not exist. `gpu_names` is `probe_gpus()` (given by tests)."""
    names = probe_gpus() if gpu_names is None else gpu_names
    if gpu is not None and gpu < 0:
        raise ConfigError(f"--gpu {gpu}: a GPU index is 0 or more")
    if not names:
        if gpu is not None:
            raise ConfigError(
                f"--gpu {gpu}: torch sees no CUDA GPU on this machine; leave out --gpu to run jobs on "
                "the CPU (Triton interpreter), or check the driver and CUDA_VISIBLE_DEVICES"
            )
        return DeviceChoice(device="cpu", visible_devices=None)
    index = 0 if gpu is None else gpu
    if index >= len(names):
        listed = ", ".join(f"{i}: {n}" for i, n in enumerate(names))
        raise ConfigError(
            f"--gpu {index}: this machine has {len(names)} GPU(s) that torch sees ({listed}); "
            f"pick one of 0..{len(names) - 1}"
        )
    # Inside an already restricted CUDA_VISIBLE_DEVICES, index N is its N-th entry.
    visible = _visible_ids()
    physical = visible[index] if visible is not None and index < len(visible) else str(index)
    return DeviceChoice(device=f"cuda:{index} ({names[index]})", visible_devices=physical)
