"""GPU tests run on a CUDA machine (the device machine), never in CI."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run tests/gpu on the GPU machine")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
