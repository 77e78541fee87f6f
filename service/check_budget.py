"""A budget of bytes for checking uploaded models: parsing and checking a model holds it in memory a
few times over (about 3.5× its size), so the API checks at most `limit` bytes of models at once.
A model bigger than the budget is checked alone. Checks are CPU-bound under the GIL anyway, so
running fewer at once costs little time and bounds the server's memory."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class CheckBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, size: int) -> Iterator[None]:
        """Wait until `size` bytes fit in the budget, hold them while the block runs."""
        size = min(max(size, 1), self.limit)
        with self._changed:
            self._changed.wait_for(lambda: self._used + size <= self.limit)
            self._used += size
        try:
            yield
        finally:
            with self._changed:
                self._used -= size
                self._changed.notify_all()
