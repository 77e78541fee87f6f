"""Triton expressions of the pointwise ops: one emitter per op, shared by every template.

An emitter takes the expressions of its arguments (float32 registers; in the pointwise template
also integer and boolean ones, for `ir.ops.MASK_OPS` and exact integer arithmetic), the node and
its inputs' scalar constants, and returns the expression of its output. `ir.ops.POINTWISE_OPS` names the ops
that have one: fusion plans with that set, so the two must agree (checked on import).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from opfuse.codegen.source import float_literal
from opfuse.graph import Node
from opfuse.ir.ops import (
    COMPARE_OPS,
    INT_TYPES,
    LOGIC_OPS,
    MASK_OPS,
    ONNX_CASTS,
    POINTWISE_OPS,
    gelu_approximate,
)

TL_DTYPES = {
    "float32": "tl.float32",
    "float16": "tl.float16",
    "bfloat16": "tl.bfloat16",
    "int32": "tl.int32",
    "int64": "tl.int64",
}

Emitter = Callable[[list[str], Node, list[float | None]], str]
EMITTERS: dict[str, Emitter] = {}


def emitter(*ops: str) -> Callable[[Emitter], Emitter]:
    def deco(fn: Emitter) -> Emitter:
        for op in ops:
            EMITTERS[op] = fn
        return fn

    return deco


_BINARY = {"Add": "({0} + {1})", "Sub": "({0} - {1})", "Mul": "({0} * {1})", "Div": "({0} / {1})"}


@emitter(*_BINARY)
def _binary(a: list[str], n: Node, c: list[float | None]) -> str:
    return _BINARY[n.op_type].format(*a)


@emitter("Max", "Min")
def _minmax(a: list[str], n: Node, c: list[float | None]) -> str:
    fn = "tl.maximum" if n.op_type == "Max" else "tl.minimum"
    expr = a[0]
    for arg in a[1:]:
        expr = f"{fn}({expr}, {arg})"
    return expr


_UNARY = {
    "Relu": "tl.maximum({0}, 0.0)",
    "Sigmoid": "tl.sigmoid({0})",
    "Erf": "tl.erf({0})",
    "Exp": "tl.exp({0})",
    "Log": "tl.log({0})",
    "Sqrt": "tl.sqrt({0})",
    "Neg": "(-{0})",
    "Abs": "tl.abs({0})",
    "Reciprocal": "(1.0 / {0})",
    "Identity": "{0}",
    # tanh through exp(-2|x|) is stable for every x (no overflow) and exact at the tails.
    "Tanh": "tl.where({0} >= 0.0, 1.0, -1.0) * (1.0 - tl.exp(-2.0 * tl.abs({0}))) / (1.0 + tl.exp(-2.0 * tl.abs({0})))",
    # softplus = max(x, 0) + log1p(exp(-|x|)): no overflow for large x; log1p(t) ≈ t - t²/2 for
    # small t keeps the digits that log(1 + t) loses when x ≪ 0 (Triton has no log1p).
    "Softplus": (
        "(tl.maximum({0}, 0.0) + tl.where(tl.exp(-tl.abs({0})) < 1e-4, "
        "tl.exp(-tl.abs({0})) * (1.0 - 0.5 * tl.exp(-tl.abs({0}))), tl.log(1.0 + tl.exp(-tl.abs({0})))))"
    ),
}


@emitter(*_UNARY)
def _unary(a: list[str], n: Node, c: list[float | None]) -> str:
    return _UNARY[n.op_type].format(a[0])


@emitter("LeakyRelu")
def _leaky(a: list[str], n: Node, c: list[float | None]) -> str:
    alpha = float_literal(float(n.attrs.get("alpha", 0.01)))
    return f"tl.where({a[0]} >= 0.0, {a[0]}, {a[0]} * {alpha})"


@emitter("Elu")
def _elu(a: list[str], n: Node, c: list[float | None]) -> str:
    alpha = float_literal(float(n.attrs.get("alpha", 1.0)))
    return f"tl.where({a[0]} > 0.0, {a[0]}, {alpha} * (tl.exp({a[0]}) - 1.0))"


@emitter("HardSigmoid")
def _hardsigmoid(a: list[str], n: Node, c: list[float | None]) -> str:
    alpha = float_literal(float(n.attrs.get("alpha", 0.2)))
    beta = float_literal(float(n.attrs.get("beta", 0.5)))
    return f"tl.minimum(tl.maximum({alpha} * {a[0]} + {beta}, 0.0), 1.0)"


@emitter("HardSwish")
def _hardswish(a: list[str], n: Node, c: list[float | None]) -> str:
    return f"({a[0]} * tl.minimum(tl.maximum({a[0]} * (1.0 / 6.0) + 0.5, 0.0), 1.0))"


@emitter("Clip")
def _clip(a: list[str], n: Node, c: list[float | None]) -> str:
    expr = a[0]
    if len(a) > 1 and a[1]:
        expr = f"tl.maximum({expr}, {a[1]})"
    if len(a) > 2 and a[2]:
        expr = f"tl.minimum({expr}, {a[2]})"
    return expr


@emitter("Gelu")
def _gelu(a: list[str], n: Node, c: list[float | None]) -> str:
    x = a[0]
    if gelu_approximate(n) == "tanh":
        two_k = float_literal(2.0 * math.sqrt(2.0 / math.pi))
        return f"({x} * tl.sigmoid({two_k} * ({x} + 0.044715 * {x} * {x} * {x})))"
    return f"(0.5 * {x} * (1.0 + tl.erf({x} * {float_literal(1.0 / math.sqrt(2.0))})))"


@emitter("Pow")
def pow_expr(a: list[str], n: Node, c: list[float | None]) -> str:
    e = c[1]
    assert e is not None  # fusible only with a scalar constant exponent (see pointwise_reason)
    x = a[0]
    special = {
        1.0: x,
        2.0: f"({x} * {x})",
        3.0: f"({x} * {x} * {x})",
        4.0: f"(({x} * {x}) * ({x} * {x}))",
        0.5: f"tl.sqrt({x})",
        -1.0: f"(1.0 / {x})",
        -0.5: f"(1.0 / tl.sqrt({x}))",
        0.0: f"({x} * 0.0 + 1.0)",
    }
    if e in special:
        return special[e]
    # exp(e * log x): NaN for a negative base with a non-integer exponent, as ONNX Pow gives.
    return f"tl.exp({float_literal(e)} * tl.log({x}))"


@emitter("Where")
def _where(a: list[str], n: Node, c: list[float | None]) -> str:
    return f"tl.where({a[0]} != 0.0, {a[1]}, {a[2]})"


@emitter("Cast")
def _cast(a: list[str], n: Node, c: list[float | None]) -> str:
    target = ONNX_CASTS[int(n.attrs["to"])]
    if target == "bool":
        return f"({a[0]} != 0)"
    if target in INT_TYPES:  # from a float: truncated toward zero, as ONNX Cast does
        return f"{a[0]}.to({TL_DTYPES[target]})"
    if target == "float32":  # the register is float32 (codegen.pointwise converts integers first)
        return a[0]
    # Round through the narrower type, as the unfused Cast would.
    return f"{a[0]}.to({TL_DTYPES[target]}).to(tl.float32)"


@emitter(*COMPARE_OPS)
def _compare(a: list[str], n: Node, c: list[float | None]) -> str:
    return f"({a[0]} {COMPARE_OPS[n.op_type]} {a[1]})"


@emitter(*LOGIC_OPS)
def _logic(a: list[str], n: Node, c: list[float | None]) -> str:
    return f"({a[0]} {LOGIC_OPS[n.op_type]} {a[1]})"


@emitter("Not")
def _not(a: list[str], n: Node, c: list[float | None]) -> str:
    return f"({a[0]} == 0)"


if set(EMITTERS) != POINTWISE_OPS | MASK_OPS:
    raise ImportError(
        "ir.ops.POINTWISE_OPS | MASK_OPS and the emitters differ in "
        f"{sorted(set(EMITTERS) ^ (POINTWISE_OPS | MASK_OPS))}"
    )
