"""What the SDK returns: typed, read-only records built from the API's JSON (DESIGN.md §3, §5).

Fields are attributes (`model.id`, `job.summary.speedup`, `report.after.p50`); the JSON the server
sent is kept whole in `.raw` (and `.to_dict()`, a copy), and every record still reads like that
dict (`job["status"]`, `job.get("error")`), so code written against the dicts keeps working.
A field the server did not send is None (or empty), never an error.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, ClassVar, Self

__all__ = [
    "ApiKey",
    "FusionGroup",
    "Job",
    "JobSummary",
    "Measurement",
    "Model",
    "NotFused",
    "OutputCheck",
    "ProfileOp",
    "Record",
    "Report",
    "TensorSpec",
    "Verification",
]


def _time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


@dataclass(frozen=True, eq=False)
class Record(Mapping[str, Any]):
    """A typed view of one JSON object; reads like the object too (a read-only Mapping)."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    # The parsed fields: name -> how to build the attribute from the JSON value.
    _parse: ClassVar[Mapping[str, Any]] = {}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Self:
        raw = dict(data or {})
        values = {name: parse(raw.get(name)) for name, parse in cls._parse.items()}
        return cls(raw=raw, **values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON the server sent (a copy)."""
        return copy.deepcopy(self.raw)

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "raw")
        return f"{type(self).__name__}({shown})"


def _records(cls: type[Record]) -> Any:
    def parse(value: Any) -> tuple[Record, ...]:
        items = value if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else ()
        return tuple(cls.from_dict(v) for v in items if isinstance(v, Mapping))

    return parse


@dataclass(frozen=True, eq=False, repr=False)
class TensorSpec(Record):
    """A model input or output: `shape` holds ints and, for a dynamic dim, its symbol (`"batch"`)."""

    name: str | None = None
    dtype: str | None = None
    shape: tuple[int | str, ...] = ()
    _parse: ClassVar[Mapping[str, Any]] = {
        "name": _str,
        "dtype": _str,
        "shape": lambda v: tuple(v or ()),
    }

    @property
    def dynamic(self) -> bool:
        """True when a dim is a symbol: the job needs `input_shapes` for it."""
        return any(not isinstance(d, int) for d in self.shape)


@dataclass(frozen=True, eq=False, repr=False)
class Model(Record):
    id: str | None = None
    name: str | None = None
    sha256: str | None = None
    size_bytes: int | None = None
    opset: int | None = None
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    created_at: datetime | None = None
    _parse: ClassVar[Mapping[str, Any]] = {
        "id": _str,
        "name": _str,
        "sha256": _str,
        "size_bytes": _int,
        "opset": _int,
        "inputs": _records(TensorSpec),
        "outputs": _records(TensorSpec),
        "created_at": _time,
    }


@dataclass(frozen=True, eq=False, repr=False)
class JobSummary(Record):
    speedup: float | None = None
    latency_ms_before: float | None = None
    latency_ms_after: float | None = None
    kernels_before: int | None = None
    kernels_after: int | None = None
    peak_memory_before: int | None = None
    peak_memory_after: int | None = None
    _parse: ClassVar[Mapping[str, Any]] = {
        "speedup": _float,
        "latency_ms_before": _float,
        "latency_ms_after": _float,
        "kernels_before": _int,
        "kernels_after": _int,
        "peak_memory_before": _int,
        "peak_memory_after": _int,
    }


@dataclass(frozen=True, eq=False, repr=False)
class Job(Record):
    """A job; `summary` is set once it succeeded (None before)."""

    id: str | None = None
    model_id: str | None = None
    status: str | None = None
    stage: str | None = None
    progress: float | None = None
    attempts: int | None = None
    error: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    summary: JobSummary | None = None
    _parse: ClassVar[Mapping[str, Any]] = {
        "id": _str,
        "model_id": _str,
        "status": _str,
        "stage": _str,
        "progress": _float,
        "attempts": _int,
        "error": _str,
        "options": _dict,
        "created_at": _time,
        "started_at": _time,
        "finished_at": _time,
        "summary": lambda v: JobSummary.from_dict(v) if isinstance(v, Mapping) else None,
    }

    @property
    def done(self) -> bool:
        """True once the job succeeded, failed or was canceled."""
        return self.status in ("succeeded", "failed", "canceled")


@dataclass(frozen=True, eq=False, repr=False)
class ApiKey(Record):
    """A key as the admin API lists it (`key`: only in the answer that made it)."""

    id: int | None = None
    key: str | None = None
    prefix: str | None = None
    tenant: str | None = None
    scope: str | None = None
    created_at: datetime | None = None
    last_used_at: datetime | None = None
    expires_at: datetime | None = None
    revoked: bool = False
    _parse: ClassVar[Mapping[str, Any]] = {
        "id": _int,
        "key": _str,
        "prefix": _str,
        "tenant": _str,
        "scope": _str,
        "created_at": _time,
        "last_used_at": _time,
        "expires_at": _time,
        "revoked": bool,
    }


# -- the report (DESIGN.md §5) ----------------------------------------------------------------------


@dataclass(frozen=True, eq=False, repr=False)
class Measurement(Record):
    """One side of the benchmark (`report.before`, `report.after`): latencies in ms."""

    latency_ms: dict[str, float] = field(default_factory=dict)
    throughput_per_s: float | None = None
    peak_memory_bytes: int | None = None
    kernel_launches_measured: int | None = None
    gpu_util_pct: float | None = None
    _parse: ClassVar[Mapping[str, Any]] = {
        "latency_ms": lambda v: {k: float(x) for k, x in _dict(v).items() if _float(x) is not None},
        "throughput_per_s": _float,
        "peak_memory_bytes": _int,
        "kernel_launches_measured": _int,
        "gpu_util_pct": _float,
    }

    @property
    def p50(self) -> float | None:
        return self.latency_ms.get("p50")

    @property
    def p99(self) -> float | None:
        return self.latency_ms.get("p99")


@dataclass(frozen=True, eq=False, repr=False)
class OutputCheck(Record):
    max_abs_err: float | None = None
    rel_l2_err: float | None = None
    rtol: float | None = None
    atol: float | None = None
    _parse: ClassVar[Mapping[str, Any]] = {
        "max_abs_err": _float,
        "rel_l2_err": _float,
        "rtol": _float,
        "atol": _float,
    }


@dataclass(frozen=True, eq=False, repr=False)
class Verification(Record):
    passed: bool | None = None
    reference: str | None = None
    outputs: dict[str, OutputCheck] = field(default_factory=dict)
    rolled_back: tuple[str, ...] = ()
    _parse: ClassVar[Mapping[str, Any]] = {
        "passed": lambda v: v if isinstance(v, bool) else None,
        "reference": _str,
        "outputs": lambda v: {str(k): OutputCheck.from_dict(o) for k, o in _dict(v).items()},
        "rolled_back": lambda v: tuple(str(g) for g in v or ()),
    }


@dataclass(frozen=True, eq=False, repr=False)
class FusionGroup(Record):
    id: str | None = None
    kind: str | None = None
    rule: str | None = None
    nodes: tuple[str, ...] = ()
    kernel: str | None = None
    bytes_saved_est: int | None = None
    time_ms_before: float | None = None
    time_ms_after: float | None = None
    _parse: ClassVar[Mapping[str, Any]] = {
        "id": _str,
        "kind": _str,
        "rule": _str,
        "nodes": lambda v: tuple(str(n) for n in v or ()),
        "kernel": _str,
        "bytes_saved_est": _int,
        "time_ms_before": _float,
        "time_ms_after": _float,
    }


@dataclass(frozen=True, eq=False, repr=False)
class NotFused(Record):
    rule: str | None = None
    nodes: tuple[str, ...] = ()
    reason: str | None = None
    _parse: ClassVar[Mapping[str, Any]] = {
        "rule": _str,
        "nodes": lambda v: tuple(str(n) for n in v or ()),
        "reason": _str,
    }


@dataclass(frozen=True, eq=False, repr=False)
class ProfileOp(Record):
    """One ONNX node of the original model, as the profiler timed it."""

    node: str | None = None
    op_type: str | None = None
    time_ms: float | None = None
    bytes: int | None = None
    flops: int | None = None
    intensity: float | None = None
    bound: str | None = None
    _parse: ClassVar[Mapping[str, Any]] = {
        "node": _str,
        "op_type": _str,
        "time_ms": _float,
        "bytes": _int,
        "flops": _int,
        "intensity": _float,
        "bound": _str,
    }


@dataclass(frozen=True, eq=False, repr=False)
class Report(Record):
    """A finished job's report; `before`/`after` are None where nothing was benchmarked."""

    device: dict[str, Any] = field(default_factory=dict)
    precision: str | None = None
    speedup: float | None = None
    kernels_before: int | None = None
    kernels_after: int | None = None
    before: Measurement | None = None
    after: Measurement | None = None
    verification: Verification = field(default_factory=Verification)
    groups: tuple[FusionGroup, ...] = ()
    not_fused: tuple[NotFused, ...] = ()
    ops: tuple[ProfileOp, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Self:
        raw = dict(data or {})
        kernels, fusion, profile = (
            _dict(raw.get("kernels")),
            _dict(raw.get("fusion")),
            _dict(raw.get("profile")),
        )

        def side(name: str) -> Measurement | None:
            value = raw.get(name)
            return Measurement.from_dict(value) if isinstance(value, Mapping) else None

        return cls(
            raw=raw,
            device=_dict(raw.get("device")),
            precision=_str(raw.get("precision")),
            speedup=_float(raw.get("speedup")),
            kernels_before=_int(kernels.get("before")),
            kernels_after=_int(kernels.get("after")),
            before=side("before"),
            after=side("after"),
            verification=Verification.from_dict(_dict(raw.get("verification"))),
            groups=_records(FusionGroup)(fusion.get("groups")),
            not_fused=_records(NotFused)(fusion.get("not_fused")),
            ops=_records(ProfileOp)(profile.get("ops")),
        )

    @property
    def on_interpreter(self) -> bool:
        """True when the kernels ran in Triton's CPU interpreter: its latencies are no speed claim."""
        return self.device.get("kind") == "cpu-interpreter"
