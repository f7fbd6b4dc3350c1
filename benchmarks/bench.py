"""The measurement behind `moe-build bench`: time an artifact's kernels and
layer on the GPU, beside the HBM floor and a torch baseline measured in the
same run, after checking each case against the float64 reference.

Method:
- Copy bandwidth: a 2 GiB device-to-device copy, bytes read + written over
  the median time of 20 copies.
- Inputs are of the artifact's model (``MoEShape``): tokens N(0, 1), router
  logits N(0, 1) per (token, expert), a fresh draw for every call from a
  pool. The routing kind sets a standard deviation ``ROUTINGS[kind]``
  (0.1 "random", 0 "uniform", 1 "skewed") and one per-expert draw fixed for
  the case's pool (``routing_inputs``, ``routing_rule``): for a model that
  routes with a score-correction bias, the bias N(0, std); for one without
  (``shape.bias`` false: bias None in every call), a logit offset
  N(0, ``LOGIT_SKEW`` * std) added to every token's logits, which skews
  selection as that bias would near a sigmoid score of 1/2. Expert choice is
  the model's routing (score function, bias, groups:
  ``runtime.reference.route_for``).
- Each timed case is a CUDA graph of ``POOL`` calls, each on its own inputs
  and on one of ``COPIES`` separately bound copies of the weights (so no call
  finds its weights in L2: GLM-5's layer of 1.7 GB is 28x the L2, and one
  token's 50 MB is not read twice in a row); the graph is replayed ``reps``
  times after ``WARMUP_S`` seconds of untimed replays, and the per-call time
  is replay time / POOL (median, min, max over replays).
- ``weight_bytes`` = bytes of the distinct experts the calls touch (mean over
  the pool), plus the shared expert where computed (never for a model
  without one, ``shape.shared_experts`` 0); ``tb_s`` =
  weight_bytes / time; ``floor_fraction`` = tb_s / copy bandwidth.
- ``host_us``: the host (CPU) time of issuing one eager call, microseconds:
  the median over ``HOST_CALLS`` calls of the wall time from the call to its
  return, the GPU work enqueued and not waited on (``time_host``), the
  process's thread free to move between CPUs; ``host_pinned_us``: the same
  with the calling thread pinned to one CPU (``host_cpu``, recorded as
  ``method.host_cpu``), as a server pins the thread that feeds its GPU;
  ``cpu_probe_us``: a fixed pure-Python workload timed just before
  (``cpu_probe``), which tells the machine's CPU speed at that moment from
  the call's own cost.
- Before timing, each case runs ``check_calls(M)`` calls on fresh inputs
  (``CHECK_CALLS``, more at small M to pool ``CHECK_ROWS`` tokens) against
  the float64 reference (outputs NaN-poisoned); the verdict is the error
  pooled over those calls' rows (``Check``), and any case above its
  ``TOLERANCE`` fails the run.
- The torch baseline (``benchmarks.baseline``) cannot be captured (it asks
  the host which experts were picked), so it is timed eagerly with CUDA
  events around each call, median of ``reps``; it has no ``host_us`` (its
  calls wait for the GPU).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runtime.model import MoEShape
from runtime.reference import moe_reference, route_for, tie_margin_for

#: Routing kind -> standard deviation of the per-expert skew: the bias of a
#: model that has one, else (times ``LOGIT_SKEW``) a logit offset.
ROUTINGS = {"random": 0.1, "uniform": 0.0, "skewed": 1.0}
#: Logit offset per unit of bias for a model without a bias: 1 / sigmoid'(0),
#: the logit shift that moves a sigmoid score of 1/2 as much as the bias does.
LOGIT_SKEW = 4.0
POOL = 8  # calls per captured graph, each on its own inputs
COPIES = 4  # separately bound weight copies the calls rotate over
#: Correctness bar (relative L2 against the float64 reference) per kind of row:
#: the kernels' bar is docs/semantics.md's ("Accuracy bar"); the BF16 baseline
#: rounds every dequantized weight to 8 mantissa bits (measured 1.6e-2).
TOLERANCE = {"mega": 1e-2, "grouped": 1e-2, "layer": 1e-2, "baseline": 3e-2}
#: Tokens whose top-(k+1) keys (or kept/dropped group scores) are closer than
#: this may be routed differently by a kernel's approximate score function;
#: they are counted apart, not failed (``tie_margins``).
NEAR_TIE = 1e-5
#: Calls on fresh inputs whose pooled error decides a case. One call at M = 1
#: is one token's rows, and one hidden FP8 code flipped by accumulation order
#: moves a whole row: on the H200 single calls reached 1.3e-2 to 2.3e-2 while
#: rows pool at 2e-3 to 7e-3. Pooled over 4 calls, one 2.3e-2 shared row (of
#: 4) still failed a case (mega, M = 1: 1.23e-2); over 16, one row at 3e-2
#: among rows at 4e-3 pools to 8e-3, and two full runs (72 cases each)
#: pooled at most 6.9e-3. At least this many calls (``check_calls``).
CHECK_CALLS = 16
#: Tokens a check pools at least, so a case of M < CHECK_ROWS / CHECK_CALLS
#: tokens takes more calls (``check_calls``). The layer's output of a model
#: without a shared expert is a weighted sum of its routes' rows, so its
#: pooled error leans on the few heaviest routes of each token and spreads
#: wider than the routes' own: Qwen3-235B TP4 on the H200, M = 3, its mega
#: kernel's output exactly the weighted sum of its rows (to FP32 ulps), read
#: 1.19e-2 pooled over 18 tokens once (worst call 2.2e-2) where its route rows
#: pool at 3.5-3.9e-3; over 48 calls a case, M = 1..5, the layer pooled at
#: 3.1e-3 to 5.3e-3 with single calls up to 1.6e-2 (docs/notes/models-h200.md,
#: "The layer's error at M <= 4").
CHECK_ROWS = 64
#: Eager calls whose host time is measured per case, issued back to back in
#: batches of HOST_BATCH with a (untimed) synchronize between batches, so the
#: launch queue never fills and blocks a launch on the GPU. On the H200 the
#: median repeats within 5% for one case (batches of 10, 50 or 200 alike),
#: but the same host path moved up to 2x between the cases of one run.
HOST_CALLS = 200
HOST_BATCH = 50
#: ``cpu_probe``'s workload (integers summed by ``sum(range(...))``, ~25 us
#: on a shared 2-core EPYC VM) and how many times it is timed.
PROBE_LOOP = 1000
PROBE_RUNS = 50
#: Seconds of untimed replays of each case's graph before its timed ones
#: (``time_graph``). With 3 replays only, the first case of a run read ~1 us
#: slower at M = 1 than the same kernel timed next (the layer 20.5-20.8 us,
#: mega 19.4-19.8 us, in every committed run and whichever routing came
#: first), with 0.1 s 0.8 us, with 1 s not (docs/notes/mega-sm90.md, "The
#: first case of a run"); about 70 s more for a full three-routing run.
WARMUP_S = 1.0


@dataclass
class Row:
    """One timed case of the result JSON (times in microseconds; errors against
    the float64 reference, pooled over ``check_calls(M)`` calls, see ``Check``)."""

    kernel: str
    arch: str
    tokens: int
    routing: str
    distinct_experts: float
    weight_bytes: int
    time_us: float
    time_us_min: float
    time_us_max: float
    reps: int
    tb_s: float
    floor_fraction: float
    correct: bool
    rel_l2: float
    max_abs: float
    near_ties: int
    speedup_vs_baseline: float | None = None
    bucket: int | None = None
    finalize: bool | None = None
    rel_l2_worst_call: float | None = None
    host_us: float | None = None
    host_pinned_us: float | None = None
    cpu_probe_us: float | None = None
    check_calls: int | None = None  # the calls ``rel_l2`` pools (``check_calls(M)``)
    ref_max_abs: float | None = None  # the largest reference magnitude ``max_abs`` sits beside


@dataclass(frozen=True)
class Check:
    """The correctness check of one case: ``calls`` calls on fresh inputs
    against the float64 reference.

    ``rel_l2``: relative L2 error of all the calls' rows concatenated (per
    output part, the worst part: routed rows, shared rows, or the MoE output);
    the case's verdict. ``rel_l2_worst_call``: the same measure of the worst
    single call. ``max_abs``: largest absolute error over every call's rows;
    ``ref_max_abs``: the largest reference magnitude of those rows (one BF16
    rounding alone errs by up to 2**-9 of it). ``near_ties``: tokens, summed over the calls, whose routing is a near tie
    (``NEAR_TIE``)."""

    rel_l2: float
    rel_l2_worst_call: float
    max_abs: float
    near_ties: int
    calls: int
    ref_max_abs: float


def check_calls(m: int, least: int | None = None) -> int:
    """Calls on fresh inputs a check of M >= 1 tokens a call pools: at least
    ``least`` (default ``CHECK_CALLS``) and enough for ``CHECK_ROWS`` tokens."""
    least = CHECK_CALLS if least is None else least
    return max(least, math.ceil(CHECK_ROWS / m))


def error_sums(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """float64 [4]: (squared error, squared reference norm, max-abs error,
    max-abs reference) of ``got`` against ``want``, on their device (no host
    sync)."""
    want = want.double()
    diff = got.double() - want
    return torch.stack([diff.square().sum(), want.square().sum(), diff.abs().max(),
                        want.abs().max()])  # fmt: skip


def pool_errors(sums: torch.Tensor) -> tuple[float, float, float, float]:
    """(pooled rel L2, worst call's rel L2, max-abs error, max-abs reference)
    from ``error_sums`` of every (call, output part), float64 [calls, parts, 4].

    A part's pooled rel L2 is sqrt(sum of squared errors / sum of squared
    reference norms) over the calls, which is the rel L2 of its rows of all
    the calls concatenated; both rel L2s are the worst over parts. NaN (an
    unwritten, poisoned output) propagates to every value."""
    err2, ref2, max_abs, ref_max = sums.unbind(-1)
    pooled = (err2.sum(0) / ref2.sum(0)).sqrt().max()
    worst = (err2 / ref2).sqrt().max()
    return pooled.item(), worst.item(), max_abs.max().item(), ref_max.max().item()


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e12


def routing_rule(shape: MoEShape) -> dict:
    """How the routing kinds skew ``shape``'s routing (recorded in the result
    JSON): ``skews`` "bias" or "logits", ``std`` kind -> standard deviation
    of the per-expert draw, ``rule`` in words."""
    if shape.bias:
        std, skews = dict(ROUTINGS), "bias"
        rule = "per-expert bias N(0, std), fixed for a case's pool; logits N(0, 1)"
    else:
        std = {kind: LOGIT_SKEW * s for kind, s in ROUTINGS.items()}
        skews = "logits"
        rule = (f"no bias (the model has none): logits N(0, 1) plus a per-expert offset "
                f"N(0, std) = N(0, {LOGIT_SKEW:g} x the bias std), fixed for a case's pool")  # fmt: skip
    return {"skews": skews, "std": std, "rule": rule}


def routing_inputs(kind: str, m: int, shape: MoEShape, pool: int, g: torch.Generator, device):
    """Inputs of ``pool`` calls of M tokens for routing ``kind``
    (``routing_rule``): tokens [pool, M, H] BF16, logits [pool, M, E] FP32,
    and the bias [E] FP32 shared by the pool's calls (None for a model
    without a bias, whose logits carry the skew instead)."""
    x = torch.randn(pool, m, shape.hidden, generator=g, device=device).bfloat16()
    logits = torch.randn(pool, m, shape.experts, generator=g, device=device)
    skew = torch.randn(shape.experts, generator=g, device=device) * routing_rule(shape)["std"][kind]
    if shape.bias:
        return x, logits, skew
    return x, logits + skew, None


def route_ids(logits: torch.Tensor, bias: torch.Tensor | None, shape: MoEShape) -> torch.Tensor:
    """int32 [..., M, top_k]: ``shape``'s expert choice (``route_for``) for
    logits [..., M, E] (any leading dims: a pool of calls)."""
    flat = logits.reshape(-1, shape.experts)
    return route_for(flat, bias, shape)[0].view(*logits.shape[:-1], shape.top_k)


#: FP32 [M]: ``runtime.reference.tie_margin`` of [M, E] logits under a
#: shape's routing (score function, bias, groups); a token below ``NEAR_TIE``
#: is a near tie.
tie_margins = tie_margin_for


def distinct_experts(logits: torch.Tensor, bias: torch.Tensor | None, shape: MoEShape) -> float:
    """Mean number of distinct routed experts per call over a pool of logits
    [pool, M, E], routed as ``shape`` routes (``route_ids``)."""
    ids = route_ids(logits, bias, shape)  # [pool, M, k]
    return statistics.mean(len(torch.unique(ids[p])) for p in range(ids.shape[0]))


def time_graph(calls, reps: int, warmup: int = 3) -> list[float]:
    """Per-call microseconds of each replay of a graph of ``calls``
    (callables), after at least ``warmup`` untimed replays and ``WARMUP_S``
    seconds of them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # first calls outside capture: workspaces, lazy init
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    began, replays = time.perf_counter(), 0
    while replays < warmup or time.perf_counter() - began < WARMUP_S:
        graph.replay()
        torch.cuda.synchronize()
        replays += 1
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / len(calls))
    return out


def time_eager(call, reps: int, warmup: int = 3) -> list[float]:
    """Microseconds of GPU time (CUDA events) of each of ``reps`` calls of
    ``call``, each waited for before the next."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return out


def cpu_probe(runs: int = PROBE_RUNS, loop: int = PROBE_LOOP) -> float:
    """Microseconds of ``sum(range(loop))``, the median of ``runs``
    timings: the same work every time, so it moves only with the CPU's own
    speed (clocks, other tenants, caches), not with the code under test."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        sum(range(loop))
        times.append((time.perf_counter() - start) * 1e6)
    return round(statistics.median(times), 2)


def host_cpu() -> int | None:
    """The CPU the bench pins host timing to: the highest-numbered one this
    process may run on (low-numbered CPUs take most device interrupts on
    common Linux setups), or None where the OS cannot pin threads."""
    try:
        return max(os.sched_getaffinity(0))
    except (AttributeError, OSError, ValueError):
        return None


@contextlib.contextmanager
def pinned(cpu: int | None):
    """The calling thread runs on ``cpu`` only inside the block (Linux
    ``sched_setaffinity`` of thread 0 = the caller), its former CPU set
    restored after; nothing changes for ``cpu`` None."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def time_host(
    calls, n: int = HOST_CALLS, batch: int = HOST_BATCH, cpu: int | None = None
) -> list[float]:
    """Microseconds of host time of each of ``n`` eager calls, rotating over
    ``calls`` (callables): the wall time (``time.perf_counter``) from the call
    to its return, with its GPU work enqueued and not waited on; with ``cpu``,
    the warm-up and the calls run with the thread pinned to that CPU
    (``pinned``).

    Calls are issued back to back in batches of ``batch``; the device is
    synchronized (untimed) before the first and after each batch, so queued
    GPU work never fills the launch queue (a full queue blocks the launch on
    the GPU, which would count GPU time as host time). Python's garbage
    collector is off while the calls run (as in ``timeit``), so a collection
    of the run's other objects is not counted as the call's time."""
    with pinned(cpu):
        for call in calls:  # warm-up: lazy init outside the timed calls
            call()
        torch.cuda.synchronize()
        out = []
        collecting = gc.isenabled()
        gc.disable()
        try:
            for first in range(0, n, batch):
                for i in range(first, min(first + batch, n)):
                    call = calls[i % len(calls)]
                    start = time.perf_counter()
                    call()
                    out.append((time.perf_counter() - start) * 1e6)
                torch.cuda.synchronize()
        finally:
            if collecting:
                gc.enable()
    return out


def _env_fact(command: list[str], fallback: str = "unknown") -> str:
    """``command``'s stripped stdout, or ``fallback`` where it cannot run or fails."""
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return fallback


def device_facts(device: torch.device) -> dict:
    """The result's device name, driver version and SM count."""
    props = torch.cuda.get_device_properties(device)
    driver = _env_fact(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"device": props.name, "driver": driver.splitlines()[0] if driver else "unknown",
            "sms": props.multi_processor_count}  # fmt: skip


#: The GPU state ``gpu_state`` records (``nvidia-smi --query-gpu`` fields):
#: clocks, power and the reasons the clocks are held down, so that a run on a
#: power-capped or down-clocked GPU shows it (the copy bandwidth, measured
#: once before the cases, does not: one run ended at 1905 of 1980 MHz, capped
#: at 652 W, `benchmarks/results/h200-2026-12-03-19a7244-host.json`).
GPU_STATE_FIELDS = (
    "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.draw",
    "power.limit", "temperature.gpu", "clocks_event_reasons.active",
)  # fmt: skip


def smi_id(device: torch.device) -> str:
    """``device`` as nvidia-smi's ``--id`` names it: its UUID (nvidia-smi
    numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, so torch's
    index may name another GPU), or the index where torch gives no UUID."""
    try:
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    except (AssertionError, RuntimeError, ValueError):  # no CUDA device to ask
        uuid = None
    return f"GPU-{uuid}" if uuid else str(device.index or 0)


def gpu_state(device: torch.device) -> dict:
    """``GPU_STATE_FIELDS`` of ``device`` as nvidia-smi reports them now
    (strings with their units), or {} where nvidia-smi cannot tell."""
    out = _env_fact(["nvidia-smi", f"--id={smi_id(device)}",
                     f"--query-gpu={','.join(GPU_STATE_FIELDS)}", "--format=csv,noheader"], "")  # fmt: skip
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
    if len(values) != len(GPU_STATE_FIELDS):
        return {}
    return dict(zip(GPU_STATE_FIELDS, values, strict=True))


def commit_id() -> str:
    """The source commit: $MOE_BUILD_COMMIT (set it where the tree has no .git,
    or where HEAD is not what the files are), else git's HEAD, with
    ``-dirty`` where tracked files differ from it (a result then says it did
    not run HEAD's tree)."""
    named = os.environ.get("MOE_BUILD_COMMIT")
    if named:
        return named
    head = _env_fact(["git", "rev-parse", "HEAD"])
    changed = _env_fact(["git", "status", "--porcelain", "--untracked-files=no"], fallback="")
    return f"{head}-dirty" if changed and head != "unknown" else head


class Bench:
    """One benchmark run of an artifact on one GPU."""

    def __init__(self, artifact_path: str, reps: int = 50, seed: int | None = None, log=print):
        import runtime
        from runtime.layout import random_moe_weights

        self.device = torch.device("cuda", torch.cuda.current_device())
        self.log = log
        self.reps = reps
        self.artifact = runtime.load(artifact_path)
        self.config = self.artifact.manifest["config"]
        self.shape = self.artifact.shape
        self.g = torch.Generator(device=self.device).manual_seed(
            seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        )
        shared = " + shared" if self.shape.shared_experts else " (no shared expert)"
        log(f"weights: {COPIES} random copies of {self.shape.experts} experts{shared}")
        self.copies = []
        self.checkpoints = None
        for i in range(COPIES):
            prepared, routed, shared = random_moe_weights(self.shape, self.g)
            if i == 0:
                self.checkpoints = (routed, shared)
            else:
                del routed, shared
            self.copies.append((prepared, self.artifact.bind(prepared, poison=False)))
        self.checker = self.artifact.bind(self.copies[0][0], poison=True)
        from benchmarks.baseline import TorchMoE

        self.baseline = TorchMoE(self.copies[0][0], self.shape)
        self.copy_tb_s = copy_bandwidth(self.device)
        self.gpu_start = gpu_state(self.device)
        self.host_cpu = host_cpu()
        log(
            f"copy bandwidth {self.copy_tb_s:.3f} TB/s"
            + "".join(f", {k} {v}" for k, v in self.gpu_start.items() if k.startswith("clocks."))
        )

    # What a row reads --------------------------------------------------------------

    def _bytes(self, distinct: float, shared: bool) -> int:
        """Weight bytes of a call touching ``distinct`` routed experts, plus
        the shared expert where the case computes it (``shared``) and the
        model has one."""
        per = self.shape.expert_bytes
        return int(round(distinct * per + (per * self.shape.shared_experts if shared else 0)))

    def _row(
        self, kernel, m, routing, distinct, shared, times, check: Check, host=None,
        host_pinned=None, probe=None, **extra,
    ) -> Row:  # fmt: skip
        """The row of one case: GPU ``times``, ``host`` and ``host_pinned``
        times (us, None where not measured), the ``cpu_probe`` us beside
        them and its ``check``."""
        wb = self._bytes(distinct, shared)
        med = statistics.median(times)
        tb = wb / (med * 1e-6) / 1e12
        host_us, pinned_us = (None if h is None else round(statistics.median(h), 2)
                              for h in (host, host_pinned))  # fmt: skip
        return Row(
            kernel=kernel, arch=self.artifact.arch, tokens=m, routing=routing,
            distinct_experts=round(distinct, 2), weight_bytes=wb, time_us=round(med, 2),
            time_us_min=round(min(times), 2), time_us_max=round(max(times), 2),
            reps=len(times), tb_s=round(tb, 3), floor_fraction=round(tb / self.copy_tb_s, 3),
            correct=check.rel_l2 <= TOLERANCE[kernel], rel_l2=check.rel_l2,
            max_abs=check.max_abs, ref_max_abs=check.ref_max_abs, near_ties=check.near_ties,
            rel_l2_worst_call=check.rel_l2_worst_call, host_us=host_us,
            host_pinned_us=pinned_us, cpu_probe_us=probe, check_calls=check.calls, **extra,
        )  # fmt: skip

    # Correctness of one case on fresh inputs ----------------------------------------

    def check(self, kind: str, m: int, routing: str, finalize: bool = False) -> Check:
        """``check_calls(M)`` calls of case (``kind``, M, ``finalize``) on
        fresh ``routing`` inputs against the float64 reference, errors pooled
        over the calls (``Check``)."""
        n = check_calls(m)
        x, logits, bias = routing_inputs(routing, m, self.shape, n, self.g, self.device)
        sums, ties = [], 0
        for c in range(n):
            ties += int((tie_margins(logits[c], bias, self.shape) < NEAR_TIE).sum())
            parts = self._outputs(kind, finalize, x[c], logits[c], bias)
            sums.append(torch.stack([error_sums(got, want) for got, want in parts]))
        rel, worst, max_abs, ref_max = pool_errors(torch.stack(sums))
        return Check(rel, worst, max_abs, ties, n, ref_max)

    def _outputs(self, kind, finalize, x, logits, bias) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(got, float64 reference) of each output part of one call: routed
        rows (on the kernel's own expert choice) and, for a model with a
        shared expert, shared rows for a kernel call (the grouped kernel's
        shared rows of a model without one are not written); the MoE output
        for the layer, the baseline and a finalizing grouped call."""
        routed, shared = self.checkpoints
        layer = self.checker

        def reference(ids=None):
            return moe_reference(
                x, logits, bias, routed, shared, self.shape, torch.float64, ids=ids
            )

        if kind == "layer":
            return [(layer(x, logits, bias), reference().final)]
        if kind == "baseline":
            return [(self.baseline(x, logits, bias), reference().final)]
        if kind == "grouped" and finalize:
            return [(layer.grouped(x, logits, bias, finalize=True), reference().final)]
        if kind == "mega":
            out, ids, _, sh = layer.mega(x, logits, bias, shared=True)
        else:
            out, ids, _, sh = layer.grouped(x, logits, bias)
        ref = reference(ids)
        parts = [(out, ref.out)]
        if self.shape.shared_experts and sh is not None:
            parts.append((sh, ref.shared))
        return parts

    # Timed cases ----------------------------------------------------------------------

    def time_case(self, kind: str, m: int, routing: str, finalize: bool = False):
        """(mean distinct experts, GPU us per call of each replay or eager
        call, host us of each eager call unpinned and pinned to ``host_cpu``,
        and the ``cpu_probe`` taken just before them, or (None, None, None))
        of one case on ``POOL`` fresh inputs. Each call's inputs are views
        made before timing, so a call's host time is the layer's own, not the
        indexing of the pool."""
        x, logits, bias = routing_inputs(routing, m, self.shape, POOL, self.g, self.device)
        distinct = distinct_experts(logits, bias, self.shape)
        if kind == "baseline":
            calls = [lambda p=p: self.baseline(x[p], logits[p], bias) for p in range(POOL)]
            times = []
            for call in calls:
                times += time_eager(call, max(1, self.reps // POOL))
            return distinct, times, (None, None, None)

        def call(layer, x, logits):
            if kind == "mega":
                return layer.mega(x, logits, bias)
            if kind == "grouped":
                return layer.grouped(x, logits, bias, finalize=finalize)
            return layer(x, logits, bias)

        calls = [
            lambda a=(self.copies[p % COPIES][1], x[p], logits[p]): call(*a) for p in range(POOL)
        ]
        times = time_graph(calls, self.reps)
        probe = cpu_probe()
        pinned = None if self.host_cpu is None else time_host(calls, cpu=self.host_cpu)
        return distinct, times, (time_host(calls), pinned, probe)

    def run(self, tokens, routings, done=None) -> list[Row]:
        """Every case of every (routing, M): the layer, the baseline, the mega
        variant of bucket M, the grouped variants of bucket M, and (for the
        crossover) the grouped kernel padded to its next bucket where M is a
        mega bucket but no grouped one. ``done(rows)``, when given, is called
        with the rows so far (speedups set) after each (routing, M), so that a
        caller can keep what a run cut short had measured."""
        rows: list[Row] = []
        buckets = {}
        for v in self.artifact.variants:
            buckets.setdefault(v.kernel, set()).add((v.tokens, v.finalize))
        grouped = sorted(t for t, f in buckets.get("grouped", ()) if not f)
        # A mega variant that also runs the shared expert reads its weights too.
        mega_shared = any(
            name == "shared_out" for v in self.artifact.variants if v.kernel == "mega"
            for name, _ in v.params
        )  # fmt: skip
        for routing in routings:
            for m in tokens:
                cases = [("layer", False, None), ("baseline", False, None)]
                has_mega = (m, False) in buckets.get("mega", ())
                if has_mega:
                    cases.append(("mega", False, m))
                for tok, fin in sorted(buckets.get("grouped", ())):
                    if tok == m:
                        cases.append(("grouped", fin, m))
                above = [t for t in grouped if t >= m]
                if has_mega and above and above[0] != m:
                    cases.append(("grouped", False, above[0]))
                for kind, fin, bucket in cases:
                    check = self.check(kind, m, routing, fin)
                    distinct, times, (host, pinned_host, probe) = self.time_case(
                        kind, m, routing, fin
                    )
                    shared = kind != "mega" or mega_shared  # _bytes: where the model has one
                    extra = {"finalize": fin} if kind == "grouped" else {}
                    row = self._row(
                        kind, m, routing, distinct, shared, times, check, host, pinned_host,
                        probe, bucket=bucket, **extra,
                    )  # fmt: skip
                    host_text = "" if row.host_us is None else (
                        f" host {row.host_us:6.1f} us"
                        + ("" if row.host_pinned_us is None else f" ({row.host_pinned_us:.1f} pinned,"
                           f" probe {row.cpu_probe_us:.1f})")
                    )  # fmt: skip
                    rows.append(row)
                    padded = f" (bucket {bucket})" if bucket not in (None, m) else ""
                    self.log(
                        f"{routing:8s} M={m:2d} {kind:8s}{' final' if fin else '      '} "
                        f"{row.time_us:9.2f} us{host_text} {row.tb_s:6.3f} TB/s "
                        f"{100 * row.floor_fraction:5.1f}% floor rel_l2 {row.rel_l2:.2e}"
                        f"{'' if row.correct else '  WRONG'}{padded}"
                    )
                if done is not None:
                    _speedups(rows)
                    done(rows)
        _speedups(rows)
        return rows

    def result(self, rows: list[Row], partial: bool = False) -> dict:
        """The result JSON of ``rows``: device, driver, SMs, copy bandwidth,
        ``gpu_state`` (start and end), commit, date, toolchain and artifact
        (config name, hash and the model's ``MoEShape``); the method's constants (``routing``: how the
        routing kinds skew this model, ``routing_rule``); the mega/grouped
        crossover; each variant's ``residency``; every row. With ``partial``
        (a run not yet finished: its rows so far), ``"partial": true`` first."""
        facts = device_facts(self.device)
        manifest = self.artifact.manifest
        return {
            **({"partial": True} if partial else {}),
            **facts,
            "copy_tb_s": round(self.copy_tb_s, 4),
            # After the copy measurement and after the last case.
            "gpu_state": {"start": self.gpu_start, "end": gpu_state(self.device)},
            "commit": commit_id(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "toolchain": manifest.get("toolchain"),
            "artifact": {
                "config": self.config["name"],
                "config_hash": manifest["config_hash"],
                "model": self.shape.to_dict(),
            },
            "method": {
                "pool": POOL,
                "weight_copies": COPIES,
                "reps": self.reps,
                "tolerance": TOLERANCE,
                "near_tie": NEAR_TIE,
                "check_calls": CHECK_CALLS,
                "check_rows": CHECK_ROWS,
                "host_calls": HOST_CALLS,
                "host_cpu": self.host_cpu,
                "cpu_probe": {"loop": PROBE_LOOP, "runs": PROBE_RUNS},
                "warmup_s": WARMUP_S,
                "routing": routing_rule(self.shape),
            },  # fmt: skip
            "crossover": crossover(rows),
            "residency": residency(self.checker, manifest),
            "rows": [asdict(r) for r in rows],
        }


def residency(layer, manifest: dict) -> dict:
    """Variant name -> {"grid": CTAs of a launch, "resident": how many CTAs
    of it the device holds at once (the driver's occupancy query at bind),
    "ctas_per_sm": what the plan assumed (the manifest's notes)}: whether a
    mega call's clusters all ran in one wave, which the plan's occupancy
    model (kernels/mega_plan.py) predicts from one measured fill."""
    notes = {v["name"]: v.get("notes") or {} for v in manifest.get("variants", [])}
    out = {}
    for name, launcher in getattr(layer, "launchers", {}).items():
        out[name] = {"grid": math.prod(launcher.variant.launch.grid),
                     "resident": launcher.residency,
                     "ctas_per_sm": notes.get(name, {}).get("ctas_per_sm")}  # fmt: skip
    return out


def _speedups(rows: list[Row]) -> None:
    """Sets each non-baseline row's speedup: baseline time / its time, same
    (M, routing)."""
    base = {(r.tokens, r.routing): r.time_us for r in rows if r.kernel == "baseline"}
    for r in rows:
        b = base.get((r.tokens, r.routing))
        if r.kernel != "baseline" and b:
            r.speedup_vs_baseline = round(b / r.time_us, 2)


def crossover(rows: list[Row]) -> list[dict]:
    """Per (routing, M): the faster of mega and grouped (layer-equivalent,
    without finalize) where both ran."""
    out = []
    by = {}
    for r in rows:
        if r.kernel in ("mega", "grouped") and not r.finalize:
            by.setdefault((r.routing, r.tokens), {})[r.kernel] = r.time_us
    for (routing, m), t in sorted(by.items()):
        if len(t) == 2:
            out.append({"routing": routing, "tokens": m, **t, "faster": min(t, key=t.get)})
    return out


def plot(result: dict, path: str) -> None:
    """Time and % of the copy floor against M, ours against the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for routing in sorted({r["routing"] for r in result["rows"]}):
        for kind, style in (("layer", "-o"), ("baseline", "--x")):
            pts = sorted(
                (r["tokens"], r["time_us"], r["floor_fraction"])
                for r in result["rows"]
                if r["kernel"] == kind and r["routing"] == routing
            )
            if not pts:
                continue
            ms, ts, fs = zip(*pts, strict=True)
            a.plot(ms, ts, style, label=f"{kind} ({routing})")
            b.plot(ms, [100 * f for f in fs], style, label=f"{kind} ({routing})")
    a.set(xlabel="tokens M", ylabel="time per call (us)", yscale="log", title="MoE layer time")
    b.set(xlabel="tokens M", ylabel="% of HBM copy bandwidth", ylim=(0, 110),
          title=f"{result['device']}, copy {result['copy_tb_s']:.2f} TB/s")  # fmt: skip
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_json(result: dict, path: str) -> None:
    """Writes ``result`` to ``path`` atomically (a temp file, then os.replace)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)
