"""Models with external data, uploaded as a zip: one .onnx file and the data files it points to.

Nothing is extracted to disk: the entries are read from the zip into the model's tensors, so an
entry's name can never reach the filesystem. Still, an entry or a location that would escape the
archive (absolute paths, `..`, backslashes), a link, an encrypted entry, or an offset outside its
file is refused with the reason. The result is one self-contained model, as if it had been saved
with `save_as_external_data=False`; protobuf caps that at 2 GiB.
"""

from __future__ import annotations

import math
import posixpath
import stat
import zipfile
from dataclasses import dataclass
from pathlib import Path

import onnx

from opfuse.frontend.external_data import external_tensors, unsafe_location
from opfuse.frontend.inspect import MAX_MODEL_BYTES
from service.errors import PayloadTooLargeError, UnprocessableError
from service.model_checks import ModelLimits, limit_problems, parse_upload

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip with entries / an empty zip
_LIMIT_WORDS = "2 GiB (protobuf's limit for one ONNX file, with its external data inlined)"


def _refuse(problem: str) -> UnprocessableError:
    return UnprocessableError(f"the zip cannot be used: {problem}")


def _is_link_or_special(info: zipfile.ZipInfo) -> bool:
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    return kind not in (0, stat.S_IFREG, stat.S_IFDIR)


# Entries smaller than this are not held to the compression ratio: they cannot hurt.
_RATIO_FLOOR_BYTES = 1024**2


def zip_entries(archive: zipfile.ZipFile, limits: ModelLimits) -> dict[str, zipfile.ZipInfo]:
    """The archive's files by normalized name; 422 for anything unsafe, 413 when they are too big
    unpacked. Sizes are the ones the zip declares: reading an entry never yields more (zipfile
    stops at the declared size and checks the CRC), so they bound what is decompressed."""
    files: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in archive.infolist():
        why = unsafe_location(info.filename)
        if why is not None:
            raise _refuse(f"entry '{info.filename}' is refused: {why}")
        if _is_link_or_special(info):
            raise _refuse(
                f"entry '{info.filename}' is a symbolic link or special file; put real files in the zip"
            )
        if info.is_dir():
            continue
        if info.flag_bits & 0x1:
            raise _refuse(f"entry '{info.filename}' is encrypted; upload an unencrypted zip")
        name = posixpath.normpath(info.filename)
        if name in files:
            raise _refuse(f"entry '{name}' is in the zip twice")
        files[name] = info
        ratio = info.file_size / max(info.compress_size, 1)
        if info.file_size > _RATIO_FLOOR_BYTES and ratio > limits.max_zip_ratio:
            raise _refuse(
                f"entry '{name}' unpacks to {info.file_size} bytes from {info.compress_size} "
                f"({ratio:.0f}:1), over this server's limit of {limits.max_zip_ratio:.0f}:1 "
                "(OPFUSE_MAX_ZIP_RATIO); model weights do not compress that well"
            )
        total += info.file_size
        if total > limits.max_unpacked_bytes:
            raise PayloadTooLargeError(
                f"the zip holds more than {limits.max_unpacked_bytes} bytes once unpacked, over this "
                "server's upload limit (OPFUSE_MAX_UPLOAD_BYTES, which counts unpacked bytes)"
            )
        if total > MAX_MODEL_BYTES:
            raise PayloadTooLargeError(
                f"the zip holds more than {_LIMIT_WORDS} once unpacked; opfuse cannot take a model that big"
            )
    return files


def _the_onnx_file(files: dict[str, zipfile.ZipInfo]) -> str:
    found = sorted(name for name in files if name.lower().endswith(".onnx"))
    if not found:
        raise _refuse(f"it holds no .onnx file (files: {', '.join(sorted(files)) or 'none'})")
    if len(found) > 1:
        raise _refuse(f"it holds {len(found)} .onnx files ({', '.join(found)}); put exactly one in the zip")
    return found[0]


@dataclass(frozen=True)
class ExternalRef:
    """Where a tensor's bytes are: `length` bytes at `offset` of zip entry `entry`."""

    tensor: onnx.TensorProto
    entry: str
    offset: int
    length: int


# Bytes per element of the types whose data length is checked (others are refused later anyway).
_ITEM_BYTES = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.INT64: 8,
    onnx.TensorProto.INT32: 4,
    onnx.TensorProto.INT16: 2,
    onnx.TensorProto.INT8: 1,
    onnx.TensorProto.UINT8: 1,
    onnx.TensorProto.BOOL: 1,
}


def _expected_bytes(tensor: onnx.TensorProto) -> int | None:
    itemsize = _ITEM_BYTES.get(tensor.data_type)
    return None if itemsize is None else math.prod(tensor.dims) * itemsize


def _external_ref(tensor: onnx.TensorProto, base: str, files: dict[str, zipfile.ZipInfo]) -> ExternalRef:
    fields = {entry.key: entry.value for entry in tensor.external_data}
    label = f"tensor '{tensor.name}'"
    location = fields.get("location", "")
    why = unsafe_location(location)
    if why is not None:
        raise _refuse(f"{label} has external data location '{location}', which is refused: {why}")
    entry = posixpath.normpath(posixpath.join(base, location))
    info = files.get(entry)
    if info is None:
        raise _refuse(
            f"{label} keeps its data in '{location}', which is not in the zip (put it next to the .onnx file)"
        )
    try:
        offset = int(fields.get("offset") or 0)
        length = int(fields["length"]) if fields.get("length") else info.file_size - offset
    except ValueError:
        raise _refuse(f"{label} has a non-integer external data offset or length") from None
    if offset < 0 or length < 0 or offset + length > info.file_size:
        raise _refuse(
            f"{label} reads bytes {offset}..{offset + length} of '{location}', "
            f"but that file has {info.file_size} bytes"
        )
    expected = _expected_bytes(tensor)
    if expected is not None and expected != length:
        raise _refuse(
            f"{label} needs {expected} bytes for its shape {list(tensor.dims)} but points at {length}"
        )
    return ExternalRef(tensor, entry, offset, length)


def _inline(archive: zipfile.ZipFile, files: dict[str, zipfile.ZipInfo], refs: list[ExternalRef]) -> None:
    """Read each reference's bytes into its tensor, one entry at a time, in offset order."""
    by_entry: dict[str, list[ExternalRef]] = {}
    for ref in refs:
        by_entry.setdefault(ref.entry, []).append(ref)
    for entry, entry_refs in by_entry.items():
        with archive.open(files[entry]) as f:
            for ref in sorted(entry_refs, key=lambda r: r.offset):
                f.seek(ref.offset)
                data = f.read(ref.length)
                if len(data) != ref.length:
                    raise _refuse(f"'{entry}' ended before the data of tensor '{ref.tensor.name}'")
                ref.tensor.raw_data = data
                del ref.tensor.external_data[:]
                ref.tensor.data_location = onnx.TensorProto.DEFAULT


def unpacked_size(path: Path, limits: ModelLimits) -> int:
    """The bytes the zip's files hold once unpacked; 422/413 as `zip_entries`. Reads only the
    zip's directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            return sum(info.file_size for info in zip_entries(archive, limits).values())
    except (zipfile.BadZipFile, OSError):
        raise _refuse("it is not a valid zip file") from None


def model_from_zip(path: Path, limits: ModelLimits) -> onnx.ModelProto:
    """The self-contained model of an uploaded zip; 422/413 with the reason when it cannot be.

    The graph is held to `limits` before any external data is read.
    """
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        raise _refuse("it is not a valid zip file") from None
    try:
        with archive:
            files = zip_entries(archive, limits)
            onnx_name = _the_onnx_file(files)
            model = parse_upload(archive.read(files[onnx_name]))
            problems = limit_problems(model, limits)
            if problems:
                raise UnprocessableError("; ".join(problems))
            base = posixpath.dirname(onnx_name)
            refs = [_external_ref(t, base, files) for t in external_tensors(model)]
            total = files[onnx_name].file_size + sum(ref.length for ref in refs)
            if total > MAX_MODEL_BYTES:
                raise PayloadTooLargeError(
                    f"the model with its external data is {total} bytes, over {_LIMIT_WORDS}; "
                    "opfuse cannot take a model that big"
                )
            _inline(archive, files, refs)
    except (zipfile.BadZipFile, EOFError, NotImplementedError) as exc:
        raise _refuse(f"an entry cannot be read ({exc})") from None
    return model
