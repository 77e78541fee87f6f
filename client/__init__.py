"""The opfuse Python SDK (`client.sdk.OpfuseClient`) and the `opfuse` command line (`client.cli`).

The SDK needs only httpx: MLOps pipelines can use it without torch, triton or the service.
"""

from __future__ import annotations

from client.sdk import (
    ArtifactIntegrityError,
    LeaseLostError,
    OpfuseAPIError,
    OpfuseClient,
    OpfuseClientError,
    OpfuseConnectionError,
    OpfuseTimeoutError,
)

__all__ = [
    "ArtifactIntegrityError",
    "LeaseLostError",
    "OpfuseAPIError",
    "OpfuseClient",
    "OpfuseClientError",
    "OpfuseConnectionError",
    "OpfuseTimeoutError",
]
