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
times them: PDL between calls, weights rotated), replays it, zeroes the
stamps, replays it once more and reads what its last call left (every call
overwrites them). Times are printed in microseconds from the first CTA's
end of its PDL wait (``per_cta``; entries before it read negative): per
stamp point the minimum, median and maximum over the CTAs that wrote it,
then the counts (FC1 and FC2 stages, units), then the summed waits in
microseconds (``STAMP_SUMS``: the consumer's wait for full stages and its
time in the closes, the producer's wait for free stages), then the
consumer's work (``consumer_work``: its busy time, and that and its closes
per weight stage, to set beside the time a stage takes to arrive);
``--json`` also keeps every CTA's values (``per_cta``, ``consumer``). The
sm_100a kernel records every point but the MMA consumer's six
(``first_full``, ``fc1_done``, ``first_fc2``, ``consumer_end``,
``wait_full``, ``closing``).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmarks.bench import COPIES, POOL, routing_inputs
from kernels.grouped_plan import (
    CONSUMER_SUMS,
    STAMP_COUNTS,
    STAMP_POINTS,
    STAMP_SUMS,
    partial_bytes,
)
from runtime import driver


def per_cta(stamps: torch.Tensor) -> dict:
    """{point: [value of each CTA, None where it wrote none]}: times in us
    from the earliest end of a PDL wait (the first moment a CTA of the call
    may act on the previous call's results; the earliest entry where no CTA
    wrote it), as signed 32-bit differences, so CTAs on either side of a
    timer wrap order right; counts as they are; the summed waits
    (``STAMP_SUMS``, ns) in us. Entries read negative: the
    grouped kernel lets the next call launch early, so its CTAs may enter
    while the previous call still runs. The stamps are zeroed before the
    call, so a 0 is a point the CTA did not write."""
    words = stamps.view(-1, len(STAMP_POINTS)).to(torch.int64) & 0xFFFFFFFF
    times = [i for i, name in enumerate(STAMP_POINTS) if name not in STAMP_COUNTS + STAMP_SUMS]
    written = words[:, times][words[:, times] != 0]
    if written.numel() == 0:
        return {name: [None] * words.shape[0] for name in STAMP_POINTS}
    ref = int(written[0])

    def since(v: int) -> float:
        return (((v - ref + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)) / 1e3

    def earliest(point: str):
        col = [since(v) for v in words[:, STAMP_POINTS.index(point)].tolist() if v]
        return min(col) if col else None

    origin = earliest("pdl_wait")
    if origin is None:
        origin = earliest("entry")
    if origin is None:
        origin = min(since(int(v)) for v in written)
    out = {}
    for i, name in enumerate(STAMP_POINTS):
        col = words[:, i].tolist()
        if name in STAMP_COUNTS:
            out[name] = col
        elif name in STAMP_SUMS:
            out[name] = [v / 1e3 for v in col]
        else:
            out[name] = [since(v) - origin if v else None for v in col]
    return out


def spread(cols: dict) -> dict:
    """{point: (min, median, max) over the CTAs that wrote it, or None} of
    ``per_cta``'s values."""
    out = {}
    for name, col in cols.items():
        vals = [v for v in col if v is not None]
        out[name] = (min(vals), statistics.median(vals), max(vals)) if vals else None
    return out


def timeline(stamps: torch.Tensor) -> dict:
    """``spread`` of the stamps' ``per_cta`` values."""
    return spread(per_cta(stamps))


def consumer_work(cols: dict) -> dict:
    """Per CTA (``per_cta``'s columns; None where a value is missing): the MMA
    consumer's ``busy`` time, us, from its first full stage to its END less
    its waits for full stages (the wgmma chains, the scaled sums and the
    closes), and per weight stage of the CTA (FC1 + FC2) ``busy_a_stage``
    and ``closes_a_stage`` (``closing``). Where a 32 KiB stage reaches an SM
    every ``32768 / (copy bandwidth / SMs)`` (1.02 us on an H200, 1.44 on an
    H100) a consumer busier than that a stage sets the stream's pace
    (docs/notes/h100-measurements.md, "The mended tests, the consumer's time
    and a read stream")."""
    out = {"busy": [], "busy_a_stage": [], "closes_a_stage": []}
    for first, end, waited, closing, fc1, fc2 in zip(
        cols["first_full"], cols["consumer_end"], cols["wait_full"], cols["closing"],
        cols["fc1_stages"], cols["fc2_stages"], strict=True,
    ):  # fmt: skip
        stages = (fc1 or 0) + (fc2 or 0)
        if None in (first, end, waited, closing) or stages == 0:
            busy = per = closes = None
        else:
            busy = end - first - waited
            per, closes = busy / stages, closing / stages
        out["busy"].append(busy)
        out["busy_a_stage"].append(per)
        out["closes_a_stage"].append(closes)
    return out


def _print_spread(name: str, v, digits: int) -> None:
    """One printed row of ``spread``'s (min, median, max); none for None."""
    if v is not None:
        print(f"  {name:14s} " + " ".join(f"{x:8.{digits}f}" for x in v))


def stamped_variant(artifact):
    """The loaded arch's first grouped variant, if it was built with stamps
    (its ``partial`` workspace holds them after the partials), else None."""
    records = {r["name"]: r for r in artifact.manifest["variants"]}
    for variant in artifact.variants:
        if variant.kernel != "grouped" or "stamps" not in records[variant.name].get("notes", {}):
            continue
        grid = variant.launch.grid[0]
        need = partial_bytes(grid) + grid * len(STAMP_POINTS) * 4
        if {w.name: w.bytes for w in variant.workspace}.get("partial", 0) >= need:
            return variant
    return None


def run_case(artifact, variant, copies, shape, g, device, routing: str, m: int, finalize: bool):
    """The raw stamps (int32, CTA-major) of the last call of a replayed graph
    of POOL calls, and the grid."""
    x, logits, bias = routing_inputs(routing, m, shape, POOL, g, device)
    # The logits in the stamped variants' dtype (a build may hold only one).
    logits = logits.to(getattr(torch, variant.logits_dtype))
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
    pointer = artifact.workspaces(device.index).pointers(stream.cuda_stream, variant)["partial"]
    grid = variant.launch.grid[0]
    base = pointer + partial_bytes(grid)
    nbytes = grid * len(STAMP_POINTS) * 4
    driver.zero(device.index, base, nbytes)
    graph.replay()
    torch.cuda.synchronize(device)
    raw = torch.frombuffer(
        bytearray(driver.copy_to_host(device.index, base, nbytes)), dtype=torch.int32
    )
    return raw, grid


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

    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: comma-separated integers")
    device = torch.device("cuda", torch.cuda.current_device())
    artifact = runtime.load(args.artifact)
    variant = stamped_variant(artifact)
    if variant is None:
        parser.error(f"{args.artifact}: no stamped grouped variant for {artifact.arch} "
                     "(build with MOE_BUILD_STAMPS=1)")  # fmt: skip
    shape = artifact.shape
    g = torch.Generator(device=device).manual_seed(args.seed)
    copies = [artifact.bind(random_moe_weights(shape, g)[0]) for _ in range(COPIES)]
    results = []
    for routing in args.routing or ["random"]:
        for m in tokens:
            raw, grid = run_case(
                artifact, variant, copies, shape, g, device, routing, m, args.finalize
            )
            cols = per_cta(raw)
            if variant.arch != "sm_90a":  # its consumer sums nothing: None, not 0
                cols.update({name: [None] * grid for name in CONSUMER_SUMS})
            line = spread(cols)
            work = consumer_work(cols)
            results.append({"routing": routing, "tokens": m, "grid": grid, "points": line,
                            "per_cta": cols, "consumer": work})  # fmt: skip
            print(
                f"{routing} M={m} ({grid} CTAs): us from the first PDL wait's end, "
                "min / median / max"
            )
            for name, v in line.items():
                if name == STAMP_SUMS[0]:
                    print("  summed waits, us a call (min / median / max over the CTAs):")
                _print_spread(name, v, 0 if name in STAMP_COUNTS else 2)
            work_line = spread(work)
            if work_line["busy"] is not None:
                print("  the consumer's work (us, us a stage; min / median / max):")
                for name, v in work_line.items():
                    _print_spread(name, v, 2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
