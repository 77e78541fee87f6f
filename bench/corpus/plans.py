"""The corpus's quick check (`python -m bench.corpus.run --check-plans`): the launches opfuse plans
for each row now, against the launches expected.csv holds, without compiling or running anything.

Each selected row and exporter is exported as the CPU leg exports it (run.export, the row's own
example inputs) and planned by bench.kernels.plan_model: the front half of opfuse.compile (load,
passes, fusion planning, lowering), fp32, nothing disabled, as the CPU leg compiles. A row takes
seconds, where the CPU leg's compile and verification in Triton's interpreter take minutes.

The plan is an upper bound on what a compile keeps: the compile can run some planned groups
unfused (a group whose code generation fails, or that verification rolls back), each one or more
launches more than planned. So a row that differs is a row to run again (`make corpus
ROWS=<row>`), not necessarily a bug; one whose plan has more launches than the file's compile
is a plan that got worse (or an export that changed: the line then says the compute nodes too).
The alternative form of every group (what tuning on the GPU times each template against) is
generated too: a group whose alternative cannot be generated makes the row an error here. With
`--run-alternatives` the plan with every group in its alternative form also runs, in the
interpreter, against onnxruntime (seconds to minutes a row; `gpu_only_verify` rows are planned
only).
Rows the file has as not compiled (export_failed, unsupported, model_error, crash, timeout,
not_run) are skipped with that status. The file is only read.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bench.corpus.run import export, input_shapes, one_line

# The file's statuses of a row that compiled: its `launches` is the compiled plan's.
COMPILED = ("ok", "compiled", "not_verified")


@dataclass
class Check:
    model: str
    exporter: str
    verdict: str  # ok, differs, error or skipped
    file_launches: str = ""  # as the file has it
    planned: int | None = None
    note: str = ""  # why a row is skipped or failed; what else differs
    # What the plan runs outside any group: launches by op type, and the rules' refusals.
    alone: Counter[str] = field(default_factory=Counter)
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)
    # --run-alternatives: the verification record of the plan with every group in its
    # alternative form (bench.kernels.verify_alternatives). None: not run.
    alternatives: dict[str, Any] | None = None
    # Copies the runtime makes that no launch counts (bench.kernels.view_copies): a kernel input
    # that is a non-contiguous view, a Reshape of a non-contiguous value. None: not counted.
    copies: int | None = None
    # Library convs with a bias the plan runs as per-op steps: torch adds the bias with a kernel
    # of its own after the library's conv, a launch no step counts (bench.kernels.bias_adds).
    bias_adds: int = 0
    # Softmaxes the plan runs outside an attention group, by the ops from their score MatMul to
    # them (bench.kernels.softmax_chains): the score chains attention does not take.
    softmaxes: Counter[str] = field(default_factory=Counter)

    @property
    def tag(self) -> str:
        """The row and its exporter's initial, as the summaries name it: `timm/dla34[d]`."""
        return f"{self.model}[{self.exporter[0]}]"

    def line(self, width: int) -> str:
        planned = "-" if self.planned is None else str(self.planned)
        verdict = f"{self.verdict}: {self.note}" if self.verdict == "error" else self.verdict
        if self.note and self.verdict != "error":
            verdict += f" ({self.note})"
        if self.alternatives is not None and self.verdict != "error":
            verdict += f" ({_errors(self.alternatives)})"
        return f"{self.model:<{width}} {self.exporter:<11} {self.file_launches or '-':>6} {planned:>7}  {verdict}"


def _verified(record: Mapping[str, Any]) -> bool:
    """The alternatives pass: verified, no group rolled back."""
    return bool(record.get("passed")) and not record.get("rolled_back")


def _errors(record: Mapping[str, Any]) -> str:
    """`alternatives: relative L2 1.2e-03[, held to the unfused plan's error][, rolled back ...]`"""
    errs = [o.get("rel_l2_err") for o in record.get("outputs", {}).values()]
    worst = max((float(e) for e in errs if e is not None), default=float("nan"))
    text = f"alternatives: relative L2 {worst:.1e}"
    if record.get("basis") == "unfused_precision":
        text += ", held to the unfused plan's error"
    if record.get("rolled_back"):
        text += f", rolled back {', '.join(record['rolled_back'])}"
    return text + (f" ({record['note']})" if not _verified(record) and record.get("note") else "")


def _reason(text: str) -> str:
    """A refusal's reason without the names and sizes of one model (counted across rows)."""
    names = r"\b[\w./:]*node_[\w./:]*|'[^']*'|(?<![\w)])/[\w./:-]+"  # dynamo's, quoted, TorchScript's
    return re.sub(r"\d+", "N", re.sub(names, "X", text))[:100]


def plan_launches(
    module: Any,
    example: dict[str, Any],
    exporter: str,
    workdir: str,
    check: Check | None = None,
    run_alternatives: bool = False,
) -> tuple[int, int]:
    """(the fused plan's launches, compute nodes) of one export of `module`, as opfuse.compile on
    the CPU would plan it (fp32, no rule disabled) before it runs anything. `check` gets what the
    plan runs outside any group and the fusion rules' refusals; with `run_alternatives`, the error
    of the plan with every group in its alternative form, run against onnxruntime."""
    import onnx

    from bench.kernels import (
        alternative_faults,
        bias_adds,
        plan_model,
        softmax_chains,
        verify_alternatives,
        view_copies,
    )

    path = os.path.join(workdir, f"{exporter}.onnx")
    export(module, example, path, exporter)
    proto = onnx.load(path)  # with its external data
    p = plan_model(proto, input_shapes(proto, example), "fp32")
    faults = alternative_faults(p, "fp32")
    if faults:  # the GPU's tuning would meet them: an error here, where no GPU is needed
        gid, why = next(iter(faults.items()))
        raise RuntimeError(
            f"the alternative form of {len(faults)} group(s) cannot be generated ({gid}: {why})"
        )
    if check is not None and run_alternatives:
        check.alternatives = verify_alternatives(p, proto)
    if check is not None:
        check.alone.update(s.op_type for s in p.plan.steps if s.kind == "op" and not s.group and s.launches)
        check.refused.update((x.rule, _reason(x.reason)) for x in p.fusion.not_fused)
        check.copies = view_copies(p.plan)
        check.bias_adds = bias_adds(p.plan)
        check.softmaxes = softmax_chains(p)
    return p.plan.launches, sum(1 for s in p.base_plan.steps if s.launches)


def check_row(
    row: Any,
    exporters: list[str],
    expected: Mapping[tuple[str, str], Mapping[str, str]],
    run_alternatives: bool = False,
) -> list[Check]:
    """One Check per exporter of `row`; the model is built only where a line of the file is to be
    checked. Never raises for the row's sake: what failed is an "error" check. With
    `run_alternatives` (not for a row the interpreter is too slow for, `gpu_only_verify`), the plan
    with every group in its alternative form is verified too, as a compile verifies its plan: a
    failure, or a group rolled back, is the row's error."""
    checks: dict[str, Check] = {}
    todo: list[str] = []
    for e in exporters:
        want = expected.get((row.name, e))
        status = (want or {}).get("status") or "not_run"
        if want is None:
            checks[e] = Check(row.name, e, "skipped", note="not in the file")
        elif status not in COMPILED or not want.get("launches"):
            checks[e] = Check(row.name, e, "skipped", note=f"{status} in the file")
        else:
            checks[e] = Check(row.name, e, "", file_launches=want["launches"])
            todo.append(e)
    if not todo:
        return [checks[e] for e in exporters]
    # The exporters' progress lines go to stderr: stdout holds only the checks.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            module, example = row.build()
        except Exception as exc:
            for e in todo:
                checks[e].verdict, checks[e].note = "error", "building: " + one_line(exc)
            return [checks[e] for e in exporters]
        for e in todo:
            c = checks[e]
            try:
                with tempfile.TemporaryDirectory(prefix="opfuse-plan-") as d:
                    run = run_alternatives and not row.gpu_only_verify
                    c.planned, compute = plan_launches(module, example, e, d, c, run)
            except Exception as exc:
                c.verdict, c.note = "error", one_line(exc)
                continue
            if c.alternatives is not None and not _verified(c.alternatives):
                c.verdict, c.note = (
                    "error",
                    f"the alternative forms miss onnxruntime: {_errors(c.alternatives)}",
                )
                continue
            c.verdict = "ok" if c.planned == int(c.file_launches) else "differs"
            was = expected[(row.name, e)].get("compute_nodes")
            if c.verdict == "differs" and was and int(was) != compute:
                c.note = f"compute nodes {was} in the file, {compute} now: the export changed"
    return [checks[e] for e in exporters]


def _by_row(checks: list[Check], counts: Callable[[Check], Counter[str]]) -> dict[str, Counter[str]]:
    """Each key of the rows' `counts` -> row[exporter] -> its count there."""
    out: dict[str, Counter[str]] = {}
    for c in checks:
        for key, n in counts(c).items():
            out.setdefault(key, Counter())[c.tag] += n
    return out


def explain(checks: list[Check], say: Callable[[str], None], top: int = 12) -> None:
    """Across the rows planned: the ops that run outside any group (launches, rows), and the
    fusion rules' most frequent refusals: where a general mechanism would save the most."""
    refused: Counter[tuple[str, str]] = sum((c.refused for c in checks), Counter())
    where = _by_row(checks, lambda c: c.alone)  # op -> row[exporter] -> launches
    alone = Counter({op: sum(r.values()) for op, r in where.items()})
    copies = Counter({c.tag: c.copies for c in checks if c.copies})
    adds = Counter({c.tag: c.bias_adds for c in checks if c.bias_adds})
    chain_rows = _by_row(checks, lambda c: c.softmaxes)  # the ops from the score MatMul -> row -> Softmaxes
    chains = Counter({chain: sum(r.values()) for chain, r in chain_rows.items()})
    if not alone and not refused and not copies and not adds and not chains:
        return
    say("runs outside any group (launches over the rows planned, rows; the rows with the most):")
    for op, n in alone.most_common(top):
        most = ", ".join(f"{r} {k}" for r, k in where[op].most_common(3))
        say(f"  {op:<28} {n:6} {len(where[op]):5}  {most}")
    say("the fusion rules' most frequent refusals (times, rule: reason):")
    for (rule, reason), n in refused.most_common(top):
        say(f"  {n:6}  {rule}: {reason}")
    if copies:
        # Real kernels on the GPU (inside the CUDA graph), outside the launch count.
        most = ", ".join(f"{r} {k}" for r, k in copies.most_common(6))
        say(
            f"copies the runtime makes that no launch counts (views a kernel cannot read, Reshapes "
            f"of non-contiguous values): {sum(copies.values())} over {len(copies)} rows; the most: {most}"
        )
    if adds:
        most = ", ".join(f"{r} {k}" for r, k in adds.most_common(6))
        say(
            f"library convs with a bias run per op (torch adds the bias with a kernel of its own, which "
            f"no launch counts): {sum(adds.values())} over {len(adds)} rows; the most: {most}"
        )
    if chains:
        say(
            "Softmaxes outside attention groups (times, rows; the ops from the score MatMul; the rows with the most):"
        )
        for chain, n in chains.most_common(top):
            most = ", ".join(f"{r} {k}" for r, k in chain_rows[chain].most_common(3))
            say(f"  {n:6} {len(chain_rows[chain]):5}  {chain}: {most}")


def check_plans(
    rows: list[Any],
    exporters: list[str],
    expected: Mapping[tuple[str, str], Mapping[str, str]],
    say: Callable[[str], None] = print,
    run_alternatives: bool = False,
) -> int:
    """Check each row and exporter, one line each as it is checked, then a summary; 1 where any
    row differs or could not be planned (or, `run_alternatives`, its alternative forms compute
    something else than onnxruntime), else 0."""
    width = max([len(r.name) for r in rows] + [len("row")])
    say(f"{'row':<{width}} {'exporter':<11} {'file':>6} {'planned':>7}  check")
    checks: list[Check] = []
    for row in rows:
        for c in check_row(row, exporters, expected, run_alternatives):
            checks.append(c)
            say(c.line(width))
            sys.stdout.flush()
    words = {"ok": "ok", "differs": "differ", "error": "failed", "skipped": "skipped"}
    count = ", ".join(f"{sum(c.verdict == v for c in checks)} {w}" for v, w in words.items())
    say(f"{count} (of {len(checks)} row-exporters)")
    explain(checks, say)
    moved = sorted({c.model for c in checks if c.verdict in ("differs", "error")})
    if moved:
        say(
            "a compile can keep fewer groups than its plan forms (groups rolled back by verification or "
            "run unfused), so a row that differs is one to run again, not necessarily a bug: "
            f"make corpus ROWS='{','.join(moved)}'"
        )
    return 1 if moved else 0
