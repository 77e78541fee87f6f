"""Zip bombs and storage: upload limits and the check budget count unpacked bytes, a zip entry may
not compress beyond a ratio, and each tenant has a storage quota (bytes and models)."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient
from onnx import TensorProto, helper, numpy_helper

from service import model_registry
from service.check_budget import CheckBudget
from service.db import make_engine, make_session_factory
from service.model_checks import ModelLimits
from service.settings import MiB, Settings
from service.spool import UploadSpool
from tests.service.conftest import Keys, bearer, client_with, upload
from tests.service.onnx_models import mlp, to_bytes


def _external_model(elements: int) -> bytes:
    """y = x + w, w: [elements] float32 kept in `w.bin`."""
    w = numpy_helper.from_array(np.zeros(elements, dtype=np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", str(elements * 4))):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [elements])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [elements])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _zip(elements: int, weights: bytes | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("m.onnx", _external_model(elements))
        archive.writestr("w.bin", weights if weights is not None else bytes(elements * 4))
    return buffer.getvalue()


def _post_zip(client: TestClient, key: str, data: bytes):
    return client.post("/v1/models", content=data, headers={**bearer(key), "Content-Type": "application/zip"})


def test_a_small_zip_that_unpacks_over_the_upload_limit_is_refused(settings: Settings, keys: Keys) -> None:
    bomb = _zip(1 << 20)  # 4 MiB of weights in about 4 kB
    assert len(bomb) < settings.max_upload_bytes < 4 * MiB
    with client_with(settings, max_zip_ratio=1e6) as client:  # the size alone refuses it
        response = _post_zip(client, keys.user, bomb)
        assert response.status_code == 413, response.text
        detail = response.json()["detail"]
        assert "unpacked" in detail and "OPFUSE_MAX_UPLOAD_BYTES" in detail
        assert client.get("/v1/models", headers=bearer(keys.user)).json()["items"] == []


def test_a_zip_entry_compressed_beyond_the_ratio_is_refused(settings: Settings, keys: Keys) -> None:
    with client_with(settings, max_upload_bytes=256 * MiB) as client:
        bomb = _zip(16 << 20)  # 64 MiB of zeros, about 1000:1
        response = _post_zip(client, keys.user, bomb)
        assert response.status_code == 422, response.text
        assert "OPFUSE_MAX_ZIP_RATIO" in response.json()["detail"]
        rng = np.random.default_rng(0)  # real weights barely compress: accepted
        weights = rng.standard_normal(1 << 18).astype(np.float32).tobytes()
        response = _post_zip(client, keys.user, _zip(1 << 18, weights))
        assert response.status_code == 201, response.text


class _RecordingBudget(CheckBudget):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.held: list[int] = []

    @contextmanager
    def hold(self, size: int) -> Iterator[None]:
        self.held.append(size)
        with super().hold(size):
            yield


def test_the_check_budget_counts_a_zip_unpacked(settings: Settings, tmp_path: Path, keys: Keys) -> None:
    rng = np.random.default_rng(1)
    weights = rng.standard_normal(1 << 16).astype(np.float32).tobytes()
    data = _zip(1 << 16, weights)
    unpacked = len(_external_model(1 << 16)) + len(weights)
    engine = make_engine(settings.database_url)
    budget = _RecordingBudget(64 * MiB)
    try:
        with ExitStack() as stack, UploadSpool.of_bytes(tmp_path, data) as spool:
            limits = ModelLimits(100, 100, 2**31, max_unpacked_bytes=64 * MiB)
            quota = model_registry.StorageQuota(0, 0)
            model_registry.prepare_upload(
                make_session_factory(engine), 1, spool, "application/zip", limits, budget, stack, quota
            )
    finally:
        engine.dispose()
    assert budget.held == [unpacked]
    assert unpacked > len(data) * 0.9


def test_a_tenant_over_its_storage_quota_gets_413_and_others_are_unaffected(
    settings: Settings, keys: Keys
) -> None:
    one = len(to_bytes(mlp(bias=0.1)))
    with client_with(settings, tenant_storage_bytes=int(one * 2.5)) as client:
        first = upload(client, keys.user, to_bytes(mlp(bias=0.1)))
        upload(client, keys.user, to_bytes(mlp(bias=0.2)))
        response = client.post(
            "/v1/models",
            content=to_bytes(mlp(bias=0.3)),
            headers={**bearer(keys.user), "Content-Type": "application/octet-stream"},
        )
        assert response.status_code == 413, response.text
        assert (
            "quota" in response.json()["detail"]
            and "OPFUSE_TENANT_STORAGE_BYTES" in response.json()["detail"]
        )
        # The same bytes again cost nothing; another tenant has its own quota.
        assert upload(client, keys.user, to_bytes(mlp(bias=0.1)))["id"] == first["id"]
        upload(client, keys.other, to_bytes(mlp(bias=0.3)))
        # Deleting frees room.
        assert client.delete(f"/v1/models/{first['id']}", headers=bearer(keys.user)).status_code == 204
        upload(client, keys.user, to_bytes(mlp(bias=0.3)))


def test_a_tenant_with_its_most_models_gets_429(settings: Settings, keys: Keys) -> None:
    with client_with(settings, tenant_max_models=2) as client:
        upload(client, keys.user, to_bytes(mlp(bias=0.1)))
        upload(client, keys.user, to_bytes(mlp(bias=0.2)))
        response = client.post(
            "/v1/models",
            content=to_bytes(mlp(bias=0.3)),
            headers={**bearer(keys.user), "Content-Type": "application/octet-stream"},
        )
        assert response.status_code == 429, response.text
        assert "OPFUSE_TENANT_MAX_MODELS" in response.json()["detail"]
        bomb_zip = _zip(64)
        assert _post_zip(client, keys.user, bomb_zip).status_code == 429  # zips too, before any check
