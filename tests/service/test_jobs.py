"""/v1/jobs: validation against the model, idempotency, listing, cancel, tenant isolation."""

from __future__ import annotations

from fastapi.testclient import TestClient

from opfuse.frontend.rule_registry import SWITCHES

from .conftest import Keys, bearer, create_job, upload
from .onnx_models import mlp, to_bytes, two_inputs


def post_job(client: TestClient, key: str, body: dict, **headers: str):
    return client.post("/v1/jobs", json=body, headers={**bearer(key), **headers})


def test_create_job_queues_it_with_defaults(client: TestClient, keys: Keys, model: dict) -> None:
    job = create_job(client, keys.user, model["id"], fusion={"disable": ["pointwise"]}, verify={"rtol": 1e-3})
    assert job["status"] == "queued" and job["stage"] is None and job["progress"] == 0
    assert job["attempts"] == 0 and job["max_attempts"] == 3
    assert job["summary"] is None and job["error"] is None
    assert job["options"] == {
        "input_shapes": {"x": [8, 4]},
        "precision": "fp32",
        "fusion": {"disable": ["pointwise"]},
        "verify": {"rtol": 1e-3, "atol": None},
        "target": "any",
    }
    assert client.get(f"/v1/jobs/{job['id']}", headers=bearer(keys.user)).json() == job


def test_static_model_needs_no_input_shapes(client: TestClient, keys: Keys) -> None:
    static = upload(client, keys.user, to_bytes(mlp(batch=2)))
    response = post_job(client, keys.user, {"model_id": static["id"], "precision": "fp16"})
    assert response.status_code == 202, response.text


def test_unbound_dynamic_dims_are_listed(client: TestClient, keys: Keys) -> None:
    model = upload(client, keys.user, to_bytes(two_inputs()))
    response = post_job(client, keys.user, {"model_id": model["id"]})
    assert response.status_code == 422
    detail = response.json()["detail"]
    for dim in (
        "input 'x' dim 0 ('batch')",
        "input 'x' dim 1 ('seq')",
        "input 'y' dim 0 ('batch')",
        "input 'y' dim 1 (unnamed)",
    ):
        assert dim in detail, detail


def test_input_shapes_must_fit_the_model(client: TestClient, keys: Keys) -> None:
    model = upload(client, keys.user, to_bytes(two_inputs()))
    cases = {
        "input_shapes names 'q', which is not an input of the model (its inputs: 'x', 'y')": {
            "x": [1, 2, 8],
            "y": [1, 2, 8],
            "q": [1],
        },
        "input 'x' has 3 dims": {"x": [1, 8], "y": [1, 2, 8]},
        "input 'y' dim 2 is 8 in the model but input_shapes gives 9": {"x": [1, 2, 8], "y": [1, 2, 9]},
        "dim 'batch' is 1 at input 'x' dim 0 but 2 at input 'y' dim 0": {"x": [1, 2, 8], "y": [2, 2, 8]},
    }
    for expected, shapes in cases.items():
        response = post_job(client, keys.user, {"model_id": model["id"], "input_shapes": shapes})
        assert response.status_code == 422, shapes
        assert expected in response.json()["detail"]
    ok = post_job(
        client, keys.user, {"model_id": model["id"], "input_shapes": {"x": [2, 5, 8], "y": [2, 7, 8]}}
    )
    assert ok.status_code == 202


def test_request_body_is_validated(client: TestClient, keys: Keys, model: dict) -> None:
    bad = [
        {"model_id": model["id"], "input_shapes": {"x": [0, 4]}},
        {"model_id": model["id"], "input_shapes": {"x": [8, 4]}, "precision": "fp8"},
        {"model_id": model["id"], "input_shapes": {"x": [8, 4]}, "unknown_option": 1},
        {"model_id": model["id"], "input_shapes": {"x": [8, 4]}, "webhook_url": "not a url"},
        {"input_shapes": {"x": [8, 4]}},
    ]
    for body in bad:
        response = post_job(client, keys.user, body)
        assert response.status_code == 422, body
        assert isinstance(response.json()["detail"], str)
    response = post_job(client, keys.user, {"model_id": model["id"], "input_shapes": {"x": [0, 4]}})
    assert "input_shapes.x.0" in response.json()["detail"]


def test_unknown_model_is_404(client: TestClient, keys: Keys) -> None:
    response = post_job(client, keys.user, {"model_id": "0" * 32})
    assert response.status_code == 404
    assert "GET /v1/models" in response.json()["detail"]


def test_idempotency_key_gives_the_same_job(
    client: TestClient, keys: Keys, model: dict, public_dns: None
) -> None:
    body = {"model_id": model["id"], "input_shapes": {"x": [8, 4]}, "webhook_url": "https://example.com/hook"}
    first = post_job(client, keys.user, body, **{"Idempotency-Key": "k1"})
    again = post_job(client, keys.user, body, **{"Idempotency-Key": "k1"})
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"]
    assert first.json()["webhook_url"] == "https://example.com/hook"
    different = post_job(client, keys.user, {**body, "precision": "fp16"}, **{"Idempotency-Key": "k1"})
    assert different.status_code == 409
    assert "Idempotency-Key 'k1'" in different.json()["detail"]
    # Keys are per tenant, and no key means a new job every time.
    other_model = upload(client, keys.other, to_bytes(mlp()))
    other = post_job(client, keys.other, {**body, "model_id": other_model["id"]}, **{"Idempotency-Key": "k1"})
    assert other.status_code == 202 and other.json()["id"] != first.json()["id"]
    assert post_job(client, keys.user, body).json()["id"] != first.json()["id"]


def test_list_filters_and_paginates(client: TestClient, keys: Keys, model: dict) -> None:
    second = upload(client, keys.user, to_bytes(mlp(bias=0.5)))
    a = [create_job(client, keys.user, model["id"])["id"] for _ in range(3)]
    b = [create_job(client, keys.user, second["id"])["id"] for _ in range(2)]
    client.post(f"/v1/jobs/{a[0]}/cancel", headers=bearer(keys.user))

    def ids(**params: object) -> list[str]:
        out, cursor = [], None
        while True:
            query = {**params, "limit": 2} | ({"cursor": cursor} if cursor else {})
            response = client.get("/v1/jobs", params=query, headers=bearer(keys.user))
            assert response.status_code == 200, response.text
            out += [j["id"] for j in response.json()["items"]]
            cursor = response.json()["next_cursor"]
            if not cursor:
                return out

    assert ids() == (a + b)[::-1]
    assert ids(model_id=second["id"]) == b[::-1]
    assert ids(status="canceled") == [a[0]]
    assert ids(status="queued", model_id=model["id"]) == a[1:][::-1]
    assert client.get("/v1/jobs", params={"status": "nope"}, headers=bearer(keys.user)).status_code == 422
    assert client.get("/v1/jobs", headers=bearer(keys.other)).json() == {"items": [], "next_cursor": None}


def test_cancel_a_queued_job(client: TestClient, keys: Keys, model: dict) -> None:
    job = create_job(client, keys.user, model["id"])
    response = client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(keys.user))
    assert response.status_code == 200
    assert response.json()["status"] == "canceled" and response.json()["finished_at"] is not None
    again = client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(keys.user))
    assert again.status_code == 409
    assert "already canceled" in again.json()["detail"]


def test_report_and_artifact_are_404_until_success(client: TestClient, keys: Keys, model: dict) -> None:
    job = create_job(client, keys.user, model["id"])
    for what in ("report", "artifact"):
        response = client.get(f"/v1/jobs/{job['id']}/{what}", headers=bearer(keys.user))
        assert response.status_code == 404
        assert "queued" in response.json()["detail"]


def test_another_tenants_job_is_404(client: TestClient, keys: Keys, model: dict) -> None:
    job = create_job(client, keys.user, model["id"])
    for method, suffix in [("GET", ""), ("GET", "/report"), ("GET", "/artifact"), ("POST", "/cancel")]:
        response = client.request(method, f"/v1/jobs/{job['id']}{suffix}", headers=bearer(keys.other))
        assert response.status_code == 404, suffix
    assert client.get(f"/v1/jobs/{job['id']}", headers=bearer(keys.user)).json()["status"] == "queued"


def _finish_with(client: TestClient, keys: Keys, job_id: str, speedup: float | None) -> None:
    from .test_worker import Worker, bundle

    worker = Worker(client, keys.worker)
    claimed = worker.claim().json()
    assert claimed["job"]["id"] == job_id
    token = claimed["lease_token"]
    assert worker.artifact(job_id, token, bundle()).status_code == 200
    report: dict = {"kernels": {"before": 3, "after": 1}}
    if speedup is not None:
        report |= {"speedup": speedup, "after": {"latency_ms": {"p50": 10 / speedup}}}
    assert worker.complete(job_id, token, report).status_code == 200


def _pages(client: TestClient, key: str, **params: object) -> list[str]:
    out, cursor = [], None
    while True:
        query = {**params, "limit": 2} | ({"cursor": cursor} if cursor else {})
        response = client.get("/v1/jobs", params=query, headers=bearer(key))
        assert response.status_code == 200, response.text
        out += [j["id"] for j in response.json()["items"]]
        cursor = response.json()["next_cursor"]
        if not cursor:
            return out


def test_order_by_a_metric_pages_correctly_with_nulls_last(
    client: TestClient, keys: Keys, model: dict
) -> None:
    speedups = [1.5, None, 3.0, 1.5, 0.8, 1.5]
    jobs = [create_job(client, keys.user, model["id"])["id"] for _ in speedups]
    for job_id, speedup in zip(jobs, speedups, strict=True):
        _finish_with(client, keys, job_id, speedup)
    queued = create_job(client, keys.user, model["id"])["id"]  # no metrics at all
    values = dict(zip(jobs, speedups, strict=True)) | {queued: None}

    def expected(descending: bool) -> list[str]:
        known = sorted(
            (j for j, v in values.items() if v is not None),
            key=lambda j: (values[j], j),
            reverse=descending,
        )
        unknown = sorted((j for j, v in values.items() if v is None), reverse=descending)
        return known + unknown

    assert _pages(client, keys.user, order_by="-speedup") == expected(descending=True)
    assert _pages(client, keys.user, order_by="speedup") == expected(descending=False)
    # latency_ms_after = 10 / speedup: the same jobs, the other way round.
    by_latency = _pages(client, keys.user, order_by="latency_ms_after")
    assert [values[j] for j in by_latency] == [3.0, 1.5, 1.5, 1.5, 0.8, None, None]
    assert _pages(client, keys.user, order_by="created_at") == [*jobs, queued]
    assert _pages(client, keys.user, order_by="-created_at") == [queued, *jobs[::-1]]
    assert _pages(client, keys.user, order_by="-speedup", status="queued") == [queued]


def test_order_by_is_checked_and_cursors_belong_to_their_order(
    client: TestClient, keys: Keys, model: dict
) -> None:
    for _ in range(3):
        create_job(client, keys.user, model["id"])
    bad = client.get("/v1/jobs", params={"order_by": "-password"}, headers=bearer(keys.user))
    assert bad.status_code == 422 and "-speedup" in bad.json()["detail"]
    page = client.get("/v1/jobs", params={"limit": 1, "order_by": "speedup"}, headers=bearer(keys.user))
    cursor = page.json()["next_cursor"]
    other = client.get(
        "/v1/jobs", params={"limit": 1, "order_by": "-speedup", "cursor": cursor}, headers=bearer(keys.user)
    )
    assert other.status_code == 400 and "order_by=speedup" in other.json()["detail"]


def test_ids_with_bytes_a_database_refuses_are_404_not_500(
    client: TestClient, keys: Keys, model: dict
) -> None:
    """PostgreSQL refuses NUL in any text comparison: such ids are answered without a query."""
    bad = "\x00y\x00"
    response = post_job(client, keys.user, {"model_id": bad})
    assert response.status_code == 404 and "no model with id" in response.json()["detail"]
    assert client.get("/v1/jobs/%00x", headers=bearer(keys.user)).status_code == 404
    assert client.get(f"/v1/models/{'a%00' * 8}", headers=bearer(keys.user)).status_code == 404
    listed = client.get("/v1/jobs", params={"model_id": bad}, headers=bearer(keys.user))
    assert listed.status_code == 200 and listed.json()["items"] == []
    # A rule name is an identifier: anything else is refused before it is stored.
    response = post_job(client, keys.user, {"model_id": model["id"], "fusion": {"disable": ["gelu\x00"]}})
    assert response.status_code == 422


def test_a_rule_name_opfuse_does_not_have_is_422_with_the_valid_names(
    client: TestClient, keys: Keys, model: dict
) -> None:
    body = {
        "model_id": model["id"],
        "input_shapes": {"x": [8, 4]},
        "fusion": {"disable": ["pointwise", "gelu"]},
    }
    response = post_job(client, keys.user, body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert "'gelu'" in detail and "'pointwise'" not in detail
    # Every name the compiler accepts is listed, and nothing was queued.
    assert all(name in detail for name in SWITCHES)
    assert client.get("/v1/jobs", headers=bearer(keys.user)).json()["items"] == []
