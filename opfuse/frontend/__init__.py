"""Load and check untrusted ONNX models; convert opsets; specialize shapes.

`inspect_model` needs only onnx (the API server uses it for upload checks); the rest of the
frontend lives in `opfuse.frontend.load`.
"""

from __future__ import annotations

from opfuse.frontend.inspect import ModelInfo, TensorInfo, inspect_model

__all__ = ["ModelInfo", "TensorInfo", "inspect_model"]
