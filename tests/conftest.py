"""Fixtures shared by the pipeline test modules."""

from __future__ import annotations

import pytest
from pipeline_support import use_stub


@pytest.fixture
def stub_env(tmp_path, monkeypatch):
    """The stub kernel modules in place of the real ones (pipeline_support.use_stub)."""
    return use_stub(tmp_path, monkeypatch)
