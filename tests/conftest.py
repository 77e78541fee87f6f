"""Suite-wide settings.

Machines without an NVIDIA GPU run Triton kernels in its interpreter. Checked without importing
torch, which would cost every test session seconds (the service suites never need it).
Kernel output buffers are filled with NaN bytes before use (OPFUSE_POISON_BUFFERS).
"""

from __future__ import annotations

import os
import shutil

# Kernel output buffers start as NaN bytes: a kernel that reads what no kernel wrote fails its test.
os.environ.setdefault("OPFUSE_POISON_BUFFERS", "1")

if not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")
