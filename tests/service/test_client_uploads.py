"""The SDK's upload_model and `opfuse submit` against the real API over HTTP: a model exported
with `torch.onnx.export`'s defaults (`m.onnx` + `m.onnx.data`) is packed into a zip and stored as
one self-contained model; a user's own zip is sent as a zip; a self-contained .onnx is sent raw;
unsafe data files are refused before anything is sent.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import torch
from fastapi.testclient import TestClient
from onnx import numpy_helper
from torch import nn
from typer.testing import CliRunner

import client.cli as cli
from client.model_pack import ModelPackError, external_data_files
from client.sdk import ModelFileError, OpfuseClient

from .conftest import Keys

DATA = "m.onnx.data"


@pytest.fixture
def database_url(sqlite_database_url: str) -> str:
    return sqlite_database_url  # nothing here depends on the database


def export(folder: Path, **kwargs: object) -> Path:
    """torch.onnx.export as a user calls it: the defaults (the dynamo exporter), unless told."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 6)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(3, 12),), str(path), **kwargs)  # type: ignore[arg-type]
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = export(tmp_path_factory.mktemp("export") / "model")
    assert (path.parent / DATA).is_file(), "the default exporter no longer writes external data"
    return path


@pytest.fixture
def model_dir(exported: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(exported.parent, folder)
    return folder


class Recording(httpx.HTTPTransport):
    """A real HTTP transport that keeps each request's method, path and Content-Type."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, str]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path, request.headers.get("content-type", "")))
        return super().handle_request(request)


@pytest.fixture
def recording() -> Recording:
    return Recording()


@pytest.fixture
def sdk(api_url: str, recording: Recording, keys: Keys) -> Iterator[OpfuseClient]:
    with OpfuseClient(api_url, keys.user, transport=recording) as c:
        yield c


def uploads(recording: Recording) -> list[str]:
    return [ctype for method, path, ctype in recording.seen if (method, path) == ("POST", "/v1/models")]


def stored_model(client: TestClient, keys: Keys, model_id: str) -> onnx.ModelProto:
    response = client.get(f"/v1/models/{model_id}/content", headers={"Authorization": f"Bearer {keys.user}"})
    assert response.status_code == 200, response.text
    return onnx.load_from_string(response.content)


def assert_same_weights(stored: onnx.ModelProto, exported: Path) -> None:
    """The stored model is self-contained and holds every weight of the export, byte for byte."""
    original = onnx.load(exported)  # onnx reads the data file itself: the reference
    assert all(t.data_location == onnx.TensorProto.DEFAULT for t in stored.graph.initializer)
    want = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in stored.graph.initializer}
    assert set(got) == set(want)
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array)


def test_sdk_uploads_a_default_export_as_a_zip(
    sdk: OpfuseClient, recording: Recording, client: TestClient, keys: Keys, exported: Path
) -> None:
    model = sdk.upload_model(exported)
    assert uploads(recording) == ["application/zip"]
    input_name = onnx.load(exported, load_external_data=False).graph.input[0].name
    assert model["name"] == "m.onnx"
    assert model["inputs"] == [{"name": input_name, "dtype": "float32", "shape": [3, 12]}]
    assert [o["shape"] for o in model["outputs"]] == [[3, 6]]
    assert_same_weights(stored_model(client, keys, model["id"]), exported)


def test_a_users_zip_is_sent_as_a_zip(
    sdk: OpfuseClient, recording: Recording, exported: Path, tmp_path: Path
) -> None:
    packed = tmp_path / "mine.zip"
    with zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.write(exported, "m.onnx")
        archive.write(exported.parent / DATA, DATA)
    from_zip = sdk.upload_model(packed, name="mine")
    from_path = sdk.upload_model(exported)
    assert uploads(recording) == ["application/zip", "application/zip"]
    # The same self-contained model either way.
    assert from_zip["id"] == from_path["id"] and from_zip["sha256"] == from_path["sha256"]


def test_a_self_contained_model_is_sent_raw(
    sdk: OpfuseClient, recording: Recording, client: TestClient, keys: Keys, tmp_path: Path
) -> None:
    path = export(tmp_path / "ts", dynamo=False)
    assert not list(path.parent.glob("*.data"))
    model = sdk.upload_model(path)
    assert uploads(recording) == ["application/octet-stream"]
    assert model["inputs"][0]["shape"] == [3, 12]
    assert stored_model(client, keys, model["id"]).SerializeToString() == path.read_bytes()


def test_cli_submit_takes_a_default_export(
    api_url: str,
    recording: Recording,
    keys: Keys,
    client: TestClient,
    exported: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPFUSE_HOME", str(exported.parent / "home"))
    monkeypatch.setattr(cli, "_client", lambda opts: OpfuseClient(api_url, keys.user, transport=recording))
    result = CliRunner().invoke(cli.app, ["submit", str(exported), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert uploads(recording) == ["application/zip"]
    assert out["model"]["inputs"][0]["shape"] == [3, 12]
    assert out["job"]["status"] == "queued" and out["job"]["model_id"] == out["model"]["id"]
    assert_same_weights(stored_model(client, keys, out["model"]["id"]), exported)


def test_cli_submit_refuses_a_linked_data_file_before_sending(
    api_url: str, recording: Recording, keys: Keys, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPFUSE_HOME", str(model_dir / "home"))
    monkeypatch.setattr(cli, "_client", lambda opts: OpfuseClient(api_url, keys.user, transport=recording))
    os.rename(model_dir / DATA, model_dir / "real.data")
    os.symlink("real.data", model_dir / DATA)
    result = CliRunner().invoke(cli.app, ["submit", str(model_dir / "m.onnx")])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("opfuse: error: "), result.stderr
    assert "is a symbolic link" in lines[0] and "Traceback" not in result.output
    assert uploads(recording) == []


def set_location(folder: Path, location: str, **fields: str) -> Path:
    path = folder / "m.onnx"
    model = onnx.load(path, load_external_data=False)
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            values = {e.key: e.value for e in tensor.external_data} | {"location": location} | fields
            del tensor.external_data[:]
            for key, value in values.items():
                tensor.external_data.add(key=key, value=value)
    path.write_bytes(model.SerializeToString())
    return path


def test_sdk_refuses_unsafe_data_files_before_sending(
    sdk: OpfuseClient, recording: Recording, model_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(model_dir / DATA, outside / DATA)
    shutil.copy(model_dir / DATA, model_dir.parent / DATA)
    os.symlink(outside, model_dir / "sub")
    size = (model_dir / DATA).stat().st_size
    cases = [
        (f"../{DATA}", {}, "contains '..'"),
        (str(outside / DATA), {}, "is an absolute path"),
        (f"sub/{DATA}", {}, "passes through the symbolic link 'sub'"),
        ("missing.data", {}, "which is not in the model's folder"),
        (DATA, {"offset": str(size)}, f"but that file has {size} bytes"),
        (DATA, {"offset": "0", "length": str(size + 1)}, f"but that file has {size} bytes"),
        ("extra.onnx", {}, "a name the upload keeps for the model"),
    ]
    shutil.copy(model_dir / DATA, model_dir / "extra.onnx")
    for location, fields, why in cases:
        path = set_location(model_dir, location, **fields)
        with pytest.raises(ModelFileError) as err:
            sdk.upload_model(path)
        assert why in str(err.value) and "save_as_external_data=False" in str(err.value), (
            location,
            err.value,
        )
        with pytest.raises(ModelPackError):
            external_data_files(path)
    assert uploads(recording) == []


def test_a_truncated_data_file_is_refused_before_sending(
    sdk: OpfuseClient, recording: Recording, model_dir: Path
) -> None:
    data = (model_dir / DATA).read_bytes()
    (model_dir / DATA).write_bytes(data[:10])
    with pytest.raises(ModelFileError, match="but that file has 10 bytes"):
        sdk.upload_model(model_dir / "m.onnx")
    assert uploads(recording) == []
