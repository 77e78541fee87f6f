"""`python -m service`: run the API server alone (settings from OPFUSE_* variables)."""

from __future__ import annotations

import sys

from service.server import ServerStartError, serve

if __name__ == "__main__":
    try:
        serve()
    except ServerStartError as exc:
        print(f"opfuse: {exc}", file=sys.stderr)
        sys.exit(1)
