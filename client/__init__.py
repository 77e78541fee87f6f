"""The opfuse Python SDK (`client.sdk.OpfuseClient`) and the `opfuse` command line (`client.cli`).

The SDK needs only httpx: MLOps pipelines can use it without torch, triton or the service. It
returns typed records (client.records: `Model`, `Job`, `Report`, `ApiKey`), the JSON in `.raw`.
"""

from __future__ import annotations

from client.records import ApiKey, Job, Model, Report
from client.sdk import (
    ArtifactIntegrityError,
    ArtifactSignatureError,
    LeaseLostError,
    OpfuseAPIError,
    OpfuseClient,
    OpfuseClientError,
    OpfuseConnectionError,
    OpfuseTimeoutError,
)

__all__ = [
    "ApiKey",
    "ArtifactIntegrityError",
    "ArtifactSignatureError",
    "Job",
    "LeaseLostError",
    "Model",
    "OpfuseAPIError",
    "OpfuseClient",
    "OpfuseClientError",
    "OpfuseConnectionError",
    "OpfuseTimeoutError",
    "Report",
]
