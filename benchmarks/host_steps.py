"""Where an eager layer call's host time goes, step by step, without a
profiler (needs a GPU):

    python3 -m benchmarks.host_steps ARTIFACT

The steps of ``MoELayer.__call__`` for a variant that writes the MoE output
itself (M = 1 and 64, FP32 logits: no padding) run one at a time between
``time.perf_counter_ns`` reads, 12 rounds of 50, interleaved with whole
calls and torch's own primitives; medians (and 10th percentiles) in us. The
steps mirror ``__call__``'s code (its private parts), so a change there
needs one here. ``docs/notes/host-path.md`` has what it read.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import runtime
from runtime import driver, graphs
from runtime.layout import random_moe_weights
from runtime.moe import current_stream

ROUNDS, CALLS = 12, 50


def measure(layer, device: torch.device, m: int) -> dict[str, list[int]]:
    """Nanoseconds of each step and primitive, per call, at M = ``m``."""
    s = layer.shape
    x = torch.randn(m, s.hidden, device=device).bfloat16()
    logits = torch.randn(m, s.experts, device=device)
    bias = torch.randn(s.experts, device=device) * 0.1 if s.bias else None
    for _ in range(5):
        layer(x, logits, bias)
    torch.cuda.synchronize(device)
    state = {}

    def check():
        state["m"], state["dtype"] = layer._check(x, logits, bias, None)

    def table():
        state["v"] = layer._variant(layer.tables[state["dtype"]].get(m), state["dtype"])

    def alloc():
        state["block"] = layer.layouts[state["v"].name].allocate_final(device)

    def release():
        graphs.release()

    def stream():
        state["stream"] = current_stream(device.index)

    def plan():
        state["plan"] = layer._plan(state["v"], state["stream"], True)

    def capture():
        graphs.capture_possible(device.index)

    def context():
        driver.context_is_current(device.index)

    def launch():
        state["plan"].launch(state["stream"], x, logits, bias, state["block"])

    def view():
        layer.layouts[state["v"].name].view(state["block"], "final", m)

    steps = [check, table, alloc, release, stream, plan, capture, context, launch, view]
    prims = {
        "torch.empty": lambda: torch.empty((m, s.hidden), dtype=torch.bfloat16, device=device),
        "current_device": torch.cuda.current_device,
        "is_capturing": torch.cuda.is_current_stream_capturing,
        "whole call": lambda: layer(x, logits, bias),
    }
    times = {f.__name__: [] for f in steps} | {k: [] for k in prims}
    for _ in range(ROUNDS):
        for _ in range(CALLS):
            for f in steps:
                t = time.perf_counter_ns()
                f()
                times[f.__name__].append(time.perf_counter_ns() - t)
        torch.cuda.synchronize(device)
        for name, f in prims.items():
            for _ in range(CALLS):
                t = time.perf_counter_ns()
                f()
                times[name].append(time.perf_counter_ns() - t)
            torch.cuda.synchronize(device)
    return times


def main(path: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    artifact = runtime.load(path, device)
    gen = torch.Generator(device).manual_seed(0)
    layer = artifact.bind(random_moe_weights(artifact.shape, gen)[0])
    for m in (1, 64):
        print(f"M={m}")
        for name, ns in measure(layer, device, m).items():
            ordered = sorted(ns)
            print(f"  {name:15s} {statistics.median(ns) / 1e3:6.2f} us "
                  f"(p10 {ordered[len(ns) // 10] / 1e3:6.2f})")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
