"""The content-addressed blob store: atomic publish, dedup, discard, sweep."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from service.blobs import BlobStore


def write(store: BlobStore, data: bytes) -> str:
    with store.writer() as writer:
        for i in range(0, len(data), 7):
            writer.write(data[i : i + 7])
        return writer.publish()


def test_publish_names_the_blob_by_its_sha256(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = b"hello blob store" * 100
    key = write(store, data)
    assert key == hashlib.sha256(data).hexdigest()
    assert store.path(key) == tmp_path / key[:2] / key
    assert store.path(key).read_bytes() == data
    assert write(store, data) == key  # same content, same file
    assert list(store.tmp_dir.iterdir()) == []


def test_leaving_without_publish_leaves_nothing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    with store.writer() as writer:
        writer.write(b"partial")
    assert list(store.tmp_dir.iterdir()) == []
    assert list(store.keys()) == []


def test_keys_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a blob key"):
        BlobStore(tmp_path).path("../../etc/passwd")


def test_sweep_removes_only_old_unreferenced_blobs(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    kept, orphan, fresh = write(store, b"kept"), write(store, b"orphan"), write(store, b"fresh")
    old = time.time() - 7200
    for key in (kept, orphan):
        os.utime(store.path(key), (old, old))
    assert store.sweep(referenced={kept}, grace_seconds=3600) == [orphan]
    assert sorted(store.keys()) == sorted([kept, fresh])
