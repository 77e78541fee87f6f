"""Load generated kernel source as Python modules (Triton needs a real file to read source from)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
import sys
import tempfile
from types import ModuleType

from opfuse.runtime import bounds

_loaded: dict[tuple[str, bool], ModuleType] = {}


def _kernel_dir() -> str:
    """This user's kernel folder. One that is a link, another user's, or writable by others is
    refused: whoever can write there could swap a module before it is imported."""
    path = os.path.join(tempfile.gettempdir(), f"opfuse-kernels-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(
            f"{path} is not a folder of this user's that only it can write to; remove it, and opfuse "
            "makes it again"
        )
    return path


def ensure_interpreter() -> None:
    """Run Triton kernels in its CPU interpreter from now on in this process.

    Triton builds parts of its language at import time for one mode or the other, so the switch
    must happen before triton is first imported (opfuse imports it lazily for that reason).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "device='cpu' runs Triton kernels in its interpreter, which must be chosen before triton is "
            "imported: set TRITON_INTERPRET=1 in the environment of this process"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _holds(path: str, source: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == source
    except (OSError, UnicodeDecodeError):
        return False


def load_kernel_module(source: str, interpret: bool) -> ModuleType:
    """Import generated source; under `interpret` its kernels run in Triton's interpreter."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:32]
    key = (digest, interpret)
    if key in _loaded:
        return _loaded[key]
    path = os.path.join(_kernel_dir(), f"k_{digest}.py")
    if not _holds(path, source):  # a file left there is imported only when it is this source
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"opfuse_kernel_{digest}_{int(interpret)}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Triton decides between interpreter and compiler when @triton.jit runs, i.e. at import.
    if interpret:
        ensure_interpreter()
        spec.loader.exec_module(module)
        if bounds.enabled():
            bounds.install()
    else:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "0"
        try:
            spec.loader.exec_module(module)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    _loaded[key] = module
    return module
