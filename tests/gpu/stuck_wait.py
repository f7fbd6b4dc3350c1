"""A grouped launch whose CTAs wait on a CTA that never runs must fail, not
hang: run one finalize call with the grid cut by one CTA (the finalize
waits for every CTA's count), and report what the launch returned.

    python3 tests/gpu/stuck_wait.py ARTIFACT

Prints ``launch failed: <error>`` and exits 0 when the launch reported an
error; exits 1 if the call returned normally. A hang is for the watching
process to catch (its time limit).
"""

from __future__ import annotations

import sys
import time

import torch

import runtime
from runtime.layout import random_moe_weights


def main(path: str) -> int:
    device = torch.device("cuda", torch.cuda.current_device())
    artifact = runtime.load(path, device)
    finals = [v for v in artifact.variants if v.kernel == "grouped" and v.finalize]
    if not finals:
        print("no grouped finalize variant")
        return 2
    variant = finals[0]
    prepared, _, _ = random_moe_weights(artifact.shape, torch.Generator(device).manual_seed(1))
    layer = artifact.bind(prepared)
    launcher = layer.launchers[variant.name]
    launcher.config.gridDimX = variant.launch.grid[0] - 1
    s = artifact.shape
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[variant.logits_dtype]
    x = torch.randn(variant.tokens, s.hidden, device=device).bfloat16()
    logits = torch.randn(variant.tokens, s.experts, device=device).to(dtype)
    bias = torch.randn(s.experts, device=device) * 0.1
    started = time.perf_counter()
    try:
        layer.grouped(x, logits, bias, finalize=True)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - the error is what this reports
        took = time.perf_counter() - started
        print(f"launch failed after {took:.1f} s: {type(e).__name__}: {e}".splitlines()[0])
        return 0
    print(f"the call returned normally after {time.perf_counter() - started:.1f} s")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
