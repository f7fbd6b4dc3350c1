"""A fake CUDA driver with two sm_90a devices (ordinals 0 and 1) for CPU
tests of the runtime's device handling, and CPU tensors that report a CUDA
device (``move``). ``fake_devices(monkeypatch)`` puts the fake in place of
``runtime.driver`` and of torch's CUDA queries (current stream, current
device, stream capture), with tensor maps and row tables kept on the CPU."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
from types import SimpleNamespace

import runtime_fixtures as fx
import torch

import runtime.moe
import runtime.tensormap
from runtime import driver
from runtime.loader import load


class FakeDriver:
    """The calls runtime.loader, .launch, .workspace and .moe make, on fake
    devices: ``capabilities[ordinal]``, ``sms[ordinal]``. Records what each
    call concerned."""

    def __init__(self, capabilities=None, sms=None):
        self.capabilities = capabilities or {0: (9, 0), 1: (9, 0)}
        self.sms = sms or {o: 132 for o in self.capabilities}
        self.contexts: list[int] = []  # the thread's context stack (ordinals)
        self.functions, self.allocs, self.freed, self.launches = [], {}, [], []
        self.unloaded, self.artifacts = [], []
        self.capturing, self.graph_objects = {}, {}
        self.sizes: dict[int, tuple[int, bool]] = {}  # pointer -> (bytes, zero)
        self._params: dict[str, list[str]] = {}  # entry -> parameter names
        self._addresses = itertools.count(0x1000_0000, 0x10_0000)
        #: torch's current stream per device (tests may change it).
        self.streams: dict[int, int] = {}
        #: Streams the driver's capture query was asked about; context pushes.
        self.queries: list[int] = []
        self.pushes = 0

    def install(self, monkeypatch) -> FakeDriver:
        for name in ("device_count", "capability", "driver_version", "load_library",
                     "unload_library", "library_kernel", "kernel_function", "function_attribute",
                     "set_function_attribute", "max_smem_optin", "sm_count", "launch_config",
                     "max_active_clusters", "max_active_blocks", "alloc", "free", "launch",
                     "context", "attribute", "capturing_graph", "retain_in_graph",
                     "context_is_current"):  # fmt: skip
            monkeypatch.setattr(driver, name, getattr(self, name))
        # torch's CUDA queries, answered from the same state.
        monkeypatch.setattr(runtime.moe, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "current_device", self.torch_device)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", self.torch_capturing)
        return self

    def _known(self, ordinal: int) -> int:
        if ordinal not in self.capabilities:
            raise AssertionError(f"the runtime asked the driver about device {ordinal}")
        return ordinal

    def device_count(self):
        return len(self.capabilities)

    def capability(self, ordinal):
        return self.capabilities[self._known(ordinal)]

    def driver_version(self):
        return 13000

    def load_library(self, cubin):
        return ("library", cubin[:8])

    def unload_library(self, library):
        self.unloaded.append(library)

    def library_kernel(self, library, entry):
        return ("kernel", entry)

    def kernel_function(self, kernel, ordinal):
        function = ("function", kernel[1], self._known(ordinal))
        self.functions.append(function)
        return function

    def function_attribute(self, function, attr):
        return {"SHARED_SIZE_BYTES": 0, "MAX_THREADS_PER_BLOCK": 1024}[attr]

    def set_function_attribute(self, function, attr, value):
        pass

    def max_smem_optin(self, ordinal):
        return 232448

    def sm_count(self, ordinal):
        return self.sms[self._known(ordinal)]

    def launch_config(self, grid, block, smem, cluster=None, pdl=False, cooperative=False):
        return SimpleNamespace(grid=grid, block=block, smem=smem, cluster=cluster,
                               cooperative=cooperative)  # fmt: skip

    def attribute(self, ordinal, attr):
        return {"COOPERATIVE_LAUNCH": 1}[attr] if self._known(ordinal) is not None else 0

    def max_active_clusters(self, function, config, ordinal):
        return self.sms[self._known(ordinal)] // 8

    def max_active_blocks(self, function, threads, smem, ordinal):
        return 1

    def alloc(self, ordinal, nbytes, zero):
        pointer = next(self._addresses)
        self.allocs[pointer] = self._known(ordinal)
        self.sizes[pointer] = (nbytes, zero)
        return pointer

    def free(self, ordinal, pointer):
        self.freed.append((ordinal, pointer))

    #: Stream handle -> the graph it is being captured into (tests set it).
    capturing: dict = {}

    def capturing_graph(self, stream):
        self.queries.append(stream)
        return self.capturing.get(stream)

    def current_stream(self, ordinal):
        """torch's current stream of a device (``runtime.moe.current_stream``)."""
        return self.streams.setdefault(self._known(ordinal), 0x5000 + ordinal)

    def torch_device(self):
        """torch's current device: the current context's (the CUDA runtime's
        rule), device 0 with none current."""
        return self.current() if self.current() is not None else 0

    def torch_capturing(self):
        """``torch.cuda.is_current_stream_capturing``: whether torch's current
        stream of its current device is being captured."""
        return self.capturing.get(self.current_stream(self.torch_device())) is not None

    def retain_in_graph(self, graph, key, destroy):
        """Records the user object; ``destroy_graph`` runs its destructor."""
        self.graph_objects.setdefault(graph, []).append((key, destroy))

    def destroy_graph(self, graph):
        """What the driver does once a graph and its instantiations are gone."""
        for key, destroy in self.graph_objects.pop(graph, []):
            ctypes.CFUNCTYPE(None, ctypes.c_void_p)(destroy)(key)

    def make_current(self, ordinal):
        """Test set-up: what the thread's current context is before a call."""
        if self.contexts:
            self.contexts[-1] = ordinal
        else:
            self.contexts.append(ordinal)

    @contextlib.contextmanager
    def context(self, ordinal):
        self.pushes += 1
        self.contexts.append(self._known(ordinal))
        try:
            yield
        finally:
            self.contexts.pop()

    def current(self):
        return self.contexts[-1] if self.contexts else None

    def context_is_current(self, ordinal):
        return self.current() == self._known(ordinal)

    def launch(self, function, config, stream, params_address):
        """Records the function, stream, current context and the parameter
        values the launcher's ``void*[]`` points at."""
        names = self._params[function[1]]
        slots = (ctypes.c_void_p * len(names)).from_address(params_address)
        values = [ctypes.c_uint64.from_address(slots[i]).value for i in range(len(names))]
        self.launches.append(
            (function, stream, self.current(), dict(zip(names, values, strict=True)))
        )


def on_device(ordinal: int | None):
    """A tensor subclass whose tensors report cuda:<ordinal> (CPU memory)."""

    class OnDevice(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

        @property
        def device(self):
            return torch.device("cuda", ordinal)

    return OnDevice


def move(t: torch.Tensor, ordinal: int) -> torch.Tensor:
    return t.as_subclass(on_device(ordinal)) if ordinal is not None else t


def weights_on(weights, ordinal):
    from runtime.layout import ExpertWeights, MoEWeights

    def part(e):
        return ExpertWeights(*(move(t, ordinal) for t in e.tensors()))

    return MoEWeights(part(weights.routed), part(weights.shared))


@contextlib.contextmanager
def fake_devices(monkeypatch):
    """The fake in place for the block; ``fake.maps`` records each tensor map
    build (names, device, the weights' devices). Artifacts appended to
    ``fake.artifacts`` are closed at the end, while the fake is in place."""
    fake = FakeDriver().install(monkeypatch)
    maps = []

    def build(tensors, names, device):
        maps.append((names, device, {n: tensors[n].device for n in names}))
        return move(torch.zeros(128 * len(names), dtype=torch.uint8), device.index)

    real_rows, real_sources = runtime.moe.logical_rows, runtime.moe.pad_sources
    monkeypatch.setattr(runtime.tensormap, "build", build)
    monkeypatch.setattr(runtime.moe, "logical_rows", lambda n, d: move(real_rows(n), d.index))
    monkeypatch.setattr(runtime.moe, "pad_sources", lambda n, d: move(real_sources(n), d.index))
    fake.maps = maps
    try:
        yield fake
    finally:
        for art in fake.artifacts:  # free the fake workspaces while the fake is in place
            art.close()


def artifact(tmp_path, fake, device="cuda:1", records=None):
    """A loaded artifact: mega m1-m4 and grouped m8 with finalize (default),
    or ``records`` ([(record, cubin)]); its parameter names told to the fake."""
    if records is None:
        records = [(fx.record("mega", tokens=m), fx.cubin(f"m{m}")) for m in (1, 2, 3, 4)]
        records.append((fx.record("grouped", tokens=8, finalize=True), fx.cubin("g8")))
    art = load(fx.write(tmp_path / "art", records), device)
    fake._params.update({v.entry: [n for n, _ in v.params] for v in art.variants})
    fake.artifacts.append(art)
    return art


def launch_args(layer, variant, ordinal):
    """Stand-ins for ``MoELayer._launch(variant, x, logits, bias, block)``:
    tensors on device ``ordinal`` (CPU memory) whose addresses are all a
    launch reads, the block as long as the variant's layout."""
    x, logits, bias = (move(torch.zeros(4, dtype=torch.float32), ordinal) for _ in range(3))

    def empty(shape, dtype, device):
        return move(torch.zeros(shape, dtype=dtype), ordinal)

    block = layer.layouts[variant.name].allocate(None, empty)
    return x, logits, bias, block
