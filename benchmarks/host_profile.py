"""Where an eager layer call spends its CPU time, for making the host path
thin:

    python3 -m benchmarks.host_profile ARTIFACT [--tokens 1,8,64] [--calls 500]

For each M: the median wall time of issuing one call without synchronizing
(as ``moe-build bench`` reports it), then a ``cProfile`` of ``calls`` more
calls with the functions that took the most time, excluding what they call
(``tottime``), so the table names the steps worth removing or caching. Needs
a GPU; weights are random, inputs the benchmark's "random" routing of the
artifact's model (``benchmarks.bench.routing_inputs``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--tokens", default="1,8,64")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--top", type=int, default=18)
    args = p.parse_args(argv)
    import runtime
    from benchmarks.bench import routing_inputs
    from runtime.layout import random_moe_weights

    device = torch.device("cuda", torch.cuda.current_device())
    artifact = runtime.load(args.artifact, device)
    gen = torch.Generator(device).manual_seed(0)
    layer = artifact.bind(random_moe_weights(artifact.shape, gen)[0])
    s = artifact.shape
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[layer.dtypes[0]]
    for m in (int(t) for t in args.tokens.split(",")):
        xs, logits, bias = routing_inputs("random", m, s, 1, gen, device)  # bias None: no bias
        x, logits = xs[0], logits[0].to(dtype)
        for _ in range(20):
            layer(x, logits, bias)
        torch.cuda.synchronize(device)
        times = []
        for i in range(args.calls):
            start = time.perf_counter()
            layer(x, logits, bias)
            times.append((time.perf_counter() - start) * 1e6)
            if i % 50 == 49:
                torch.cuda.synchronize(device)
        torch.cuda.synchronize(device)
        profile = cProfile.Profile()
        profile.enable()
        for i in range(args.calls):
            layer(x, logits, bias)
            if i % 50 == 49:
                torch.cuda.synchronize(device)
        profile.disable()
        torch.cuda.synchronize(device)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"M={m}: eager host time per call, median {statistics.median(times):.1f} us "
              f"(of {args.calls})")  # fmt: skip
        body = text.getvalue()
        print(body[body.find("ncalls") :])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
