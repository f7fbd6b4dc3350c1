"""For the kernels' GPU tests: which artifacts to test, and one artifact
loaded and bound to fresh random weights (NaN-poisoning its outputs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import seeding

#: Relative L2 error, against the float64 reference, of any one layer call
#: (its 1-512 tokens; an error pooled over calls has the 1e-2 bar). One call
#: of 1-3 tokens has read up to 2.3e-2 on the H200 where its pool read 9.3e-3;
#: ~21,000 single tokens of Qwen3-235B TP4 and GLM-5.3 read at most 2.5e-2
#: (p99.9 1.2-2.3e-2; docs/notes/models-h200.md, "The layer's error at M <= 4").
CALL_TOL = 3e-2

#: Tokens whose best top_k + 1 routing keys (or kept and dropped group
#: scores) are closer than this (``runtime.reference.tie_margin``) may be
#: routed differently by a kernel whose score function is a few ulp off
#: torch's: tests compare them on the kernel's own choice or count them apart.
TIE = 1e-6


def pooled_rel_l2(pairs) -> float:
    """The relative L2 error of (got, want) pairs taken together, in float64
    (0.0 for none): what the 1e-2 bar holds for a test's calls."""
    err = sum(float((g.double() - w.double()).square().sum()) for g, w in pairs)
    ref = sum(float(w.double().square().sum()) for _, w in pairs)
    return (err / ref) ** 0.5 if ref else 0.0


#: A sum of top_k weighted rows and a shared row in FP32 (at most k + 1
#: roundings a summand, in any order, fused or not) is off the exact sum by
#: about (k + 1) x 2^-24 of its summands' magnitudes; ``final_bound`` allows
#: (top_k + SUM_ULPS) x 2^-24.
SUM_ULPS = 2


def final_bound(out, weights, shared):
    """(exact sum, bound), float64 [M, H] each, of a kernel's BF16 ``final``
    against its own launch's rows: the exact weighted sum of the BF16 route
    rows ``out`` ([M * top_k, H]) with ``weights`` ([M, top_k]) plus the
    ``shared`` rows ([M, H] or None), and how far ``final`` may be from it:
    the FP32 sum in any order, fused or not, is within (top_k + SUM_ULPS) x
    2^-24 of the summands' magnitudes, and rounding it to BF16 moves it by
    at most 2^-8 of itself."""
    m, k = weights.shape
    terms = weights.double()[:, :, None] * out.double().view(m, k, -1)
    extra = 0 if shared is None else shared.double()
    size = terms.abs().sum(1) + (0 if shared is None else extra.abs())
    want = terms.sum(1) + extra
    drift = (k + SUM_ULPS) * 2.0**-24 * size
    return want, 2.0**-8 * (want.abs() + drift) + drift


def artifact_paths(env: str) -> list[Path]:
    """Paths in ``$env`` (joined by os.pathsep), else ``$MOE_BUILD_ARTIFACT``."""
    joined = os.environ.get(env) or os.environ.get("MOE_BUILD_ARTIFACT")
    return [Path(p) for p in joined.split(os.pathsep)] if joined else []


#: The package suffix an artifact file carries (artifacts/README.md).
PACKAGE = ".tar.zst"


def is_artifact(path: Path) -> bool:
    """Whether ``path`` is an artifact: a directory holding manifest.json, or
    a ``.tar.zst`` package file."""
    return (path / "manifest.json").is_file() or (path.is_file() and path.name.endswith(PACKAGE))


def model_artifacts(env: str = "MOE_MODEL_ARTIFACTS") -> list[Path]:
    """The artifacts named by ``$env`` (paths joined by os.pathsep), else by
    ``$MOE_BUILD_ARTIFACT``: a path that is an artifact (``is_artifact``)
    stands for itself; any other directory for every artifact directly in it
    (one per config, as ``make build-all`` leaves them in artifacts/), sorted
    by name. A path that does not exist is kept, for the test to skip."""
    found = []
    for path in artifact_paths(env):
        if path.is_dir() and not is_artifact(path):
            found += sorted(p for p in path.iterdir() if is_artifact(p))
        else:
            found.append(path)
    return found


def artifact_name(path: Path | None) -> str:
    """A test id for ``path``: its name less the package suffix ("none" for None)."""
    if path is None:
        return "none"
    return path.name[: -len(PACKAGE)] if path.name.endswith(PACKAGE) else path.name


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
