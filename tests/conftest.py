"""Suite-wide settings.

Machines without an NVIDIA GPU run Triton kernels in its interpreter. Checked without importing
torch, which would cost every test session seconds (the service suites never need it).
"""

from __future__ import annotations

import os
import shutil

if not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")
