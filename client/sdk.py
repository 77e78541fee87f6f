"""Python SDK for the opfuse REST API v1 (DESIGN.md §3): models, jobs, reports, artifacts, and the
worker protocol. Depends on httpx only (and onnx, imported to pack a model that keeps its weights in
external data files into the zip upload).

    client = OpfuseClient("http://127.0.0.1:8000", api_key)
    model = client.upload_model("model.onnx")
    job = client.create_job(model.id, input_shapes={"x": [8, 3, 224, 224]}, precision="fp16")
    job = client.wait_job(job.id)
    client.download_artifact(job.id, "model.opfuse.zip")

What it returns are typed records (client.records): attributes, the JSON in `.raw`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypedDict, cast

import httpx

from client.model_pack import ModelPackError, upload_file
from client.records import ApiKey, Job, Model, Report

__all__ = [
    "TERMINAL_STATUSES",
    "ApiKey",
    "ApiKeyInfo",
    "ArtifactIntegrityError",
    "Claim",
    "Download",
    "Job",
    "LeaseLostError",
    "Model",
    "ModelFileError",
    "OpfuseAPIError",
    "OpfuseClient",
    "OpfuseClientError",
    "OpfuseConnectionError",
    "OpfuseTimeoutError",
    "Report",
]

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "canceled"})
_CHUNK = 1 << 20


class JobDict(TypedDict, total=False):
    """A job as the worker protocol hands it over (the claim's `job`), as JSON."""

    id: str
    model_id: str
    status: str
    stage: str | None
    progress: float
    attempts: int
    options: dict[str, Any]


ApiKeyInfo = ApiKey  # the earlier name of the key record


class Claim(TypedDict, total=False):
    job: JobDict
    lease_token: str
    lease_expires_at: str
    model: dict[str, Any]


@dataclass(frozen=True)
class Download:
    """Where a downloaded file landed, and its verified sha256."""

    path: Path
    sha256: str
    size_bytes: int
    signature: str | None = None  # the server's Opfuse-Signature, verified where the call checks it


class OpfuseClientError(Exception):
    """Base class of every error the SDK raises."""


class OpfuseAPIError(OpfuseClientError):
    """The server answered with an error status; `detail` is its explanation."""

    def __init__(self, status: int, detail: str, *, method: str = "", url: str = "") -> None:
        self.status = status
        self.detail = detail
        self.method = method
        self.url = url
        super().__init__(f"{status}: {detail}")


class LeaseLostError(OpfuseAPIError):
    """409 on a worker call: this worker no longer holds the job's lease and must stop working on it."""


class OpfuseConnectionError(OpfuseClientError):
    """The server could not be reached (not running, wrong URL, network down, timed out)."""


class OpfuseTimeoutError(OpfuseClientError):
    """`wait_job` gave up before the job reached a final status."""


class ModelFileError(OpfuseClientError):
    """A model file cannot be uploaded as it is on disk (e.g. its external data files are unsafe)."""


class ArtifactIntegrityError(OpfuseClientError):
    """A downloaded file's sha256 does not match the ETag the server sent."""


class ArtifactSignatureError(ArtifactIntegrityError):
    """A downloaded bundle is unsigned or its Opfuse-Signature is not the API's (docs/api.md)."""


def _detail(response: httpx.Response) -> str:
    """The server's `detail`, flattened to one readable line (FastAPI 422s carry a list)."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return text[:500] if text else response.reason_phrase or "no detail"
    detail = body.get("detail") if isinstance(body, dict) else body
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
                msg = str(item.get("msg", item))
                parts.append(f"{loc}: {msg}" if loc else msg)
            else:
                parts.append(str(item))
        return "; ".join(parts) or "invalid request"
    return str(detail) if detail is not None else response.reason_phrase or "no detail"


def _etag_sha256(response: httpx.Response) -> str | None:
    etag = response.headers.get("etag")
    if not etag:
        return None
    etag = etag.strip()
    if etag.startswith("W/"):
        etag = etag[2:]
    etag = etag.strip('"')
    if etag.startswith("sha256:"):
        etag = etag[len("sha256:") :]
    return etag.lower() or None


class OpfuseClient:
    """A client for one opfuse API server and one API key. Use as a context manager or call close()."""

    def __init__(
        self,
        api_url: str,
        api_key: str,
        timeout: float = 30.0,
        *,
        transport: httpx.BaseTransport | None = None,
        signing_key: str | None = None,
    ) -> None:
        """`signing_key`: your tenant's bundle-signing key (hex, GET /v1/signing-key); when None,
        the first download asks the API for it."""
        self.api_url = api_url.rstrip("/")
        self._signing_key = bytes.fromhex(signing_key) if signing_key else None
        self._http = httpx.Client(
            base_url=self.api_url,
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": "opfuse-sdk/0.1"},
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> OpfuseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------

    def _request(self, method: str, path: str, *, lease: bool = False, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise OpfuseConnectionError(
                f"the opfuse API at {self.api_url} did not answer {method} {path} in time ({exc})"
            ) from exc
        except httpx.TransportError as exc:
            raise OpfuseConnectionError(
                f"cannot reach the opfuse API at {self.api_url} ({exc}); is the server running "
                "(`opfuse serve`) and is the URL right?"
            ) from exc
        self._raise_for_status(response, method, path, lease=lease)
        return response

    @staticmethod
    def _raise_for_status(response: httpx.Response, method: str, path: str, *, lease: bool) -> None:
        if response.status_code < 400:
            return
        if not response.is_closed:
            response.read()
        cls = LeaseLostError if lease and response.status_code == 409 else OpfuseAPIError
        raise cls(response.status_code, _detail(response), method=method, url=path)

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    def _paginate(self, path: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        query = {k: v for k, v in params.items() if v is not None}
        seen: set[str] = set()
        while True:
            page = self._json("GET", path, params=query)
            if isinstance(page, list):
                return items + page
            items.extend(page.get("items", []))
            cursor = page.get("next_cursor")
            if not cursor or cursor in seen:
                return items
            seen.add(cursor)
            query["cursor"] = cursor

    def _stream_to_file(
        self,
        method: str,
        path: str,
        dest: str | os.PathLike[str],
        *,
        lease: bool = False,
        check: Callable[[Download], None] | None = None,
        **kwargs: Any,
    ) -> Download:
        """Stream a response body into `dest` (atomically) and check it against the ETag, if any;
        `check` sees the download (in its temporary place) before it lands at `dest`."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        digest = hashlib.sha256()
        size = 0
        try:
            with self._http.stream(method, path, **kwargs) as response:
                self._raise_for_status(response, method, path, lease=lease)
                expected = _etag_sha256(response)
                signature = response.headers.get("Opfuse-Signature")
                with part.open("wb") as f:
                    for chunk in response.iter_bytes(_CHUNK):
                        f.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
        except httpx.TransportError as exc:
            part.unlink(missing_ok=True)
            raise OpfuseConnectionError(
                f"download of {path} from {self.api_url} broke off ({exc}); try again"
            ) from exc
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        sha = digest.hexdigest()
        if expected is not None and len(expected) == 64 and expected != sha:
            part.unlink(missing_ok=True)
            raise ArtifactIntegrityError(
                f"the download of {path} is damaged: its sha256 is {sha} but the server's ETag says "
                f"{expected}; download it again"
            )
        got = Download(path=part, sha256=sha, size_bytes=size, signature=signature)
        if check is not None:
            try:
                check(got)
            except BaseException:
                part.unlink(missing_ok=True)
                raise
        os.replace(part, dest)
        return Download(path=dest, sha256=sha, size_bytes=size, signature=signature)

    # -- models -----------------------------------------------------------------------------

    def upload_model(self, path: str | os.PathLike[str], name: str | None = None) -> Model:
        """Upload a model file (streamed). The same model again gives back the same model.

        A self-contained .onnx is sent as it is. A model that keeps its weights in external data
        files (what `torch.onnx.export(m, args, "m.onnx")` writes by default: `m.onnx.data`) is
        packed with them into a zip and sent as `application/zip`; so is a .zip given here. The
        data files must be real files inside the model's folder (ModelFileError otherwise).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no such model file: {path}")
        try:
            with upload_file(path) as upload, upload.path.open("rb") as f:
                return Model.from_dict(
                    self._json(
                        "POST",
                        "/v1/models",
                        params={"name": name or path.name},
                        content=f,
                        headers={"Content-Type": upload.content_type},
                    )
                )
        except ModelPackError as exc:
            raise ModelFileError(str(exc)) from None

    def list_models(self) -> list[Model]:
        return [Model.from_dict(m) for m in self._paginate("/v1/models", {})]

    def get_model(self, model_id: str) -> Model:
        return Model.from_dict(self._json("GET", f"/v1/models/{model_id}"))

    def delete_model(self, model_id: str) -> None:
        """Delete the model, its finished jobs and its stored bytes; 409 while a job of it is
        queued or running."""
        self._request("DELETE", f"/v1/models/{model_id}")

    # -- jobs -------------------------------------------------------------------------------

    def create_job(
        self,
        model_id: str,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        precision: str = "fp32",
        fusion_disable: Sequence[str] = (),
        rtol: float | None = None,
        atol: float | None = None,
        idempotency_key: str | None = None,
        webhook_url: str | None = None,
        target: str | None = None,
    ) -> Job:
        """Queue a fusion job for an uploaded model. Unset options take the server's defaults.

        `target` is the device kind to run on (`any`, `cpu`, or a GPU kind such as `h200`); the
        server answers 422 for a kind it does not know, listing the ones it does.
        """
        body: dict[str, Any] = {"model_id": model_id, "precision": precision}
        if target:
            body["target"] = target
        if input_shapes:
            body["input_shapes"] = {k: [int(d) for d in v] for k, v in input_shapes.items()}
        if fusion_disable:
            body["fusion"] = {"disable": list(fusion_disable)}
        verify = {k: v for k, v in (("rtol", rtol), ("atol", atol)) if v is not None}
        if verify:
            body["verify"] = verify
        if webhook_url:
            body["webhook_url"] = webhook_url
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return Job.from_dict(self._json("POST", "/v1/jobs", json=body, headers=headers))

    def get_job(self, job_id: str) -> Job:
        return Job.from_dict(self._json("GET", f"/v1/jobs/{job_id}"))

    def list_jobs(
        self, status: str | None = None, model_id: str | None = None, order_by: str | None = None
    ) -> list[Job]:
        """The tenant's jobs, newest first; `order_by` a column (`-speedup`: largest first, jobs
        without a value last): created_at, finished_at, speedup, latency_ms_before,
        latency_ms_after, kernels_before, kernels_after, peak_memory_before, peak_memory_after."""
        query = {"status": status, "model_id": model_id, "order_by": order_by}
        return [Job.from_dict(j) for j in self._paginate("/v1/jobs", query)]

    def wait_job(
        self,
        job_id: str,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        on_update: Callable[[Job], None] | None = None,
    ) -> Job:
        """Poll until the job succeeds, fails or is canceled; returns the final Job.

        `on_update` sees every polled state. Brief network errors are retried; after `timeout_s`
        an OpfuseTimeoutError is raised (the job keeps running on the server).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failures = 0
        while True:
            try:
                job = self.get_job(job_id)
                failures = 0
            except OpfuseConnectionError:
                failures += 1
                if failures > 5:
                    raise
            else:
                if on_update is not None:
                    on_update(job)
                if job.get("status") in TERMINAL_STATUSES:
                    return job
            if deadline is not None and time.monotonic() >= deadline:
                raise OpfuseTimeoutError(
                    f"job {job_id} did not finish within {timeout_s:g} s; it is still on the server "
                    f"(check it with `opfuse status {job_id}`)"
                )
            time.sleep(poll_s)

    def get_report(self, job_id: str) -> Report:
        """A finished job's report (DESIGN.md §5); its JSON is `.raw`."""
        return Report.from_dict(self._json("GET", f"/v1/jobs/{job_id}/report"))

    def get_report_html(self, job_id: str) -> str:
        """A finished job's report as one self-contained HTML page (works offline)."""
        return self._request("GET", f"/v1/jobs/{job_id}/report.html").text

    def signing_key(self) -> bytes:
        """Your tenant's bundle-signing key: the one given to the client, else the API's answer."""
        if self._signing_key is None:
            self._signing_key = bytes.fromhex(str(self._json("GET", "/v1/signing-key")["key"]))
        return self._signing_key

    def download_artifact(
        self, job_id: str, path: str | os.PathLike[str], *, verify_signature: bool = True
    ) -> Download:
        """Stream the job's bundle to `path`; its sha256 is checked against the server's ETag and
        its Opfuse-Signature against your tenant's signing key (ArtifactSignatureError, nothing
        saved, when it does not match). `verify_signature=False` skips the signature only."""
        key = self.signing_key() if verify_signature else None

        def check(got: Download) -> None:
            if key is None:
                return
            message = f"opfuse-artifact-v1\n{job_id}\n{got.sha256}".encode()
            expected = "hmac-sha256=" + hmac.new(key, message, hashlib.sha256).hexdigest()
            if got.signature is None:
                raise ArtifactSignatureError(
                    f"the bundle of job {job_id} came without the API's signature (Opfuse-Signature); "
                    "it was not saved: download it from the opfuse API itself"
                )
            if not hmac.compare_digest(got.signature, expected):
                raise ArtifactSignatureError(
                    f"the bundle of job {job_id} does not carry this API's signature for your tenant: "
                    "it was altered on its way or does not come from this server; it was not saved"
                )

        return self._stream_to_file("GET", f"/v1/jobs/{job_id}/artifact", path, check=check)

    def cancel_job(self, job_id: str) -> Job:
        return Job.from_dict(self._json("POST", f"/v1/jobs/{job_id}/cancel"))

    # -- worker protocol (scope `worker`) ---------------------------------------------------

    def claim(self, worker_id: str, device: str) -> Claim | None:
        """Take the next queued job under a lease, or None when the queue is empty (204)."""
        response = self._request("POST", "/v1/worker/claim", json={"worker_id": worker_id, "device": device})
        if response.status_code == 204 or not response.content:
            return None
        return cast(Claim, response.json())

    def heartbeat(self, job_id: str, lease_token: str, stage: str | None, progress: float) -> dict[str, Any]:
        """Renew the lease; the answer's `cancel` says the user canceled. LeaseLostError on 409."""
        return cast(
            dict[str, Any],
            self._json(
                "POST",
                f"/v1/worker/jobs/{job_id}/heartbeat",
                json={"lease_token": lease_token, "stage": stage, "progress": progress},
                lease=True,
            ),
        )

    def download_model(self, job_id: str, lease_token: str, path: str | os.PathLike[str]) -> Download:
        return self._stream_to_file(
            "GET", f"/v1/worker/jobs/{job_id}/model", path, lease=True, headers={"Lease-Token": lease_token}
        )

    def upload_artifact(self, job_id: str, lease_token: str, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Upload the bundle (streamed). Kept by the server only under the current lease."""
        with Path(path).open("rb") as f:
            response = self._request(
                "PUT",
                f"/v1/worker/jobs/{job_id}/artifact",
                content=f,
                headers={"Lease-Token": lease_token, "Content-Type": "application/zip"},
                lease=True,
            )
        return cast(dict[str, Any], response.json()) if response.content else {}

    def complete(self, job_id: str, lease_token: str, report: Mapping[str, Any]) -> Job:
        return Job.from_dict(
            self._json(
                "POST",
                f"/v1/worker/jobs/{job_id}/complete",
                json={"lease_token": lease_token, "report": dict(report)},
                lease=True,
            )
        )

    def fail(self, job_id: str, lease_token: str, error: str, retryable: bool) -> Job:
        return Job.from_dict(
            self._json(
                "POST",
                f"/v1/worker/jobs/{job_id}/fail",
                json={"lease_token": lease_token, "error": error, "retryable": retryable},
                lease=True,
            )
        )

    # -- admin: API keys (an `admin` key: its own tenant; a `platform` key: any tenant) ---------

    def create_key(
        self, scope: str = "user", tenant: str | None = None, expires_at: datetime | None = None
    ) -> ApiKey:
        """A new key (its `key` is in this answer only); `tenant` defaults to the caller's."""
        body: dict[str, Any] = {"scope": scope}
        if tenant is not None:
            body["tenant"] = tenant
        if expires_at is not None:
            if expires_at.tzinfo is None:
                raise ValueError("expires_at needs a time zone, e.g. datetime.now(UTC) + timedelta(days=30)")
            body["expires_at"] = expires_at.isoformat()
        return ApiKey.from_dict(self._json("POST", "/v1/admin/api-keys", json=body))

    def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        """Keys, newest first (never the keys themselves): the caller's tenant, or with a platform
        key every tenant's (or `tenant`'s)."""
        query = {"tenant": tenant, "limit": 200}
        return [ApiKey.from_dict(k) for k in self._paginate("/v1/admin/api-keys", query)]

    def revoke_key(self, key_id: int) -> ApiKey:
        """Revoke a key: refused (401) from its next request on."""
        return ApiKey.from_dict(self._json("POST", f"/v1/admin/api-keys/{int(key_id)}/revoke"))

    # -- health -----------------------------------------------------------------------------

    def ready(self) -> bool:
        """True when the server answers /readyz with 200."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False
