"""For the kernels' GPU tests: which artifacts to test, and one artifact
loaded and bound to fresh random weights (NaN-poisoning its outputs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import seeding


def artifact_paths(env: str) -> list[Path]:
    """Paths in ``$env`` (joined by os.pathsep), else ``$MOE_BUILD_ARTIFACT``."""
    joined = os.environ.get(env) or os.environ.get("MOE_BUILD_ARTIFACT")
    return [Path(p) for p in joined.split(os.pathsep)] if joined else []


def bind_fresh(path: Path | None, env: str, kernel: str):
    """(artifact, poisoned layer, (prepared, routed, shared) weights) of the
    artifact at ``path``; skips without a GPU, a path, or a ``kernel`` variant
    for sm_90a in it."""
    torch = pytest.importorskip("torch")
    if path is None:
        pytest.skip(f"set {env} or MOE_BUILD_ARTIFACT")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not path.exists():
        pytest.skip(f"{path} does not exist")
    import runtime
    from runtime.layout import random_moe_weights

    device = torch.device("cuda", torch.cuda.current_device())
    artifact = runtime.load(path, device)
    if not any(v.kernel == kernel and v.arch == "sm_90a" for v in artifact.variants):
        pytest.skip(f"{path} holds no sm_90a {kernel} variant")
    gen = seeding.generator(f"weights of {path} for {kernel}", device=device)
    weights = random_moe_weights(artifact.shape, gen)
    return artifact, artifact.bind(weights[0], poison=True), weights
