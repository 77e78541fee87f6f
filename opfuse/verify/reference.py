"""The independent reference: onnxruntime on the CPU, running the model as uploaded."""

from __future__ import annotations

import os
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
        threads = reference_threads()
        if threads:  # several compiles share the host: a bounded pool that sleeps when idle
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.model, self.options = model, opts

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outs = self.session.run(self.output_names, dict(feeds))
        return {name: np.asarray(v) for name, v in zip(self.output_names, outs, strict=True)}

    def sensitivity(
        self,
        feeds: Mapping[str, np.ndarray],
        base: Mapping[str, np.ndarray],
        step: float,
        rng: np.random.Generator,
    ) -> dict[str, float]:
        """How far each output moves (relative L2 from `base`, this reference's outputs on `feeds`)
        when every float weight of the model moves by
        `step` of itself, with a random sign: the model's own amplification of one rounding
        step. A deep network with random weights can turn float32's 1e-7 into 1e-3 at its
        outputs; two correct float32 implementations differ by about that much there."""
        import onnxruntime as ort
        from onnx import numpy_helper

        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
        for t in model.graph.initializer:
            if t.data_type in floats:
                a = numpy_helper.to_array(t)
                if a.size > 1:  # scalars are epsilons, scales and such: not weights
                    signs = rng.choice(np.array([-1.0, 1.0]), size=a.shape)
                    t.CopyFrom(numpy_helper.from_array((a * (1.0 + step * signs)).astype(a.dtype), t.name))
        session = ort.InferenceSession(
            model.SerializeToString(), self.options, providers=["CPUExecutionProvider"]
        )
        moved = session.run(self.output_names, dict(feeds))
        out: dict[str, float] = {}
        for name, m in zip(self.output_names, moved, strict=True):
            r = np.asarray(base[name], dtype=np.float64)
            d = np.asarray(m, dtype=np.float64)
            if r.dtype.kind != "f" or r.shape != d.shape:
                continue
            ok = np.isfinite(r) & np.isfinite(d)
            ref_norm = float(np.linalg.norm(r[ok]))
            out[name] = float(np.linalg.norm(r[ok] - d[ok]) / ref_norm) if ref_norm > 0 else 0.0
        return out


def reference_threads() -> int:
    """$OPFUSE_REFERENCE_THREADS: the threads onnxruntime's reference may use; 0 or unset leaves
    onnxruntime's default (one per physical core, spinning while it waits for work), which suits
    one compile to a host and oversubscribes a host that runs several."""
    env = os.environ.get("OPFUSE_REFERENCE_THREADS", "").strip()
    try:
        return max(0, int(env)) if env else 0
    except ValueError:
        raise ValueError(f"OPFUSE_REFERENCE_THREADS must be a whole number, not {env!r}") from None


# Integer inputs drawn wider, where the reference is non-finite everywhere on the usual draw
# (Verifier._draw): at level n >= 1 an input that indexes a table (TensorSpec.high) takes any
# valid index, [0, high); any other integer input stays below WIDER_INT_HIGHS[n - 1]. Level 1
# only redraws those others below 4, as level 0 does: each level risks more than the last.
WIDER_INT_HIGHS = (4, 16, 256, 4096)


def random_inputs(specs: list[TensorSpec], rng: np.random.Generator, wider: int = 0) -> dict[str, np.ndarray]:
    """Fresh random inputs: normal floats, small non-negative integers (valid indices), random bools.
    `wider` (0 to len(WIDER_INT_HIGHS)): integers across a wider range, see WIDER_INT_HIGHS."""
    feeds: dict[str, np.ndarray] = {}
    for s in specs:
        if s.dtype in ("float32", "float16", "float64"):
            feeds[s.name] = rng.standard_normal(s.shape).astype(s.dtype)
        elif s.dtype == "bfloat16":  # numpy has no bfloat16: ml_dtypes' (what onnx uses) does
            feeds[s.name] = rng.standard_normal(s.shape).astype(ml_dtypes.bfloat16)
        elif s.dtype in ("int64", "int32", "int16", "int8", "uint8"):
            feeds[s.name] = rng.integers(0, int_high(s, wider), size=s.shape).astype(s.dtype)
        elif s.dtype == "bool":
            feeds[s.name] = rng.random(s.shape) < 0.5
        else:
            raise ValueError(f"cannot make random inputs of type {s.dtype} for input {s.name!r}")
    return feeds


def int_high(spec: TensorSpec, wider: int = 0) -> int:
    """The bound (exclusive) of integer input `spec`'s random values at level `wider`: below 4, and
    below the smallest axis the input indexes (TensorSpec.high); wider, the whole of that axis, or
    for an input with no such bound WIDER_INT_HIGHS[wider - 1], within its type's range."""
    if wider <= 0:
        return max(1, min(4, spec.high)) if spec.high is not None else 4
    if spec.high is not None:
        return max(1, spec.high)
    high = WIDER_INT_HIGHS[min(wider, len(WIDER_INT_HIGHS)) - 1]
    return min(high, int(np.iinfo(np.dtype(spec.dtype)).max) + 1)


def describe_draw(wider: int) -> str:
    """How `random_inputs` draws integer inputs at level `wider`, in words."""
    if wider <= 0:
        return "integer inputs below 4"
    high = WIDER_INT_HIGHS[min(wider, len(WIDER_INT_HIGHS)) - 1]
    return f"integer inputs that index a table across the table, others below {high}"
