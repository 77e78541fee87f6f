"""Suite-wide settings.

Machines without an NVIDIA GPU run Triton kernels in its interpreter. Checked without importing
torch, which would cost every test session seconds (the service suites never need it).
Kernel output buffers are filled with NaN bytes before use (OPFUSE_POISON_BUFFERS), and in the
interpreter every load, store and atomic of a generated kernel is checked against the tensors of
its launch (OPFUSE_CHECK_BOUNDS, opfuse/runtime/bounds.py): a test whose process saw a kernel touch
memory outside them fails, even where opfuse caught the kernel's error and ran its group unfused.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest

# Kernel output buffers start as NaN bytes: a kernel that reads what no kernel wrote fails its test.
os.environ.setdefault("OPFUSE_POISON_BUFFERS", "1")
# Kernels that touch memory outside their tensors fail their test (the interpreter only).
os.environ.setdefault("OPFUSE_CHECK_BOUNDS", "1")

if not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _kernels_stay_in_bounds() -> Iterator[None]:
    """Fail a test during which a generated kernel touched memory outside its tensors."""
    bounds = sys.modules.get("opfuse.runtime.bounds")
    seen = len(bounds.violations) if bounds is not None else 0
    yield
    bounds = sys.modules.get("opfuse.runtime.bounds")
    if bounds is not None and len(bounds.violations) > seen:
        new = bounds.violations[seen:]
        pytest.fail(f"{len(new)} out-of-bounds kernel access(es); the first: {new[0]}", pytrace=False)
