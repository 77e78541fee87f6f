"""The measurement protocol: warm-up, device events, percentiles, rotated inputs, peak memory."""

from __future__ import annotations

from opfuse.bench.protocol import measure

__all__ = ["measure"]
