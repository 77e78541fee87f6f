"""Uploads beyond a plain .onnx: zips with external data (extracted safely, made self-contained),
and models over the server's limits (shapes, node count, depth), refused with reasons."""

from __future__ import annotations

import io
import stat
import zipfile

import numpy as np
import onnx
import pytest
from fastapi.testclient import TestClient
from onnx import TensorProto, helper, numpy_helper

from service import model_zip
from service.settings import Settings

from .conftest import Keys, bearer, client_with, upload
from .onnx_models import mlp, to_bytes, with_external_data

WEIGHTS = (np.arange(12, dtype=np.float32).reshape(4, 3) / 10).tobytes()


@pytest.fixture
def database_url(sqlite_database_url: str) -> str:
    return sqlite_database_url  # nothing here depends on the database


def make_zip(*entries: tuple[str | zipfile.ZipInfo, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            archive.writestr(name, data)
    return buffer.getvalue()


def external(location: str = "weights.bin", offset: int = 0, length: int = 48) -> bytes:
    model = with_external_data()
    weight = model.graph.initializer[0]
    del weight.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    return to_bytes(model)


def post(client: TestClient, key: str, data: bytes, content_type: str = "application/zip"):
    return client.post("/v1/models", content=data, headers={**bearer(key), "Content-Type": content_type})


def test_a_zip_with_external_data_becomes_a_self_contained_model(client: TestClient, keys: Keys) -> None:
    for onnx_name, data_name in (("model.onnx", "weights.bin"), ("export/model.onnx", "export/weights.bin")):
        response = post(client, keys.user, make_zip((onnx_name, external()), (data_name, WEIGHTS)))
        assert response.status_code in (200, 201), response.text
        body = response.json()
        assert body["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
        stored = client.get(f"/v1/models/{body['id']}/content", headers=bearer(keys.user)).content
        model = onnx.load_from_string(stored)
        weight = model.graph.initializer[0]
        assert weight.data_location == TensorProto.DEFAULT and not weight.external_data
        assert numpy_helper.to_array(weight).tobytes() == WEIGHTS
        assert body["size_bytes"] == len(stored)
    # Both zips hold the same model: one model (the sha256 is of the self-contained bytes).
    assert len(client.get("/v1/models", headers=bearer(keys.user)).json()["items"]) == 1


def _symlink(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        (
            [("model.onnx", external()), ("../weights.bin", WEIGHTS)],
            "entry '../weights.bin' is refused: it contains '..'",
        ),
        ([("model.onnx", external()), ("/etc/weights.bin", WEIGHTS)], "it is an absolute path"),
        ([("model.onnx", external()), ("a\\weights.bin", WEIGHTS)], "backslash"),
        ([("model.onnx", external()), (_symlink("weights.bin"), b"/etc/passwd")], "symbolic link"),
        (
            [("model.onnx", external(location="../weights.bin")), ("weights.bin", WEIGHTS)],
            "location '../weights.bin', which is refused",
        ),
        ([("model.onnx", external(location="/tmp/weights.bin")), ("weights.bin", WEIGHTS)], "absolute path"),
        (
            [("model.onnx", external(offset=40)), ("weights.bin", WEIGHTS)],
            "reads bytes 40..88 of 'weights.bin', but that file has 48 bytes",
        ),
        (
            [("model.onnx", external(length=40)), ("weights.bin", WEIGHTS)],
            "needs 48 bytes for its shape [4, 3] but points at 40",
        ),
        ([("model.onnx", external())], "keeps its data in 'weights.bin', which is not in the zip"),
        ([("weights.bin", WEIGHTS)], "holds no .onnx file"),
        ([("a.onnx", external()), ("b.onnx", external()), ("weights.bin", WEIGHTS)], "holds 2 .onnx files"),
        ([("model.onnx", b"not protobuf at all \xff\xfe" * 4)], "not an ONNX model"),
    ],
)
def test_unsafe_or_broken_zips_are_422_with_the_reason(
    client: TestClient, keys: Keys, entries: list, reason: str
) -> None:
    response = post(client, keys.user, make_zip(*entries))
    assert response.status_code == 422, response.text
    assert reason in response.json()["detail"]
    assert client.get("/v1/models", headers=bearer(keys.user)).json()["items"] == []


def test_not_a_zip_and_too_big_unpacked(
    client: TestClient, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    response = post(client, keys.user, b"PK\x03\x04 but then garbage")
    assert response.status_code == 422 and "not a valid zip" in response.json()["detail"]
    monkeypatch.setattr(model_zip, "MAX_MODEL_BYTES", 100)
    response = post(client, keys.user, make_zip(("model.onnx", external()), ("weights.bin", WEIGHTS)))
    assert response.status_code == 413 and "2 GiB" in response.json()["detail"]


def test_a_raw_upload_with_external_data_is_told_about_zips(client: TestClient, keys: Keys) -> None:
    response = post(client, keys.user, external(), "application/octet-stream")
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "application/zip" in detail and "save_as_external_data=False" in detail
    wrong_type = post(client, keys.user, external(), "text/plain")
    assert wrong_type.status_code == 415 and "application/zip" in wrong_type.json()["detail"]


def chain(length: int) -> onnx.ModelProto:
    """x → Relu → Relu → ... (`length` nodes deep)."""
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(length)]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("v0", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(f"v{length}", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_absurd_graphs_and_shapes_are_422_with_reasons(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    huge = mlp(batch=1)
    huge.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 10**9
    response = post(client, keys.user, to_bytes(huge), "application/octet-stream")
    assert response.status_code == 422
    assert "input 'x' declares 4000000000 elements" in response.json()["detail"]
    assert "OPFUSE_MAX_INPUT_ELEMENTS" in response.json()["detail"]

    with client_with(settings, max_graph_nodes=50, max_graph_depth=20) as limited:
        too_many = post(limited, keys.user, to_bytes(chain(60)), "application/octet-stream")
        assert too_many.status_code == 422
        assert "the graph has 60 nodes" in too_many.json()["detail"]
        assert "OPFUSE_MAX_GRAPH_NODES" in too_many.json()["detail"]
        too_deep = post(limited, keys.user, to_bytes(chain(30)), "application/octet-stream")
        assert too_deep.status_code == 422
        assert "30 nodes deep" in too_deep.json()["detail"]
        zipped = post(limited, keys.user, make_zip(("m.onnx", to_bytes(chain(30)))))
        assert zipped.status_code == 422 and "30 nodes deep" in zipped.json()["detail"]
        assert post(limited, keys.user, to_bytes(chain(20)), "application/octet-stream").status_code == 201


def test_absurd_input_shapes_at_job_creation_are_422(client: TestClient, keys: Keys) -> None:
    model = upload(client, keys.user, to_bytes(mlp()))
    body = {"model_id": model["id"], "input_shapes": {"x": [2**31, 4]}}
    response = client.post("/v1/jobs", json=body, headers=bearer(keys.user))
    assert response.status_code == 422
    assert "8589934592 elements" in response.json()["detail"]
