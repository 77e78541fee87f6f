"""/v1/signing-key: the key that the caller's tenant's bundle downloads are signed with
(service/signing.py), for `opfuse download` and the SDK to verify `Opfuse-Signature`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from service import signing
from service.api.deps import UserDep

router = APIRouter(prefix="/v1", tags=["jobs"])


class SigningKeyOut(BaseModel):
    algorithm: str  # "hmac-sha256"
    key: str  # hex
    message: str  # what is signed, with {job_id} and {sha256} to fill in


@router.get("/signing-key")
def get_signing_key(request: Request, principal: UserDep) -> SigningKeyOut:
    """Your tenant's bundle-signing key: HMAC-SHA256 of `message` (the job id and the bundle's
    sha256 filled in) is the hex after `hmac-sha256=` in a download's Opfuse-Signature header."""
    key = signing.tenant_key(request.app.state.signing_key, principal.tenant_id)
    return SigningKeyOut(
        algorithm=signing.ALGORITHM, key=key.hex(), message="opfuse-artifact-v1\n{job_id}\n{sha256}"
    )
