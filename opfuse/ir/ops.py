"""Op names and sets the stages agree on, and predicates on single nodes.

Internal ops are named `opfuse.*`: the channels-last pass makes them, the runtime runs them, and
a bundle's model.onnx exports them in the `ai.opfuse` domain; a model never brings one.
"""

from __future__ import annotations

from opfuse.ir.graph import Graph, Node

NHWC_CONV = "opfuse.ConvNHWC"
MAX_POOL_NHWC = "opfuse.MaxPoolNHWC"
AVERAGE_POOL_NHWC = "opfuse.AveragePoolNHWC"
LRN_NHWC = "opfuse.LRNNHWC"
DFTN = "opfuse.DFTN"  # a Fourier transform over several axes (passes/dft.py)
# The ONNX pool -> its channels-last internal op.
NHWC_POOLS = {"MaxPool": MAX_POOL_NHWC, "AveragePool": AVERAGE_POOL_NHWC}
INTERNAL_OPS = (NHWC_CONV, *NHWC_POOLS.values(), LRN_NHWC, DFTN)
CONV_OPS = ("Conv", NHWC_CONV)
# A conv with fewer input channels (a network's first layer) runs its template's flat K loop
# (codegen/conv.py): one loop over (kh, kw, cin), every load a gather of a few channels.
FLAT_CONV_CHANNELS = 16

FLOAT_TYPES = ("float32", "float16", "bfloat16")
ONNX_FLOAT_CASTS = {1: "float32", 10: "float16", 16: "bfloat16"}  # Cast.to enum -> dtype
INT_TYPES = ("int32", "int64")
# Cast.to enum -> dtype for every type a generated pointwise kernel holds in its registers.
ONNX_CASTS = {**ONNX_FLOAT_CASTS, 6: "int32", 7: "int64", 9: "bool"}

# Ops on integers and booleans a generated pointwise kernel computes exactly (no float rounding):
# the mask and position-id arithmetic models do at run time (RoBERTa's position ids from the
# token ids: Equal, Not, Cast, Mul, Add). Comparisons and logic give booleans.
COMPARE_OPS = {"Equal": "==", "Less": "<", "Greater": ">", "LessOrEqual": "<=", "GreaterOrEqual": ">="}
LOGIC_OPS = {"And": "&", "Or": "|", "Xor": "^"}
MASK_OPS = frozenset({*COMPARE_OPS, *LOGIC_OPS, "Not"})
EXACT_INT_OPS = frozenset({"Add", "Sub", "Mul", "Neg", "Abs", "Max", "Min", "Identity", "Where", "Cast"})

# The ops a generated pointwise kernel computes (codegen/emitters.py has an expression for each).
POINTWISE_OPS = frozenset(
    {
        *("Abs", "Add", "Cast", "Clip", "Div", "Elu", "Erf", "Exp", "Gelu", "HardSigmoid", "HardSwish"),
        *("Identity", "LeakyRelu", "Log", "Max", "Min", "Mul", "Neg", "Pow", "Reciprocal", "Relu"),
        *("Sigmoid", "Softplus", "Sqrt", "Sub", "Tanh", "Where"),
    }
)


# Gelu (opset 20, the default exporter's spelling of F.gelu): the same arithmetic as the older
# spellings written out with Erf or Tanh. tanh form: 0.5 * (1 + tanh(u)) = sigmoid(2u).
GELU_APPROXIMATIONS = ("none", "tanh")


def gelu_approximate(n: Node) -> str:
    """Gelu's `approximate` attribute as a str ("none" by default)."""
    value = n.attrs.get("approximate", "none")
    return value.decode() if isinstance(value, bytes) else str(value)


# Window ops: pointwise but for one input read at neighbouring channel offsets as well (op -> the
# channel axis). That input must be in memory: a tensor input of the kernel, never computed in it.
WINDOW_OPS = {"LRN": 1, LRN_NHWC: -1}


def window_input(node: Node) -> str:
    """The value a window op reads at neighbouring offsets."""
    return node.inputs[0]


def has_shortcut(node: Node) -> bool:
    """An `opfuse.ConvNHWC` that also sums a 1x1 conv of a second input, its inputs 3 and 4
    (passes/shortcut_conv.py), at the strides of its `shortcut_strides` attribute."""
    return node.op_type == NHWC_CONV and len(node.inputs) > 3 and bool(node.inputs[3])


def is_depthwise(graph: Graph, node: Node) -> bool:
    """One filter per channel: group == input channels == output channels (an ONNX Conv, NCHW, or
    its NHWC form)."""
    group = int(node.attrs.get("group", 1))
    channels = graph.spec(node.inputs[0]).shape[3 if node.op_type == NHWC_CONV else 1]
    return group > 1 and group == channels == graph.spec(node.inputs[1]).shape[0]


# Ops a row kernel reduces (fusion/rowwise.py, codegen/rowwise.py).
# ReduceL2 is F.normalize's norm (cosine attention, XCiT's cross-covariance, embedding heads).
ROW_REDUCTIONS = frozenset(
    {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceL2", "ReduceSumSquare"}
)
GLOBAL_POOLS = frozenset({"GlobalAveragePool", "GlobalMaxPool"})
ROW_OPS = (
    ROW_REDUCTIONS
    | GLOBAL_POOLS
    | {
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "RMSNormalization",  # opset 23: the mean of squares over the trailing axes, no centring
        "InstanceNormalization",
        "GroupNormalization",
    }
)
