"""Compare outputs with a reference: relative L2 error against a tolerance per precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# (rtol on the relative L2 error ||out - ref|| / ||ref||, atol on the max absolute error).
# An output passes when its relative L2 error is within rtol, or, for outputs whose reference is
# (near) zero, when every element is within atol. Where the reference is ~0 everywhere (max |ref|
# <= atol, an untrained network whose outputs vanish) atol would pass anything, so a precision with
# float32's exponent range (fp32, tf32, bf16: tiny values are still exact to their precision) is
# held to rtol alone there; fp16, which cannot represent such values, passes on atol, said plainly.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-5),
    "tf32": (2e-3, 1e-4),
    "fp16": (2e-2, 1e-3),
    "bf16": (2e-2, 1e-2),
}


@dataclass
class OutputCheck:
    max_abs_err: float
    rel_l2_err: float
    rtol: float
    atol: float
    passed: bool
    reason: str = ""
    # False where the reference has no finite element (NaN or ±inf everywhere): nothing was
    # compared, so the check is no pass (`passed` False), and no failure to roll a group back for.
    compared: bool = True

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "max_abs_err": self.max_abs_err,
            "rel_l2_err": self.rel_l2_err,
            "rtol": self.rtol,
            "atol": self.atol,
            "passed": self.passed,
        }
        if self.reason:
            d["reason"] = self.reason
        return d


WIDE_RANGE = ("fp32", "tf32", "bf16")  # float32's exponent range: scale-free checks are fair


def compare_outputs(
    out: np.ndarray, ref: np.ndarray, rtol: float, atol: float, scale_free: bool = False
) -> OutputCheck:
    """`scale_free`: a reference that is ~0 everywhere is still checked against rtol (see above)."""
    if out.shape != ref.shape:
        return OutputCheck(
            float("inf"), float("inf"), rtol, atol, False, f"shape {out.shape} != reference {ref.shape}"
        )
    if ref.dtype.kind in "biu" or out.dtype.kind in "biu":
        mismatches = int(np.count_nonzero(out != ref))
        diff = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64)))) if out.size else 0.0
        return OutputCheck(
            diff,
            0.0 if mismatches == 0 else 1.0,
            rtol,
            atol,
            mismatches == 0,
            f"{mismatches} elements differ" if mismatches else "",
        )
    o = out.astype(np.float64)
    r = ref.astype(np.float64)
    if nothing_to_compare(r):
        # NaN against NaN compares equal, and a fused plan that computes finite values there may
        # be right: neither is evidence. The verifier draws other inputs (Verifier._draw) first.
        what = "NaN" if np.isnan(r).all() else "non-finite (NaN or ±inf)"
        return OutputCheck(
            0.0,
            0.0,
            rtol,
            atol,
            False,
            f"nothing compared: the reference is {what} everywhere on these inputs",
            compared=False,
        )
    nan_o, nan_r = np.isnan(o), np.isnan(r)
    if not np.array_equal(nan_o, nan_r):
        return OutputCheck(
            float("nan"), float("nan"), rtol, atol, False, "NaN where the reference has none (or vice versa)"
        )
    finite = ~nan_r
    err = np.abs(o[finite] - r[finite])
    err = np.where(np.isnan(err), 0.0, err)  # inf - inf at the same place counts as equal
    max_abs = float(err.max()) if err.size else 0.0
    ref_norm = float(np.linalg.norm(np.where(np.isinf(r[finite]), 0.0, r[finite])))
    err_norm = float(np.linalg.norm(err))
    rel = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))
    passed = bool(rel <= rtol or max_abs <= atol)
    reason = ""
    ref_max = float(np.max(np.abs(r[finite]))) if r[finite].size else 0.0
    if scale_free and 0 < ref_max <= atol:
        passed = bool(rel <= rtol)
        reason = (
            f"the reference is ~0 everywhere (max |ref| {ref_max:.2e} <= atol): held to rtol "
            "on the relative L2 error alone"
        )
    elif passed and rel > rtol and ref_max <= atol:
        # Passed only because every reference value is within atol of zero: the comparison says
        # little about the fused model (an untrained network whose outputs vanish, for example).
        reason = f"passed on atol alone: the reference is ~0 everywhere (max |ref| {ref_max:.2e} <= atol)"
    return OutputCheck(max_abs, rel, rtol, atol, passed, reason)


def nothing_to_compare(ref: np.ndarray) -> bool:
    """Whether reference `ref` (a float output) has no finite element at all: NaN or ±inf everywhere."""
    r = np.asarray(ref)
    if r.dtype.kind in "biu" or r.size == 0:
        return False
    return not bool(np.isfinite(r.astype(np.float64)).any())
