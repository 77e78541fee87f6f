"""opfuse: fuse the memory-bound ops of an ONNX model into generated Triton kernels.

Library API (DESIGN.md §6)::

    cm = opfuse.compile("model.onnx", input_shapes={"x": [8, 3, 224, 224]}, precision="fp32", device="cpu")
    outs = cm.run({"x": array})
    cm.report; cm.save("model.opfuse.zip")
    m = opfuse.load("model.opfuse.zip", device="cpu")

Heavy modules (torch, triton) load on first use, so `opfuse.frontend` stays importable by the
API server, which never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opfuse.errors import BundleError, InputError, ModelError, OpfuseError

__version__ = "0.1.0"
__all__ = [
    "BundleError",
    "CompiledModel",
    "InputError",
    "ModelError",
    "OpfuseError",
    "__version__",
    "compile",
    "load",
]

if TYPE_CHECKING:
    from opfuse.compiler import CompiledModel, compile, load


def __getattr__(name: str) -> Any:
    if name in ("compile", "load", "CompiledModel"):
        from opfuse import compiler

        return getattr(compiler, name)
    raise AttributeError(f"module 'opfuse' has no attribute {name!r}")
