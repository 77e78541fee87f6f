"""Verification with rollback: the fused plan against the reference, and the groups to blame.

`Verifier` checks a plan on fresh random inputs against onnxruntime (or, where onnxruntime cannot
run the model, opfuse's unfused float32 plan: `UnfusedReference`); where the fused plan fails, the
unfused plan at the same precision is checked the same way (`precision_bound`), and the groups that
fail (on their own, or together) are found by halving (`bisect_bad`) and rolled back. `first_run`
runs a fused plan for the first time, leaving unfused a group whose kernel fails to compile or
raises.

An output whose reference has no finite element on the inputs drawn (NaN or ±inf everywhere:
a row fully masked for small token ids) compares nothing: other inputs are drawn first, integer
inputs across a wider range (`_draw`); where every draw leaves it so, its check is no pass and no
failure (`OutputCheck.compared`), and no rollback is decided on it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from opfuse.errors import ModelError
from opfuse.fusion.planner import FusionPlan
from opfuse.lowering import build_plan
from opfuse.pipeline.context import describe
from opfuse.runtime.executor import Executor
from opfuse.runtime.plan import Plan
from opfuse.verify.compare import OutputCheck, compare_outputs, nothing_to_compare
from opfuse.verify.reference import WIDER_INT_HIGHS, OnnxRuntimeReference, describe_draw, random_inputs

if TYPE_CHECKING:
    from opfuse.pipeline.builder import PlanBuilder

log = logging.getLogger(__name__)

VERIFY_TRIALS = 2
KEPT_FAILURES = 2  # inputs a check failed on, run again by every later check
# Draws tried after one whose reference is non-finite everywhere on some output, one per level of
# `random_inputs(wider=...)`: integer inputs that index a table across the table, then the other
# integer inputs below 4, 16, 256, 4096.
VACUOUS_RETRIES = len(WIDER_INT_HIGHS)


class UnfusedReference:
    """The fallback reference where onnxruntime cannot run a model: opfuse's unfused per-op plan
    in float32 on the CPU (independent of every fusion, though not of opfuse's op kernels)."""

    name = "opfuse-unfused-fp32-cpu"

    def __init__(self, plan: Plan, why: str) -> None:
        self.executor = Executor(plan, "cpu")
        self.why = why

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in self.executor.run(feeds).items()}


class Verifier:
    def __init__(
        self,
        original: onnx.ModelProto,
        inputs: list[Any],
        device: str,
        tol: tuple[float, float],
        rng: np.random.Generator,
        fallback: Plan,
        scale_free: bool = False,
        background: bool = False,
    ) -> None:
        """`background`: the first trials' reference outputs are computed in a thread (onnxruntime
        releases the GIL), ready when the first check needs them."""
        self.scale_free = scale_free  # see compare_outputs
        # Output name -> the rtol it is held to where the unfused plan itself misses the
        # reference at this precision (precision_bound); empty: every output at self.tol.
        self.bound: dict[str, float] = {}
        # Output name -> how far the reference moves under one rounding step of its weights
        # (OnnxRuntimeReference.sensitivity); measured only where the unfused plan misses by more
        # than PRECISION_BOUND_LIMIT rtols.
        self.sensitivity: dict[str, float] = {}
        self.baseline: dict[str, OutputCheck] = {}
        self.inputs = inputs
        self.device = device
        self.tol = tol
        self.rng = rng
        self.reference: Any = None
        # (feeds, reference outputs) computed ahead: the first check's trials.
        self.ready: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        # (feeds, reference outputs) a check failed on: every later check runs them first.
        self.kept: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        # Under a precision bound: the unfused plan's cases, which every later check runs instead
        # of fresh ones (its error varies from input to input, so the bound holds on those only).
        self.fixed: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] | None = None
        self.last: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
        # How integer inputs are drawn (random_inputs' `wider`): raised where the usual draw left
        # an output's reference non-finite everywhere and a wider one did not (`_draw`).
        self.wider = 0
        # Set once every retry left some output non-finite everywhere: later draws retry no more.
        self.exhausted = False
        self.widened = ""  # what `_draw` drew instead, for the report's note
        self.tried = ""  # the draws `_draw` tried in vain, for the report's note
        feeds = [random_inputs(inputs, rng) for _ in range(VERIFY_TRIALS)]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if background:
            self._thread = threading.Thread(
                target=self._prepare, args=(original, fallback, feeds), daemon=True
            )
            self._thread.start()
        else:
            self._prepare(original, fallback, feeds)

    def _prepare(self, original: onnx.ModelProto, fallback: Plan, feeds: list[dict[str, np.ndarray]]) -> None:
        try:
            try:
                self.reference = OnnxRuntimeReference(original)
                # The first run also shows whether onnxruntime takes the model: it may load but
                # not run it (types, opsets).
                self.ready = [(f, self.reference.run(f)) for f in feeds]
            except Exception as exc:  # onnxruntime cannot run every valid model (newest opsets, bf16)
                self.ready = []
                self.reference = UnfusedReference(
                    fallback, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                )
        except BaseException as exc:  # raised again where the check waits for it
            self._error = exc

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def check(self, plan: Plan) -> tuple[bool, dict[str, OutputCheck]]:
        """Fresh random inputs for every check, after the inputs an earlier check failed on (at
        most KEPT_FAILURES): a miss that only some inputs show (a token id whose embedding row is
        zero) is seen again by the unfused plan's check and by each step of the bisection, so the
        group behind it is found. Under a precision bound, the unfused plan's own cases instead
        (self.fixed), so fusion's error is set against the unfused plan's on the same inputs. The
        worst result per output is kept."""
        self._wait()
        worst: dict[str, OutputCheck] = {}
        executor = Executor(plan, self.device)
        cases = list(self.kept if self.fixed is None else self.fixed)
        for _ in range(VERIFY_TRIALS if self.fixed is None else 0):
            cases.append(self._draw(self.ready.pop()) if self.ready else self._draw())
        self.last = cases
        for feeds, ref in cases:
            out = executor.run(feeds)
            missed = False
            for name, r in ref.items():
                rtol = self.bound.get(name, self.tol[0])
                c = compare_outputs(np.asarray(out[name]), r, rtol, self.tol[1], scale_free=self.scale_free)
                missed = missed or (c.compared and not c.passed)
                if _worse(c, worst.get(name)):
                    worst[name] = c
            fresh = self.fixed is None and all(f is not feeds for f, _ in self.kept)
            if missed and len(self.kept) < KEPT_FAILURES and fresh:
                self.kept.append((feeds, ref))
        # An output that compared nothing on every case neither passes nor fails here: no
        # rollback is decided on it (the record says so, `_json`).
        return all(c.passed or not c.compared for c in worst.values()), worst

    def _draw(
        self, case: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """A fresh case (feeds, reference outputs), or `case`, computed ahead at level 0. Where
        some output's reference is non-finite everywhere on it (transformers/helium on token ids
        0-3: a row fully masked, softmax of all -inf), other inputs are drawn, one per level of
        `random_inputs(wider=...)` from the level later draws use (at least 1), and the first
        whose reference is finite somewhere on every output is taken, its level kept for later
        draws. A draw the reference refuses (an index out of range through an op the frontend
        does not bound) is passed over. Where none does, the draw with the fewest such outputs
        is taken and later draws retry no more."""
        drawn = 0 if case is not None else self.wider
        if case is None:
            feeds = random_inputs(self.inputs, self.rng, drawn)
            case = (feeds, self.reference.run(feeds))
        empty = _nothing_to_compare(case[1])
        if not empty or self.exhausted:
            return case
        best, fewest, level = case, empty, drawn
        first = max(1, self.wider)  # the levels below gave nothing to compare already
        for wider in range(first, VACUOUS_RETRIES + 1):
            feeds = random_inputs(self.inputs, self.rng, wider)
            try:
                ref = self.reference.run(feeds)
            except Exception:  # inputs this model does not take: the next level, or none
                continue
            now = _nothing_to_compare(ref)
            if len(now) < len(fewest):
                best, fewest, level = (feeds, ref), now, wider
            if not now:
                break
        if fewest:
            self.exhausted = True
            self.tried = (
                f"on each of {2 + VACUOUS_RETRIES - first} input draws, from {describe_draw(drawn)} to "
                f"{describe_draw(VACUOUS_RETRIES)}"
            )
        elif level != self.wider or not self.widened:
            self.widened = (
                f"the reference of output(s) {', '.join(repr(n) for n in empty)} was NaN or ±inf "
                f"everywhere with {describe_draw(drawn)}: checked on inputs drawn with {describe_draw(level)}"
            )
        self.wider = level
        return best

    def verify_with_rollback(self, builder: PlanBuilder, plan: Plan) -> tuple[Plan, dict[str, Any]]:
        """Check `plan` (made by `builder`); where it fails, and fusion is to blame, the plan
        without the groups that fail on their own, and the verification record (report key)."""
        groups = builder.groups
        ok, checks = self.check(plan)
        rolled: list[str] = []
        note = ""
        if not ok:
            # Is fusion to blame? The unfused plan (one library op per node) at the same precision
            # is checked the same way: where it misses too, the miss is the precision's.
            if groups:
                base_ok, base_checks = self.check(self._unfused(builder))
            else:
                base_ok, base_checks = ok, checks
            if not base_ok:
                failed, note = self._bound_by_unfused(builder, base_checks)
                if failed:
                    return plan, self._json(False, checks, rolled, note)
                ok, checks = self.check(plan) if groups else (True, checks)
        if not ok and groups:
            full = plan
            plan, rolled, ok, checks = self._roll_back(builder)
            if not ok and not self.bound:
                # Still missing with those groups unfused: the misses are not fusion's alone. An
                # error that varies with the input near rtol (halonet26t in fp16: the unfused
                # plan passed on the first inputs, later ones missed for every plan, and the
                # bisection rolled back 11 correct groups) is the precision's own where the
                # unfused plan misses on these same inputs: then the fused plan is held to the
                # unfused plan's error on them, as above, and rolled back only where it fails so.
                self.fixed = self.last
                base_ok, base_checks = self.check(self._unfused(builder))
                if base_ok:
                    self.fixed = None
                else:
                    failed, note = self._bound_by_unfused(builder, base_checks)
                    if failed:
                        return plan, self._json(False, checks, rolled, note)
                    plan = full
                    ok, checks = self.check(plan)
                    rolled = []
                    if not ok:
                        plan, rolled, ok, checks = self._roll_back(builder)
        return plan, self._json(ok, checks, rolled, note)

    def _unfused(self, builder: PlanBuilder) -> Plan:
        return build_plan(
            builder.graph, FusionPlan([], []), builder.precision, builder.inputs, builder.outputs
        )

    def _roll_back(self, builder: PlanBuilder) -> tuple[Plan, list[str], bool, dict[str, OutputCheck]]:
        """Bisect the groups that fail on their own: (the plan without them, their ids, and the
        check of that plan)."""
        ids = [g.id for g in builder.groups]

        def fails(subset: list[str]) -> bool:
            try:
                return not self.check(builder.plan(subset))[0]
            except ModelError:
                raise
            except Exception as exc:  # a fused kernel that raises fails verification too
                log.warning("verifying the plan with groups %s fused raised %s", subset, describe(exc))
                return True

        rolled = bisect_bad(ids, fails)
        plan = builder.plan([i for i in ids if i not in rolled])
        ok, checks = self.check(plan)
        return plan, rolled, ok, checks

    def _bound_by_unfused(
        self, builder: PlanBuilder, base_checks: dict[str, OutputCheck]
    ) -> tuple[bool, str]:
        """The unfused plan misses the reference too (`base_checks`): hold each output to
        PRECISION_BOUND_FACTOR times the unfused plan's error on the unfused plan's cases, where
        that error is the precision's own. (True, why not) where it is not: no fusion is to
        blame, and the compile is unverified; else (False, the report's note)."""
        note = ""
        bound, why = precision_bound(base_checks, self.tol[0])
        if not bound and self.kept and isinstance(self.reference, OnnxRuntimeReference):
            # Past PRECISION_BOUND_LIMIT rtols: an op is wrong, or the model amplifies
            # rounding that much. The reference's own move under one rounding step of
            # its weights tells them apart (a deep CNN with random weights, in fp32).
            step = ROUNDING_STEP.get(builder.precision, ROUNDING_STEP["fp32"])
            try:
                self.sensitivity = self.reference.sensitivity(*self.kept[0], step, self.rng)
            except Exception as exc:  # a second session that fails: no bound, and why
                note = f"the reference's sensitivity could not be measured: {describe(exc)}"
            else:
                bound, why = precision_bound(base_checks, self.tol[0], self.sensitivity)
        if not bound:
            return True, (
                f"the unfused plan in {builder.precision} also differs from the reference ({why}), so "
                "no fusion is to blame: the model is too sensitive for this precision (try fp32 "
                "or tf32, or a looser rtol), or an op is wrong" + (f"; {note}" if note else "")
            )
        self.bound, self.baseline, self.fixed = bound, base_checks, self.last
        return False, (
            f"the unfused plan in {builder.precision} differs from the reference by more than rtol "
            f"{self.tol[0]:g} ({why}): that is this precision's own error on this model, not "
            f"fusion's. Each such output is held to {PRECISION_BOUND_FACTOR:g}x the unfused "
            "plan's relative L2 error instead (outputs.*.baseline_rel_l2_err)"
        )

    def _json(
        self, ok: bool, checks: dict[str, OutputCheck], rolled: list[str], note: str = ""
    ) -> dict[str, Any]:
        empty = [name for name, c in checks.items() if not c.compared]
        notes = [note, self.widened]
        if empty:  # a check that compared nothing is no pass (and rolled nothing back)
            ok = False
            notes.append(
                f"nothing compared on output(s) {', '.join(repr(n) for n in empty)}: the reference is NaN "
                f"or ±inf everywhere {self.tried or 'on the inputs drawn'}; unverified there, and no group "
                "was rolled back for it"
            )
        note = "; ".join(n for n in notes if n)
        d: dict[str, Any] = {
            "passed": ok,
            "reference": self.reference.name,
            "outputs": {k: self._output_json(k, v) for k, v in checks.items()},
            "rolled_back": rolled,
            "trials": VERIFY_TRIALS,
        }
        if note:
            d["note"] = note
        if self.bound:
            d["basis"] = "unfused_precision"
        if isinstance(self.reference, UnfusedReference):
            d["reference_note"] = f"onnxruntime could not run the model ({self.reference.why})"
        return d

    def _output_json(self, name: str, check: OutputCheck) -> dict[str, Any]:
        d = check.to_json()
        if name in self.bound:
            d["baseline_rel_l2_err"] = self.baseline[name].rel_l2_err
        if name in self.sensitivity:
            d["reference_sensitivity"] = self.sensitivity[name]
        return d


def first_run(builder: PlanBuilder, plan: Plan, device: str, feeds: dict[str, Any]) -> tuple[Plan, Executor]:
    """Compile the plan's kernels here and run it once on `feeds`; (the plan that ran, its warm
    executor). A group whose kernel fails to compile (load its generated module) or raises when
    it first runs is excluded from `builder`, with why, and the plan is made again without it. A
    failure in a step no group owns is not fusion's: it is raised."""
    from opfuse.runtime import executor as executor_module

    interpret = not device.startswith("cuda")
    while True:
        bad: dict[str, str] = {}
        for k in plan.kernels.values():
            if k.group in bad:
                continue
            try:
                executor_module.load_kernel_module(k.source, interpret)
            except ModelError:
                raise
            except Exception as exc:
                bad[k.group] = f"compiling its generated kernel raised {describe(exc)}"
        if not bad:
            runner = Executor(plan, device)
            at = [-1]
            runner.step_hook = lambda i, step, at=at: at.__setitem__(0, i)
            try:
                runner.run(feeds)
                runner.step_hook = None
                return plan, runner
            except ModelError:
                raise
            except Exception as exc:
                step = plan.steps[at[0]] if at[0] >= 0 else None
                if step is None or not step.group or step.group in builder.unsafe:
                    raise
                what = f"kernel {step.kernel}" if step.kind == "kernel" else f"library op {step.op_type}"
                bad[step.group] = f"the first run of its {what} raised {describe(exc)}"
        builder.exclude(bad)
        plan = builder.plan()


PRECISION_BOUND_FACTOR = 2.0  # how much more error than the unfused plan's a fused output may have
PRECISION_BOUND_LIMIT = 5.0  # past this many rtols (or sensitivities) the unfused plan is wrong
# One rounding step of a weight (relative): the machine epsilon of the values the plan computes in.
ROUNDING_STEP = {"fp32": 2.0**-23, "tf32": 2.0**-10, "fp16": 2.0**-10, "bf16": 2.0**-7}


def precision_bound(
    base: dict[str, OutputCheck], rtol: float, sensitivity: Mapping[str, float] | None = None
) -> tuple[dict[str, float], str]:
    """Where the unfused plan misses the reference at the job's precision, what each output's
    rtol becomes: PRECISION_BOUND_FACTOR times the unfused plan's error, for an output it misses
    by at most PRECISION_BOUND_LIMIT rtols, or as many times the reference's own sensitivity (how
    far it moves under one rounding step of its weights) where that is larger. Fusion changes the
    order of arithmetic, never the precision of the values between kernels; a deep network whose
    error in fp16 is already past rtol unfused (ResNet-50 with random weights: 2.8%) is held to
    what fusion adds. Empty (with why) where an output misses by more, has NaN, or has the wrong
    shape: that is not a rounding error."""
    bound: dict[str, float] = {}
    sens = sensitivity or {}
    missed = [(name, c) for name, c in base.items() if c.compared and not c.passed]
    for name, c in missed:
        limit = PRECISION_BOUND_LIMIT * max(rtol, sens.get(name, 0.0))
        if not (np.isfinite(c.rel_l2_err) and c.rel_l2_err <= limit) or c.reason:
            moved = (
                f" (the reference moves by {sens[name]:.3g} under one rounding step)" if name in sens else ""
            )
            return {}, f"output {name!r}: relative L2 error {c.rel_l2_err:.3g}{moved}" + (
                f", {c.reason}" if c.reason else ""
            )
        bound[name] = PRECISION_BOUND_FACTOR * c.rel_l2_err
    why = ", ".join(
        f"output {name!r}: {c.rel_l2_err:.3g}"
        + (
            f", the reference itself moving by {sens[name]:.3g} under one rounding step"
            if name in sens
            else ""
        )
        for name, c in missed
    )
    return bound, why


def bisect_bad(ids: list[str], fails: Callable[[list[str]], bool]) -> list[str]:
    """Groups to roll back so that the rest passes: first those that fail on their own, found by
    halving the set of fused groups; then, while the rest still fails (groups that are right
    alone and wrong together: one sanitizes a NaN the other makes), the group whose addition
    makes a prefix of the rest fail, found by halving the prefix. Each round rolls back one
    group and the rest shrinks, so it ends; where nothing fails it costs one check."""
    if not ids or not fails(ids):
        return []
    found = _failing_alone(ids, fails, True)
    rest = [i for i in ids if i not in found]
    known_failing = not found  # nothing fails alone, so `rest` (all of ids) fails together
    while rest and (known_failing or fails(rest)):
        known_failing = False
        lo, hi = 1, len(rest)  # rest[:hi] fails; rest[:0] (nothing fused) passes
        while lo < hi:
            mid = (lo + hi) // 2
            if fails(rest[:mid]):
                hi = mid
            else:
                lo = mid + 1
        found.append(rest.pop(hi - 1))
    return found


def _failing_alone(
    ids: list[str], fails: Callable[[list[str]], bool], failing: bool | None = None
) -> list[str]:
    if not ids or not (fails(ids) if failing is None else failing):
        return []
    if len(ids) == 1:
        return list(ids)
    mid = len(ids) // 2
    return _failing_alone(ids[:mid], fails) + _failing_alone(ids[mid:], fails)


def _nothing_to_compare(ref: Mapping[str, np.ndarray]) -> list[str]:
    """The outputs whose reference has no finite element (NaN or ±inf everywhere)."""
    return [name for name, r in ref.items() if nothing_to_compare(np.asarray(r))]


def _worse(new: OutputCheck, old: OutputCheck | None) -> bool:
    """Whether `new` replaces `old` as an output's worst check of one `Verifier.check`: a check
    that compared something beats one that compared nothing; then a failure beats a pass; then
    the larger relative L2 error (NaN and a wrong shape the largest). Among failures too: the
    unfused plan's worst check sets the precision bound (`precision_bound`), and a later,
    smaller miss kept instead would hold every plan to less than its own error on the inputs it
    missed most on."""
    if old is None:
        return True
    if new.compared != old.compared:
        return new.compared
    if new.passed != old.passed:
        return not new.passed
    return _error_size(new) > _error_size(old)


def _error_size(check: OutputCheck) -> float:
    return check.rel_l2_err if np.isfinite(check.rel_l2_err) else float("inf")
