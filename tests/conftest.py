"""Suite-wide settings: Triton kernels run in the interpreter on machines without a GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
