"""Adding a fusion rule takes its module, its test and its registry entry, nothing else
(docs/design.md, "Adding a fusion rule"): a rule written to a temporary module and named by one
registry entry runs in the planner, in the registry's order, claims its group, says why it
refuses, and turns off with its `fusion.disable` name. The worked example in the docs is the
real code of a rule."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from onnx import helper

from opfuse.frontend import rule_registry as registry
from opfuse.fusion.planner import fusion_rules
from tests.builders import claimed, planned, refusals, tiny_model

ROOT = Path(__file__).resolve().parents[3]

TOY = """
from collections.abc import Iterator

from opfuse.fusion.groups import Group, group_boundary
from opfuse.fusion.rules.base import Candidate, FusionRule

NAME = "abs_neg"


class AbsNeg(FusionRule):
    def match(self) -> Iterator[Candidate]:
        consumers = self.graph.consumers()
        for node in self.graph.nodes:
            readers = consumers.get(node.outputs[0], [])
            if node.op_type == "Abs" and node.id not in self.state.held() and "Neg" in [r.op_type for r in readers]:
                neg = next(r for r in readers if r.op_type == "Neg")
                yield Candidate(NAME, [node, neg], data=len(readers))

    def check(self, c: Candidate) -> str | None:
        return None if c.data == 1 else f"{c.data} nodes read the Abs"

    def claim(self, c: Candidate) -> None:
        ins, outs = group_boundary(self.graph, c.nodes)
        self.state.anchors.append(Group(f"t{len(self.state.anchors)}", "pointwise", NAME, c.nodes, ins, outs))


RULE = AbsNeg
"""


@pytest.fixture
def toy_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The toy rule's module on the path and its entry in the registry, before `pointwise`."""
    (tmp_path / "toy_abs_neg.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = registry.RuleInfo("abs_neg", registry.FUSION, "Abs then Neg in one kernel.", impl="toy_abs_neg")
    at = [r.name for r in registry.REGISTRY].index(registry.POINTWISE)
    entries = (*registry.REGISTRY[:at], entry, *registry.REGISTRY[at:])
    monkeypatch.setattr(registry, "REGISTRY", entries)
    monkeypatch.setattr(registry, "RULES", {r.name: r for r in entries})
    monkeypatch.setattr(registry, "SWITCHES", tuple(r.name for r in entries if r.switchable))
    return entry.name


def model() -> object:
    n = helper.make_node
    return tiny_model(
        [
            n("Abs", ["x"], ["a"], name="abs"),
            n("Neg", ["a"], ["y"], name="neg"),
            n("Abs", ["x"], ["b"], name="abs2"),
            n("Neg", ["b"], ["c"], name="neg2"),
            n("Exp", ["b"], ["d"], name="exp"),
            n("Add", ["c", "d"], ["z"], name="add"),
        ],
        {"x": [4, 8]},
        {"y": [4, 8], "z": [4, 8]},
    )


def test_a_rule_from_its_own_module_runs_from_its_registry_entry(toy_rule: str) -> None:
    order = [loaded.names for loaded in fusion_rules()]
    assert order.index((toy_rule,)) == order.index((registry.POINTWISE,)) - 1
    _, plan = planned(model())
    assert ("pointwise", toy_rule, ["abs", "neg"]) in claimed(plan)
    assert refusals(plan, toy_rule) == [(["abs2", "neg2"], "2 nodes read the Abs")]
    # What it refused, the rules after it may take.
    assert ("pointwise", registry.POINTWISE, ["abs2", "neg2", "exp", "add"]) in claimed(plan)


def test_the_new_rule_turns_off_by_its_name(toy_rule: str) -> None:
    off = registry.check_disable([toy_rule])
    _, plan = planned(model(), tuple(off))
    assert refusals(plan, toy_rule) == []
    assert all(rule != toy_rule for _, rule, _ in claimed(plan))


def test_without_its_entry_the_module_does_not_run() -> None:
    assert all(loaded.names != ("abs_neg",) for loaded in fusion_rules())
    with pytest.raises(ValueError, match="'abs_neg'"):
        registry.check_disable(["abs_neg"])


def test_the_worked_example_in_the_docs_is_the_rules_real_code() -> None:
    """Each code block of docs/design.md's "Adding a fusion rule" that names a file is a run of
    that file's lines, word for word."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design[design.index("## 11. Adding a fusion rule") :]
    blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", section, re.S)
    assert len(blocks) >= 2
    for path, code in blocks:
        assert code.strip() and code in (ROOT / path).read_text(), path
