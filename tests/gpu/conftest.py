"""Tests under tests/gpu need a CUDA device. Without one they are reported as skipped,
with the reason, instead of failing (CI runs `pytest tests --ignore=tests/gpu` anyway).
Modules here must import without a GPU: they import triton and CUDA-only code lazily."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine with: python -m pytest -q tests/gpu")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
