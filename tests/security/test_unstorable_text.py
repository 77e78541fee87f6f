"""One tenant cannot stop dispatch for all with text the database cannot hold (NUL, lone
surrogates): it is refused at the edge, a stored job that cannot be handed out fails alone, and
/readyz says when claims fail. Every test runs on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import onnx
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session

from service.db import make_engine
from service.models import Job
from service.settings import Settings
from tests.service.bundles import real_bundle
from tests.service.conftest import Keys, bearer, create_job, upload
from tests.service.onnx_models import mlp, to_bytes

NUL = "\x00"


def _claim(client: TestClient, keys: Keys, worker_id: str = "w1", device: str = "cpu"):
    return client.post(
        "/v1/worker/claim", json={"worker_id": worker_id, "device": device}, headers=bearer(keys.worker)
    )


def _renamed_input(name: str) -> onnx.ModelProto:
    model = mlp(bias=0.7)
    model.graph.input[0].name = name
    model.graph.node[0].input[0] = name
    return model


def test_a_model_with_nul_in_an_input_name_is_refused_naming_it(client: TestClient, keys: Keys) -> None:
    response = client.post(
        "/v1/models",
        content=to_bytes(_renamed_input(f"x{NUL}y")),
        headers={**bearer(keys.user), "Content-Type": "application/octet-stream"},
    )
    assert response.status_code == 422, response.text
    assert "graph input 0" in response.json()["detail"] and "NUL" in response.json()["detail"]
    assert client.get("/v1/models", headers=bearer(keys.user)).json()["items"] == []


def test_input_shapes_naming_an_input_with_nul_is_refused(
    client: TestClient, keys: Keys, model: dict
) -> None:
    body = {"model_id": model["id"], "input_shapes": {f"x{NUL}": [8, 4]}}
    response = client.post("/v1/jobs", json=body, headers=bearer(keys.user))
    assert response.status_code == 422, response.text
    assert "input_shapes" in response.json()["detail"] and "NUL" in response.json()["detail"]
    lone = json.dumps({"model_id": model["id"], "input_shapes": {"x\ud800": [8, 4]}})
    response = client.post(
        "/v1/jobs", content=lone, headers={**bearer(keys.user), "Content-Type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert "surrogate" in response.json()["detail"]


def test_worker_fields_with_nul_are_refused_and_a_fail_with_nul_is_recorded(
    client: TestClient, keys: Keys, model: dict
) -> None:
    for fields in ({"worker_id": f"w{NUL}"}, {"device": f"cpu{NUL}"}):
        body = {"worker_id": "w1", "device": "cpu", **fields}
        response = client.post("/v1/worker/claim", json=body, headers=bearer(keys.worker))
        assert response.status_code == 422, response.text
        assert next(iter(fields)) in response.json()["detail"]
    job = create_job(client, keys.user, model["id"])
    claimed = _claim(client, keys)
    assert claimed.status_code == 200, claimed.text
    token = claimed.json()["lease_token"]
    body = {"lease_token": token, "error": f"bad{NUL}error \ud800", "retryable": False}
    response = client.post(  # json.dumps escapes the lone surrogate as \ud800, as any client could
        f"/v1/worker/jobs/{job['id']}/fail",
        content=json.dumps(body),
        headers={**bearer(keys.worker), "Content-Type": "application/json"},
    )
    assert response.status_code == 200, response.text
    seen = client.get(f"/v1/jobs/{job['id']}", headers=bearer(keys.user)).json()
    assert seen["status"] == "failed"
    assert seen["error"] == "bad\ufffderror \ufffd"


def test_a_report_with_nul_is_stored_scrubbed(client: TestClient, keys: Keys, model: dict) -> None:
    job = create_job(client, keys.user, model["id"])
    token = _claim(client, keys).json()["lease_token"]
    headers = {**bearer(keys.worker), "Lease-Token": token, "Content-Type": "application/zip"}
    assert client.put(
        f"/v1/worker/jobs/{job['id']}/artifact", content=real_bundle(), headers=headers
    ).is_success
    report = {"fusion": {"groups": [{"nodes": [f"n{NUL}1"], f"k{NUL}": 1}]}, "speedup": 1.5}
    response = client.post(
        f"/v1/worker/jobs/{job['id']}/complete",
        json={"lease_token": token, "report": report},
        headers=bearer(keys.worker),
    )
    assert response.status_code == 200, response.text
    stored = client.get(f"/v1/jobs/{job['id']}/report", headers=bearer(keys.user)).json()
    assert stored["fusion"]["groups"] == [{"nodes": ["n\ufffd1"], "k\ufffd": 1}]
    # Later claims still work.
    assert _claim(client, keys).status_code == 204


def test_a_report_nested_too_deep_is_a_422(client: TestClient, keys: Keys, model: dict) -> None:
    job = create_job(client, keys.user, model["id"])
    token = _claim(client, keys).json()["lease_token"]
    deep = "[" * 900 + "]" * 900
    body = '{"lease_token": ' + json.dumps(token) + ', "report": {"a": ' + deep + "}}"
    response = client.post(
        f"/v1/worker/jobs/{job['id']}/complete",
        content=body,
        headers={**bearer(keys.worker), "Content-Type": "application/json"},
    )
    assert response.status_code == 422, response.text


def _insert_raw_job(settings: Settings, template_id: str, options_json: str) -> str:
    """A queued job whose options are `options_json` verbatim, as a server before the edge checks
    could have stored them; copied from the job `template_id`."""
    engine = make_engine(settings.database_url)
    try:
        with Session(engine) as session, session.begin():
            template = session.get(Job, template_id)
            assert template is not None
            job = Job(
                tenant_id=template.tenant_id,
                model_id=template.model_id,
                options={},
                status="queued",
                max_attempts=3,
                created_at=datetime(2020, 1, 1, tzinfo=UTC),
            )
            session.add(job)
            session.flush()
            session.execute(
                text("UPDATE jobs SET options = :o WHERE id = :i"), {"o": options_json, "i": job.id}
            )
            return job.id
    finally:
        engine.dispose()


def test_a_stored_job_with_nul_in_its_options_does_not_stop_claims(
    client: TestClient, keys: Keys, model: dict, settings: Settings
) -> None:
    other_model = upload(client, keys.other, to_bytes(mlp(bias=0.3)))
    victim = create_job(client, keys.other, other_model["id"])
    poisoned = _insert_raw_job(
        settings, victim["id"], '{"input_shapes": {"x\\u0000": [8, 4]}, "precision": "fp32", "target": "any"}'
    )
    first = _claim(client, keys)
    assert first.status_code == 200, first.text
    assert first.json()["job"]["id"] == poisoned
    second = _claim(client, keys, worker_id="w2")
    assert second.status_code == 200, second.text
    assert second.json()["job"]["id"] == victim["id"]
    assert client.get("/readyz").status_code == 200


def test_a_job_that_cannot_be_handed_out_fails_alone(
    client: TestClient, keys: Keys, model: dict, settings: Settings
) -> None:
    broken = create_job(client, keys.user, model["id"])
    fine_model = upload(client, keys.other, to_bytes(mlp(bias=0.4)))
    fine = create_job(client, keys.other, fine_model["id"])
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as connection:  # a model row that no longer describes a model
            connection.execute(
                text("UPDATE models SET inputs = :i WHERE id = :m"),
                {"i": json.dumps([{"no": "name"}]), "m": model["id"]},
            )
    finally:
        engine.dispose()
    claimed = _claim(client, keys)
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["job"]["id"] == fine["id"]
    seen = client.get(f"/v1/jobs/{broken['id']}", headers=bearer(keys.user)).json()
    assert seen["status"] == "failed" and "could not be handed to a worker" in seen["error"]
    assert client.get("/readyz").status_code == 200


def test_readyz_is_unready_while_claims_fail(client: TestClient, keys: Keys, settings: Settings) -> None:
    engine = make_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("ALTER TABLE jobs RENAME TO jobs_away"))
        try:
            client_no_raise = TestClient(client.app, raise_server_exceptions=False)
            assert _claim(client_no_raise, keys).status_code == 500
            ready = client.get("/readyz")
            assert ready.status_code == 503 and "claims are failing" in ready.json()["detail"]
        finally:
            with engine.begin() as connection:
                connection.execute(text("ALTER TABLE jobs_away RENAME TO jobs"))
        assert _claim(client, keys).status_code == 204
        assert client.get("/readyz").status_code == 200
    finally:
        engine.dispose()
