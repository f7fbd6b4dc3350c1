#!/usr/bin/env python3
"""A decode loop over one MoE layer, served as inference servers serve it:
one CUDA graph per batch size, replayed.

    python examples/serve.py ARTIFACT --random
    python examples/serve.py ARTIFACT --checkpoint DIR --layer 3 --rank 0 --world 4

ARTIFACT is an artifact directory or .tar.zst built for this GPU's arch. The
weights are random realistic experts (``--random``:
``runtime.layout.random_moe_weights``) or one MoE layer of a Hugging Face
style FP8 block-scale checkpoint, this rank's tensor-parallel slice
(``runtime.checkpoint.load_layer``; it must match the artifact's shape).
The ``runtime`` package must be importable (``pip install -e .`` or
PYTHONPATH=the repository root).

Steps:
1. Load the artifact, bind the weights (``Artifact.bind``) and wrap the
   layer in ``runtime.ops.MoEModule`` (the ``moe_build::moe_layer`` op; M
   above the largest bucket runs in row chunks: ``runtime.chunks``).
2. For every batch size M of ``--sizes``: static input buffers x BF16 [M, H]
   and logits [M, E], warm-up calls on a side stream, then one CUDA graph
   capturing the op (all graphs share one memory pool), as servers capture
   their decode step per batch size.
3. ``--steps`` decode steps: each picks a batch size at random, writes fresh
   random tokens and logits into that size's buffers (not timed) and replays
   its graph, timed with CUDA events around the replay.
4. Per size: steps, median / p10 / p90 replay time in microseconds, tokens
   per second at the median, and the time of one eager (uncaptured) call.
5. A final check of one step (``--check-size``, default the largest size):
   its graph's output against the float64 reference
   (``runtime.reference.moe_reference``), relative L2 error below 1e-2
   (docs/semantics.md's bar). Logits whose top routing keys nearly tie are
   redrawn first, so the reference routes as the kernels do. Exit status 1
   when the check fails, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Relative L2 error bar against the float64 reference (docs/semantics.md).
TOL = 1e-2
#: Tokens whose best top_k + 1 routing keys are closer than this are redrawn.
TIE = 1e-6
#: Warm-up calls per size before capture.
WARMUP = 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_sizes(text: str) -> list[int]:
    """Batch sizes from ``"1,2,4"`` or ``"1-8,64,100"``: sorted, distinct, >= 1."""
    values = set()
    for part in text.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if found is None or int(found[2] or found[1]) < int(found[1]) or int(found[1]) < 1:
            raise argparse.ArgumentTypeError(
                f"sizes: expected e.g. 1,2,4,8 or 1-8,64 (each >= 1), found {text!r}"
            )
        values.update(range(int(found[1]), int(found[2] or found[1]) + 1))
    return sorted(values)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="serve.py",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("artifact", help="artifact directory or .tar.zst for this GPU's arch")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--random", action="store_true", help="random realistic weights")
    source.add_argument("--checkpoint", help="safetensors checkpoint (directory or file)")
    parser.add_argument("--layer", type=int, help="with --checkpoint: the MoE layer's index")
    parser.add_argument("--rank", type=int, default=0, help="tensor-parallel rank (default 0)")
    parser.add_argument("--world", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument(
        "--family", default="deepseek_v3", help="checkpoint naming (runtime.checkpoint.FAMILIES)"
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes("1,2,4,8,16,32,64"),
        help="decode batch sizes to capture (default 1,2,4,8,16,32,64; above the largest "
        "bucket, 128 for the configs' builds, runs in chunks)",
    )
    parser.add_argument("--steps", type=int, default=1000, help="decode steps (default 1000)")
    parser.add_argument("--logits-dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--check-size", type=int, help="batch size of the final check")
    parser.add_argument("--seed", type=int, help="weights and inputs (default: random, printed)")
    args = parser.parse_args(argv)
    if args.checkpoint is not None and args.layer is None:
        parser.error("--checkpoint needs --layer")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.check_size is not None and args.check_size not in args.sizes:
        parser.error(f"--check-size {args.check_size} is not one of --sizes {args.sizes}")
    return args


@dataclass
class Captured:
    """One batch size's static buffers and the graph replaying the op on them."""

    x: torch.Tensor
    logits: torch.Tensor
    out: torch.Tensor
    graph: torch.cuda.CUDAGraph
    eager_us: float


def weights_and_bias(args, artifact, device, generator):
    """(runtime.layout.MoEWeights, FP32 [E] bias or None) on ``device``."""
    shape = artifact.shape
    if args.random:
        from runtime.layout import random_moe_weights

        prepared = random_moe_weights(shape, generator)[0]
        bias = torch.randn(shape.experts, generator=generator, device=device) * 0.1
        return prepared, bias if shape.bias else None  # a model without a bias takes none
    from runtime.checkpoint import load_layer

    loaded = load_layer(args.checkpoint, args.layer, rank=args.rank, world=args.world,
                        names=args.family, shape=shape, device=device)  # fmt: skip
    return loaded.weights, loaded.bias


def capture(module, sizes, shape, dtype, bias, device) -> dict[int, Captured]:
    """One CUDA graph per size, after warm-up on a side stream; all graphs
    share the first one's memory pool."""
    captured, pool = {}, None
    side = torch.cuda.Stream(device)
    for m in sizes:
        x = torch.empty(m, shape.hidden, dtype=torch.bfloat16, device=device).normal_()
        logits = torch.empty(m, shape.experts, dtype=dtype, device=device).normal_()
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                module(x, logits, bias)
        torch.cuda.current_stream(device).wait_stream(side)
        eager_us = time_eager(module, x, logits, bias)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = module(x, logits, bias)
        pool = graph.pool() if pool is None else pool
        captured[m] = Captured(x, logits, out, graph, eager_us)
    torch.cuda.synchronize(device)
    return captured


def time_eager(module, x, logits, bias, calls: int = 10) -> float:
    """Median microseconds of one uncaptured call (host launch time included)."""
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module(x, logits, bias)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in times)


def decode(captured: dict[int, Captured], steps: int, rng: random.Random) -> dict[int, list]:
    """``steps`` replays of randomly chosen sizes with fresh inputs; returns
    size -> replay times in microseconds."""
    events = []
    sizes = sorted(captured)
    for _ in range(steps):
        m = rng.choice(sizes)
        c = captured[m]
        c.x.normal_()
        c.logits.normal_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        c.graph.replay()
        end.record()
        events.append((m, start, end))
    torch.cuda.synchronize()
    times: dict[int, list] = {m: [] for m in sizes}
    for m, start, end in events:
        times[m].append(start.elapsed_time(end) * 1e3)
    return times


def report(times: dict[int, list], captured: dict[int, Captured]) -> None:
    print(f"{'M':>5} {'steps':>6} {'median us':>10} {'p10 us':>8} {'p90 us':>8} "
          f"{'tokens/s':>10} {'eager us':>9}")  # fmt: skip
    for m, values in times.items():
        if not values:
            print(
                f"{m:>5} {0:>6} {'-':>10} {'-':>8} {'-':>8} {'-':>10} {captured[m].eager_us:>9.1f}"
            )
            continue
        values = sorted(values)
        med = statistics.median(values)
        p10 = values[int(0.1 * (len(values) - 1))]
        p90 = values[int(0.9 * (len(values) - 1))]
        print(f"{m:>5} {len(values):>6} {med:>10.1f} {p10:>8.1f} {p90:>8.1f} "
              f"{m / med * 1e6:>10.0f} {captured[m].eager_us:>9.1f}")  # fmt: skip


def check(c: Captured, weights, bias, shape, generator) -> float:
    """Replays ``c``'s graph on fresh tie-free inputs; relative L2 error of
    its output against the float64 reference (inf when it holds NaN)."""
    from runtime.reference import moe_reference, rel_l2, tie_margin_for

    device, dtype = c.x.device, c.logits.dtype
    c.x.copy_(torch.randn(c.x.shape, generator=generator, device=device))
    logits = torch.randn(c.logits.shape, generator=generator, device=device).to(dtype)
    for _ in range(100):
        close = tie_margin_for(logits, bias, shape) < TIE
        if not bool(close.any()):
            break
        fresh = torch.randn(int(close.sum()), shape.experts, generator=generator, device=device)
        logits[close] = fresh.to(dtype)
    c.logits.copy_(logits)
    c.graph.replay()
    torch.cuda.synchronize()
    if c.out.isnan().any():
        return float("inf")
    ref = moe_reference(c.x, c.logits, bias, weights.routed, weights.shared, shape,
                        dtype=torch.float64)  # fmt: skip
    return rel_l2(c.out, ref.final)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("serve.py: needs a CUDA GPU, and torch sees none", file=sys.stderr)
        return 2
    import runtime
    from runtime.ops import MoEModule

    device = torch.device("cuda", torch.cuda.current_device())
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed} (rerun: --seed {seed})")
    torch.manual_seed(seed)
    generator = torch.Generator(device).manual_seed(seed)
    artifact = runtime.load(args.artifact, device)
    shape = artifact.shape
    weights, bias = weights_and_bias(args, artifact, device, generator)
    layer = artifact.bind(weights)
    if args.logits_dtype not in layer.dtypes:
        print(f"serve.py: the artifact serves logits {', '.join(layer.dtypes)}, not "
              f"{args.logits_dtype}", file=sys.stderr)  # fmt: skip
        return 2
    module = MoEModule(layer, bias=bias)
    source = "random weights" if args.random else f"{args.checkpoint} layer {args.layer}"
    print(f"{torch.cuda.get_device_name(device)}: {artifact.arch}, H {shape.hidden}, "
          f"I {shape.inter}, E {shape.experts}, top_k {shape.top_k}; {source} "
          f"(rank {args.rank} of {args.world}); logits {args.logits_dtype}")  # fmt: skip
    captured = capture(module, args.sizes, shape, DTYPES[args.logits_dtype], bias, device)
    print(f"captured {len(captured)} graphs (sizes {','.join(map(str, args.sizes))}); "
          f"{args.steps} decode steps")  # fmt: skip
    times = decode(captured, args.steps, random.Random(seed))
    report(times, captured)
    m = args.check_size or max(args.sizes)
    err = check(captured[m], weights, bias, shape, generator)
    ok = err < TOL
    print(f"check M={m}: rel_l2 vs float64 reference {err:.5f} (bar {TOL}): "
          f"{'ok' if ok else 'FAILED'}")  # fmt: skip
    module.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
