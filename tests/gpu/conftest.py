"""GPU test harness: a CUDA device and the artifact under test, or a clean skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


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
