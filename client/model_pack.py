"""What the SDK uploads for a model file: the .onnx itself, or a zip of it and its external data.

`torch.onnx.export(m, args, "m.onnx")` writes the weights beside the model (`m.onnx.data`); the
server takes such a model as a zip (`Content-Type: application/zip`) holding the .onnx file and its
data files. The files are collected under the rules the server and the library apply: only regular
files inside the model's folder, no symbolic links (nor a path through one), no absolute paths or
`..`, and every offset and length inside its file. A user's own .zip is sent as it is.

onnx is imported only when a model may have external data (the SDK otherwise needs httpx alone).
"""

from __future__ import annotations

import mmap
import os
import stat
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

ONNX_CONTENT_TYPE = "application/octet-stream"
ZIP_CONTENT_TYPE = "application/zip"
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip with entries / an empty zip
_CHUNK = 1 << 20
_FIX = (
    "keep the data files the exporter wrote as real files next to the .onnx file, or save the model "
    "self-contained (onnx.save_model(model, path, save_as_external_data=False))"
)


class ModelPackError(ValueError):
    """A model's external data cannot be collected for upload; the message says why and what to do."""


@dataclass(frozen=True)
class UploadFile:
    """The file to send and how: the model itself, a user's zip, or a zip packed here."""

    path: Path
    content_type: str
    packed_files: tuple[str, ...] = ()  # the data files a packed zip holds besides the .onnx


def is_zip(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) in ZIP_MAGIC


def _may_have_external_data(path: Path) -> bool:
    """False when the file cannot hold an external reference: the key "location" never occurs."""
    if path.stat().st_size == 0:
        return False
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return view.find(b"location") >= 0


def _external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    import onnx

    def node_tensors(nodes: list[onnx.NodeProto]) -> Iterator[onnx.TensorProto]:
        for node in nodes:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors
                elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices
                elif attr.type == onnx.AttributeProto.GRAPH:
                    pending.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    pending.extend(attr.graphs)

    pending: list[onnx.GraphProto] = [model.graph]
    tensors: list[onnx.TensorProto] = []
    for function in model.functions:
        tensors.extend(node_tensors(list(function.node)))
    while pending:
        graph = pending.pop()
        tensors.extend(graph.initializer)
        for sparse in graph.sparse_initializer:
            tensors.extend((sparse.values, sparse.indices))
        tensors.extend(node_tensors(list(graph.node)))
    return (t for t in tensors if t.data_location == onnx.TensorProto.EXTERNAL)


def _unsafe_location(location: str) -> str | None:
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


def _refuse(problem: str) -> ModelPackError:
    return ModelPackError(f"cannot upload the model's external data: {problem}; {_FIX}")


def _checked_file(base: Path, location: str, label: str) -> tuple[str, Path]:
    """(the location as a zip entry name, the file): walked one component at a time, no links."""
    why = _unsafe_location(location)
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
    if not current.resolve().is_relative_to(base.resolve()):
        raise _refuse(f"{label} has external data location '{location}', which is outside the model's folder")
    return "/".join(parts), current


def external_data_files(model_path: Path) -> dict[str, Path]:
    """The data files `model_path` refers to, by their zip entry name (checked); {} for none."""
    if not _may_have_external_data(model_path):
        return {}
    import onnx
    from google.protobuf.message import DecodeError

    model = onnx.ModelProto()
    try:
        model.ParseFromString(model_path.read_bytes())
    except (DecodeError, ValueError, RuntimeError):
        return {}  # not a model: sent as it is, and the server says what is wrong with it
    base = Path(os.path.abspath(model_path.parent))
    files: dict[str, Path] = {}
    sizes: dict[str, int] = {}
    for tensor in _external_tensors(model):
        label = f"tensor '{tensor.name}'" if tensor.name else "an unnamed tensor"
        fields = {entry.key: entry.value for entry in tensor.external_data}
        location = fields.get("location", "")
        entry, path = _checked_file(base, location, label)
        if entry.lower().endswith(".onnx"):
            raise _refuse(f"{label} keeps its data in '{location}', a name the upload keeps for the model")
        size = sizes.setdefault(entry, path.stat().st_size)
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
        files[entry] = path
    return files


def _model_entry(model_path: Path) -> str:
    name = model_path.name
    return name if name.lower().endswith(".onnx") else name + ".onnx"


def _copy_into(archive: zipfile.ZipFile, source: Path, entry: str) -> None:
    info = zipfile.ZipInfo(entry, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    info.compress_type = zipfile.ZIP_STORED  # weights hardly compress; storing is fast
    # O_NOFOLLOW: a link put in place since the check is refused.
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as src, archive.open(info, "w", force_zip64=True) as dst:
        while chunk := src.read(_CHUNK):
            dst.write(chunk)


@contextmanager
def upload_file(path: str | os.PathLike[str]) -> Iterator[UploadFile]:
    """What to send for the model at `path`; a zip packed here is deleted on exit.

    A .zip (by content) is sent as a zip; a self-contained model as raw ONNX; a model with external
    data as a zip of the model and its data files. ModelPackError when the data files cannot be
    collected safely.
    """
    path = Path(path)
    if is_zip(path):
        yield UploadFile(path, ZIP_CONTENT_TYPE)
        return
    files = external_data_files(path)
    if not files:
        yield UploadFile(path, ONNX_CONTENT_TYPE)
        return
    with tempfile.TemporaryDirectory(prefix="opfuse-upload-") as tmp:
        packed = Path(tmp) / (path.stem + ".zip")
        with zipfile.ZipFile(packed, "w", allowZip64=True) as archive:
            _copy_into(archive, path, _model_entry(path))
            for entry, source in sorted(files.items()):
                _copy_into(archive, source, entry)
        yield UploadFile(packed, ZIP_CONTENT_TYPE, tuple(sorted(files)))
