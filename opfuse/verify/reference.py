"""The independent reference: onnxruntime on the CPU, running the model as uploaded."""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np
import onnx

from opfuse.graph import TensorSpec


class OnnxRuntimeReference:
    name = "onnxruntime-cpu"

    def __init__(self, model: onnx.ModelProto) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        # The reference runs the graph as written: no ORT fusions between it and the user's model.
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.session.run(self.output_names, dict(feeds))
        return {name: np.asarray(v) for name, v in zip(self.output_names, outs, strict=True)}


def random_inputs(specs: list[TensorSpec], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh random inputs: normal floats, small non-negative integers (valid indices), random bools."""
    feeds: dict[str, np.ndarray] = {}
    for s in specs:
        if s.dtype in ("float32", "float16", "float64"):
            feeds[s.name] = rng.standard_normal(s.shape).astype(s.dtype)
        elif s.dtype == "bfloat16":  # numpy has no bfloat16: ml_dtypes' (what onnx uses) does
            feeds[s.name] = rng.standard_normal(s.shape).astype(ml_dtypes.bfloat16)
        elif s.dtype in ("int64", "int32", "int16", "int8", "uint8"):
            # Below 4, and below the smallest axis the input indexes (TensorSpec.high).
            high = max(1, min(4, s.high)) if s.high is not None else 4
            feeds[s.name] = rng.integers(0, high, size=s.shape).astype(s.dtype)
        elif s.dtype == "bool":
            feeds[s.name] = rng.random(s.shape) < 0.5
        else:
            raise ValueError(f"cannot make random inputs of type {s.dtype} for input {s.name!r}")
    return feeds
