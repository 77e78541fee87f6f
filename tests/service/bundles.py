"""A real bundle for the service's tests: the API checks every uploaded artifact as `opfuse.load`
does (its kernels rendered again from their specs), so a worker in a test uploads what opfuse
compiles, not a zip that merely looks like one."""

from __future__ import annotations

import functools
import io
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from tests.service.onnx_models import mlp


@functools.cache
def real_bundle() -> bytes:
    """The MLP compiled for x: [8, 4] in the CPU interpreter (once per test process)."""
    import opfuse

    compiled = opfuse.compile(mlp(), {"x": [8, 4]}, device="cpu")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mlp.opfuse.zip"
        compiled.save(path)
        return path.read_bytes()


def altered(data: bytes, change: Callable[[str, bytes], bytes]) -> bytes:
    """The bundle with each member passed through `change(name, bytes)`."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as w:
        for name in z.namelist():
            w.writestr(name, change(name, z.read(name)))
    return out.getvalue()
