"""The host (CPU) time of an eager layer call, measured without a GPU:

    python3 -m benchmarks.host_path [--tokens 1,4,5,8,13,64] [--calls 5000] [--repeats 7]
                                    [--shape glm5|small] [--profile M]

What runs is the real ``runtime.moe.MoELayer`` with the real
``runtime.loader.Artifact``, ``runtime.launch.Launcher`` and
``runtime.workspace.Workspaces``, over a null driver (``NullDriver``): every
``runtime.driver`` call the layer makes returns at once (a launch is only
counted), torch's CUDA queries (current stream and device, stream capture)
answer "stream 0x5000, the layer's device, not capturing", and the layer is
bound to the CPU (its inputs, outputs, padding and row tables are CPU tensors;
its weights are 16-byte stand-ins whose addresses are all a launch reads).

So the time per call is the Python and torch-dispatch work of a call:
validation, the choice of variant, padding, output allocation, the parameter
fill, the capture and context bookkeeping. It leaves out what the faked calls
cost on a GPU machine (``cuLaunchKernelEx`` and the other driver calls
through cuda.bindings, torch's stream and capture queries), CUDA's caching
allocator (here torch's CPU allocator), and the CUDA kernel launches of
padding (two torch ops when M is not a bucket and its variant does not take
``valid``: the mega kernel, grouped builds from before it). ``benchmarks.host_profile``
measures the whole path on a GPU.

For each M: the median and the minimum over ``--repeats`` runs of
``--calls`` calls of ``layer(x, logits, bias)``, microseconds per call; then
``runtime.inputs.check_call`` alone. ``--profile M``: a cProfile of
``--calls`` calls at that M, the functions that took the most time
themselves (``tottime``). Shapes: ``glm5`` is configs/glm5.yaml's model
(H 4096, E 288, top-8, a shared expert) with its kernels' buckets up to 64
(mega 1-4, grouped 8-64 with and without finalize, both logits dtypes; the
config's 96 and 128 take the same host path); ``small`` the
CPU tests' model (H 256, E 32, top-4).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import itertools
import platform
import pstats
import statistics
import time
from types import SimpleNamespace

import torch

from kernels import abi
from runtime import driver, graphs
from runtime.artifact import ArtifactData, Launch, Variant, WorkspaceNeed
from runtime.model import MoEShape

#: Stream handle the null driver's torch reports as current.
STREAM = 0x5000
SHAPES = {
    "glm5": dict(hidden=4096, inter=512, experts=288, top_k=8, routed_scale=2.5,
                 swiglu_limit=10.0, ue8m0=False, shared_experts=1),
    "small": dict(hidden=256, inter=128, experts=32, top_k=4, routed_scale=2.5,
                  swiglu_limit=10.0, ue8m0=False, shared_experts=1),
}  # fmt: skip
MEGA_BUCKETS, GROUPED_BUCKETS = (1, 2, 3, 4), (8, 16, 32, 48, 64)
#: The grouped kernel's workspace records (sizes do not matter: nothing is read).
GROUPED_WORKSPACE = ("plan_x", "plan_s", "hidden", "hscale", "partial", "counters")


class NullDriver:
    """``runtime.driver`` calls (and torch's CUDA queries) that return at once.

    ``install(setattr_)`` replaces every one that exists in this tree
    (``setattr_(module, name, value)``: ``monkeypatch.setattr`` or
    ``setattr``); ``launches`` counts ``driver.launch`` calls and
    ``last_params`` keeps the last parameter address."""

    def __init__(self):
        self.launches = 0
        self.last_params = None
        self._addresses = itertools.count(0x1000_0000, 0x10_0000)

    def install(self, setattr_=setattr) -> NullDriver:
        import runtime.moe
        import runtime.tensormap

        calls = {
            "device_count": lambda: 1, "capability": lambda o: (9, 0),
            "driver_version": lambda: 13000, "load_library": lambda cubin: ("library",),
            "unload_library": lambda library: None,
            "library_kernel": lambda library, entry: ("kernel", entry),
            "kernel_function": lambda kernel, ordinal: ("function", kernel[1]),
            "function_attribute": lambda f, attr: {"SHARED_SIZE_BYTES": 0,
                                                   "MAX_THREADS_PER_BLOCK": 1024}[attr],
            "set_function_attribute": lambda f, attr, value: None,
            "max_smem_optin": lambda o: 232448, "sm_count": lambda o: 132,
            "attribute": lambda o, attr: 1,
            "launch_config": lambda *a, **k: SimpleNamespace(),
            "max_active_clusters": lambda f, c, o: 16, "max_active_blocks": lambda *a: 1,
            "alloc": lambda o, nbytes, zero: next(self._addresses),
            "free": lambda o, p: None, "launch": self.launch, "context": self.context,
            "capturing_graph": lambda stream: None,
            "retain_in_graph": lambda graph, key, destroy: None,
            "context_is_current": lambda ordinal: True,
        }  # fmt: skip
        for name, value in calls.items():
            if hasattr(driver, name):
                setattr_(driver, name, value)
        # torch's queries of a CUDA build (a CPU build has none of them).
        setattr_(
            torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=STREAM)
        )
        setattr_(torch.cuda, "current_device", lambda: None)
        setattr_(torch.cuda, "is_current_stream_capturing", lambda: False)
        if hasattr(runtime.moe, "current_stream"):
            setattr_(runtime.moe, "current_stream", lambda ordinal: STREAM)
        setattr_(
            runtime.tensormap, "build",
            lambda tensors, names, device: torch.zeros(128 * len(names), dtype=torch.uint8),
        )  # fmt: skip
        return self

    @contextlib.contextmanager
    def context(self, ordinal):
        yield

    def launch(self, function, config, stream, params_address):
        self.launches += 1
        self.last_params = params_address


def variants(shape: MoEShape, mega=MEGA_BUCKETS, grouped=GROUPED_BUCKETS) -> tuple[Variant, ...]:
    """The variants of one arch, named and laid out as the pipeline records
    them (kernels.abi's parameters: routed only for a model without a shared
    expert), for both logits dtypes."""
    shared = bool(shape.shared_experts)
    mega_abi = (abi.MEGA_PARAMS, abi.MEGA_MAPS) if shared else (abi.MEGA_ROUTED_PARAMS,
                                                               abi.MEGA_ROUTED_MAPS)  # fmt: skip
    grouped_abi = (abi.GROUPED_PARAMS, abi.GROUPED_MAPS) if shared else (
        abi.GROUPED_ROUTED_PARAMS, abi.GROUPED_ROUTED_MAPS)  # fmt: skip
    found = []
    for dtype in ("float32", "bfloat16"):
        for m in mega:
            found.append(_variant("mega", m, dtype, False, *mega_abi,
                                  (WorkspaceNeed("arrivals", 4 * m * 16, True),)))  # fmt: skip
        for m in grouped:
            for final in (False, True):
                spaces = tuple(WorkspaceNeed(n, 4096, n == "counters") for n in GROUPED_WORKSPACE)
                found.append(_variant("grouped", m, dtype, final, *grouped_abi, spaces))
    return tuple(sorted(found, key=lambda v: v.name))


def _variant(kernel, tokens, dtype, finalize, params, maps, workspace) -> Variant:
    name = f"{kernel}-sm_90a-m{tokens}-{dtype}" + ("-final" if finalize else "")
    return Variant(
        name=name, kernel=kernel, arch="sm_90a", tokens=tokens, logits_dtype=dtype,
        finalize=finalize, sms=132, entry=f"moe_{kernel}_0",
        params=tuple((p, abi.param_kind(p)) for p in params), tensor_maps=tuple(maps),
        launch=Launch((132, 1, 1), (256, 1, 1), None, 0, True), workspace=workspace,
        sha256="0" * 64, cubin=b"",
    )  # fmt: skip


def cpu_layer(shape: MoEShape, chosen=None, poison: bool = False):
    """A ``runtime.moe.MoELayer`` bound to the CPU through the real loader
    classes (install a ``NullDriver`` first); weights are 16-byte stand-ins."""
    from runtime.loader import Artifact
    from runtime.moe import MoELayer

    chosen = variants(shape) if chosen is None else tuple(chosen)
    manifest = {"config": {"model": shape.to_dict()}, "min_driver": 0}
    artifact = Artifact(ArtifactData("null-driver", manifest, chosen), "sm_90a", chosen)
    names = ("w13", "w13_scale", "w2", "w2_scale", "s13", "s13_scale", "s2", "s2_scale")
    tensors = {n: torch.zeros(16, dtype=torch.uint8) for n in names}
    return MoELayer(artifact, tensors, shape, torch.device("cpu"), poison=poison)


def inputs(shape: MoEShape, m: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, shape.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(m, shape.experts, generator=g).to(dtype)
    bias = torch.randn(shape.experts, generator=g) * 0.1 if shape.bias else None
    return x, logits, bias


def per_call_us(fn, calls: int, repeats: int) -> tuple[float, float]:
    """(median, minimum) over ``repeats`` runs of ``calls`` calls of ``fn``, us per call."""
    for _ in range(min(calls, 200)):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter_ns() - start) / calls / 1e3)
    return statistics.median(runs), min(runs)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,4,5,8,13,64")
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shape", choices=sorted(SHAPES), default="glm5")
    p.add_argument("--profile", type=int, default=None, metavar="M")
    p.add_argument("--top", type=int, default=16)
    args = p.parse_args(argv)
    from runtime.chunks import run_chunked
    from runtime.constants import MAX_TOKENS
    from runtime.inputs import check_call

    null = NullDriver().install()
    shape = MoEShape(**SHAPES[args.shape])
    layer = cpu_layer(shape)
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; shape {args.shape}; "
          f"{args.calls} calls x {args.repeats} runs; null driver")  # fmt: skip
    for m in (int(t) for t in args.tokens.split(",")):
        if m < 1:
            p.error(f"--tokens: {m}: an M of at least 1 (an empty call launches nothing)")
        x, logits, bias = inputs(shape, m)
        before = null.launches
        call = functools.partial(layer, x, logits, bias)
        median, best = per_call_us(call, args.calls, args.repeats)
        assert null.launches > before, "the layer launched nothing"
        # The check a call makes: check_call's, without the upper bound for
        # a chunked M (run_chunked's check_inputs).
        limit = MAX_TOKENS if m <= layer.largest else None
        check = functools.partial(check_call, x, logits, bias, shape, layer.device, layer.dtypes,
                                  limit)  # fmt: skip
        checked = per_call_us(check, args.calls, args.repeats)[0]
        # The torch op's body (runtime.ops.moe_layer), less torch's dispatch.
        op = functools.partial(run_chunked, layer, x, logits, bias)
        op_us = per_call_us(op, args.calls, args.repeats)[0]
        print(f"M={m:3d}: layer call {median:6.2f} us (min {best:6.2f}); "
              f"check_call {checked:5.2f} us; op body {op_us:6.2f} us")  # fmt: skip
    if args.profile is not None:
        x, logits, bias = inputs(shape, args.profile)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            layer(x, logits, bias)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        body = text.getvalue()
        print(f"M={args.profile}: cProfile of {args.calls} calls")
        print(body[body.find("ncalls") :])
    graphs.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
