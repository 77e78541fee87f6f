"""/v1/models: upload checks, dedup, limits, listing, download, delete, tenant isolation."""

from __future__ import annotations

import hashlib

from fastapi.testclient import TestClient

from service.settings import Settings

from .conftest import Keys, bearer, create_job, upload
from .onnx_models import mlp, to_bytes, two_inputs, with_external_data

OCTET = {"Content-Type": "application/octet-stream"}


def post_model(client: TestClient, key: str, data: bytes | object, **headers: str):
    return client.post(
        "/v1/models", params={"name": "m.onnx"}, content=data, headers={**bearer(key), **OCTET, **headers}
    )


def test_upload_describes_the_model(client: TestClient, keys: Keys) -> None:
    data = to_bytes(mlp())
    response = post_model(client, keys.user, data)
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["name"] == "m.onnx"
    assert body["sha256"] == hashlib.sha256(data).hexdigest()
    assert body["size_bytes"] == len(data)
    assert body["opset"] == 17
    assert body["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
    assert body["outputs"] == [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]
    assert body["created_at"].endswith(("Z", "+00:00"))
    assert client.get(f"/v1/models/{body['id']}", headers=bearer(keys.user)).json() == body


def test_same_bytes_give_the_same_model_per_tenant(client: TestClient, keys: Keys) -> None:
    data = to_bytes(mlp())
    first = post_model(client, keys.user, data)
    again = post_model(client, keys.admin, data)  # same tenant, another key
    elsewhere = post_model(client, keys.other, data)
    assert (first.status_code, again.status_code, elsewhere.status_code) == (201, 200, 201)
    assert again.json() == first.json()
    assert elsewhere.json()["id"] != first.json()["id"]


def test_garbage_bytes_are_422_with_the_reason(client: TestClient, keys: Keys) -> None:
    response = post_model(client, keys.user, b"\xff\xfe this is not protobuf \x00\x01" * 10)
    assert response.status_code == 422
    assert "not an ONNX model" in response.json()["detail"]


def test_truncated_protobuf_is_422(client: TestClient, keys: Keys) -> None:
    data = to_bytes(mlp())
    response = post_model(client, keys.user, data[: len(data) // 2])
    assert response.status_code == 422
    assert "ONNX" in response.json()["detail"]


def test_external_data_is_422_saying_how_to_submit(client: TestClient, keys: Keys) -> None:
    response = post_model(client, keys.user, to_bytes(with_external_data()))
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "external data" in detail and "save_as_external_data=False" in detail


def test_empty_body_is_422(client: TestClient, keys: Keys) -> None:
    response = post_model(client, keys.user, b"")
    assert response.status_code == 422
    assert "empty" in response.json()["detail"]


def test_wrong_content_type_is_415(client: TestClient, keys: Keys) -> None:
    response = client.post(
        "/v1/models",
        content=to_bytes(mlp()),
        headers={**bearer(keys.user), "Content-Type": "application/json"},
    )
    assert response.status_code == 415
    assert "application/octet-stream" in response.json()["detail"]


def test_over_the_size_limit_is_413_and_stores_nothing(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    too_big = b"\0" * (settings.max_upload_bytes + 1)
    assert post_model(client, keys.user, too_big).status_code == 413

    def chunked():  # no Content-Length: the limit must hold while streaming
        for _ in range(settings.max_upload_bytes // 4096 + 2):
            yield b"\0" * 4096

    response = post_model(client, keys.user, chunked())
    assert response.status_code == 413
    assert "limit" in response.json()["detail"]
    assert client.get("/v1/models", headers=bearer(keys.user)).json()["items"] == []
    assert list(settings.tmp_dir.iterdir()) == []


def test_list_is_paginated_newest_first(client: TestClient, keys: Keys) -> None:
    ids = [upload(client, keys.user, to_bytes(mlp(bias=0.1 * i)), name=f"m{i}")["id"] for i in range(5)]
    upload(client, keys.other, to_bytes(mlp(bias=9.0)))
    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/models", params=params, headers=bearer(keys.user)).json()
        seen += [m["id"] for m in page["items"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert seen == ids[::-1]


def test_bad_cursor_is_400(client: TestClient, keys: Keys) -> None:
    response = client.get("/v1/models", params={"cursor": "not-a-cursor"}, headers=bearer(keys.user))
    assert response.status_code == 400
    assert "next_cursor" in response.json()["detail"]


def test_content_streams_the_original_bytes_with_its_etag(client: TestClient, keys: Keys) -> None:
    data = to_bytes(two_inputs())
    model = upload(client, keys.user, data)
    response = client.get(f"/v1/models/{model['id']}/content", headers=bearer(keys.user))
    assert response.status_code == 200
    assert response.content == data
    assert response.headers["etag"] == f'"{model["sha256"]}"'
    cached = client.get(
        f"/v1/models/{model['id']}/content",
        headers={**bearer(keys.user), "If-None-Match": response.headers["etag"]},
    )
    assert cached.status_code == 304


def test_delete_refuses_while_jobs_are_active(client: TestClient, keys: Keys, model: dict) -> None:
    job = create_job(client, keys.user, model["id"])
    response = client.delete(f"/v1/models/{model['id']}", headers=bearer(keys.user))
    assert response.status_code == 409
    assert "cancel" in response.json()["detail"]
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(keys.user))
    assert client.delete(f"/v1/models/{model['id']}", headers=bearer(keys.user)).status_code == 204
    assert client.get(f"/v1/models/{model['id']}", headers=bearer(keys.user)).status_code == 404
    assert client.get(f"/v1/jobs/{job['id']}", headers=bearer(keys.user)).status_code == 404


def test_another_tenants_model_is_404(client: TestClient, keys: Keys, model: dict) -> None:
    for method, path in [
        ("GET", f"/v1/models/{model['id']}"),
        ("GET", f"/v1/models/{model['id']}/content"),
        ("DELETE", f"/v1/models/{model['id']}"),
    ]:
        response = client.request(method, path, headers=bearer(keys.other))
        assert response.status_code == 404, (method, path)
    assert client.get("/v1/models", headers=bearer(keys.other)).json()["items"] == []
    response = client.post(
        "/v1/jobs", json={"model_id": model["id"], "input_shapes": {"x": [1, 4]}}, headers=bearer(keys.other)
    )
    assert response.status_code == 404
