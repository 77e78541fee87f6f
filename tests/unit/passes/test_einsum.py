"""`einsum_matmul` (opfuse/passes/einsum.py): two-operand Einsums that are matrix products become
MatMul with the views around it, computing what onnxruntime's Einsum computes."""

from __future__ import annotations

import pytest
from onnx import helper

from opfuse.frontend import rule_registry as names
from opfuse.passes.einsum import einsum_matmul, parse_equation
from tests.builders import assert_computes_as_onnxruntime, graph_of, ops, run_pass, tiny_model


def einsum_model(equation: str, a: list[int], b: list[int], out: list[int]):  # type: ignore[no-untyped-def]
    node = helper.make_node("Einsum", ["a", "b"], ["y"], name="es", equation=equation)
    return tiny_model([node], {"a": a, "b": b}, {"y": out})


@pytest.mark.parametrize(
    ("equation", "a", "b", "out", "want"),
    [
        # MaxViT's attention: scores, then the product with V (no view at all).
        ("bghid,bghjd->bghij", [2, 3, 2, 5, 4], [2, 3, 2, 6, 4], [2, 3, 2, 5, 6], ["Transpose", "MatMul"]),
        ("B G H I J, B G H J D -> B G H I D", [2, 3, 2, 5, 6], [2, 3, 2, 6, 4], [2, 3, 2, 5, 4], ["MatMul"]),
        # Ellipsis and the implicit output (the letters used once, alphabetically).
        ("...id,...jd->...ij", [3, 5, 4], [3, 6, 4], [3, 5, 6], ["Transpose", "MatMul"]),
        ("ij,jk", [5, 4], [4, 6], [5, 6], ["MatMul"]),
        # The output in another order; two contracted letters; two column letters.
        ("bij,bjk->bki", [2, 5, 4], [2, 4, 6], [2, 6, 5], ["MatMul", "Transpose"]),
        (
            "bcij,cjk->bik",
            [2, 3, 5, 4],
            [3, 4, 6],
            [2, 5, 6],
            ["Transpose", "Reshape", "Reshape", "MatMul", "Reshape"],
        ),
        ("bi,ijk->bjk", [2, 5], [5, 3, 4], [2, 3, 4], ["Reshape", "MatMul", "Reshape"]),
        # A vector: no row letter.
        ("bk,bkj->bj", [2, 5], [2, 5, 3], [2, 3], ["Reshape", "MatMul", "Reshape"]),
    ],
)
def test_a_matrix_product_becomes_matmul(
    equation: str, a: list[int], b: list[int], out: list[int], want: list[str]
) -> None:
    model = einsum_model(equation, a, b, out)
    graph = graph_of(model)
    log = run_pass(graph, einsum_matmul)
    assert log.fired == {names.EINSUM_MATMUL: 1} and ops(graph) == want
    assert graph.nodes[-1].outputs == ["y"]
    assert_computes_as_onnxruntime(model, graph)


@pytest.mark.parametrize(
    ("equation", "a", "b", "out", "why"),
    [
        ("ij,ij->ij", [3, 4], [3, 4], [3, 4], "no letter is contracted"),
        ("ij,jk->k", [3, 4], [4, 5], [5], "summed away"),
        ("...ij,...jk->...ik", [1, 3, 4], [2, 4, 5], [2, 3, 5], "(broadcast)"),
        ("iij,jk->ik", [3, 3, 4], [4, 5], [3, 5], "a diagonal"),
    ],
)
def test_what_is_not_a_matrix_product_stays_an_einsum(
    equation: str, a: list[int], b: list[int], out: list[int], why: str
) -> None:
    graph = graph_of(einsum_model(equation, a, b, out))
    log = run_pass(graph, einsum_matmul)
    assert ops(graph) == ["Einsum"] and not log.fired
    assert len(log.not_fired) == 1 and why in log.not_fired[0].reason, log.not_fired


def test_equations_are_spelled_out() -> None:
    (a, b), out = parse_equation("...ij,...jk", [4, 3])  # type: ignore[misc]
    assert len(a) == 4 and len(b) == 3 and a[2:] == "ij" and b[1:] == "jk"
    assert out == a[:2] + "ik"  # the ellipsis' dims first, then the letters used once
    assert parse_equation("ij,jk->ik", [2]) is None  # operands and equation disagree
    assert parse_equation("ij,jk->ik", [3, 2]) is None
