"""The bundle's layout constants (DESIGN.md §4, docs/bundle.md), shared by the writer
(opfuse.runtime.bundle) and the checking reader (opfuse.bundle_check), which the API imports."""

from __future__ import annotations

BUNDLE_FORMAT = "opfuse-bundle"
# 2: each kernel's spec in plan.json; the loader renders kernels from it and runs only that.
BUNDLE_VERSION = 2
FUSED_DOMAIN = "ai.opfuse"
# A bundle is untrusted input too: refuse archives that unpack to absurd sizes.
MAX_MEMBER_BYTES = 4 * 1024**3
