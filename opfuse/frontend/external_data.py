"""External data of a local model (what `torch.onnx.export` writes beside `m.onnx` as `m.onnx.data`),
read safely into the model's tensors.

A model file is untrusted: its external data locations are paths it chooses. Only files inside the
model's own folder are read: a location that is empty, absolute, holds `..`, a backslash or a NUL,
that is a symbolic link or passes through one, that resolves outside the folder, or that is not a
regular file is refused; so is an offset or length outside the file, or a length that is not the
tensor's dtype × shape byte count. onnx's own `load_external_data_for_model` checks none of this.

Needs only onnx and the standard library (the API server's upload checks import this package).
"""

from __future__ import annotations

import math
import os
import posixpath
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx

from opfuse.errors import ModelError

__all__ = [
    "ExternalRef",
    "external_refs",
    "external_tensors",
    "has_external_data",
    "inline_external_data",
    "unsafe_location",
]

MAX_INLINE_BYTES = 2 * 1024**3 - 1  # protobuf's limit for one message (inspect.MAX_MODEL_BYTES)

_FIX = (
    "keep the data files the exporter wrote as real files next to the .onnx file, or save the model "
    "self-contained (onnx.save_model(model, path, save_as_external_data=False))"
)


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _node_tensors(nodes: Iterator[onnx.NodeProto] | list[onnx.NodeProto]) -> Iterator[onnx.TensorProto]:
    for node in nodes:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            elif attr.type == onnx.AttributeProto.TENSORS:
                yield from attr.tensors
            elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                yield attr.sparse_tensor.values
                yield attr.sparse_tensor.indices


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor that can carry data: initializers, sparse initializers and node attributes, in
    the graph, all its subgraphs and the model's functions."""
    pending = [model.graph]
    for function in model.functions:
        yield from _node_tensors(list(function.node))
        for node in function.node:
            pending.extend(_subgraphs(node))
    while pending:
        graph = pending.pop()
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        yield from _node_tensors(list(graph.node))
        for node in graph.node:
            pending.extend(_subgraphs(node))


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """The tensors whose bytes live in an external file."""
    return (t for t in _all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL)


def has_external_data(model: onnx.ModelProto) -> bool:
    return next(external_tensors(model), None) is not None


def unsafe_location(location: str) -> str | None:
    """Why an external data location could name a file outside the model's folder, or None."""
    if not location:
        return "it is empty"
    if "\x00" in location:
        return "it contains a NUL byte"
    if "\\" in location:
        return "it contains a backslash"
    if location.startswith("/") or (len(location) > 1 and location[1] == ":"):
        return "it is an absolute path"
    if ".." in location.split("/"):
        return "it contains '..'"
    return None


# Bits per element of the types external data can hold (STRING cannot: its bytes are not raw).
_BITS_BY_NAME = {
    "FLOAT": 32,
    "UINT8": 8,
    "INT8": 8,
    "UINT16": 16,
    "INT16": 16,
    "INT32": 32,
    "INT64": 64,
    "BOOL": 8,
    "FLOAT16": 16,
    "DOUBLE": 64,
    "UINT32": 32,
    "UINT64": 64,
    "COMPLEX64": 64,
    "COMPLEX128": 128,
    "BFLOAT16": 16,
    "FLOAT8E4M3FN": 8,
    "FLOAT8E4M3FNUZ": 8,
    "FLOAT8E5M2": 8,
    "FLOAT8E5M2FNUZ": 8,
    "FLOAT8E8M0": 8,
    "UINT4": 4,
    "INT4": 4,
    "FLOAT4E2M1": 4,
    "UINT2": 2,
    "INT2": 2,
}
_BITS = {
    int(getattr(onnx.TensorProto, name)): bits
    for name, bits in _BITS_BY_NAME.items()
    if hasattr(onnx.TensorProto, name)
}


def _refuse(problem: str) -> ModelError:
    return ModelError(f"cannot read the model's external data: {problem}; {_FIX}")


def _expected_bytes(tensor: onnx.TensorProto, label: str) -> int:
    if any(d < 0 for d in tensor.dims):
        raise _refuse(f"{label} has a negative dim in its shape {list(tensor.dims)}")
    bits = _BITS.get(tensor.data_type)
    if bits is None:
        type_name = onnx.TensorProto.DataType.Name(tensor.data_type) if tensor.data_type else "UNDEFINED"
        raise _refuse(f"{label} is of type {type_name}, which external data cannot hold")
    return (math.prod(tensor.dims) * bits + 7) // 8


def _checked_file(base: Path, location: str, label: str) -> Path:
    """`location` under `base`, walked one component at a time: no links, a regular file at the
    end, and still inside `base` once resolved."""
    why = unsafe_location(location)
    if why is not None:
        raise _refuse(f"{label} has external data location '{location}', which is refused: {why}")
    parts = [p for p in location.split("/") if p not in ("", ".")]
    if not parts:
        raise _refuse(f"{label} has external data location '{location}', which names no file")
    current = base
    for i, part in enumerate(parts):
        current = current / part
        last = i == len(parts) - 1
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            raise _refuse(
                f"{label} keeps its data in '{location}', which is not in the model's folder {base}"
            ) from None
        except OSError as exc:
            raise _refuse(f"{label} keeps its data in '{location}', which cannot be read ({exc})") from None
        if stat.S_ISLNK(st.st_mode):
            what = (
                "is a symbolic link"
                if last
                else f"passes through the symbolic link '{'/'.join(parts[: i + 1])}'"
            )
            raise _refuse(f"{label} has external data location '{location}', which {what}")
        if last and not stat.S_ISREG(st.st_mode):
            raise _refuse(f"{label} has external data location '{location}', which is not a regular file")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise _refuse(f"{label} has external data location '{location}', whose '{part}' is not a folder")
    real_base = base.resolve()
    if not current.resolve().is_relative_to(real_base):
        raise _refuse(f"{label} has external data location '{location}', which is outside the model's folder")
    return current


@dataclass(frozen=True)
class ExternalRef:
    """`length` bytes at `offset` of `path` (its name relative to the model's folder: `location`)."""

    tensor: onnx.TensorProto
    location: str
    path: Path
    offset: int
    length: int


def external_refs(model: onnx.ModelProto, base: str | os.PathLike[str]) -> list[ExternalRef]:
    """Every external reference of `model`, checked against the files in folder `base` (nothing
    read yet). Raises ModelError with the first problem."""
    base_path = Path(os.path.abspath(base))
    sizes: dict[Path, int] = {}
    refs: list[ExternalRef] = []
    for tensor in external_tensors(model):
        label = f"tensor '{tensor.name}'" if tensor.name else "an unnamed tensor"
        fields = {entry.key: entry.value for entry in tensor.external_data}
        location = fields.get("location", "")
        path = _checked_file(base_path, location, label)
        if path not in sizes:
            sizes[path] = os.stat(path).st_size
        size = sizes[path]
        try:
            offset = int(fields.get("offset") or 0)
            length = int(fields["length"]) if fields.get("length") else size - offset
        except ValueError:
            raise _refuse(f"{label} has a non-integer external data offset or length") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise _refuse(
                f"{label} reads bytes {offset}..{offset + length} of '{location}', "
                f"but that file has {size} bytes (truncated or not the file the model was saved with)"
            )
        expected = _expected_bytes(tensor, label)
        if expected != length:
            raise _refuse(
                f"{label} needs {expected} bytes for its shape {list(tensor.dims)} but its external "
                f"data is {length} bytes"
            )
        refs.append(ExternalRef(tensor, posixpath.normpath(location), path, offset, length))
    return refs


def _read_exactly(fd: int, offset: int, length: int) -> bytes:
    chunks: list[bytes] = []
    done = 0
    while done < length:
        chunk = os.pread(fd, min(length - done, 1 << 26), offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def inline_external_data(model: onnx.ModelProto, base: str | os.PathLike[str], model_bytes: int = 0) -> None:
    """Read every external tensor's bytes from the files in folder `base` into the model, in place,
    as if it had been saved self-contained. `model_bytes`: the size of the .onnx file itself, counted
    with the data against protobuf's 2 GiB limit. Raises ModelError saying what is wrong."""
    refs = external_refs(model, base)
    total = model_bytes + sum(ref.length for ref in refs)
    if total > MAX_INLINE_BYTES:
        raise ModelError(
            f"the model with its external data is {total} bytes, over 2 GiB (protobuf's limit for one "
            "ONNX model, which opfuse holds in memory); opfuse cannot take a model that big"
        )
    by_path: dict[Path, list[ExternalRef]] = {}
    for ref in refs:
        by_path.setdefault(ref.path, []).append(ref)
    for path, path_refs in by_path.items():
        try:
            # O_NOFOLLOW: a link put in place since the check is refused by the kernel.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise _refuse(f"'{path_refs[0].location}' cannot be opened ({exc})") from None
        try:
            size = os.fstat(fd).st_size
            for ref in sorted(path_refs, key=lambda r: r.offset):
                data = _read_exactly(fd, ref.offset, ref.length) if ref.offset + ref.length <= size else b""
                if len(data) != ref.length:
                    raise _refuse(f"'{ref.location}' ended before the data of tensor '{ref.tensor.name}'")
                ref.tensor.raw_data = data
                del ref.tensor.external_data[:]
                ref.tensor.data_location = onnx.TensorProto.DEFAULT
        finally:
            os.close(fd)
