"""Models with external data, as `torch.onnx.export(m, args, "m.onnx")` writes them by default
(`m.onnx` + `m.onnx.data`): compiled from the path by the library and `opfuse compile`, checked
against onnxruntime; and every unsafe or broken external reference refused with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import client.cli as cli
import opfuse
from opfuse.errors import ModelError
from opfuse.frontend.external_data import has_external_data
from opfuse.frontend.inspect import inspect_model
from opfuse.frontend.load import read_model

DATA = "m.onnx.data"


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def export_default(folder: Path, **kwargs: object) -> Path:
    """torch.onnx.export with today's defaults (the dynamo exporter), as a user calls it."""
    torch.manual_seed(0)
    model = Mlp().eval()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(4, 16),), str(path), **kwargs)  # type: ignore[arg-type]
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = export_default(tmp_path_factory.mktemp("export") / "model")
    assert (path.parent / DATA).is_file(), "the default exporter no longer writes external data"
    assert has_external_data(onnx.load(path, load_external_data=False))
    return path


@pytest.fixture
def model_dir(exported: Path, tmp_path: Path) -> Path:
    """A fresh copy of the exported folder, to damage."""
    folder = tmp_path / "model"
    shutil.copytree(exported.parent, folder)
    return folder


def input_name(path: Path) -> str:
    return onnx.load(path, load_external_data=False).graph.input[0].name


def check_against_onnxruntime(cm: opfuse.CompiledModel, path: Path, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((4, 16)).astype(np.float32)
    name = input_name(path)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    expected = session.run(None, {name: x})
    got = list(cm.run({name: x}).values())
    assert len(got) == len(expected) == 1
    np.testing.assert_allclose(np.asarray(got[0]), expected[0], rtol=1e-4, atol=1e-5)


def test_default_export_compiles_from_its_path(exported: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cm = opfuse.compile(str(exported), device="cpu")
    assert cm.report["verification"]["passed"] is True
    check_against_onnxruntime(cm, exported, seed=1)
    # The bundle is self-contained: it runs with the data file gone.
    bundle = exported.parent.parent / "m.opfuse.zip"
    cm.save(bundle)
    check_against_onnxruntime(opfuse.load(bundle, device="cpu"), exported, seed=2)


def test_torchscript_export_still_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = export_default(tmp_path / "ts", dynamo=False)
    assert not has_external_data(onnx.load(path, load_external_data=False))
    check_against_onnxruntime(opfuse.compile(path, device="cpu"), path, seed=3)


def test_data_in_a_subfolder_is_read(model_dir: Path) -> None:
    """onnx.save_model's own layout, every tensor external, in a subfolder of the model's folder."""
    model = onnx.load(model_dir / "m.onnx")
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    (model_dir / "m.onnx").unlink()
    (model_dir / DATA).unlink()
    (model_dir / "weights").mkdir()
    onnx.save_model(
        model,
        model_dir / "m.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights/all.bin",
        size_threshold=0,
    )
    assert (model_dir / "weights" / "all.bin").is_file()
    loaded = read_model(model_dir / "m.onnx")
    assert not has_external_data(loaded)
    assert {t.name for t in loaded.graph.initializer} == set(weights)
    for tensor in loaded.graph.initializer:
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(tensor), weights[tensor.name])
    info = inspect_model(model_dir / "m.onnx")
    assert [(t.name, t.shape) for t in info.inputs] == [(input_name(model_dir / "m.onnx"), [4, 16])]


# -- refusals ------------------------------------------------------------------------------------


def rewrite_refs(folder: Path, change: Callable[[dict[str, str]], None]) -> Path:
    """Apply `change` to the external_data fields of every external tensor and save the .onnx file."""
    path = folder / "m.onnx"
    model = onnx.load(path, load_external_data=False)
    changed = 0
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        fields = {e.key: e.value for e in tensor.external_data}
        change(fields)
        del tensor.external_data[:]
        for key, value in fields.items():
            tensor.external_data.add(key=key, value=value)
        changed += 1
    assert changed > 0
    path.write_bytes(model.SerializeToString())
    return path


def set_location(location: str) -> Callable[[dict[str, str]], None]:
    return lambda fields: fields.update(location=location)


def refused(path: Path, *fragments: str) -> None:
    with pytest.raises(ModelError) as err:
        read_model(path)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert "save_as_external_data=False" in message or "pass the path" in message, message


def test_a_data_file_that_is_a_link_is_refused(model_dir: Path) -> None:
    # Even a link to a file inside the folder: the target could change between check and read.
    os.rename(model_dir / DATA, model_dir / "real.data")
    os.symlink("real.data", model_dir / DATA)
    refused(model_dir / "m.onnx", f"'{DATA}'", "is a symbolic link")


def test_a_location_through_a_linked_folder_is_refused(model_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(model_dir / DATA, outside / DATA)
    os.symlink(outside, model_dir / "sub")
    path = rewrite_refs(model_dir, set_location(f"sub/{DATA}"))
    refused(path, "passes through the symbolic link 'sub'")


def test_dotdot_is_refused(model_dir: Path) -> None:
    shutil.copy(model_dir / DATA, model_dir.parent / DATA)  # the file exists there: still refused
    path = rewrite_refs(model_dir, set_location(f"../{DATA}"))
    refused(path, "contains '..'")
    path = rewrite_refs(model_dir, set_location(f"./x/../../{DATA}"))
    refused(path, "contains '..'")


def test_absolute_locations_are_refused(model_dir: Path) -> None:
    path = rewrite_refs(model_dir, set_location(str(model_dir / DATA)))
    refused(path, "is an absolute path")
    path = rewrite_refs(model_dir, set_location("C:/weights/m.onnx.data"))
    refused(path, "is an absolute path")
    path = rewrite_refs(model_dir, set_location("weights\\m.onnx.data"))
    refused(path, "contains a backslash")


def test_a_file_outside_the_folder_is_not_found(model_dir: Path) -> None:
    """The model moved without its data: the copy in the parent folder is never looked at."""
    shutil.move(model_dir / DATA, model_dir.parent / DATA)
    refused(model_dir / "m.onnx", f"keeps its data in '{DATA}', which is not in the model's folder")


def test_a_folder_as_the_data_file_is_refused(model_dir: Path) -> None:
    (model_dir / "dir.data").mkdir()
    refused(rewrite_refs(model_dir, set_location("dir.data")), "is not a regular file")


def test_offsets_and_lengths_out_of_range_are_refused(model_dir: Path) -> None:
    size = (model_dir / DATA).stat().st_size
    path = rewrite_refs(model_dir, lambda f: f.update(offset=str(size)))
    refused(path, f"but that file has {size} bytes")
    path = rewrite_refs(model_dir, lambda f: f.update(offset="0", length=str(size + 4)))
    refused(path, f"reads bytes 0..{size + 4}", f"but that file has {size} bytes")
    path = rewrite_refs(model_dir, lambda f: f.update(offset="-4", length="4"))
    refused(path, "reads bytes -4..0")
    path = rewrite_refs(model_dir, lambda f: f.update(offset="zero"))
    refused(path, "non-integer external data offset or length")


def test_a_length_that_does_not_fit_the_shape_is_refused(model_dir: Path) -> None:
    path = rewrite_refs(model_dir, lambda f: f.update(offset="0", length="16"))
    refused(path, "bytes for its shape", "its external data is 16 bytes")


def test_a_truncated_data_file_is_refused(model_dir: Path) -> None:
    data = (model_dir / DATA).read_bytes()
    (model_dir / DATA).write_bytes(data[: len(data) // 3])
    refused(model_dir / "m.onnx", f"but that file has {len(data) // 3} bytes", "truncated")


def test_external_refs_without_a_folder_are_refused(exported: Path) -> None:
    with pytest.raises(ModelError, match=r"pass the path of the \.onnx file"):
        read_model(exported.read_bytes())
    with pytest.raises(ModelError, match=r"no folder to read them from.*pass the path"):
        read_model(onnx.load(exported, load_external_data=False))
    # Loaded by onnx itself (the data inlined): fine.
    assert not has_external_data(read_model(onnx.load(exported)))


def test_a_zip_is_not_taken_for_a_model(tmp_path: Path) -> None:
    import zipfile

    path = tmp_path / "m.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("m.onnx", b"x")
    with pytest.raises(ModelError, match=r"this is a zip file.*unpack it"):
        read_model(path)


# -- opfuse compile ------------------------------------------------------------------------------


def test_opfuse_compile_takes_a_default_export(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OPFUSE_HOME", str(tmp_path / "home"))
    bundle = tmp_path / "b.zip"
    result = CliRunner().invoke(
        cli.app, ["compile", str(exported), "-o", str(bundle), "--device", "cpu", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["report"]["verification"]["passed"] is True
    check_against_onnxruntime(opfuse.load(bundle, device="cpu"), exported, seed=4)


def test_opfuse_compile_refuses_a_linked_data_file_in_one_line(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPFUSE_HOME", str(tmp_path / "home"))
    os.rename(model_dir / DATA, model_dir / "real.data")
    os.symlink("real.data", model_dir / DATA)
    result = CliRunner().invoke(
        cli.app, ["compile", str(model_dir / "m.onnx"), "-o", str(tmp_path / "b.zip"), "--device", "cpu"]
    )
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("opfuse: error: "), result.stderr
    assert "is a symbolic link" in lines[0] and "Traceback" not in result.output
