"""Job targets: the device kinds a job may ask for, and the kind of device a worker reports.

The one list of kinds lives here. A job names a `target` (`any`, `cpu` or a GPU kind such as
`h200`); a worker reports its device at claim time as free text ("cuda:0 (NVIDIA H200)", "cpu"),
which `device_kind` turns into a kind; a worker claims only jobs whose target is its kind or `any`.
"""

from __future__ import annotations

import re
from enum import StrEnum


class Target(StrEnum):
    """What a job may run on. A GPU kind is the model's short name as NVIDIA prints it, lowercased."""

    ANY = "any"
    CPU = "cpu"  # the Triton interpreter on a machine without a GPU
    B200 = "b200"
    GB200 = "gb200"
    GH200 = "gh200"
    H200 = "h200"
    H100 = "h100"
    H800 = "h800"
    H20 = "h20"
    A100 = "a100"
    A800 = "a800"
    A40 = "a40"
    A30 = "a30"
    A10G = "a10g"
    A10 = "a10"
    L40S = "l40s"
    L40 = "l40"
    L4 = "l4"
    V100 = "v100"
    T4 = "t4"
    RTX6000 = "rtx6000"
    RTX5090 = "rtx5090"
    RTX4090 = "rtx4090"
    RTX3090 = "rtx3090"


TARGETS: tuple[str, ...] = tuple(t.value for t in Target)
GPU_KINDS: frozenset[str] = frozenset(TARGETS) - {Target.ANY.value, Target.CPU.value}

# Words in device names that say nothing about the kind.
_NOISE = frozenset({"nvidia", "tesla", "geforce", "quadro", "cuda", "pcie", "sxm", "nvl", "hbm3", "hbm3e"})


def _words(device: str) -> list[str]:
    """The lowercase alphanumeric words of a device description, GPU index prefix dropped."""
    text = re.sub(r"^\s*cuda(:\d+)?\s*", "", device.lower())
    return [w for w in re.findall(r"[a-z0-9]+", text) if w not in _NOISE]


def device_kind(device: str) -> str:
    """The kind of a worker's device: "cuda:0 (NVIDIA H200)" → "h200", "cpu" → "cpu",
    "NVIDIA GeForce RTX 4090" → "rtx4090". A GPU not in the list gets a kind made of its name's
    words ("NVIDIA RTX A6000" → "rtxa6000"): it serves jobs with target `any` only."""
    stripped = device.strip().lower()
    if not stripped or stripped == "cpu" or stripped.startswith("cpu"):
        return Target.CPU.value
    words = _words(device)
    for i, word in enumerate(words):
        pair = word + words[i + 1] if i + 1 < len(words) else ""
        if pair in GPU_KINDS:  # "rtx" "4090"
            return pair
        if word in GPU_KINDS:
            return word
    return "".join(words)[:64] or "gpu"


def serves(device: str, target: str | None) -> bool:
    """Whether a worker with this device may run a job with this target (None: an older job: any)."""
    return target in (None, Target.ANY.value) or target == device_kind(device)
