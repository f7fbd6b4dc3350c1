"""`moe-build bench`: time an artifact's kernels and layer on the GPU, beside the
HBM floor and a torch baseline measured in the same run.

Method (design/benchmarks.md):
- Copy bandwidth: a 2 GiB device-to-device copy, bytes read + written over
  the median time of 20 copies.
- Router logits N(0, 1) per (token, expert), a fresh draw for every call from a
  pool; the per-expert bias is fixed per run: N(0, 0.1) "random", 0
  "uniform", N(0, 1) "skewed".
- Each timed case is a CUDA graph of ``POOL`` calls, each on its own inputs
  and on one of ``COPIES`` separately bound copies of the weights (so no call
  finds its weights in L2: a layer's 1.7 GB is 28x the L2, and one token's
  50 MB is not read twice in a row); the graph is replayed ``reps`` times
  after a warm-up, and the per-call time is replay time / POOL (median, min,
  max over replays).
- ``weight_bytes`` = bytes of the distinct experts the calls touch (mean over
  the pool), plus the shared expert where computed; ``tb_s`` =
  weight_bytes / time; ``floor_fraction`` = tb_s / copy bandwidth.
- Before timing, each case runs once on fresh inputs against the float64
  reference (outputs NaN-poisoned); any disagreement fails the run.
- The torch baseline (``pipeline.baseline``) cannot be captured (it asks the
  host which experts were picked), so it is timed eagerly with CUDA events
  around each call, median of ``reps``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runtime.model import MoEShape
from runtime.reference import moe_reference, rel_l2, tie_margin

ROUTINGS = {"random": 0.1, "uniform": 0.0, "skewed": 1.0}  # bias standard deviation
POOL = 8  # calls per captured graph, each on its own inputs
COPIES = 4  # separately bound weight copies the calls rotate over
#: Correctness bar (relative L2 against the float64 reference) per kind of row:
#: the kernels' bar is design/semantics.md's; the BF16 baseline rounds every
#: dequantized weight to 8 mantissa bits (measured 1.6e-2).
TOLERANCE = {"mega": 1e-2, "grouped": 1e-2, "layer": 1e-2, "baseline": 3e-2}
#: Tokens whose top-(k+1) keys are closer than this may be routed differently
#: by a kernel's approximate sigmoid; they are counted apart, not failed.
NEAR_TIE = 1e-5


@dataclass
class Row:
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


def routing_inputs(kind: str, m: int, shape: MoEShape, pool: int, g: torch.Generator, device):
    """Tokens [pool, M, H] BF16, logits [pool, M, E] FP32 and the run's bias [E]."""
    x = torch.randn(pool, m, shape.hidden, generator=g, device=device).bfloat16()
    logits = torch.randn(pool, m, shape.experts, generator=g, device=device)
    bias = torch.randn(shape.experts, generator=g, device=device) * ROUTINGS[kind]
    return x, logits, bias


def distinct_experts(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> float:
    """Mean number of distinct routed experts per call over a pool of logits."""
    keys = torch.sigmoid(logits.float()) + bias
    ids = keys.topk(top_k, dim=-1).indices  # [pool, M, k]
    return statistics.mean(len(torch.unique(ids[p])) for p in range(ids.shape[0]))


def time_graph(calls, reps: int, warmup: int = 3) -> list[float]:
    """Per-call microseconds of each replay of a graph of ``calls`` (callables)."""
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
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
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


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(relative L2, max-abs) error of ``got`` against ``want``."""
    return rel_l2(got, want), (got.double() - want.double()).abs().max().item()


def _env_fact(command: list[str], fallback: str = "unknown") -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return fallback


def device_facts(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    driver = _env_fact(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"device": props.name, "driver": driver.splitlines()[0] if driver else "unknown",
            "sms": props.multi_processor_count}  # fmt: skip


def commit_id() -> str:
    """The source commit: $MOE_BUILD_COMMIT (set it where the tree has no .git)
    or git's HEAD."""
    return os.environ.get("MOE_BUILD_COMMIT") or _env_fact(["git", "rev-parse", "HEAD"])


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
        log(f"weights: {COPIES} random copies of {self.shape.experts} experts + shared")
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
        from pipeline.baseline import TorchMoE

        self.baseline = TorchMoE(self.copies[0][0], self.shape)
        self.copy_tb_s = copy_bandwidth(self.device)
        log(f"copy bandwidth {self.copy_tb_s:.3f} TB/s")

    # What a row reads --------------------------------------------------------------

    def _bytes(self, distinct: float, shared: bool) -> int:
        per = self.shape.expert_bytes
        return int(round(distinct * per + (per if shared else 0)))

    def _row(self, kernel, m, routing, distinct, shared, times, check, **extra) -> Row:
        wb = self._bytes(distinct, shared)
        med = statistics.median(times)
        tb = wb / (med * 1e-6) / 1e12
        rel, mx, ties = check
        return Row(
            kernel=kernel, arch=self.artifact.arch, tokens=m, routing=routing,
            distinct_experts=round(distinct, 2), weight_bytes=wb, time_us=round(med, 2),
            time_us_min=round(min(times), 2), time_us_max=round(max(times), 2),
            reps=len(times), tb_s=round(tb, 3), floor_fraction=round(tb / self.copy_tb_s, 3),
            correct=rel <= TOLERANCE[kernel], rel_l2=rel, max_abs=mx, near_ties=ties, **extra,
        )  # fmt: skip

    # Correctness of one case on fresh inputs ----------------------------------------

    def check(self, kind: str, m: int, routing: str, finalize: bool = False):
        """(rel_l2, max_abs, near-tie tokens) of one call against float64:
        routed rows (on the kernel's own expert choice) and shared rows for a
        kernel call, the MoE output for the layer and the baseline."""
        x, logits, bias = routing_inputs(routing, m, self.shape, 1, self.g, self.device)
        x, logits = x[0], logits[0]
        routed, shared = self.checkpoints
        layer = self.checker
        ties = int((tie_margin(logits, bias, self.shape.top_k) < NEAR_TIE).sum())

        def reference(ids=None):
            return moe_reference(
                x, logits, bias, routed, shared, self.shape, torch.float64, ids=ids
            )

        if kind == "layer":
            return (*_errors(layer(x, logits, bias), reference().final), ties)
        if kind == "baseline":
            return (*_errors(self.baseline(x, logits, bias), reference().final), ties)
        if kind == "grouped" and finalize:
            final = layer.grouped(x, logits, bias, finalize=True)
            return (*_errors(final, reference().final), ties)
        if kind == "mega":
            out, ids, _, sh = layer.mega(x, logits, bias, shared=True)
        else:
            out, ids, _, sh = layer.grouped(x, logits, bias)
        ref = reference(ids)
        errors = [_errors(out, ref.out)]
        if sh is not None:
            errors.append(_errors(sh, ref.shared))
        return max(e[0] for e in errors), max(e[1] for e in errors), ties

    # Timed cases ----------------------------------------------------------------------

    def time_case(self, kind: str, m: int, routing: str, finalize: bool = False):
        x, logits, bias = routing_inputs(routing, m, self.shape, POOL, self.g, self.device)
        distinct = distinct_experts(logits, bias, self.shape.top_k)
        if kind == "baseline":
            calls = [lambda p=p: self.baseline(x[p], logits[p], bias) for p in range(POOL)]
            times = []
            for call in calls:
                times += time_eager(call, max(1, self.reps // POOL))
            return distinct, times

        def call(p):
            layer = self.copies[p % COPIES][1]
            if kind == "mega":
                return layer.mega(x[p], logits[p], bias)
            if kind == "grouped":
                return layer.grouped(x[p], logits[p], bias, finalize=finalize)
            return layer(x[p], logits[p], bias)

        return distinct, time_graph([lambda p=p: call(p) for p in range(POOL)], self.reps)

    def run(self, tokens, routings) -> list[Row]:
        """Every case of every (routing, M): the layer, the baseline, the mega
        variant of bucket M, the grouped variants of bucket M, and (for the
        crossover) the grouped kernel padded to its next bucket where M is a
        mega bucket but no grouped one."""
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
                    distinct, times = self.time_case(kind, m, routing, fin)
                    shared = kind != "mega" or mega_shared
                    extra = {"finalize": fin} if kind == "grouped" else {}
                    row = self._row(
                        kind, m, routing, distinct, shared, times, check, bucket=bucket, **extra
                    )
                    rows.append(row)
                    padded = f" (bucket {bucket})" if bucket not in (None, m) else ""
                    self.log(
                        f"{routing:8s} M={m:2d} {kind:8s}{' final' if fin else '      '} "
                        f"{row.time_us:9.2f} us {row.tb_s:6.3f} TB/s "
                        f"{100 * row.floor_fraction:5.1f}% floor rel_l2 {row.rel_l2:.2e}"
                        f"{'' if row.correct else '  WRONG'}{padded}"
                    )
        _speedups(rows)
        return rows

    def result(self, rows: list[Row]) -> dict:
        facts = device_facts(self.device)
        manifest = self.artifact.manifest
        return {
            **facts,
            "copy_tb_s": round(self.copy_tb_s, 4),
            "commit": commit_id(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "toolchain": manifest.get("toolchain"),
            "artifact": {"config": self.config["name"], "config_hash": manifest["config_hash"]},
            "method": {
                "pool": POOL,
                "weight_copies": COPIES,
                "reps": self.reps,
                "tolerance": TOLERANCE,
                "near_tie": NEAR_TIE,
            },  # fmt: skip
            "crossover": crossover(rows),
            "rows": [asdict(r) for r in rows],
        }


def _speedups(rows: list[Row]) -> None:
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
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)
