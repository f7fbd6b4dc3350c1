"""One launch of one variant of an artifact, for tools that watch a process
(compute-sanitizer, ncu):

    compute-sanitizer --tool memcheck --kernel-name kns=moe_ \
        python3 tests/gpu/one_call.py ARTIFACT VARIANT [same]

With ``same`` every token is a copy of the first (x and logits), so every
token takes the same routes: the shape of a padded M = 1 call, the fewest
units a grouped call can have.

Weights are random bytes (FP8 NaN codes replaced) made with a handful of
torch kernels, so a sanitizer spends its time on the MoE kernel, not on
weight generation. Prints the seed of its random weights and inputs
(tests/seeding.py: fresh each run; ``MOE_TEST_SEED`` repeats a run) and the
outputs' finiteness; exit 1 if not finite.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import runtime
from runtime.layout import ExpertWeights, MoEWeights
from runtime.model import TILE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: seeding
import seeding  # noqa: E402


def random_experts(e: int, hidden: int, inter: int, device) -> ExpertWeights:
    def fp8(*shape):
        raw = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
        raw[(raw & 0x7F) == 0x7F] = 0x38  # e4m3 NaN codes -> 1.0
        return raw.view(torch.float8_e4m3fn)

    def scales(*shape):
        return torch.rand(*shape, device=device) * 1e-3 + 1e-4

    return ExpertWeights(
        w13=fp8(e, hidden // TILE, 2 * inter, TILE),
        w13_scale=scales(e, 2 * inter // TILE, hidden // TILE),
        w2=fp8(e, inter // TILE, hidden, TILE),
        w2_scale=scales(e, hidden // TILE, inter // TILE),
    )


def main(path: str, name: str, same: bool = False) -> int:
    device = torch.device("cuda", 0)
    artifact = runtime.load(path, device)
    variant = {v.name: v for v in artifact.variants}[name]
    seeding.seed_torch(f"one_call {name}")
    s = artifact.shape
    weights = MoEWeights(
        random_experts(s.experts, s.hidden, s.inter, device),
        random_experts(1, s.hidden, s.inter, device) if s.shared_experts else None,
    )
    layer = artifact.bind(weights, poison=True)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[variant.logits_dtype]
    m = variant.tokens
    x = torch.randn(m, s.hidden, device=device).bfloat16()
    logits = torch.randn(m, s.experts, device=device).to(dtype)
    if same:
        x, logits = x[:1].expand_as(x).contiguous(), logits[:1].expand_as(logits).contiguous()
    # A model routing without a score-correction bias takes none.
    bias = torch.randn(s.experts, device=device) * 0.1 if s.bias else None
    if variant.kernel == "mega":
        outputs = layer.mega(x, logits, bias)
    else:
        outputs = layer.grouped(x, logits, bias, finalize=variant.finalize)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    outputs = [t for t in outputs if t is not None]  # no shared rows without a shared expert
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(t.float()).all()) for t in outputs)
    print(f"{name}: one call, outputs finite: {finite}")
    return 0 if finite else 1


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[3:] not in ([], ["same"]):
        sys.exit("usage: one_call.py ARTIFACT VARIANT [same]")
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["same"]))
