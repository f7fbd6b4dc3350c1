"""One launch of one variant of an artifact, for tools that watch a process
(compute-sanitizer, ncu):

    compute-sanitizer --tool memcheck --kernel-name kns=moe_ \
        python3 tests/gpu/one_call.py ARTIFACT VARIANT [same]

With ``same`` every token is a copy of the first (x and logits), so every
token takes the same routes: the shape of a padded M = 1 call, the fewest
units a grouped call can have. With ``rows=N`` (N below the variant's
bucket, which must be the bucket the layer picks for N) the call has N
rows: a grouped variant that takes ``valid`` then reads the caller's N rows
unpadded, its MoE output an N-row tensor (the layer call, not poisoned).
Run it with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so each tensor is an
allocation of its own and memcheck sees a read or write past row N - 1.

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


def main(path: str, name: str, same: bool = False, rows: int | None = None) -> int:
    device = torch.device("cuda", 0)
    artifact = runtime.load(path, device)
    variant = {v.name: v for v in artifact.variants}[name]
    seeding.seed_torch(f"one_call {name}")
    s = artifact.shape
    weights = MoEWeights(
        random_experts(s.experts, s.hidden, s.inter, device),
        random_experts(1, s.hidden, s.inter, device) if s.shared_experts else None,
    )
    # With rows=N the layer call itself (not poisoned: the path that
    # allocates a final of N rows, which a kernel writing past them overruns).
    layer = artifact.bind(weights, poison=rows is None)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[variant.logits_dtype]
    m = variant.tokens if rows is None else rows
    if not 1 <= m <= variant.tokens:
        sys.exit(f"rows={m}: {name} serves 1..{variant.tokens} rows")
    x = torch.randn(m, s.hidden, device=device).bfloat16()
    logits = torch.randn(m, s.experts, device=device).to(dtype)
    if same:
        x, logits = x[:1].expand_as(x).contiguous(), logits[:1].expand_as(logits).contiguous()
    # A model routing without a score-correction bias takes none.
    bias = torch.randn(s.experts, device=device) * 0.1 if s.bias else None
    if rows is not None:
        chosen = layer._variant(layer.tables[variant.logits_dtype][m], variant.logits_dtype)
        if chosen.name != name:
            sys.exit(f"rows={m}: the layer serves it with {chosen.name}, not {name}")
        outputs = layer(x, logits, bias)
    elif variant.kernel == "mega":
        outputs = layer.mega(x, logits, bias)
    else:
        outputs = layer.grouped(x, logits, bias, finalize=variant.finalize)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    outputs = [t for t in outputs if t is not None]  # no shared rows without a shared expert
    torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(t.float()).all()) for t in outputs)
    print(f"{name}: one call of {m} rows, outputs finite: {finite}")
    return 0 if finite else 1


def _options(args: list[str]) -> tuple[bool, int | None]:
    """``same`` and ``rows=N`` from the arguments after VARIANT."""
    same, rows = False, None
    for a in args:
        if a == "same":
            same = True
        elif a.startswith("rows=") and a[5:].isdigit():
            rows = int(a[5:])
        else:
            sys.exit("usage: one_call.py ARTIFACT VARIANT [same] [rows=N]")
    return same, rows


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: one_call.py ARTIFACT VARIANT [same] [rows=N]")
    sys.exit(main(sys.argv[1], sys.argv[2], *_options(sys.argv[3:])))
