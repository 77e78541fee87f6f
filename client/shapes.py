"""Input shapes as users type them: `--shape x=2x3x224x224` (or `x=2,3,224,224`; `x=` for a scalar)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SHAPE_HELP = "NAME=DIMxDIMx..., e.g. x=1x3x224x224"


class ShapeSpecError(ValueError):
    """A --shape value that does not parse, or that does not fit the model. The message says why."""


def parse_shape(spec: str) -> tuple[str, list[int]]:
    """`"x=1x3x224x224"` → `("x", [1, 3, 224, 224])`."""
    name, sep, dims_text = spec.rpartition("=")
    name = name.strip()
    if not sep or not name:
        raise ShapeSpecError(f"--shape {spec!r}: expected {SHAPE_HELP}")
    dims_text = dims_text.strip()
    if not dims_text:
        return name, []
    dims: list[int] = []
    for part in re.split(r"[x,X*]", dims_text):
        part = part.strip()
        if not part.isdigit():
            what = "an empty dimension" if not part else f"{part!r} is not a whole number"
            raise ShapeSpecError(f"--shape {spec!r}: {what}; expected {SHAPE_HELP}")
        dim = int(part)
        if dim < 1:
            raise ShapeSpecError(f"--shape {spec!r}: dimensions must be at least 1, got {dim}")
        dims.append(dim)
    return name, dims


def parse_shapes(specs: Iterable[str]) -> dict[str, list[int]]:
    """Several --shape values into `{name: dims}`; the same name twice is an error."""
    shapes: dict[str, list[int]] = {}
    for spec in specs:
        name, dims = parse_shape(spec)
        if name in shapes:
            raise ShapeSpecError(f"--shape given twice for input {name!r}; give each input once")
        shapes[name] = dims
    return shapes


def format_shape(shape: Sequence[Any]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def check_shapes_fit(shapes: Mapping[str, Sequence[int]], inputs: Sequence[Mapping[str, Any]]) -> None:
    """Every name is a model input, ranks agree, static dims match, and every dynamic input has a shape."""
    by_name = {str(i.get("name")): list(i.get("shape") or []) for i in inputs}
    described = ", ".join(f"{n} [{', '.join(str(d) for d in s)}]" for n, s in by_name.items())
    for name, dims in shapes.items():
        if name not in by_name:
            raise ShapeSpecError(
                f"--shape {name}=...: the model has no input {name!r}; its inputs are: {described}"
            )
        declared = by_name[name]
        if declared and len(declared) != len(dims):
            raise ShapeSpecError(
                f"--shape {name}={format_shape(dims)}: input {name!r} has rank {len(declared)} "
                f"({', '.join(str(d) for d in declared)}), not {len(dims)}"
            )
        for i, (want, got) in enumerate(zip(declared, dims, strict=False)):
            if isinstance(want, int) and want != got:
                raise ShapeSpecError(
                    f"--shape {name}={format_shape(dims)}: dimension {i} of input {name!r} is fixed at {want}"
                )
    for name, declared in by_name.items():
        dynamic = [str(d) for d in declared if not isinstance(d, int)]
        if dynamic and name not in shapes:
            example = "x".join(str(d) if isinstance(d, int) else "1" for d in declared)
            raise ShapeSpecError(
                f"input {name!r} has dynamic dimensions ({', '.join(dynamic)}); give its shape, "
                f"e.g. --shape {name}={example}"
            )
