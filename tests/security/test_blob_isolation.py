"""Upload timing told whether another tenant held the same bytes: blobs were shared across tenants,
so a second tenant's upload of known bytes wrote nothing. Each tenant now stores its own copy: the
upload path writes the same rows (one blob, every chunk) for bytes another tenant has as for bytes
no one has, and no key or answer names the other tenant's blob."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient
from onnx import TensorProto, helper, numpy_helper
from sqlalchemy import func, select

from service.db import make_engine
from service.models import Blob, BlobChunk, Model
from service.settings import Settings
from tests.service.conftest import Keys, bearer, client_with, upload

ELEMENTS = 1500  # 6 kB of weights: six 1 kB chunks


def _model(seed: int) -> bytes:
    """y = x + w with random weights (6 kB, so it is stored as several chunks)."""
    w = numpy_helper.from_array(np.random.default_rng(seed).standard_normal(ELEMENTS).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ELEMENTS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ELEMENTS])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _rows(settings: Settings) -> tuple[int, int]:
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            blobs = connection.scalar(select(func.count()).select_from(Blob))
            chunks = connection.scalar(select(func.count()).select_from(BlobChunk))
            return int(blobs or 0), int(chunks or 0)
    finally:
        engine.dispose()


def _written(settings: Settings, client: TestClient, key: str, data: bytes) -> tuple[int, int]:
    before = _rows(settings)
    upload(client, key, data)
    after = _rows(settings)
    return after[0] - before[0], after[1] - before[1]


def test_an_upload_does_the_same_work_whether_another_tenant_has_the_bytes(
    settings: Settings, keys: Keys
) -> None:
    # Small chunks, so the model is several of them (what a timing probe would measure).
    with client_with(settings, blob_chunk_bytes=1024) as client:
        known = _model(1)
        fresh = _model(2)
        assert len(known) == len(fresh) and len(known) > 3 * 1024
        victim = _written(settings, client, keys.other, known)  # tenant "other" holds `known`
        assert victim[0] == 1 and victim[1] >= 4

        probe_known = _written(settings, client, keys.user, known)
        probe_fresh = _written(settings, client, keys.user, fresh)
        assert probe_known == probe_fresh == victim

        # Each tenant reads its own copy; deleting one leaves the other whole.
        engine = make_engine(settings.database_url)
        with engine.connect() as connection:
            keys_by_tenant = dict(
                connection.execute(
                    select(Model.tenant_id, Model.blob_key).where(Model.size_bytes == len(known))
                )
                .tuples()
                .all()
            )
        engine.dispose()
        assert len(set(keys_by_tenant.values())) == len(keys_by_tenant) == 2
        models = client.get("/v1/models", headers=bearer(keys.user)).json()["items"]
        mine = models[-1]  # newest first: the oldest is `known`
        assert client.delete(f"/v1/models/{mine['id']}", headers=bearer(keys.user)).status_code == 204
        theirs = client.get("/v1/models", headers=bearer(keys.other)).json()["items"]
        content = client.get(f"/v1/models/{theirs[0]['id']}/content", headers=bearer(keys.other))
        assert content.status_code == 200 and content.content == known
