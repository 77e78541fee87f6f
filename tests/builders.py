"""Small ONNX models the tests build in memory (random weights; nothing is committed as a binary)."""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from opfuse.graph import Graph
from opfuse.passes.rules import Pass, PassContext, RuleLog

# Where the fusion tests run their compiled models: the CPU (Triton's interpreter) in CI; on the GPU
# machine `OPFUSE_TEST_DEVICE=cuda` runs the same tests, and the same assertions, on the device.
TEST_DEVICE = os.environ.get("OPFUSE_TEST_DEVICE", "cpu")


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(arr.astype(np.float32), name)


def residual_mlp(hidden: int = 32, ffn: int = 64, seed: int = 0, opset: int = 18) -> onnx.ModelProto:
    """x -> LayerNorm(x + W2 · GELU(W1 · x + b1) + b2), GELU written with Erf and LayerNorm written out.

    The input has a dynamic batch dim ("batch").
    """
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.standard_normal((hidden, ffn)) * 0.2),
        _init("b1", rng.standard_normal(ffn) * 0.1),
        _init("w2", rng.standard_normal((ffn, hidden)) * 0.2),
        _init("b2", rng.standard_normal(hidden) * 0.1),
        _init("gamma", 1.0 + rng.standard_normal(hidden) * 0.1),
        _init("beta", rng.standard_normal(hidden) * 0.1),
        _init("half", np.array(0.5)),
        _init("one", np.array(1.0)),
        _init("inv_sqrt2", np.array(1.0 / np.sqrt(2.0))),
        _init("two", np.array(2.0)),
        _init("eps", np.array(1e-5)),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes"),
    ]
    n = helper.make_node

    def reduce_mean(x: str, y: str, name: str) -> onnx.NodeProto:
        if opset >= 18:  # axes moved from an attribute to an input at opset 18
            return n("ReduceMean", [x, "axes"], [y], name=name)
        return n("ReduceMean", [x], [y], name=name, axes=[-1])

    nodes = [
        n("MatMul", ["x", "w1"], ["h0"], name="fc1"),
        n("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
        n("Mul", ["h1", "inv_sqrt2"], ["g0"], name="gelu_scale"),
        n("Erf", ["g0"], ["g1"], name="gelu_erf"),
        n("Add", ["g1", "one"], ["g2"], name="gelu_add1"),
        n("Mul", ["h1", "g2"], ["g3"], name="gelu_mul"),
        n("Mul", ["g3", "half"], ["g4"], name="gelu_half"),
        n("MatMul", ["g4", "w2"], ["h2"], name="fc2"),
        n("Add", ["h2", "b2"], ["h3"], name="fc2_bias"),
        n("Add", ["h3", "x"], ["r"], name="residual"),
        reduce_mean("r", "mu", "ln_mean"),
        n("Sub", ["r", "mu"], ["d"], name="ln_sub"),
        n("Pow", ["d", "two"], ["d2"], name="ln_pow"),
        reduce_mean("d2", "var", "ln_var"),
        n("Add", ["var", "eps"], ["var_eps"], name="ln_eps"),
        n("Sqrt", ["var_eps"], ["std"], name="ln_sqrt"),
        n("Div", ["d", "std"], ["xn"], name="ln_div"),
        n("Mul", ["xn", "gamma"], ["xs"], name="ln_scale"),
        n("Add", ["xs", "beta"], ["y"], name="ln_shift"),
    ]
    graph = helper.make_graph(
        nodes,
        "residual_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def depthwise_conv_relu(channels: int, kernel: int = 3, stride: int = 1, seed: int = 0) -> onnx.ModelProto:
    """Depthwise Conv (group = channels, "same" padding, bias) -> Relu, with a dynamic batch and
    image size."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w", rng.standard_normal((channels, 1, kernel, kernel)) * 0.3),
        _init("b", rng.standard_normal(channels) * 0.1),
    ]
    p = kernel // 2
    nodes = [
        helper.make_node(
            "Conv", ["x", "w", "b"], ["c"], name="dw", group=channels, pads=[p] * 4, strides=[stride] * 2
        ),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "depthwise_conv_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", channels, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", channels, "oh", "ow"])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def conv_bn_relu(channels: int = 4, out_channels: int = 8, size: int = 8, seed: int = 0) -> onnx.ModelProto:
    """Conv(3x3, bias) -> BatchNormalization -> Relu, with a dynamic batch dim."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w", rng.standard_normal((out_channels, channels, 3, 3)) * 0.3),
        _init("b", rng.standard_normal(out_channels) * 0.1),
        _init("scale", 1.0 + rng.standard_normal(out_channels) * 0.1),
        _init("bias", rng.standard_normal(out_channels) * 0.1),
        _init("mean", rng.standard_normal(out_channels) * 0.1),
        _init("var", 0.5 + rng.random(out_channels)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["bn"], name="bn", epsilon=1e-5
        ),
        helper.make_node("Relu", ["bn"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_bn_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", channels, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out_channels, size, size])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def softmax_then_gemm(seed: int = 3) -> onnx.ModelProto:
    """Two groups: a row group (Softmax, then a scale: nodes Softmax#n0, Mul#n1) feeding a GEMM group
    (MatMul, bias Add, Relu); x [8, 16] -> y [8, 16]. The scale stays away from zero."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w", rng.standard_normal((16, 16))),
        _init("b", rng.standard_normal(16)),
        _init("c", rng.standard_normal(16) + 2.0),
    ]
    nodes = [
        helper.make_node("Softmax", ["x"], ["s"], axis=-1),
        helper.make_node("Mul", ["s", "c"], ["m"]),
        helper.make_node("MatMul", ["m", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 16])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def graph_of(model: onnx.ModelProto, shapes: dict[str, list[int]] | None = None) -> Graph:
    """The model as the passes see it: loaded, checked and specialized to `shapes`, as opfuse.compile
    does before its passes (no ONNX-level folding)."""
    from opfuse.frontend.load import load_and_specialize
    from opfuse.graph import graph_from_onnx
    from opfuse.runtime.ops import SUPPORTED_OPS

    _, specialized = load_and_specialize(model, shapes or {}, SUPPORTED_OPS)
    return graph_from_onnx(specialized)


def run_pass(graph: Graph, rule: Pass, disabled: tuple[str, ...] = (), device: str = "cpu") -> RuleLog:
    """Run one pass of the pipeline on `graph` (in place); what fired and why candidates did not."""
    ctx = PassContext(frozenset(disabled), device=device)
    rule.apply(graph, ctx)
    return ctx.log


# -- tiny graphs for graph-level tests of one fusion rule (tests/unit/fusion_rules/) ----------------

import typing  # noqa: E402  (appended with the builders below)

if typing.TYPE_CHECKING:
    from opfuse.fusion.planner import FusionPlan


def tiny_model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, list[int]],
    outputs: dict[str, list[int]],
    inits: dict[str, np.ndarray] | None = None,
    opset: int = 18,
) -> onnx.ModelProto:
    """A model of `nodes`: float32 inputs and outputs of the given shapes, and constants `inits`
    (float arrays as float32, integer arrays as int64, booleans as they are)."""

    def typed(v: np.ndarray) -> np.ndarray:
        if v.dtype == np.bool_:
            return v
        return v.astype(np.int64 if np.issubdtype(v.dtype, np.integer) else np.float32)

    initializers = [numpy_helper.from_array(typed(v), k) for k, v in (inits or {}).items()]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in outputs.items()],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def weights(*shape: int, seed: int = 0) -> np.ndarray:
    """Random float32 constants of `shape` (never zeros)."""
    return (np.random.default_rng(seed).standard_normal(shape) * 0.3).astype(np.float32)


def planned(model: onnx.ModelProto, disabled: tuple[str, ...] = ()) -> tuple[Graph, FusionPlan]:
    """The model after the graph passes (on the CPU), and its fusion plan: what the planner's
    rules claimed and why they refused, without generating a kernel."""
    from opfuse.fusion.planner import plan_fusion
    from opfuse.passes.pipeline import run_passes

    graph = graph_of(model)
    run_passes(graph, set(disabled))
    return graph, plan_fusion(graph, set(disabled))


def claimed(plan: FusionPlan) -> list[tuple[str, str, list[str]]]:
    """Each group of the plan (lone anchors after the groups) as (kind, rule, the names of its
    nodes, prologue first); a node without a name shows as its op type."""
    return [
        (g.kind, g.rule, [n.name or n.op_type for n in [*g.prologue, *g.nodes]])
        for g in [*plan.groups, *plan.lone]
    ]


def refusals(plan: FusionPlan, rule: str) -> list[tuple[list[str], str]]:
    """The plan's refusals by `rule`: (the nodes it names, why)."""
    return [(r.nodes, r.reason) for r in plan.not_fused if r.rule == rule]


# -- graph-level tests of one rewrite pass (tests/unit/passes/) ---------------------------------------


def run_graph(graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The graph's outputs for `feeds`, each node run by opfuse's per-op runtime (the unfused
    "before" kernels, internal opfuse.* ops included), in the graph's order."""
    import torch

    from opfuse.runtime.ops import run_op
    from opfuse.runtime.tensors import from_numpy, to_numpy

    env = {k: from_numpy(np.asarray(v)) for k, v in {**graph.constants, **feeds}.items()}
    with torch.no_grad():
        for n in graph.nodes:
            outs = run_op(n.op_type, [env[x] if x else None for x in n.inputs], n.attrs, len(n.outputs))
            env.update({name: t for name, t in zip(n.outputs, outs, strict=False) if name})
    return {o.name: to_numpy(env[o.name]) for o in graph.outputs}


def assert_computes_as_onnxruntime(
    model: onnx.ModelProto, graph: Graph, seed: int = 0, atol: float = 1e-4, rtol: float = 1e-4
) -> None:
    """The rewritten `graph` gives, element for element, what onnxruntime gives on the original
    `model` for random float inputs (the model's own static input shapes)."""
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    feeds = {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in model.graph.input
        if i.name not in {init.name for init in model.graph.initializer}
    }
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    got = run_graph(graph, feeds)
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].shape == want.shape, name
        np.testing.assert_allclose(got[name].astype(np.float32), want, atol=atol, rtol=rtol, err_msg=name)


def ops(graph: Graph) -> list[str]:
    """The graph's op types in order."""
    return [n.op_type for n in graph.nodes]


def excitation_block(
    images: int, mlp: str, pool: str = "ReduceMean", c: int = 24, hidden: int = 8, size: int = 5
) -> onnx.ModelProto:
    """Squeeze-excitation after a dense conv (tests/unit/test_pooled_excitation.py):
    y = Relu(x + a * gate(MLP(mean(a)))), a = Relu(conv3x3(x)); `mlp` "two" (fc1, Relu, fc2,
    Sigmoid: SE) or "one" (fc, HardSigmoid: ESE)."""
    n = helper.make_node
    inits = {"w": weights(c, c, 3, 3), "b": weights(c, seed=1)}
    nodes = [
        n("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        n("Relu", ["c"], ["a"], name="act"),
    ]
    if pool == "ReduceMean":
        inits["axes"] = np.array([2, 3])
        nodes.append(n("ReduceMean", ["a", "axes"], ["p"], name="pool", keepdims=1))
    else:
        nodes.append(n("GlobalAveragePool", ["a"], ["p"], name="pool"))
    if mlp == "two":
        inits |= {
            "w1": weights(hidden, c, 1, 1, seed=2),
            "b1": weights(hidden, seed=3),
            "w2": weights(c, hidden, 1, 1, seed=4),
            "b2": weights(c, seed=5),
        }
        nodes += [
            n("Conv", ["p", "w1", "b1"], ["h"], name="fc1"),
            n("Relu", ["h"], ["hr"], name="fc1_act"),
            n("Conv", ["hr", "w2", "b2"], ["s"], name="fc2"),
            n("Sigmoid", ["s"], ["g"], name="gate"),
        ]
    else:
        inits |= {"w1": weights(c, c, 1, 1, seed=2), "b1": weights(c, seed=3)}
        nodes += [
            n("Conv", ["p", "w1", "b1"], ["s"], name="fc"),
            n("HardSigmoid", ["s"], ["g"], name="gate", alpha=1 / 6, beta=0.5),
        ]
    nodes += [
        n("Mul", ["a", "g"], ["scaled"], name="scale"),
        n("Add", ["x", "scaled"], ["sum"], name="residual"),
        n("Relu", ["sum"], ["y"], name="out"),
    ]
    shape = [images, c, size, size]
    return tiny_model(nodes, {"x": shape}, {"y": shape}, inits)


def assert_every_config(
    cm: typing.Any,
    model: onnx.ModelProto,
    kernel: typing.Any,
    shapes: dict[str, list[int]],
    precision: str,
    seed: int,
) -> None:
    """The compiled plan with `kernel` at its own config and at each of its tuning candidates'
    (fresh random inputs each time): every element of every output against onnxruntime on
    `model`, finite, within the precision's tolerance."""
    import onnxruntime as ort

    from opfuse.runtime.executor import Executor
    from opfuse.tuning.candidates import candidates

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    rng = np.random.default_rng(seed)
    tol = 1e-4 if precision == "fp32" else 2e-2
    ex = Executor(cm.plan, TEST_DEVICE)
    for cand in [{}, *candidates(kernel)]:
        ex.configs[kernel.id] = {**kernel.config, **cand}
        feeds = {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}
        got = ex.run(feeds)
        for name, want in zip(names, session.run(None, feeds), strict=True):
            have = np.asarray(got[name], dtype=np.float32)
            assert have.shape == want.shape and np.all(np.isfinite(have)), name
            np.testing.assert_allclose(have, want, rtol=tol, atol=tol * 10, err_msg=f"{name} at {cand}")
