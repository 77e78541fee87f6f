"""The rule registry: one list of every pass and fusion rule, the docs generated from it, and
`fusion_disable` checked against it."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest

import opfuse
from opfuse.frontend import rule_registry as registry
from tests.builders import residual_mlp

REGENERATE = ".venv/bin/python -m opfuse.frontend.rule_registry --write-docs"


def test_docs_rule_table_and_names_are_the_registry() -> None:
    for path, text in registry.generated_docs().items():
        assert path.read_text() == text, f"{path.name} differs from the rule registry: run `{REGENERATE}`"


def test_every_entry_is_well_formed() -> None:
    names = [r.name for r in registry.REGISTRY]
    assert len(names) == len(set(names))
    constants = {v for k, v in vars(registry).items() if k.isupper() and isinstance(v, str)}
    assert set(names) <= constants  # each name is a constant of the module
    stages = [registry.STAGES.index(r.stage) for r in registry.REGISTRY]
    assert stages == sorted(stages), "entries are in the order the compiler applies them"
    for r in registry.REGISTRY:
        assert r.doc and "\n" not in r.doc and "|" not in r.doc
        assert all(x in registry.RULES and registry.RULES[x].switchable for x in r.requires), r.name
        assert r.switch == (r.name if r.switchable else None)


def test_a_rule_is_off_when_a_rule_it_requires_is() -> None:
    assert registry.enabled(registry.SHORTCUT_CONV)
    assert not registry.enabled(registry.SHORTCUT_CONV, {registry.CONV_EPILOGUE})
    assert not registry.enabled(registry.SHORTCUT_CONV, {registry.CHANNELS_LAST})
    assert not registry.enabled(registry.CHANNEL_WINDOW, [registry.POINTWISE])
    assert registry.enabled(registry.POINTWISE, {registry.CHANNEL_WINDOW})


def test_unknown_names_are_named_with_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        registry.check_disable(["pointwise", "gelu", "layernorm", "gelu"])
    message = str(info.value)
    assert "'gelu', 'layernorm'." in message and "'pointwise'" not in message
    assert all(name in message for name in registry.SWITCHES)
    # Names of passes that always run are not switches.
    with pytest.raises(ValueError, match="'fold_constants'"):
        registry.check_disable([registry.FOLD_CONSTANTS])
    with pytest.raises(
        ValueError, match=r"a list of rule names, got the string 'attention': write \['attention'\]"
    ):
        registry.check_disable("attention")
    assert registry.check_disable(registry.SWITCHES) == frozenset(registry.SWITCHES)


def test_compile_refuses_an_unknown_rule_name_before_anything_runs() -> None:
    model = residual_mlp(hidden=8, ffn=16)
    with pytest.raises(ValueError, match=r"fusion.disable names no rule: 'gelu'\. Use the names .*pointwise"):
        opfuse.compile(model, {"x": [2, 8]}, device="cpu", fusion_disable=["gelu"], verify=False)
    with pytest.raises(opfuse.OpfuseError):  # one line in the CLI, not "a bug in opfuse"
        opfuse.compile(model, {"x": [2, 8]}, device="cpu", fusion_disable=["Pointwise"], verify=False)


def test_compile_with_every_rule_off_matches_the_model() -> None:
    """Every switch the registry lists is accepted, and with all of them off the model runs unfused."""
    model = residual_mlp(hidden=8, ffn=16)
    cm = opfuse.compile(model, {"x": [3, 8]}, device="cpu", fusion_disable=registry.SWITCHES, tune_budget_s=0)
    assert cm.report["verification"]["passed"]
    assert cm.report["fusion"]["groups"] == [] and cm.report["fusion"]["passes"]["fired"] == {}
    x = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    (ref,) = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    (out,) = cm.run({"x": x}).values()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_the_pass_pipeline_is_the_registrys_graph_passes_in_order() -> None:
    from opfuse.passes.pipeline import PASSES
    from opfuse.passes.rules import GraphRule

    run = list(dict.fromkeys(p.name for p in PASSES))  # constants are folded twice
    inside = [o for p in PASSES if isinstance(p, GraphRule) for o in p.options]
    listed = [r.name for r in registry.stage_rules(registry.GRAPH_PASS)]
    assert [n for n in listed if n not in inside] == run
    assert all(p.doc == registry.RULES[p.name].doc for p in PASSES)


def test_a_pass_whose_prerequisite_is_off_does_not_run() -> None:
    from opfuse.passes.pipeline import run_passes
    from tests.builders import conv_bn_relu, graph_of

    graph = graph_of(conv_bn_relu(), {"x": [2, 4, 8, 8]})
    graph_off = graph.copy()
    assert run_passes(graph).fired.get(registry.CHANNELS_LAST, 0) > 0
    fired = run_passes(graph_off, [registry.CHANNELS_LAST]).fired
    assert registry.CHANNELS_LAST not in fired and registry.FOLD_BATCHNORM in fired


def test_the_planner_runs_the_registrys_fusion_rules_in_order() -> None:
    from opfuse.fusion.planner import FUSION_RULES

    claimed = [n for r in FUSION_RULES for n in r.names]
    inside = {o for r in FUSION_RULES for o in r.options}
    listed = [r.name for r in registry.stage_rules(registry.FUSION)]
    assert len(claimed) == len(set(claimed)) and not set(claimed) & inside
    assert set(claimed) | inside == set(listed)
    assert [n for n in listed if n in claimed] == claimed


def test_the_fusion_rules_claim_in_order_and_say_why_not() -> None:
    """A graph-level run of the planner on one small graph: the row rule claims first (the LayerNorm
    with the bias and residual before it), then the GEMM its bias and GELU, then the row kernel
    takes the second GEMM onto its tiles; with the GEMM rule off, that epilogue is a pointwise
    group instead."""
    from opfuse.fusion.planner import plan_fusion
    from opfuse.passes.pipeline import run_passes
    from tests.builders import graph_of

    graph = graph_of(residual_mlp(hidden=8, ffn=16), {"x": [2, 8]})
    run_passes(graph)
    gelu = ["gelu_scale", "gelu_erf", "gelu_add1", "gelu_mul", "gelu_half"]
    norm = ["ln_mean", "ln_sub", "ln_pow", "ln_var", "ln_eps", "ln_sqrt", "ln_div", "ln_scale", "ln_shift"]
    row = (f"{registry.ROW_REDUCTION}+{registry.GEMM_REDUCTION}", ["fc2", "fc2_bias", "residual", *norm])

    def groups(disabled: set[str]) -> list[tuple[str, list[str]]]:
        plan = plan_fusion(graph, disabled)
        return [(g.rule, [n.name for n in [*g.prologue, *g.nodes]]) for g in plan.groups]

    on = groups(set())
    assert on == [row, (registry.GEMM_EPILOGUE, ["fc1", "fc1_bias", *gelu])]
    off = groups({registry.GEMM_EPILOGUE})
    # No GEMM groups, so no lone GEMM for the row kernel to take either.
    assert off == [(registry.ROW_REDUCTION, row[1][1:]), (registry.POINTWISE, ["fc1_bias", *gelu])]
    assert groups({registry.GEMM_REDUCTION})[0] == (registry.ROW_REDUCTION, row[1][1:])
    assert groups({registry.GEMM_EPILOGUE, registry.POINTWISE, registry.ROW_REDUCTION}) == []
