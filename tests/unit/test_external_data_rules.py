"""One table of external-data rules, run against the three places that apply them: the library
(opfuse.frontend.external_data, a model on disk), the server (service.model_zip, an uploaded zip)
and the SDK (client.model_pack, which packs a model's data files for upload and cannot import
opfuse). A rule changed in one of them and not the others fails here.
"""

from __future__ import annotations

import os
import stat
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import client.model_pack as model_pack
from client.model_pack import ModelPackError, external_data_files
from opfuse.errors import ModelError
from opfuse.frontend.external_data import external_refs, external_tensors, inline_external_data
from service.errors import UnprocessableError
from service.model_checks import ModelLimits
from service.model_zip import model_from_zip

LIMITS = ModelLimits(max_nodes=100, max_depth=100, max_input_elements=2**20)
RNG = np.random.default_rng(7)
WEIGHTS = {name: RNG.standard_normal(4).astype(np.float32) for name in ("w", "v")}


def external(name: str, location: str, **fields: str) -> onnx.TensorProto:
    """A float tensor of shape [4] whose bytes live at `location`."""
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[4])
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    for key, value in fields.items():
        tensor.external_data.add(key=key, value=value)
    return tensor


def base_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# -- where an external tensor can sit: every walk must find it --------------------------------


def _branch(*nodes: onnx.NodeProto, initializer: list[onnx.TensorProto] | None = None) -> onnx.GraphProto:
    return helper.make_graph(
        list(nodes) or [helper.make_node("Identity", ["x"], ["b"])],
        "branch",
        [],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])],
        initializer=initializer or [],
    )


def _if(then_branch: onnx.GraphProto) -> onnx.NodeProto:
    return helper.make_node("If", ["c"], ["z"], then_branch=then_branch, else_branch=_branch())


def _in_sparse_initializer(model: onnx.ModelProto, t: onnx.TensorProto) -> None:
    indices = helper.make_tensor("i", TensorProto.INT64, [4], [0, 1, 2, 3])
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(t, indices, [4]))


def _in_function(model: onnx.ModelProto, t: onnx.TensorProto) -> None:
    body = helper.make_node("Constant", [], ["out"], value=t)
    model.functions.append(
        helper.make_function("local", "F", [], ["out"], [body], [helper.make_opsetid("", 17)])
    )


PLACES: dict[str, Callable[[onnx.ModelProto, onnx.TensorProto], None]] = {
    "initializer": lambda m, t: m.graph.initializer.append(t),
    "sparse initializer": _in_sparse_initializer,
    "Constant attribute": lambda m, t: m.graph.node.append(helper.make_node("Constant", [], ["k"], value=t)),
    "tensors attribute": lambda m, t: m.graph.node.append(
        helper.make_node("Custom", [], ["k"], domain="local", tensors=[t])
    ),
    "If branch initializer": lambda m, t: m.graph.node.append(_if(_branch(initializer=[t]))),
    "subgraph of a subgraph": lambda m, t: m.graph.node.append(
        _if(_branch(_if(_branch(helper.make_node("Constant", [], ["b"], value=t)))))
    ),
    "function body": _in_function,
}


def _tensors_named(model: onnx.ModelProto, name: str) -> list[onnx.TensorProto]:
    """The test's own look-up of a placed tensor, by where PLACES put it."""
    found: list[onnx.TensorProto] = []
    graphs = [model.graph]
    nodes = [n for f in model.functions for n in f.node]
    while graphs:
        g = graphs.pop()
        found += [t for t in g.initializer if t.name == name]
        found += [s.values for s in g.sparse_initializer if s.values.name == name]
        nodes += list(g.node)
        for node in g.node:
            graphs += [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    for node in nodes:
        for a in node.attribute:
            found += [t for t in (a.t, *a.tensors) if t.name == name]
    return found


# -- the three implementations, each given a model and the files beside it ----------------------

Files = dict[str, "bytes | str"]  # name -> contents, or a str: a symbolic link to that target


@dataclass(frozen=True)
class Implementation:
    name: str
    error: type[Exception]
    # (model, folder or zip holding the files) -> the data read or collected, by tensor or file
    run: Callable[[onnx.ModelProto, Path], dict[str, bytes]]
    kind: str = "folder"


def _write_folder(model: onnx.ModelProto, files: Files, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            os.symlink(content, path)
        else:
            path.write_bytes(content)
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    return folder / "m.onnx"


def _write_zip(model: onnx.ModelProto, files: Files, path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("m.onnx", model.SerializeToString())
        for name, content in files.items():
            if isinstance(content, str):
                info = zipfile.ZipInfo(name)
                info.external_attr = (stat.S_IFLNK | 0o777) << 16
                archive.writestr(info, content)
            else:
                archive.writestr(name, content)
    return path


def _library(model: onnx.ModelProto, model_path: Path) -> dict[str, bytes]:
    refs = external_refs(model, model_path.parent)
    inline_external_data(model, model_path.parent)
    return {ref.tensor.name: ref.tensor.raw_data for ref in refs}


def _server(model: onnx.ModelProto, zip_path: Path) -> dict[str, bytes]:
    names = {t.name for t in external_tensors(model)}
    inlined = model_from_zip(zip_path, LIMITS)
    data: dict[str, bytes] = {}
    for name in names:
        (tensor,) = _tensors_named(inlined, name)
        assert tensor.data_location == TensorProto.DEFAULT
        data[name] = tensor.raw_data
    return data


def _sdk(model: onnx.ModelProto, model_path: Path) -> dict[str, bytes]:
    # The SDK reads nothing into the model: what it collects is the files it will zip.
    return {entry: path.read_bytes() for entry, path in external_data_files(model_path).items()}


IMPLEMENTATIONS = [
    Implementation("library", ModelError, _library),
    Implementation("server", UnprocessableError, _server, kind="zip"),
    Implementation("sdk", ModelPackError, _sdk),
]


def apply(impl: Implementation, model: onnx.ModelProto, files: Files, tmp: Path) -> dict[str, bytes]:
    path = (
        _write_zip(model, files, tmp / "m.zip")
        if impl.kind == "zip"
        else _write_folder(model, files, tmp / "model")
    )
    return impl.run(model, path)


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda impl: impl.name)
def impl(request: pytest.FixtureRequest) -> Implementation:
    return request.param  # type: ignore[no-any-return]


@pytest.mark.parametrize("place", sorted(PLACES))
def test_every_walk_finds_the_tensor(impl: Implementation, place: str, tmp_path: Path) -> None:
    model = base_model()
    PLACES[place](model, external("w", "w.bin"))
    model.graph.initializer.append(external("v", "v.bin"))  # a second file beside it
    files: Files = {"w.bin": WEIGHTS["w"].tobytes(), "v.bin": WEIGHTS["v"].tobytes()}
    got = apply(impl, model, files, tmp_path)
    keys = {"w": "w.bin", "v": "v.bin"} if impl.name == "sdk" else {"w": "w", "v": "v"}
    assert set(got) == set(keys.values())
    for tensor, key in keys.items():
        np.testing.assert_array_equal(np.frombuffer(got[key], np.float32), WEIGHTS[tensor])


@pytest.mark.parametrize("location", ["w.bin", "./w.bin", "sub/w.bin", "sub/./w.bin", "sub//w.bin"])
def test_a_location_inside_the_folder_is_read(impl: Implementation, location: str, tmp_path: Path) -> None:
    model = base_model()
    data = WEIGHTS["w"].tobytes()
    model.graph.initializer.append(external("w", location, offset="8", length="16"))
    name = location.replace("./", "").replace("//", "/")
    got = apply(impl, model, {name: b"\x01" * 8 + data + b"\x02" * 8}, tmp_path)
    if impl.name == "sdk":
        assert got == {name: b"\x01" * 8 + data + b"\x02" * 8}
    else:
        assert got == {"w": data}


# (what the model says, the files beside it, a fragment every implementation's refusal holds)
REFUSALS: dict[str, tuple[dict[str, str], Files, str]] = {
    "empty location": ({"location": ""}, {}, "it is empty"),
    "NUL byte": ({"location": "w.bin\x00.txt"}, {"w.bin": b"x" * 16}, "it contains a NUL byte"),
    "backslash": ({"location": "sub\\w.bin"}, {"sub/w.bin": b"x" * 16}, "it contains a backslash"),
    "absolute path": ({"location": "/etc/passwd"}, {}, "it is an absolute path"),
    "drive letter": ({"location": "C:/w.bin"}, {}, "it is an absolute path"),
    "dotdot": ({"location": "../w.bin"}, {}, "it contains '..'"),
    "dotdot inside": ({"location": "sub/../../w.bin"}, {"sub/x": b""}, "it contains '..'"),
    "missing file": (
        {"location": "gone.bin"},
        {"w.bin": b"x" * 16},
        "keeps its data in 'gone.bin', which is not",
    ),
    "offset past the end": (
        {"location": "w.bin", "offset": "8", "length": "16"},
        {"w.bin": b"x" * 16},
        "reads bytes 8..24",
    ),
    "length past the end": ({"location": "w.bin", "length": "17"}, {"w.bin": b"x" * 16}, "reads bytes 0..17"),
    "negative offset": (
        {"location": "w.bin", "offset": "-4", "length": "16"},
        {"w.bin": b"x" * 16},
        "reads bytes -4",
    ),
    "non-integer offset": ({"location": "w.bin", "offset": "4k"}, {"w.bin": b"x" * 16}, "non-integer"),
    "link": ({"location": "w.bin"}, {"real.bin": b"x" * 16, "w.bin": "real.bin"}, "symbolic link"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_an_unsafe_or_broken_reference_is_refused(impl: Implementation, case: str, tmp_path: Path) -> None:
    fields, files, fragment = REFUSALS[case]
    model = base_model()
    tensor = external("w", "")
    del tensor.external_data[:]
    for key, value in fields.items():
        tensor.external_data.add(key=key, value=value)
    model.graph.initializer.append(tensor)
    with pytest.raises(impl.error) as err:
        apply(impl, model, files, tmp_path)
    assert fragment in str(err.value), str(err.value)
    assert "tensor 'w'" in str(err.value) or case == "link", str(err.value)


@pytest.mark.parametrize("impl_name", ["library", "server"])
def test_a_length_that_is_not_the_shape_is_refused(impl_name: str, tmp_path: Path) -> None:
    """The SDK leaves this one to the server: the bytes are there, only their count is wrong."""
    (impl,) = [i for i in IMPLEMENTATIONS if i.name == impl_name]
    model = base_model()
    model.graph.initializer.append(external("w", "w.bin", length="8"))
    with pytest.raises(impl.error) as err:
        apply(impl, model, {"w.bin": b"x" * 16}, tmp_path)
    assert "needs 16 bytes for its shape [4]" in str(err.value), str(err.value)


def test_the_sdk_copy_says_the_same_as_the_library() -> None:
    """client/ cannot import opfuse, so it keeps its own path check: the same reason for every case."""
    from opfuse.frontend.external_data import unsafe_location

    for fields, _files, _fragment in REFUSALS.values():
        location = fields["location"]
        assert model_pack._unsafe_location(location) == unsafe_location(location), location
