"""A kernel's spec: what the template registry renders its source from, as plain JSON.

Every generated kernel is `template(part.kind).render(kernel id, part, graph, precision)`, where
the part is a fusion group or a piece of one (a split form's kernel). The spec holds that call's
arguments: the part (its nodes with op types and attributes, inputs, outputs, row space, match,
views, prologue), the precision, the rules the job switched off, and the names of the constants
the template read (their values live in the bundle's model.onnx, the value shapes in plan.json).

A bundle carries the specs so that its loader renders each kernel itself with the installed opfuse
and runs only that (opfuse.bundle_check); the spec is data: the decoder builds only the
dataclasses named in `_CLASSES`, and every identifier in it must look like one opfuse generates.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opfuse.codegen.fragments import KernelSource
from opfuse.codegen.registry import TEMPLATES
from opfuse.ir.graph import Graph, Node, TensorSpec
from opfuse.ir.index_map import IndexMap, IndexStep
from opfuse.ir.resize import ResizeAxis, ResizeGather
from opfuse.ir.views import AttentionMatch, StridedView

SPEC_VERSION = 1
# Kernel, group and node ids, op types, kinds, precisions and attribute names: what opfuse
# generates or knows, never model text (node names, the one kind of model text a template reads,
# go into comments through comment_text).
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}")
_NUMERIC_DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}
)


class SpecError(ValueError):
    """The spec is not one this opfuse renders (malformed, unknown template, foreign data)."""


@dataclass
class Part:
    """What a template reads of a fusion group (the registry's GroupLike): a whole group, or
    one kernel of a group's split form."""

    id: str
    kind: str
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    full: tuple[int, ...] = ()
    split: int = -1
    match: Any = None
    views: dict[str, Any] = field(default_factory=dict)
    prologue: list[Node] = field(default_factory=list)
    rule: str = ""  # the group's (a split form's kernel: none of its own)


_CLASSES: dict[str, type] = {
    c.__name__: c
    for c in (Part, Node, StridedView, AttentionMatch, ResizeAxis, ResizeGather, IndexMap, IndexStep)
}


class _Reads(dict[str, np.ndarray]):
    """The graph's constants, noting each name a template asks for (present or not)."""

    def __init__(self, constants: Mapping[str, np.ndarray]) -> None:
        super().__init__(constants)
        self.asked: set[str] = set()

    def __getitem__(self, name: str) -> np.ndarray:
        self.asked.add(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        self.asked.add(name)
        return super().get(name, default)

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str):
            self.asked.add(name)
        return super().__contains__(name)


def render_part(kid: str, part: Part, graph: Graph, precision: str) -> tuple[KernelSource, dict[str, Any]]:
    """Render a part through its kind's template; also its spec (the constants it read noted)."""
    reads = _Reads(graph.constants)
    view = dataclasses.replace(graph, constants=reads)
    src = TEMPLATES[part.kind].render(kid, part, view, precision)
    spec = {
        "version": SPEC_VERSION,
        "kernel": kid,
        "template": part.kind,
        "precision": precision,
        "disabled": sorted(graph.disabled),
        "constants": sorted(n for n in reads.asked if n in graph.constants),
        "part": encode(part),
    }
    return src, spec


def render_spec(
    spec: Any, values: Mapping[str, TensorSpec], constants: Mapping[str, np.ndarray]
) -> KernelSource:
    """The kernel a spec describes, rendered by this opfuse. `values`: every buffer's dtype and
    shape (plan.json); `constants`: the bundle's constants by name. SpecError when the spec is
    malformed, names an unknown template or does not render."""
    if not isinstance(spec, dict) or spec.get("version") != SPEC_VERSION:
        raise SpecError("its spec is missing or of another spec version")
    kid = _ident(spec.get("kernel"), "kernel id")
    kind = _ident(spec.get("template"), "template")
    precision = _ident(spec.get("precision"), "precision")
    if kind not in TEMPLATES:
        raise SpecError(f"its spec names template {kind!r}, which this opfuse does not have")
    disabled, names = spec.get("disabled"), spec.get("constants")
    if not isinstance(disabled, list) or not isinstance(names, list):
        raise SpecError("its spec's disabled rules or constants are not lists")
    for name in disabled:
        _ident(name, "disabled rule")
    missing = [n for n in names if not isinstance(n, str) or n not in constants]
    if missing:
        raise SpecError(f"its spec reads constants the bundle does not hold: {missing[:3]}")
    part = decode(spec.get("part"))
    if not isinstance(part, Part):
        raise SpecError("its spec's part is not a kernel part")
    _check_part(part, kind)
    graph = Graph(
        nodes=[*part.prologue, *part.nodes],
        inputs=[],
        outputs=[],
        constants={n: constants[n] for n in names},
        values=dict(values),
        disabled=set(disabled),
    )
    try:
        return TEMPLATES[kind].render(kid, part, graph, precision)
    except Exception as exc:  # any failure of a foreign spec to render is the spec's fault
        raise SpecError(f"its spec does not render ({type(exc).__name__}: {exc})"[:300]) from None


def _ident(text: Any, what: str) -> str:
    if not isinstance(text, str) or not _IDENT.fullmatch(text):
        raise SpecError(f"its spec's {what} {str(text)[:40]!r} is not one opfuse generates")
    return text


def _check_part(part: Part, kind: str) -> None:
    _ident(part.id, "group id")
    if part.kind != kind:
        raise SpecError("its spec's part is of another kind than its template")
    for n in [*part.prologue, *part.nodes]:
        if not isinstance(n, Node):
            raise SpecError("its spec's nodes are not nodes")
        _ident(n.id, "node id")
        _ident(n.op_type, "op type")
        for key in n.attrs:
            _ident(key, "attribute name")
        if not isinstance(n.name, str):
            raise SpecError("its spec's node name is not text")


def encode(value: Any) -> Any:
    """Plain JSON for a part and what it holds: every container tagged, so it decodes exactly."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float) and not isinstance(value, np.generic):
        return value
    if isinstance(value, np.generic):
        return {"$": "scalar", "dtype": value.dtype.name, "v": value.item()}
    if isinstance(value, np.ndarray):
        return {
            "$": "array",
            "dtype": value.dtype.name,
            "shape": list(value.shape),
            "v": value.ravel().tolist(),
        }
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, tuple):
        return {"$": "tuple", "v": [encode(v) for v in value]}
    if isinstance(value, set | frozenset):
        return {"$": "set", "v": sorted(encode(v) for v in value)}
    if isinstance(value, dict):
        return {"$": "dict", "v": {str(k): encode(v) for k, v in value.items()}}
    if dataclasses.is_dataclass(value) and type(value).__name__ in _CLASSES:
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"$": type(value).__name__, "v": fields}
    raise TypeError(f"a kernel spec cannot hold a {type(value).__name__}")


def decode(data: Any, depth: int = 0) -> Any:
    """The inverse of `encode`, building nothing but containers, numbers, text, numpy arrays of
    numeric dtypes and the dataclasses in `_CLASSES`."""
    if depth > 32:
        raise SpecError("its spec is nested too deep")
    if data is None or isinstance(data, bool | str | int | float):
        return data
    if isinstance(data, list):
        return [decode(v, depth + 1) for v in data]
    if not isinstance(data, dict) or not isinstance(data.get("$"), str):
        raise SpecError("its spec holds an untagged object")
    tag, v = data["$"], data.get("v")
    if tag not in ("scalar", "array") and not isinstance(v, list | dict):
        raise SpecError(f"its spec's {tag[:40]} holds no fields")
    try:
        if tag in ("scalar", "array"):
            dtype = data.get("dtype")
            if dtype not in _NUMERIC_DTYPES:
                raise SpecError(f"its spec holds an array of dtype {str(dtype)[:20]!r}")
            if tag == "scalar":
                return np.dtype(dtype).type(v)
            shape = [int(d) for d in data["shape"]]
            return np.asarray(v, dtype=dtype).reshape(shape)
        if tag == "tuple" and isinstance(v, list):
            return tuple(decode(x, depth + 1) for x in v)
        if tag == "set" and isinstance(v, list):
            return {decode(x, depth + 1) for x in v}
        if tag == "dict" and isinstance(v, dict):
            return {str(k): decode(x, depth + 1) for k, x in v.items()}
        cls = _CLASSES.get(tag)
        if cls is None:
            raise SpecError(f"its spec holds an object of unknown type {tag[:40]!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(v, dict) or not set(v) <= names:
            raise SpecError(f"its spec's {tag} has fields this opfuse does not know")
        return cls(**{k: decode(x, depth + 1) for k, x in v.items()})
    except SpecError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise SpecError(f"its spec's {tag[:40]} does not decode ({exc})"[:200]) from None
