"""The unsupported-op error: every op type the runtime lacks, with its nodes and, where known, why.

Raised before any work is done, so that a user learns about all of them at once.
"""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from opfuse.errors import ModelError
from opfuse.frontend.opsets import DEFAULT_DOMAINS
from opfuse.frontend.validate import node_label

# Why an op is outside opfuse's contract (the label is what the conformance report counts by).
NONDETERMINISTIC = "nondeterministic: opfuse compiles deterministic inference"
CONTROL_FLOW = "control flow: subgraphs are not compiled (export with loops unrolled)"
SEQUENCES = "sequence and optional values are not supported, only tensors"
STRINGS = "string tensors are not supported"
TRAINING = "a training op: opfuse compiles inference"
DATA_DEPENDENT = "its output shape depends on the data: opfuse compiles static shapes"
QUANTIZED = "quantized ops are not supported yet: export the float model"

REFUSED_OPS: dict[str, str] = {
    **dict.fromkeys(
        [
            "RandomNormal",
            "RandomUniform",
            "RandomNormalLike",
            "RandomUniformLike",
            "Bernoulli",
            "Multinomial",
        ],
        NONDETERMINISTIC,
    ),
    **dict.fromkeys(["If", "Loop", "Scan"], CONTROL_FLOW),
    **dict.fromkeys(
        [
            "SequenceConstruct",
            "SequenceAt",
            "SequenceEmpty",
            "SequenceErase",
            "SequenceInsert",
            "SequenceLength",
            "SequenceMap",
            "ConcatFromSequence",
            "SplitToSequence",
            "Optional",
            "OptionalGetElement",
            "OptionalHasElement",
        ],
        SEQUENCES,
    ),
    **dict.fromkeys(
        ["StringNormalizer", "StringConcat", "StringSplit", "RegexFullMatch", "TfIdfVectorizer"], STRINGS
    ),
    **dict.fromkeys(
        [
            "NegativeLogLikelihoodLoss",
            "SoftmaxCrossEntropyLoss",
            "Gradient",
            "Adagrad",
            "Adam",
            "Momentum",
        ],
        TRAINING,
    ),
    **dict.fromkeys(["Unique", "NonMaxSuppression"], DATA_DEPENDENT),
    **dict.fromkeys(
        [
            "QuantizeLinear",
            "DequantizeLinear",
            "DynamicQuantizeLinear",
            "QLinearConv",
            "QLinearMatMul",
            "ConvInteger",
            "MatMulInteger",
        ],
        QUANTIZED,
    ),
}
TRAINING_DOMAINS = ("ai.onnx.preview.training",)


def refusal_reason(domain: str, op_type: str) -> str | None:
    if domain in TRAINING_DOMAINS:
        return TRAINING
    if domain in DEFAULT_DOMAINS:
        return REFUSED_OPS.get(op_type)
    return f"ops of domain {domain!r} are not supported, only the default ONNX domain"


def unsupported_ops(model: onnx.ModelProto, supported: frozenset[str]) -> dict[str, list[str]]:
    """Op types opfuse cannot run, each with the node names that use it."""
    found: dict[str, list[str]] = {}
    for i, node in enumerate(model.graph.node):
        key = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}::{node.op_type}"
        if node.domain in DEFAULT_DOMAINS and node.op_type in supported:
            continue
        found.setdefault(key, []).append(node.name or f"#{i}")
    return found


def check_supported(model: onnx.ModelProto, supported: frozenset[str]) -> None:
    missing = unsupported_ops(model, supported)
    if not missing:
        return
    parts = []
    for key, names in sorted(missing.items()):
        domain, _, op_type = key.rpartition("::")
        shown = ", ".join(repr(n) for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        reason = refusal_reason(domain, op_type)
        parts.append(f"{key} (nodes {shown}{more})" + (f": {reason}" if reason else ""))
    raise ModelError(
        f"the model uses {len(missing)} op type(s) opfuse does not support: " + "; ".join(parts) + ". "
        "Export without them (e.g. decompose them in the exporter) or file a request for the op."
    )


def check_inference_mode(model: onnx.ModelProto) -> None:
    """Refuse nodes set to training mode: their results are random (Dropout) or update state (BN)."""
    constants = {init.name: init for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = node.attribute[0].t
    problems = []
    for i, node in enumerate(model.graph.node):
        if node.domain not in DEFAULT_DOMAINS:
            continue
        label = node_label(node, i)
        if node.op_type == "BatchNormalization" and any(
            a.name == "training_mode" and a.i == 1 for a in node.attribute
        ):
            problems.append(f"{label} has training_mode=1")
        if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
            flag = constants.get(node.input[2])
            if flag is None:
                problems.append(f"{label} takes training_mode from run-time value {node.input[2]!r}")
            elif bool(numpy_helper.to_array(flag).reshape(-1)[0]):
                problems.append(f"{label} has training_mode=true")
    if problems:
        raise ModelError(
            "the model has nodes in training mode, which opfuse does not compile (it compiles inference): "
            + "; ".join(problems)
            + ". Export the model in eval mode (model.eval() before torch.onnx.export)"
        )
