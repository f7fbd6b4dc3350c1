#!/usr/bin/env python3
"""GLM-5.3-Flash's MoE layer served as 4 tensor-parallel shards from one
artifact, checked against the unsharded layer.

The layer (hidden 4096, inter 2048, 288 experts, top_k 8, one shared expert
of inter 2048) runs in production as 4 shards of inter 512, one per GPU, and
the shards' outputs are all-reduced. One artifact built from
configs/glm5.yaml (the shard's shape) serves every shard: each GPU binds its
own shard's weights to it.

    # one process per GPU, NCCL all-reduce; N = 1, 2 or 4 (4/N shards each)
    torchrun --nproc-per-node N examples/tensor_parallel.py ARTIFACT
    # one process: all 4 shards on one GPU, summed there
    python examples/tensor_parallel.py ARTIFACT --single-process
    # one process serving several GPUs (4/D shards each, summed on the first)
    python examples/tensor_parallel.py ARTIFACT --single-process --devices cuda:0,cuda:1

ARTIFACT is a directory or .tar.zst built from configs/glm5.yaml for these
GPUs' arch; the ``runtime`` package must be importable (``pip install -e .``
or PYTHONPATH=the repository root).

Steps:
1. Rank 0 makes random realistic full-width experts
   (``runtime.layout.random_checkpoint``: routed and shared, inter 2048),
   splits them into 4 inter slices (``runtime.sharding.split_checkpoint``;
   every shard routes identically, and the layer's output is the sum of the
   shards' outputs) and sends each slice to the process that serves it; each
   process prepares its slices (``runtime.layout.prepare``) and binds each to
   its GPU (``Artifact.bind``).
2. For each routing (``random``: logits N(0, 1), bias N(0, 0.1); ``skewed``:
   bias N(0, 1), which crowds the tokens onto a few experts) and each M
   (default 1..512, runtime.constants.MAX_TOKENS): rank 0 draws BF16 tokens N(0, 1) and broadcasts them;
   every process runs its shard layers, adds their BF16 outputs in FP32; an
   all-reduce (SUM, FP32) adds the processes' partial sums; the total is
   rounded to BF16 once.
3. Rank 0 compares with the float64 reference of the unsharded layer
   (``runtime.reference.moe_reference`` on the full-inter checkpoint) and
   prints relative L2 and max-abs errors for each (routing, M); the exit
   status is 1 when any exceeds its tolerance.

Summing in FP32, not BF16. Every shard's layer output is BF16 (what the
kernels store). Those values are exact in FP32, four of them add in FP32
with rounding errors 2^15 times smaller than one BF16 rounding, and the sum
is rounded to BF16 once, at the end. Adding in BF16 instead rounds after
every addition (N - 1 more roundings for N shards), each relative to a
partial sum that can exceed the result when shards cancel; and since an
all-reduce's addition order depends on the number of GPUs and on NCCL's
algorithm (ring, tree), BF16 results would also change with the deployment.
FP32 doubles the bytes reduced, at most 128 x 4096 x 4 B = 2 MiB per call:
a latency-bound message at decode sizes.

Tolerances. Each shard's output meets the 1e-2 relative-L2 bar against its
own reference (tests/gpu/test_moe_artifact.py; measured on the H200: 2e-3 to
6e-3, mostly hidden FP8 values that the kernels' accumulation order moves
across a rounding boundary). The shards' errors are independent and their
outputs (disjoint inter slices, random weights) nearly orthogonal, so the
sum's relative error stays at the shards' level: 1e-2. BF16 rounding adds
at most 2^-9 relative per element for the shards' outputs (independent, so
2^-9 of the sum's norm) and 2^-9 for the final rounding: the relative-L2
tolerance is 1e-2 + 2 * 2^-9 = 1.39e-2. The float64 reference contributes
nothing comparable. Max-abs error: per-element errors are that small noise
spread over M x 4096 outputs, whose maximum stays below about 5 standard
deviations; the tolerance is 8 x 1.39e-2 x the reference's RMS. One wrong
route (a weight of about 2.5/8 times a whole expert row) or a missing shard
lands far above both.

Near-ties: a token whose top_k + 1 best routing keys differ by under 1e-6 may
be routed differently by a kernel whose sigmoid is a few ulp off the
reference's; the example redraws such tokens' logits (about one token in
2,000 with random routing, one in 10,000 skewed), so every remaining
difference is the kernels' arithmetic.

NVLink multicast stays off: the example's environment defaults are
NCCL_NVLS_ENABLE=0 (with TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1), set before torch.distributed starts, and nothing
here turns it on. An all-reduce of at most 1 MiB is latency-bound and needs
no NVLink SHARP, and a program that uses multicast objects can take a
shared host's GPUs out of service.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

# Before torch.distributed (and NCCL) read the environment; see the docstring.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
for _name, _value in MULTICAST_OFF.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import runtime  # noqa: E402
from runtime.constants import MAX_TOKENS, TILE  # noqa: E402
from runtime.inputs import LOGITS  # noqa: E402
from runtime.layout import CheckpointWeights, MoEWeights, prepare, random_checkpoint  # noqa: E402
from runtime.model import MoEShape  # noqa: E402
from runtime.reference import moe_reference, tie_margin_for  # noqa: E402
from runtime.sharding import shard_shape, split_checkpoint  # noqa: E402

#: GLM-5.3-Flash's full MoE layer (the artifact holds one shard of it).
GLM5 = MoEShape(
    hidden=4096, inter=2048, experts=288, top_k=8, routed_scale=2.5, swiglu_limit=10.0,
    ue8m0=False, shared_experts=1,
)  # fmt: skip
SHARDS = 4
#: Routing name -> standard deviation of the bias (logits are N(0, 1)).
ROUTINGS = {"random": 0.1, "skewed": 1.0}

#: Relative-L2 bar each shard meets against its own reference.
SHARD_BAR = 1e-2
#: BF16's unit roundoff: the largest relative error of one rounding.
BF16_ROUNDING = 2.0**-9
#: Relative L2 error of the summed output vs the float64 unsharded reference.
REL_TOL = SHARD_BAR + 2 * BF16_ROUNDING
#: Max-abs tolerance in units of REL_TOL x the reference's RMS.
ABS_SIGMAS = 8.0
#: Tokens whose best top_k + 1 routing keys are closer than this are redrawn.
TIE = 1e-6

#: (shard weights, device) -> a layer: ``layer(x, logits, bias)`` -> BF16 [M, H].
Bind = Callable[[MoEWeights, torch.device], Callable]


# Arguments ---------------------------------------------------------------------


def parse_tokens(text: str) -> list[int]:
    """M values from ``"1-64"``, ``"1,2,5-8"``: sorted, distinct, in 1..MAX_TOKENS."""
    values = set()
    for part in text.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if found is None or int(found[2] or found[1]) < int(found[1]):
            raise argparse.ArgumentTypeError(
                f"tokens: expected e.g. 1-64 or 1,2,5-8, found {text!r}"
            )
        values.update(range(int(found[1]), int(found[2] or found[1]) + 1))
    if min(values) < 1 or max(values) > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"tokens: M must be in 1..{MAX_TOKENS}, found {text!r}")
    return sorted(values)


def parse_devices(text: str) -> tuple[torch.device, ...]:
    """``"cuda:0,cuda:1"`` -> CUDA devices (each named once, with an index)."""
    try:
        devices = tuple(torch.device(d.strip()) for d in text.split(","))
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"devices: {e}") from None
    if any(d.type != "cuda" or d.index is None for d in devices) or len(set(devices)) < len(
        devices
    ):
        raise argparse.ArgumentTypeError(f"devices: expected distinct cuda:N, found {text!r}")
    return devices


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tensor_parallel.py",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:4]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("artifact", help="artifact built from configs/glm5.yaml (dir or .tar.zst)")
    parser.add_argument(
        "--single-process",
        action="store_true",
        help="serve all shards from this process (no torch.distributed); "
        "default: one process per GPU under torchrun",
    )
    parser.add_argument(
        "--devices",
        type=parse_devices,
        help="with --single-process: GPUs to spread the shards over, e.g. cuda:0,cuda:1 "
        "(default: the current device)",
    )
    parser.add_argument(
        "--tokens",
        type=parse_tokens,
        default=parse_tokens(f"1-{MAX_TOKENS}"),
        help=f"M values, e.g. 1-64 or 1,4,5,64 (default: 1-{MAX_TOKENS})",
    )
    parser.add_argument(
        "--routing",
        choices=[*ROUTINGS, "both"],
        default="both",
        help="random: bias N(0, 0.1); skewed: bias N(0, 1) (default: both)",
    )
    parser.add_argument("--logits-dtype", choices=list(LOGITS), default="float32")
    parser.add_argument("--seed", type=int, help="weights and inputs (default: random, printed)")
    args = parser.parse_args(argv)
    if args.devices and not args.single_process:
        parser.error("--devices needs --single-process (under torchrun: one GPU per process)")
    if args.devices and SHARDS % len(args.devices):
        parser.error(f"{SHARDS} shards do not split evenly over {len(args.devices)} devices")
    args.routings = list(ROUTINGS) if args.routing == "both" else [args.routing]
    return args


# Where shards run --------------------------------------------------------------


def shard_plan(shards: int, parts: int, part: int) -> list[int]:
    """The shards served by ``part`` of ``parts`` (processes, or devices of a
    process): a contiguous block of ``shards / parts``."""
    if parts < 1 or shards % parts or not 0 <= part < parts:
        raise ValueError(f"{shards} shards do not split evenly over {parts} parts (part {part})")
    per = shards // parts
    return list(range(part * per, (part + 1) * per))


@dataclass(frozen=True)
class Topology:
    """This process: ``rank`` of ``world`` processes (world 1: no
    torch.distributed) and the devices it serves; results land on
    ``devices[0]``."""

    rank: int
    world: int
    devices: tuple[torch.device, ...]

    @property
    def root(self) -> bool:
        return self.rank == 0

    def owner(self, shard: int, shards: int) -> int:
        """The rank serving ``shard``."""
        return next(r for r in range(self.world) if shard in shard_plan(shards, self.world, r))

    def placement(self, shards: int) -> dict[int, torch.device]:
        """Shard -> device, for this process's shards."""
        mine = shard_plan(shards, self.world, self.rank)
        out = {}
        for i, device in enumerate(self.devices):
            for j in shard_plan(len(mine), len(self.devices), i):
                out[mine[j]] = device
        return out


def full_shape(shard: MoEShape, shards: int = SHARDS) -> MoEShape:
    """The unsharded layer whose ``shards`` inter slices have ``shard``'s shape."""
    return replace(shard, inter=shard.inter * shards)


def check_glm5(full: MoEShape) -> None:
    """Refuses an artifact whose shards do not make GLM-5.3-Flash's layer."""
    fields = ("hidden", "inter", "experts", "top_k", "shared_experts")
    wrong = {f: getattr(full, f) for f in fields if getattr(full, f) != getattr(GLM5, f)}
    if wrong:
        want = {f: getattr(GLM5, f) for f in wrong}
        raise ValueError(
            f"the artifact's shape times {SHARDS} shards gives {wrong}; GLM-5.3-Flash has "
            f"{want}: build the artifact from configs/glm5.yaml"
        )


# Weights -----------------------------------------------------------------------


def _tensors(c: CheckpointWeights) -> tuple[torch.Tensor, ...]:
    return (c.w13, c.w13_scale, c.w2, c.w2_scale)


def empty_checkpoint(experts: int, hidden: int, inter: int, device) -> CheckpointWeights:
    """Uninitialized checkpoint-layout experts (a receive buffer)."""
    fp8 = torch.float8_e4m3fn
    return CheckpointWeights(
        w13=torch.empty(experts, 2 * inter, hidden, dtype=fp8, device=device),
        w13_scale=torch.empty(experts, 2 * inter // TILE, hidden // TILE, device=device),
        w2=torch.empty(experts, hidden, inter, dtype=fp8, device=device),
        w2_scale=torch.empty(experts, hidden // TILE, inter // TILE, device=device),
    )


def make_checkpoint(full: MoEShape, generator: torch.Generator):
    """Random full-width (routed, shared or None) experts on ``generator``'s device."""
    routed = random_checkpoint(full.experts, full.hidden, full.inter, generator)
    shared = None
    if full.shared_experts:
        shared = random_checkpoint(1, full.hidden, full.inter, generator)
    return routed, shared


def split(routed, shared, shards: int) -> list[tuple]:
    """[(routed, shared or None)] per shard, in shard order."""
    pieces = split_checkpoint(routed, shards)
    shared_pieces = split_checkpoint(shared, shards) if shared is not None else [None] * shards
    return list(zip(pieces, shared_pieces, strict=True))


def distribute(pieces, full: MoEShape, shards: int, topo: Topology) -> dict[int, tuple]:
    """This process's shards (checkpoint layout, on ``topo.devices[0]``): the
    root's ``pieces`` (every shard; None elsewhere), sent point to point to
    the rank that serves each shard (raw bytes: any backend moves uint8)."""
    part = shard_shape(full, shards)
    mine = {}
    for s in range(shards):
        owner = topo.owner(s, shards)
        if topo.root and owner == 0:
            mine[s] = pieces[s]
        elif topo.root:
            for c in pieces[s]:
                for t in _tensors(c) if c is not None else ():
                    dist.send(t.view(torch.uint8), dst=owner)
        elif topo.rank == owner:
            dev = topo.devices[0]
            routed = empty_checkpoint(part.experts, part.hidden, part.inter, dev)
            shared = None
            if part.shared_experts:
                shared = empty_checkpoint(1, part.hidden, part.inter, dev)
            for c in (routed, shared):
                for t in _tensors(c) if c is not None else ():
                    dist.recv(t.view(torch.uint8), src=0)
            mine[s] = (routed, shared)
    return mine


def prepared(routed, shared, device) -> MoEWeights:
    """One shard's checkpoint-layout experts in the kernels' layout, on ``device``."""
    weights = MoEWeights(prepare(routed), None if shared is None else prepare(shared))
    return weights.to(device)


# One call ----------------------------------------------------------------------


def draw_inputs(full: MoEShape, m: int, bias_std: float, logits_dtype, generator):
    """BF16 tokens x [M, H] N(0, 1), logits [M, E] N(0, 1) in ``logits_dtype``,
    FP32 bias [E] N(0, bias_std); tokens with a near-tie among their best
    top_k + 1 keys get new logits (module docstring)."""
    dev = generator.device
    x = torch.randn(m, full.hidden, generator=generator, device=dev).to(torch.bfloat16)
    logits = torch.randn(m, full.experts, generator=generator, device=dev).to(logits_dtype)
    bias = torch.randn(full.experts, generator=generator, device=dev) * bias_std
    for _ in range(100):
        close = tie_margin_for(logits, bias, full) < TIE
        if not bool(close.any()):
            return x, logits, bias
        fresh = torch.randn(int(close.sum()), full.experts, generator=generator, device=dev)
        logits[close] = fresh.to(logits_dtype)
    raise RuntimeError("could not draw logits without near-ties")


def share(tensors: Sequence[torch.Tensor], topo: Topology) -> list[torch.Tensor]:
    """The root's tensors, broadcast in place to every rank (raw bytes)."""
    if topo.world > 1:
        for t in tensors:
            dist.broadcast(t.view(torch.uint8), src=0)
    return list(tensors)


def local_sum(layers: dict[int, Callable], placement: dict[int, torch.device], inputs,
              out: torch.device) -> torch.Tensor:  # fmt: skip
    """FP32 [M, H] on ``out``: this process's shard outputs (BF16), added in
    shard order. ``inputs``: (x, logits, bias) on ``out``; copied once to
    each other device."""
    copies = {out: inputs}
    total = None
    for s in sorted(layers):
        dev = placement[s]
        if dev not in copies:
            copies[dev] = [t.to(dev) for t in inputs]
        y = layers[s](*copies[dev]).to(out).float()
        total = y if total is None else total + y
    return total


def tensor_parallel(layers, placement, inputs, topo: Topology) -> torch.Tensor:
    """The layer's BF16 [M, H] output: the local FP32 sum, all-reduced in FP32
    across ranks, rounded once."""
    total = local_sum(layers, placement, inputs, topo.devices[0])
    if topo.world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.to(torch.bfloat16)


@dataclass(frozen=True)
class Case:
    """One (routing, M) result against the float64 unsharded reference."""

    routing: str
    m: int
    rel_l2: float
    max_abs: float
    abs_tol: float

    @property
    def ok(self) -> bool:
        finite = math.isfinite(self.rel_l2) and math.isfinite(self.max_abs)
        return finite and self.rel_l2 < REL_TOL and self.max_abs <= self.abs_tol


def compare(routing: str, got: torch.Tensor, want: torch.Tensor) -> Case:
    """Relative L2 and max-abs error of ``got`` (BF16 [M, H]) vs ``want``."""
    diff = got.double() - want.double()
    scale = want.double().norm().item()
    rms = scale / math.sqrt(want.numel())
    return Case(
        routing=routing,
        m=got.shape[0],
        rel_l2=diff.norm().item() / scale,
        max_abs=diff.abs().max().item(),
        abs_tol=ABS_SIGMAS * REL_TOL * rms,
    )


# The run -----------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    cases: list[Case]  # on the root; empty elsewhere
    failed: bool  # the same on every rank


def run(full: MoEShape, topo: Topology, bind: Bind, tokens: Sequence[int],
        routings: Sequence[str] = tuple(ROUTINGS), logits_dtype=torch.float32,
        seed: int | None = None, shards: int = SHARDS, say=print) -> Report:  # fmt: skip
    """Makes, splits, binds and checks ``full`` as ``shards`` shards (module
    docstring); ``say`` prints on the root only."""
    root_dev = topo.devices[0]
    if not topo.root:
        say = _silent
    seed = _agree(seed if seed is not None else torch.seed() % 2**31, topo)
    say(f"layer: hidden {full.hidden}, inter {full.inter} = {shards} shards x "
        f"{full.inter // shards}, {full.experts} experts, top_k {full.top_k}, "
        f"{full.shared_experts} shared expert(s), ue8m0 {full.ue8m0}")  # fmt: skip
    say(f"{topo.world} process(es); this one serves shards on "
        f"{', '.join(map(str, topo.devices))}; seed {seed}")  # fmt: skip
    started = time.perf_counter()
    routed = shared = pieces = None
    if topo.root:
        routed, shared = make_checkpoint(full, torch.Generator(root_dev).manual_seed(seed))
        pieces = split(routed, shared, shards)
    placement = topo.placement(shards)
    mine = distribute(pieces, full, shards, topo)
    del pieces
    layers = {s: bind(prepared(*mine.pop(s), placement[s]), placement[s]) for s in sorted(mine)}
    say(f"weights made, split, sent and bound in {time.perf_counter() - started:.1f} s")
    say(f"{'routing':8} {'M':>3} {'rel_l2':>9} {'tol':>8} {'max_abs':>9} {'tol':>8}")
    inputs_gen = torch.Generator(root_dev).manual_seed(seed + 1) if topo.root else None
    cases = []
    for routing in routings:
        for m in tokens:
            if topo.root:
                inputs = draw_inputs(full, m, ROUTINGS[routing], logits_dtype, inputs_gen)
            else:
                inputs = [
                    torch.empty(m, full.hidden, dtype=torch.bfloat16, device=root_dev),
                    torch.empty(m, full.experts, dtype=logits_dtype, device=root_dev),
                    torch.empty(full.experts, dtype=torch.float32, device=root_dev),
                ]
            inputs = share(inputs, topo)
            got = tensor_parallel(layers, placement, inputs, topo)
            if topo.root:
                want = moe_reference(*inputs, routed, shared, full, torch.float64).final
                case = compare(routing, got, want)
                cases.append(case)
                say(f"{routing:8} {m:3d} {case.rel_l2:9.2e} {REL_TOL:8.2e} {case.max_abs:9.2e} "
                    f"{case.abs_tol:8.2e} {'ok' if case.ok else 'FAIL'}")  # fmt: skip
    bad = [c for c in cases if not c.ok]
    if topo.root:
        summary = f"{len(cases) - len(bad)} of {len(cases)} cases within tolerance"
        if cases:
            worst = max(cases, key=lambda c: c.rel_l2)
            summary += f"; worst rel_l2 {worst.rel_l2:.2e} (M={worst.m}, {worst.routing})"
        say(summary)
    failed = bool(_agree(int(bool(bad)), topo))
    return Report(cases=cases, failed=failed)


def _agree(value: int, topo: Topology) -> int:
    """The root's integer, on every rank."""
    if topo.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=topo.devices[0])
    dist.broadcast(t, src=0)
    return int(t.item())


def _silent(*args, **kwargs) -> None:
    pass


def serve(args: argparse.Namespace, topo: Topology) -> Report:
    """Loads the artifact for this process's GPUs, binds the shards, runs."""
    artifact = runtime.load(args.artifact, topo.devices[0])
    full = full_shape(artifact.shape)
    check_glm5(full)

    def bind(weights: MoEWeights, device: torch.device):
        return artifact.bind(weights, device=device)

    return run(full, topo, bind, args.tokens, args.routings, LOGITS[args.logits_dtype], args.seed)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.single_process:
        devices = args.devices or (torch.device("cuda", torch.cuda.current_device()),)
        return 1 if serve(args, Topology(rank=0, world=1, devices=devices)).failed else 0
    if "RANK" not in os.environ:
        print("not started by torchrun: run under torchrun, or pass --single-process",
              file=sys.stderr)  # fmt: skip
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if SHARDS % world:
        print(f"{SHARDS} shards do not split over {world} processes", file=sys.stderr)
        return 2
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        return 1 if serve(args, Topology(rank=rank, world=world, devices=(device,))).failed else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
