"""Where one grouped call's time goes: the per-CTA ``%globaltimer`` stamps of a
diagnostics build (``kernels.grouped_plan.STAMPS_ENV``).

Build the stamped variants (any config; ``--no-cache`` is not needed, the
variable is part of the build-cache key), then run this on the GPU machine:

    MOE_BUILD_STAMPS=1 moe-build compile configs/glm5.yaml --arch sm_90a \\
        -o /tmp/glm5-stamps
    python3 -m benchmarks.grouped_timeline /tmp/glm5-stamps --tokens 8,64 \\
        --routing random --routing skewed

For each (routing, M) it binds ``bench.COPIES`` random weight copies, captures
a CUDA graph of ``bench.POOL`` calls on fresh inputs (as ``moe-build bench``
times them: PDL between calls, weights rotated), replays it, and reads the
stamps the last call left (every call overwrites them). Times are printed in
microseconds from the first CTA's entry: per stamp point the minimum, median
and maximum over the CTAs, then the counts (FC1 and FC2 stages, units). The
sm_100a kernel records the common points only (not the consumer's).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.bench import COPIES, POOL, routing_inputs
from kernels.grouped_plan import STAMP_COUNTS, STAMP_POINTS, partial_bytes


def read_device(pointer: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of device memory at ``pointer`` as a CPU uint8 tensor."""
    from cuda.bindings import driver as cu

    host = torch.empty(nbytes, dtype=torch.uint8)
    (err,) = cu.cuMemcpyDtoH(host.data_ptr(), pointer, nbytes)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyDtoH: {err}")
    return host


def timeline(stamps: torch.Tensor) -> dict:
    """{point: (min, median, max) over CTAs}: times in us from the earliest
    entry (32-bit wrap-safe), counts as they are."""
    words = stamps.view(-1, len(STAMP_POINTS)).to(torch.int64) & 0xFFFFFFFF
    entry = words[:, STAMP_POINTS.index("entry")]
    origin = int(entry.min())
    out = {}
    for i, name in enumerate(STAMP_POINTS):
        col = words[:, i]
        if name in STAMP_COUNTS:
            vals = col.tolist()
        else:
            vals = [((v - origin) & 0xFFFFFFFF) / 1e3 if v else float("nan") for v in col.tolist()]
            vals = [v if v < 1e6 else float("nan") for v in vals]  # unwritten / stale
        finite = [v for v in vals if v == v]
        out[name] = (min(finite), statistics.median(finite), max(finite)) if finite else None
    return out


def run_case(artifact, copies, shape, g, device, routing: str, m: int, finalize: bool):
    """The stamps of the last call of a replayed graph of POOL calls."""
    x, logits, bias = routing_inputs(routing, m, shape, POOL, g, device)
    stream = torch.cuda.Stream(device)

    def call(p):
        return copies[p % len(copies)].grouped(x[p], logits[p], bias, finalize=finalize)

    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for p in range(POOL):  # workspaces, lazy init, outside the capture
            call(p)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for p in range(POOL):
            call(p)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(device)
    variant = next(v for v in artifact.variants if v.kernel == "grouped")
    pointer = artifact.workspaces(device.index).pointers(stream.cuda_stream, variant)["partial"]
    grid = variant.launch.grid[0]
    base = partial_bytes(grid)
    raw = read_device(pointer + base, grid * len(STAMP_POINTS) * 4)
    return timeline(raw.view(torch.int32)), grid


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--tokens", default="8,16,64")
    parser.add_argument("--routing", action="append", choices=["random", "uniform", "skewed"])
    parser.add_argument("--finalize", action="store_true", help="the finalizing variants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the timelines here")
    args = parser.parse_args(argv)

    import runtime
    from runtime.layout import random_moe_weights

    device = torch.device("cuda", torch.cuda.current_device())
    artifact = runtime.load(args.artifact)
    stamped = [r for r in artifact.manifest["variants"]
               if r["kernel"] == "grouped" and "stamps" in r.get("notes", {})]  # fmt: skip
    if not stamped:
        parser.error(f"{args.artifact}: no stamped grouped variant (build with MOE_BUILD_STAMPS=1)")
    shape = artifact.shape
    g = torch.Generator(device=device).manual_seed(args.seed)
    copies = [artifact.bind(random_moe_weights(shape, g)[0]) for _ in range(COPIES)]
    results = []
    for routing in args.routing or ["random"]:
        for m in [int(t) for t in args.tokens.split(",")]:
            line, grid = run_case(artifact, copies, shape, g, device, routing, m, args.finalize)
            results.append({"routing": routing, "tokens": m, "grid": grid, "points": line})
            print(f"{routing} M={m} ({grid} CTAs): us from the first entry, min / median / max")
            for name, v in line.items():
                if v is None:
                    continue
                if name in STAMP_COUNTS:
                    print(f"  {name:14s} {v[0]:8.0f} {v[1]:8.0f} {v[2]:8.0f}")
                else:
                    print(f"  {name:14s} {v[0]:8.2f} {v[1]:8.2f} {v[2]:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
