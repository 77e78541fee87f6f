"""Views of a report: a self-contained HTML page (`html`) and a Chrome/Perfetto trace (`trace`).

Pure Python, standard library only: the API server (which never imports torch) and the CLI render
with them as the library does.
"""

from __future__ import annotations

from opfuse.views.html import CONTENT_SECURITY_POLICY, SCRIPT_HASH, kernel_sources_from_zip, render_html
from opfuse.views.trace import render_trace

__all__ = ["CONTENT_SECURITY_POLICY", "SCRIPT_HASH", "kernel_sources_from_zip", "render_html", "render_trace"]
