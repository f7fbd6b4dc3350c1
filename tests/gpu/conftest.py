"""GPU test harness: skips cleanly without a CUDA device, and makes the
runtime's test helpers (tests/runtime_fixtures.py) importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cuda_ready() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no usable torch/CUDA means skip
        return False


@pytest.fixture(scope="session")
def device():
    if not cuda_ready():
        pytest.skip("no CUDA device")
    import torch

    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def artifact_path():
    """The artifact under test: $MOE_BUILD_ARTIFACT (directory or .tar.zst)."""
    path = os.environ.get("MOE_BUILD_ARTIFACT")
    if not path:
        pytest.skip("MOE_BUILD_ARTIFACT is not set")
    if not Path(path).exists():
        pytest.skip(f"MOE_BUILD_ARTIFACT={path} does not exist")
    return Path(path)
