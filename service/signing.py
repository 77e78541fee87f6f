"""Bundles signed by the API: each download carries `Opfuse-Signature`, an HMAC-SHA256 over the
job id and the sha256 the API computed when it received and checked the bundle, with a key of the
job's tenant. `opfuse download` and the SDK fetch their tenant's key (GET /v1/signing-key, any key
of the tenant) or take it configured, and refuse a bundle whose signature does not match.

The API's signing key is OPFUSE_SIGNING_KEY, or else `signing.key` under OPFUSE_HOME, made (0600)
on first start. A tenant's key is derived from it, so a tenant holds only its own: what one can
sign, no other tenant's client accepts. HMAC, not a public-key signature (the `cryptography`
package is not a dependency): whoever holds a tenant's key can sign for that tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from service.file_modes import FILE_MODE, private_dir
from service.settings import Settings

ALGORITHM = "hmac-sha256"
HEADER = "Opfuse-Signature"
KEY_FILE = "signing.key"


def load_signing_key(settings: Settings) -> bytes:
    """The configured key, or the one kept under OPFUSE_HOME (made on first use, mode 0600)."""
    if settings.signing_key is not None:
        return settings.signing_key.get_secret_value().encode()
    path = private_dir(settings.home) / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return _read_key(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    os.chmod(path, FILE_MODE)
    key = path.read_text().strip()
    if len(key) < 32:
        raise RuntimeError(f"{path} holds no signing key; remove it and the server makes a new one")
    return key.encode()


def tenant_key(master: bytes, tenant_id: int) -> bytes:
    """The tenant's own signing key, derived from the API's."""
    return hmac.new(master, f"opfuse-tenant-signing-key\n{tenant_id}".encode(), hashlib.sha256).digest()


def message(job_id: str, sha256: str) -> bytes:
    """What a signature covers: the job and its bundle's sha256 (client/sdk.py signs the same)."""
    return f"opfuse-artifact-v1\n{job_id}\n{sha256}".encode()


def signature(key: bytes, job_id: str, sha256: str) -> str:
    """The header's value: `hmac-sha256=<hex>`."""
    return f"{ALGORITHM}={hmac.new(key, message(job_id, sha256), hashlib.sha256).hexdigest()}"
