"""Twenty 20 MB models uploaded at once: every one is stored (and reads back with its sha256), and
the API server's memory stays bounded (uploads are streamed, not held whole per request).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import onnx
import pytest
from onnx import TensorProto, helper

from .harness import FIGURES, ApiServer

pytestmark = pytest.mark.e2e

UPLOADS = 20
MB = 1024**2
SIZE = 20 * MB
# Peak growth of the server's resident memory over the whole burst; all twenty held whole would
# be 400 MB (and twice that with a parsed copy each).
MAX_GROWTH = 160 * MB


def big_model(path: Path) -> int:
    """A valid ONNX model whose 20 MB initializer is random bytes: y = x + w, x and w [5242880]."""
    n = SIZE // 4
    w = helper.make_tensor("w", TensorProto.FLOAT, [n], vals=os.urandom(SIZE), raw=True)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save(model, path)
    return path.stat().st_size


@pytest.fixture(autouse=True)
def _postgres_only(database_url: str) -> None:
    # The heaviest reliability runs go against PostgreSQL only, to keep `make test` short; SQLite's
    # claim path is covered by tests/service (concurrent claims) and the other modules here.
    if database_url.startswith("sqlite"):
        pytest.skip("run against PostgreSQL only")


def test_twenty_concurrent_20mb_uploads(server: ApiServer, user_key: str, tmp_path: Path) -> None:
    paths = [tmp_path / f"big{i}.onnx" for i in range(UPLOADS)]
    sizes = [big_model(p) for p in paths]
    assert all(s > SIZE for s in sizes)
    digests = {hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    before = server.rss_kib()

    def send(path: Path) -> dict[str, object]:
        with server.client(user_key) as client:
            return dict(client.upload_model(path))

    with ThreadPoolExecutor(UPLOADS) as pool:
        models = list(pool.map(send, paths))
    after = server.rss_kib()
    FIGURES.uploads += len(models)

    assert {str(m["sha256"]) for m in models} == digests, "every upload stored under its own sha256"
    assert len({m["id"] for m in models}) == UPLOADS
    with server.client(user_key) as client:
        listed = {str(m["id"]) for m in client.list_models()}
        assert {str(m["id"]) for m in models} <= listed
    # One read back in full, streamed, checked against its sha256.
    digest, size = hashlib.sha256(), 0
    with httpx.stream(
        "GET",
        f"{server.url}/v1/models/{models[7]['id']}/content",
        headers={"Authorization": f"Bearer {user_key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        for chunk in response.iter_bytes():
            digest.update(chunk)
            size += len(chunk)
    assert digest.hexdigest() == models[7]["sha256"] and size == sizes[7]

    growth = (after["VmHWM"] - before["VmRSS"]) * 1024
    print(
        f"server RSS {before['VmRSS'] // 1024} MiB before, peak {after['VmHWM'] // 1024} MiB, "
        f"{after['VmRSS'] // 1024} MiB after {UPLOADS} concurrent uploads of {SIZE // MB} MB"
    )
    assert growth < MAX_GROWTH, (
        f"the server's peak memory grew by {growth / MB:.0f} MB over {UPLOADS} concurrent "
        f"{SIZE // MB} MB uploads (limit {MAX_GROWTH // MB} MB): uploads are held whole in memory"
    )
