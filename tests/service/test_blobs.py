"""Blobs in the database: chunked, content-addressed, verified on every read, deleted with the last
model or job that uses them."""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from service import maintenance
from service.blobs import BlobCorruptError, BlobReader, open_blob, store_blob
from service.db import make_engine, make_session_factory
from service.models import Blob, BlobChunk, Model
from service.settings import Settings
from service.spool import UploadSpool

from .conftest import Keys, bearer, create_job, upload
from .onnx_models import mlp, to_bytes
from .test_worker import Worker, bundle

CHUNK = 1024
DATA = random.Random(0).randbytes(3328)  # 4 chunks, the last one short


@pytest.fixture
def factory(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def put(factory: sessionmaker[Session], tmp_path: Path, data: bytes) -> str:
    with UploadSpool(tmp_path / "spool") as spool, factory.begin() as session:
        for i in range(0, len(data), 100):  # arrives in pieces, as a request body does
            spool.write(data[i : i + 100])
        spool.close()
        return store_blob(session, spool, CHUNK)


def reader(factory: sessionmaker[Session], key: str) -> BlobReader:
    """As a download does: the first chunk in the request's transaction, the rest after it ended."""
    with factory() as session:
        return open_blob(session, factory, key)


def read(factory: sessionmaker[Session], key: str) -> list[bytes]:
    return list(reader(factory, key))


def corrupt(factory: sessionmaker[Session], key: str, seq: int) -> None:
    with factory.begin() as session:
        session.execute(
            update(BlobChunk)
            .where(BlobChunk.blob_sha256 == key, BlobChunk.seq == seq)
            .values(data=b"X" * CHUNK)
        )


def test_stored_in_chunks_under_the_sha256_once(factory: sessionmaker[Session], tmp_path: Path) -> None:
    key = put(factory, tmp_path, DATA)
    assert key == hashlib.sha256(DATA).hexdigest()
    assert put(factory, tmp_path, DATA) == key  # same bytes: stored once
    with factory() as session:
        blob = session.get(Blob, key)
        assert blob is not None and (blob.size_bytes, blob.chunk_count) == (len(DATA), 4)
        assert session.scalar(select(func.count()).select_from(BlobChunk)) == 4
    chunks = read(factory, key)
    assert [len(c) for c in chunks] == [CHUNK, CHUNK, CHUNK, len(DATA) - 3 * CHUNK]
    assert b"".join(chunks) == DATA
    assert list((tmp_path / "spool").iterdir()) == []  # spools are removed


def test_a_damaged_chunk_is_never_handed_out(factory: sessionmaker[Session], tmp_path: Path, caplog) -> None:
    key = put(factory, tmp_path, DATA)
    corrupt(factory, key, 2)
    received: list[bytes] = []
    with caplog.at_level(logging.ERROR), pytest.raises(BlobCorruptError, match="chunk 2 does not match"):
        for chunk in reader(factory, key):
            received.append(chunk)
    assert received == [DATA[:CHUNK], DATA[CHUNK : 2 * CHUNK]]
    assert any("download aborted" in r.getMessage() for r in caplog.records)


def test_a_missing_chunk_stops_the_download_before_the_end(
    factory: sessionmaker[Session], tmp_path: Path
) -> None:
    key = put(factory, tmp_path, DATA)
    with factory.begin() as session:
        session.execute(delete(BlobChunk).where(BlobChunk.seq == 3))
    with pytest.raises(BlobCorruptError, match="chunk 3 of 4 is missing"):
        read(factory, key)


def test_the_whole_sha256_is_checked_before_the_last_chunk(
    factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """Chunks that each match their own sha256 but are not the blob's bytes (e.g. swapped)."""
    key = put(factory, tmp_path, DATA)
    with factory.begin() as session:
        rows = {c.seq: c for c in session.scalars(select(BlobChunk).where(BlobChunk.blob_sha256 == key))}
        rows[0].data, rows[1].data = rows[1].data, rows[0].data
        rows[0].sha256, rows[1].sha256 = rows[1].sha256, rows[0].sha256
    received: list[bytes] = []
    with pytest.raises(BlobCorruptError, match="do not match the blob's sha256"):
        received.extend(reader(factory, key))
    assert len(received) == 3  # the last chunk was held back


def blob_key_of(settings: Settings, model_id: str) -> str:
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            return str(connection.scalar(select(Model.blob_key).where(Model.id == model_id)))
    finally:
        engine.dispose()


def test_a_damaged_model_is_a_500_not_wrong_bytes(client: TestClient, keys: Keys, settings: Settings) -> None:
    model = upload(client, keys.user, to_bytes(mlp()))
    engine = make_engine(settings.database_url)
    corrupt(make_session_factory(engine), blob_key_of(settings, model["id"]), 0)
    engine.dispose()
    app_client = TestClient(client.app, raise_server_exceptions=False)
    response = app_client.get(f"/v1/models/{model['id']}/content", headers=bearer(keys.user))
    assert response.status_code == 500
    assert "internal server error" in response.json()["detail"]


def test_deleting_a_model_deletes_the_blobs_no_one_else_uses(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    shared = to_bytes(mlp(bias=3.0))
    mine, theirs = upload(client, keys.user, shared), upload(client, keys.other, shared)
    alone = upload(client, keys.user, to_bytes(mlp(bias=2.0)))
    job = create_job(client, keys.user, alone["id"])
    worker = Worker(client, keys.worker)
    token = worker.claim().json()["lease_token"]
    artifact = bundle()
    worker.artifact(job["id"], token, artifact)
    assert worker.complete(job["id"], token).status_code == 200

    engine = make_engine(settings.database_url)
    factory = make_session_factory(engine)

    def keys_stored() -> set[str]:
        with factory() as session:
            return set(session.scalars(select(Blob.sha256)))

    artifact_key = hashlib.sha256(artifact).hexdigest()
    mine_key, theirs_key = blob_key_of(settings, mine["id"]), blob_key_of(settings, theirs["id"])
    assert mine_key != theirs_key  # tenants share no blob
    assert keys_stored() == {mine_key, theirs_key, blob_key_of(settings, alone["id"]), artifact_key}
    for model in (mine, alone):
        assert client.delete(f"/v1/models/{model['id']}", headers=bearer(keys.user)).status_code == 204
    assert keys_stored() == {theirs_key}  # the other tenant's model
    content = client.get(f"/v1/models/{theirs['id']}/content", headers=bearer(keys.other))
    assert content.status_code == 200 and content.content == shared
    engine.dispose()


def test_sweep_deletes_bundles_of_abandoned_attempts(
    client: TestClient, keys: Keys, model: dict, settings: Settings
) -> None:
    from .test_worker import expire_lease

    job = create_job(client, keys.user, model["id"])
    worker = Worker(client, keys.worker)
    token = worker.claim().json()["lease_token"]
    abandoned = bundle()
    assert worker.artifact(job["id"], token, abandoned).status_code == 200
    expire_lease(settings, job["id"])
    assert worker.claim().status_code == 200  # a new attempt forgets the old bundle
    engine = make_engine(settings.database_url)
    try:
        removed = maintenance.sweep_blobs(make_session_factory(engine))
    finally:
        engine.dispose()
    assert removed == [hashlib.sha256(abandoned).hexdigest()]
