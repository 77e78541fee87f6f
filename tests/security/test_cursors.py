"""Forged pagination cursors: whatever a client passes as `cursor` gets a 400 (or, for a cursor that
is well-formed, a page), never a 500: out-of-range times and numbers, NUL, lone surrogates, deep
JSON, wrong shapes. Hypothesis fuzzes both the raw string and the decoded JSON."""

from __future__ import annotations

import base64
import json
from typing import Any

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service.conftest import Keys, bearer, create_job

LISTS = (
    ("/v1/jobs", "-created_at"),
    ("/v1/jobs", "finished_at"),
    ("/v1/jobs", "-speedup"),
    ("/v1/jobs", "kernels_after"),
    ("/v1/models", "-created_at"),
)
ROW_ID = "0" * 32
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _encode(raw: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(raw).encode()).decode().rstrip("=")


def _get(client: TestClient, keys: Keys, path: str, order: str, cursor: str) -> int:
    params = {"cursor": cursor} if path == "/v1/models" else {"cursor": cursor, "order_by": order}
    response = client.get(path, params=params, headers=bearer(keys.user))
    assert response.status_code in (200, 400), (path, order, cursor, response.status_code, response.text)
    if response.status_code == 400:
        assert "cursor" in response.json()["detail"]
    return response.status_code


FORGED: list[Any] = [
    ["-created_at", "0001-01-01T00:00:00+01:00", ROW_ID],  # before the first UTC time
    ["-created_at", "9999-12-31T23:59:59-01:00", ROW_ID],  # after the last
    ["-created_at", "2026-01-01T00:00:00", ROW_ID],  # no zone
    ["-created_at", 12, ROW_ID],
    ["-created_at", "2026-01-01T00:00:00+00:00", "x\x00y"],  # NUL in the id
    ["-created_at", "2026-01-01T00:00:00+00:00", "\ud800"],  # a lone surrogate
    ["-created_at", "2026-01-01T00:00:00+00:00\x00", ROW_ID],
    ["-created_at\x00", None, ROW_ID],
    ["-speedup", 10**400, ROW_ID],  # beyond a float
    ["-speedup", 2**63, ROW_ID],  # beyond BIGINT
    ["-speedup", -(2**70), ROW_ID],
    ["-speedup", float("nan"), ROW_ID],
    ["-speedup", float("inf"), ROW_ID],
    ["-speedup", True, ROW_ID],
    ["-speedup", "1.5", ROW_ID],
    ["kernels_after", 2**40, ROW_ID],
    ["-speedup", [1], ROW_ID],
    ["-speedup", None, 5],
    ["-speedup", None, [ROW_ID]],
    ["-speedup"],
    {"a": 1},
    None,
]


def test_forged_cursors_are_400_never_500(client: TestClient, keys: Keys, model: dict) -> None:
    create_job(client, keys.user, model["id"])
    for raw in FORGED:
        cursor = _encode(raw)
        for path, order in LISTS:
            _get(client, keys, path, order, cursor)
    for cursor in ("\x00", "%00", "é", "a" * 5000, _encode("[" * 5000), "====", "!!!!"):
        for path, order in LISTS:
            _get(client, keys, path, order, cursor)
    for raw_query in ("cursor=%ED%A0%80", "cursor=%FF%FE", "cursor=%00%00"):  # not UTF-8 on the wire
        response = client.get(f"/v1/jobs?{raw_query}", headers=bearer(keys.user))
        assert response.status_code in (400, 422), (raw_query, response.text)
    # A real cursor still pages.
    first = client.get("/v1/jobs", params={"limit": 1}, headers=bearer(keys.user)).json()
    create_job(client, keys.user, model["id"])
    page = client.get("/v1/jobs", params={"limit": 1}, headers=bearer(keys.user)).json()
    assert page["next_cursor"] and _get(client, keys, "/v1/jobs", "-created_at", page["next_cursor"]) == 200
    assert first["items"]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=3),
    max_leaves=6,
)


@FUZZ
@given(raw=st.text(max_size=200))
def test_any_cursor_string_is_400_or_a_page(client: TestClient, keys: Keys, raw: str) -> None:
    for path, order in LISTS[:3]:
        _get(client, keys, path, order, raw)


@FUZZ
@given(
    order=st.sampled_from([order for _, order in LISTS]),
    value=JSON_VALUES | st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat()),
    row_id=st.text(max_size=40) | st.just(ROW_ID) | JSON_VALUES,
)
def test_any_decoded_cursor_is_400_or_a_page(
    client: TestClient, keys: Keys, order: str, value: Any, row_id: Any
) -> None:
    cursor = _encode([order, value, row_id])
    for path, list_order in LISTS:
        _get(client, keys, path, list_order, cursor)
