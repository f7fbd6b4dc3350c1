"""Persistent launches beside other work, for a process a test can watch
with a time limit (a hang cannot be caught inside the hung process):

    python3 tests/gpu/stress_streams.py ARTIFACT [--pairs N] [--m M --m2 M2]

Two streams of different priority (0 and the device's highest) call the
layer in turn, ``pairs`` times each, while a third stream keeps a plain
elementwise kernel on the GPU. Each stream's outputs are checked against
the same layer's results computed alone on one stream beforehand (the
kernel is deterministic: the same inputs give the same bits), and those
against the torch reference once. Prints one summary line; exit 0 when
every checked output is within 1e-3 relative L2 of the one-stream result
(bit-equal is expected and counted), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import runtime
from runtime.layout import random_moe_weights
from runtime.reference import moe_reference, rel_l2

POOL = 4


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--pairs", type=int, default=10_000)
    p.add_argument("--m", type=int, default=64, help="tokens per call on the first stream")
    p.add_argument("--m2", type=int, default=64, help="tokens per call on the second stream")
    args = p.parse_args(argv)
    seed = int(os.environ.get("MOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little") >> 1)
    print(f"seed {seed} (rerun with MOE_TEST_SEED={seed})", flush=True)
    device = torch.device("cuda", torch.cuda.current_device())
    artifact = runtime.load(args.artifact, device)
    gen = torch.Generator(device).manual_seed(seed)
    prepared, routed, shared = random_moe_weights(artifact.shape, gen)
    layer = artifact.bind(prepared)
    s = artifact.shape
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[layer.dtypes[0]]

    def inputs(m):
        x = torch.randn(m, s.hidden, device=device, generator=gen).bfloat16()
        logits = torch.randn(m, s.experts, device=device, generator=gen).to(dtype)
        bias = torch.randn(s.experts, device=device, generator=gen) * 0.1
        return x, logits, bias

    pools = [[inputs(m) for _ in range(POOL)] for m in (args.m, args.m2)]
    alone = [[layer(*call) for call in pool] for pool in pools]
    torch.cuda.synchronize(device)
    worst_ref = max(
        rel_l2(alone[i][j], moe_reference(*pools[i][j], routed, shared, s).final)
        for i in range(2) for j in range(POOL)
    )  # fmt: skip
    _, high = torch.cuda.Stream.priority_range()
    streams = (torch.cuda.Stream(device, priority=0), torch.cuda.Stream(device, priority=high))
    other = torch.cuda.Stream(device)
    filler = torch.randn(64 << 20, device=device)  # 256 MB: each add spans every SM
    started, mismatched, checked, worst = time.perf_counter(), 0, 0, 0.0
    for i in range(args.pairs):
        if i % 8 == 0:
            with torch.cuda.stream(other):
                filler.mul_(0.5).add_(1.0)
        got = []
        for k, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                got.append(layer(*pools[k][i % POOL]))
        if i % 97 == 0 or i == args.pairs - 1:
            for k, stream in enumerate(streams):
                stream.synchronize()
                checked += 1
                mismatched += int(not torch.equal(got[k], alone[k][i % POOL]))
                worst = max(worst, rel_l2(got[k], alone[k][i % POOL]))
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    print(
        f"{args.pairs} pairs (M={args.m} on priority 0, M={args.m2} on priority {high}) beside "
        f"a third stream's kernel: {seconds:.1f} s, {checked} outputs checked, {mismatched} "
        f"not bit-equal to the one-stream result (worst rel_l2 {worst:.2e}); one-stream vs "
        f"reference worst rel_l2 "
        f"{worst_ref:.5f}",
        flush=True,
    )
    return 0 if worst < 1e-3 and worst_ref < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
