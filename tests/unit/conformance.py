"""The ONNX conformance suite (the node test cases shipped inside the onnx package), run through opfuse.

Each case is a small model with inputs and expected outputs. opfuse compiles it on the CPU for the
case's input shapes and runs it; the outputs must match with the case's own tolerances. A case that
exercises something outside opfuse's contract (an op opfuse does not run, sequence values, string or
float8 tensors, ...) must instead end in a ModelError of the matching kind: `expected_refusal`
decides which from the case's model alone, so an op that silently starts accepting what it should
refuse (or the reverse) fails the run.

Used by tests/unit/test_conformance.py (every case, in `make test`) and by
`python -m tests.unit.conformance_report > docs/ops.md` (the per-op table).
"""

from __future__ import annotations

import functools
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

import opfuse
from opfuse.errors import ModelError
from opfuse.frontend.load import RENAMED_BY_CONVERSION
from opfuse.frontend.static_values import runtime_shape_inputs
from opfuse.frontend.unsupported import refusal_reason
from opfuse.frontend.validate import REFUSED_ELEM_TYPES, SUPPORTED_ELEM_TYPES
from opfuse.runtime.capture import audit, host_blockers
from opfuse.runtime.executor import Executor
from opfuse.runtime.ops import SUPPORTED_OPS

UNSUPPORTED_OP = "unsupported op"
# Ops opfuse runs only in some cases: If when its condition is known at compile time (it is inlined).
# A case with one must pass, or be refused for control flow.
CONDITIONAL_OPS = frozenset({"If"})
CONTROL_FLOW = "unsupported op: control flow (an If on run-time data)"
NON_TENSOR = "sequence/optional values"

# Cases that need a word of their own: outside the contract for a reason the model alone does not
# show. Each must still end in a ModelError whose message contains the given text.
SPECIAL_REFUSALS: dict[str, tuple[str, str]] = {
    # Dropout with training_mode=true masks at random: nondeterministic, and a training op.
    **{
        name: ("training mode", "training")
        for name in [
            "test_training_dropout",
            "test_training_dropout_default",
            "test_training_dropout_default_mask",
            "test_training_dropout_mask",
            "test_training_dropout_zero_ratio",
            "test_training_dropout_zero_ratio_mask",
            "test_batchnorm_epsilon_training_mode",
            "test_batchnorm_example_training_mode",
        ]
    },
    # AffineGrid's function body feeds Range with 1-element tensors where Range requires scalars.
    # Once opfuse inlines the body's If (its condition is static), strict shape inference sees it.
    **{
        name: ("invalid function body (Range of 1-element tensors)", "inconsistent")
        for name in [
            "test_affine_grid_2d_expanded",
            "test_affine_grid_2d_align_corners_expanded",
            "test_affine_grid_3d_expanded",
            "test_affine_grid_3d_align_corners_expanded",
        ]
    },
}

# Cases that fail because of a known bug outside the frontend and runtime ops, with whose it is:
# run as strict xfails, so that they start failing the suite (as XPASS) the day they are fixed.
KNOWN_FAILURES: dict[str, str] = {}

# Phrases the ModelError of each refusal category must contain: the user sees what kind of problem
# it is, not just that there was one.
CATEGORY_PHRASES: dict[str, str] = {
    UNSUPPORTED_OP: "does not support",
    NON_TENSOR: "not a tensor",
}


@dataclass
class Outcome:
    name: str
    op: str  # the op under test (for expanded cases, the function op they expand)
    status: str  # "passed", "refused" (as expected), "failed"
    category: str  # refusal category, or "" when the case is expected to run
    detail: str
    seconds: float


# Cases whose expected outputs come from onnx's reference implementation where it departs from the
# operator's definition; opfuse follows the definition, as onnxruntime does, and these cases are
# checked against onnxruntime instead.
ORT_EXPECTED: dict[str, str] = {
    name: "align_corners maps with the integer output length (the reference uses scale * input length)"
    for name in [
        "test_resize_downsample_scales_linear_align_corners",
        "test_resize_downsample_scales_cubic_align_corners",
    ]
}

# Ops whose rounding error scales with the whole output's magnitude, not each element's: a Fourier
# transform sums every input element into every output, so a frequency that is exactly 0 comes out
# as roundoff of the size of the largest ones (numpy's float32 FFT gives 1.9e-07 where opfuse's, in
# float64, gives 0, against an atol of 1e-07). Their atol is this fraction of the largest expected
# magnitude, at least (one float32 ulp is 2**-23 of it).
SCALED_ATOL: dict[str, float] = {"DFT": 2**-20}

# Every outcome of this session, in order: the terminal summary and the report read it.
OUTCOMES: list[Outcome] = []


@functools.cache
def load_cases() -> dict[str, Any]:
    """Every node test case, by name (generating them runs onnx's reference code: ~15 s)."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return {c.name: c for c in collect_testcases()}


_EXPANDED = re.compile(r"_expanded(_ver\d+)?$")
_ALIASES = {"sce": "SoftmaxCrossEntropyLoss", "nllloss": "NegativeLogLikelihoodLoss"}


def op_under_test(case: Any) -> str:
    """The op a case is about: its single node's op, or for an expanded case the op it expands."""
    nodes = case.model.graph.node
    if len(nodes) == 1:
        return _qualified(nodes[0])
    base = load_cases().get(_EXPANDED.sub("", case.name))
    if base is not None and len(base.model.graph.node) == 1:
        return _qualified(base.model.graph.node[0])
    stem = case.name.removeprefix("test_").replace("_", "").lower()
    for alias, op in _ALIASES.items():
        if stem.startswith(alias):
            return op
    best = max((n.op_type for n in nodes if stem.startswith(n.op_type.lower())), key=len, default=None)
    return best or _qualified(nodes[0])


def _qualified(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def expected_refusal(case: Any) -> tuple[str, str] | None:
    """(category, phrase its ModelError must contain) if the case is outside the contract, else None."""
    if case.name in SPECIAL_REFUSALS:
        return SPECIAL_REFUSALS[case.name]
    model = case.model
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    unsupported = sorted(
        {
            _qualified(n)
            for n in model.graph.node
            if n.domain not in ("", "ai.onnx")
            or (
                n.op_type not in SUPPORTED_OPS
                and n.op_type not in CONDITIONAL_OPS
                and not (n.op_type in RENAMED_BY_CONVERSION and opset < 18)
            )
        }
    )
    if unsupported:
        op = unsupported[0]
        domain, _, op_type = op.rpartition("::")
        reason = refusal_reason(domain, op_type) or "not implemented"
        return f"{UNSUPPORTED_OP}: {reason}", CATEGORY_PHRASES[UNSUPPORTED_OP]
    ins, outs = case.data_sets[0]
    g = model.graph
    if any(not _is_tensor(v) for v in [*ins, *outs]) or any(
        vi.type.WhichOneof("value") not in ("tensor_type", None) for vi in [*g.input, *g.output]
    ):
        return NON_TENSOR, CATEGORY_PHRASES[NON_TENSOR]
    for elem in _element_types(model):
        if elem not in SUPPORTED_ELEM_TYPES:
            return REFUSED_ELEM_TYPES.get(elem, "unknown element type"), "types opfuse does not support"
    return None


def _is_tensor(value: Any) -> bool:
    return isinstance(value, np.ndarray | np.generic | onnx.TensorProto)


def _element_types(model: onnx.ModelProto) -> list[int]:
    g = model.graph
    types = [vi.type.tensor_type.elem_type for vi in [*g.input, *g.output] if vi.type.HasField("tensor_type")]
    types += [init.data_type for init in g.initializer]
    for node in g.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to":
                types.append(attr.i)
            if attr.type == onnx.AttributeProto.TENSOR:
                types.append(attr.t.data_type)
    return [t for t in types if t != onnx.TensorProto.UNDEFINED]


def as_array(value: Any) -> np.ndarray:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return np.asarray(value)


def bake_shape_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Graph inputs that decide shapes (Reshape's shape, Slice's starts, ...) made initializers.

    opfuse compiles for static shapes, so such values must be constants in the model (a model that
    feeds them at run time is refused: tests/unit/test_frontend.py). The conformance cases feed
    them as inputs only because that is how the suite is written; the exporters write constants.
    """
    baked = {name for _, _, sources in runtime_shape_inputs(model) for name in sources} & set(feeds)
    if not baked:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [vi for vi in out.graph.input if vi.name not in baked]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    for name in sorted(baked):
        out.graph.initializer.append(numpy_helper.from_array(feeds.pop(name), name))
    return out


def compare(name: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> str:
    """'' when `got` matches `want` the way onnx's backend test runner checks it, else what differs."""
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, expected {want.shape}"
    if want.dtype.name == "bfloat16":
        # numpy has no bfloat16: opfuse hands bfloat16 outputs back as float32. Two bfloat16 ulps, as
        # in onnx's runner.
        if got.dtype != np.float32:
            return f"{name}: dtype {got.dtype}, expected bfloat16 (as float32)"
        got, want, rtol = got.astype(np.float32), want.astype(np.float32), max(rtol, 2**-6)
    elif got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype}, expected {want.dtype}"
    elif want.dtype == np.float16:
        # Fused kernels compute in float32 registers and round once, where the reference rounds
        # after every op: allow two float16 ulps.
        rtol = max(rtol, 2**-9)
    if want.dtype.kind in "fc":
        close = np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = got == want
    if close.all():
        return ""
    bad = np.argwhere(~close)
    at = tuple(int(i) for i in bad[0])
    return f"{name}: {len(bad)} of {want.size} elements differ, e.g. at {at}: {got[at]!r} vs {want[at]!r}"


def run_case(case: Any) -> Outcome:
    start = time.perf_counter()
    op = op_under_test(case)
    refusal = expected_refusal(case)
    category = refusal[0] if refusal else ""
    try:
        detail = _run(case)
    except ModelError as exc:
        detail = str(exc)
        conditional = any(n.op_type in CONDITIONAL_OPS for n in case.model.graph.node)
        if refusal is None and conditional and "control flow" in detail:
            return Outcome(case.name, op, "refused", CONTROL_FLOW, detail, time.perf_counter() - start)
        if refusal is None:
            status = "failed"
            detail = f"unexpected ModelError: {detail}"
        elif refusal[1] in detail:
            status = "refused"
        else:
            status = "failed"
            detail = f"refused, but without {refusal[1]!r} in the message: {detail}"
        return Outcome(case.name, op, status, category, detail, time.perf_counter() - start)
    except Exception as exc:  # anything but a ModelError is a crash: a failure whatever the case
        detail = f"crash: {type(exc).__name__}: {exc}"
        return Outcome(case.name, op, "failed", category, detail, time.perf_counter() - start)
    if refusal is not None:
        status, detail = (
            "failed",
            f"expected a ModelError ({category}), but it ran: {detail or 'and matched'}",
        )
    else:
        status = "passed" if not detail else "failed"
    return Outcome(case.name, op, status, category, detail, time.perf_counter() - start)


def _run(case: Any) -> str:
    """Compile and run every data set; '' when all outputs match, else the differences."""
    model = case.model
    problems: list[str] = []
    for inputs, outputs in case.data_sets:
        names = [
            vi.name for vi in model.graph.input if vi.name not in {i.name for i in model.graph.initializer}
        ]
        feeds = {n: as_array(v) if _is_tensor(v) else v for n, v in zip(names, inputs, strict=False)}
        baked = bake_shape_inputs(model, feeds)
        # Non-tensor inputs (sequences) get no shape: the frontend refuses them by their declared type.
        shapes = {n: list(v.shape) for n, v in feeds.items() if isinstance(v, np.ndarray)}
        cm = opfuse.compile(baked, input_shapes=shapes, device="cpu", verify=False)
        got = cm.run(feeds)
        problems += capture_problems(cm, feeds)
        if case.name in ORT_EXPECTED:
            outputs = _onnxruntime_outputs(baked, feeds)
        for vi, want in zip(model.graph.output, outputs, strict=True):
            want = as_array(want)
            atol, scaled = case.atol, SCALED_ATOL.get(op_under_test(case))
            if scaled is not None and want.size:
                atol = max(atol, scaled * float(np.abs(want).max()))
            diff = compare(vi.name, np.asarray(got[vi.name]), want, case.rtol, atol)
            if diff:
                problems.append(diff)
    return "; ".join(problems)


def capture_problems(cm: opfuse.CompiledModel, feeds: dict[str, Any]) -> list[str]:
    """A plan with no static CUDA-graph blocker must run on a GPU without touching the host: the
    capture audit (opfuse/runtime/capture.py) of its run here finds nothing."""
    if host_blockers(cm.plan):
        return []
    found = audit(Executor(cm.plan, "cpu", host_copies=True), feeds)
    return [f"capture audit: {f}" for f in found]


def _onnxruntime_outputs(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[np.ndarray]:
    import onnxruntime

    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, feeds)]


def summarize(outcomes: list[Outcome]) -> dict[str, Counter[str]]:
    """Per op under test: counts of passed, refused and failed cases."""
    table: dict[str, Counter[str]] = {}
    for o in outcomes:
        table.setdefault(o.op, Counter())[o.status] += 1
    return table


def format_table(outcomes: list[Outcome]) -> str:
    """The per-op table and the refusal categories, as plain text for the terminal."""
    table = summarize(outcomes)
    width = max((len(op) for op in table), default=2) + 2
    lines = [f"{'op':{width}s} passed/total  refused  failed"]
    for op in sorted(table):
        c = table[op]
        total = sum(c.values())
        lines.append(f"{op:{width}s} {c['passed']:>6}/{total:<5} {c['refused']:>7}  {c['failed']:>6}")
    statuses = Counter(o.status for o in outcomes)
    known = sum(1 for o in outcomes if o.status == "failed" and o.name in KNOWN_FAILURES)
    lines.append(
        f"conformance: {statuses['passed']} passed, {statuses['refused']} refused as expected, "
        f"{statuses['failed'] - known} failed, {known} known failure(s) (xfail), of {len(outcomes)} cases"
    )
    categories = Counter(o.category for o in outcomes if o.status == "refused")
    for cat, n in categories.most_common():
        lines.append(f"  refused {n:4d}: {cat}")
    return "\n".join(lines)
