"""One process, several devices, on the CPU: runtime.driver is replaced by a
fake with two sm_90a devices (ordinals 0 and 1), and weights and inputs by
CPU tensors that report a CUDA device. Checked: functions, workspaces and
tensor maps are kept per device; a layer is bound to its device and launches
there (its function, stream and workspaces) without moving the thread's
current device; tensors on another device or on the CPU are refused with a
message naming both devices; bind refuses a device of another arch, one that
cannot hold a persistent grid, and one that does not exist."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import seeding
import torch
from driver_fakes import artifact, fake_devices, launch_args, move, weights_on

from kernels import abi
from runtime.artifact import Launch, Variant, WorkspaceNeed
from runtime.errors import DeviceRefused, InputError
from runtime.layout import random_moe_weights
from runtime.model import MoEShape
from runtime.workspace import Workspaces

SHAPE = MoEShape(**fx.SMALL_MODEL)


@pytest.fixture(scope="module")
def weights():
    return random_moe_weights(SHAPE, seeding.generator(f"{__name__}.weights"))[0]


@pytest.fixture
def fake(monkeypatch):
    with fake_devices(monkeypatch) as fake:
        yield fake


def _inputs(m, ordinal):
    g = seeding.generator()
    x = torch.randn(m, SHAPE.hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(m, SHAPE.experts, generator=g)
    bias = torch.randn(SHAPE.experts, generator=g) * 0.1
    return [move(t, ordinal) for t in (x, logits, bias)]


def test_functions_and_workspaces_are_kept_per_device(tmp_path, fake):
    art = artifact(tmp_path, fake)
    grouped = next(v for v in art.variants if v.kernel == "grouped")
    first, second = art.launcher(grouped, 0), art.launcher(grouped, 1)
    assert first is not second
    assert first.function[2] == 0 and second.function[2] == 1
    assert art.launcher(grouped, 1) is second  # resolved once per (variant, device)
    # The same stream handle on two devices (0: each device's legacy stream)
    # gets two sets of buffers, each allocated on its own device.
    zero, one = art.workspaces(0).pointers(0, grouped), art.workspaces(1).pointers(0, grouped)
    assert set(zero) == set(one) == {w.name for w in grouped.workspace}
    assert not set(zero.values()) & set(one.values())
    assert {fake.allocs[p] for p in zero.values()} == {0}
    assert {fake.allocs[p] for p in one.values()} == {1}
    assert art.workspaces(1) is art.workspaces(1)
    art.close()
    assert sorted(fake.freed) == sorted((fake.allocs[p], p) for p in fake.allocs)
    assert len(fake.unloaded) == len(art.data.for_arch("sm_90a"))


def _grouped_variant(name, workspace=fx.GROUPED_WORKSPACE) -> Variant:
    return Variant(
        name=name, kernel="grouped", arch="sm_90a", tokens=8, logits_dtype="float32",
        finalize=False, sms=132, entry="moe_grouped_0",
        params=tuple((p, abi.param_kind(p)) for p in fx.GROUPED_PARAMS), tensor_maps=(),
        launch=Launch((132, 1, 1), (256, 1, 1), None, 0, True),
        workspace=tuple(WorkspaceNeed(n, b, z) for n, b, z in workspace), sha256="0" * 64,
        cubin=b"",
    )  # fmt: skip


def test_workspaces_are_kept_per_stream(fake):
    """runtime/workspace.py: two streams of one device never share a buffer
    (every call reads and writes its workspaces); on one stream, variants of
    one kernel with equal records (name, bytes, zero) share, a differing
    record gets its own buffer; each buffer has its record's size and zero
    flag and is allocated once."""
    spaces = Workspaces(1)
    first, second = _grouped_variant("g8"), _grouped_variant("g16")
    bigger = [(n, 2 * b if n == "counters" else b, z) for n, b, z in fx.GROUPED_WORKSPACE]
    other = _grouped_variant("g32", bigger)
    a, b = 0x5000, 0x6000
    on_a, on_b = spaces.pointers(a, first), spaces.pointers(b, first)
    names = [n for n, _, _ in fx.GROUPED_WORKSPACE]
    counters_bytes = next(b for n, b, _ in fx.GROUPED_WORKSPACE if n == "counters")
    assert list(on_a) == list(on_b) == names
    assert not set(on_a.values()) & set(on_b.values()), "two streams share a workspace"
    assert len(set(on_a.values())) == len(names)  # one buffer per workspace
    for n, nbytes, zero in fx.GROUPED_WORKSPACE:
        assert fake.sizes[on_a[n]] == fake.sizes[on_b[n]] == (nbytes, zero), n
    assert {fake.allocs[p] for p in (*on_a.values(), *on_b.values())} == {1}
    # Same stream again, or an equal record of another variant: the same buffers.
    assert spaces.pointers(a, first) == on_a and spaces.pointers(a, second) == on_a
    assert spaces.pointers(b, second) == on_b
    # A record that differs (counters twice as large) gets its own buffer on each stream.
    for stream, known in ((a, on_a), (b, on_b)):
        got = spaces.pointers(stream, other)
        assert got["counters"] not in {*on_a.values(), *on_b.values()}
        assert fake.sizes[got["counters"]] == (2 * counters_bytes, True)
        assert {n: p for n, p in got.items() if n != "counters"} == {
            n: p for n, p in known.items() if n != "counters"
        }
    assert len(fake.allocs) == 2 * (len(names) + 1)  # nothing allocated twice
    assert spaces.streams() == {a, b}
    spaces.close()
    assert sorted(p for _, p in fake.freed) == sorted(fake.allocs)


def test_layers_on_two_devices_launch_on_their_own(tmp_path, fake, weights):
    art = artifact(tmp_path, fake)
    layers = {o: art.bind(weights_on(weights, o), device=f"cuda:{o}") for o in (0, 1)}
    for o, layer in layers.items():
        assert layer.device == torch.device("cuda", o) and layer.ordinal == o
        assert {launcher.ordinal for launcher in layer.launchers.values()} == {o}
    # Maps: per layer, encoded from that device's weights, stored there (both
    # kernels read the routed and the shared expert's maps: one set).
    assert {(names, dev.index) for names, dev, _ in fake.maps} == {
        (("w13", "w2", "s13", "s2"), 0), (("w13", "w2", "s13", "s2"), 1),
    }  # fmt: skip
    assert all({d.index for d in found.values()} == {dev.index} for _, dev, found in fake.maps)
    # Launch on device 1 while the thread's current context is device 0's
    # (torch's current device): device 1's function, stream, workspaces and
    # maps, in device 1's context; device 0's context current again afterwards.
    grouped = next(v for v in art.variants if v.kernel == "grouped")
    fake.make_current(0)
    for o in (1, 0, 1):
        layer = layers[o]
        x, logits, bias, block = launch_args(layer, grouped, o)
        layer._launch(grouped, x, logits, bias, block)
        function, stream, context, values = fake.launches[-1]
        assert function == ("function", grouped.entry, o)
        assert stream == 0x5000 + o and context == o
        assert fake.current() == 0, "a launch left another device's context current"
        spaces = art.workspaces(o).pointers(stream, grouped)
        assert all(values[n] == p and fake.allocs[p] == o for n, p in spaces.items())
        assert values["maps"] == layer.maps[grouped.tensor_maps].data_ptr()
        assert values["w13_scale"] == layer.tensors["w13_scale"].data_ptr()
        assert values["x"] == x.data_ptr() and values["bias"] == bias.data_ptr()
        final = layer.layouts[grouped.name].view(block, "final")
        assert values["final"] == final.data_ptr()


@pytest.mark.parametrize("where", ["cpu", 0])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_layer_refuses_tensors_on_another_device(tmp_path, fake, weights, where, which):
    art = artifact(tmp_path, fake)
    layer = art.bind(weights_on(weights, 1), device=torch.device("cuda", 1))
    args = _inputs(3, 1)
    args[which] = move(args[which].as_subclass(torch.Tensor), None if where == "cpu" else where)
    name = ("x", "logits", "bias")[which]
    found = "cpu" if where == "cpu" else "cuda:0"
    for call in (layer, layer.mega, layer.grouped):
        with pytest.raises(InputError, match=rf"^{name}: expected device cuda:1, found {found}$"):
            call(*args)
    assert not fake.launches


def test_bind_refusals_name_the_device(tmp_path, fake, weights):
    art = artifact(tmp_path, fake, device="cuda:0")
    with pytest.raises(
        InputError, match=r"weights.routed.w13: expected device cuda:1, found cuda:0"
    ):
        art.bind(weights_on(weights, 0), device="cuda:1")
    with pytest.raises(DeviceRefused, match=r"bind: expected a CUDA device, found cpu"):
        art.bind(weights)  # CPU weights, no device named
    with pytest.raises(DeviceRefused, match=r"cuda:2: no such device; the driver sees 2"):
        art.bind(weights_on(weights, 2), device="cuda:2")
    assert art.bind(weights_on(weights, 1)).device == torch.device("cuda", 1)  # weights' device


def test_bind_checks_each_device(tmp_path, monkeypatch, fake, weights):
    art = artifact(tmp_path, fake, device="cuda:0")
    # Device 1 of another arch.
    fake.capabilities[1] = (10, 0)
    with pytest.raises(DeviceRefused, match=r"loaded for sm_90a; device cuda:1 is sm_100a"):
        art.bind(weights_on(weights, 1), device="cuda:1")
    # Device 1 with fewer SMs than the persistent grouped grid (132 CTAs) needs.
    fake.capabilities[1], fake.sms[1] = (9, 0), 114
    with pytest.raises(DeviceRefused, match=r"persistent grid of 132 CTAs .* device 1 holds 114"):
        art.bind(weights_on(weights, 1), device="cuda:1")
    assert art.bind(weights_on(weights, 0), device="cuda:0").ordinal == 0


def _launch_each(layer, ordinal: int) -> None:
    """One launch of each of the layer's variants, inputs and outputs faked
    on the CPU."""
    for v in layer.variants.values():
        layer._launch(v, *launch_args(layer, v, ordinal))


def test_a_captured_graph_keeps_its_layer_alive(tmp_path, fake, weights):
    """runtime/graphs.py: a launch into a capture makes the graph hold the
    layer; deleting the layer and the artifact frees nothing while the graph
    lives, ``close`` is refused, and destroying the graph frees it all (at the
    next runtime call, never on the driver's thread)."""
    import gc
    import weakref

    from runtime import graphs
    from runtime.errors import ArtifactError

    art = artifact(tmp_path, fake, device="cuda:0")
    layer = art.bind(weights_on(weights, 0))
    fake.capturing[0x5000] = "graph-1"
    _launch_each(layer, 0)
    fake.capturing.clear()
    launches = len(layer.variants)
    assert len(fake.graph_objects["graph-1"]) == launches
    with pytest.raises(ArtifactError, match="captured CUDA graph"):
        art.close()
    fake.artifacts.remove(art)
    alive = weakref.ref(art)
    del layer, art
    gc.collect()
    assert alive() is not None and fake.freed == [] and fake.unloaded == []
    fake.destroy_graph("graph-1")
    gc.collect()
    assert alive() is not None  # the destructor only queues the release
    assert graphs.release() == launches
    gc.collect()
    assert alive() is None
    assert fake.allocs and sorted(fake.freed) == sorted((fake.allocs[p], p) for p in fake.allocs)


def test_an_eager_launch_holds_nothing(tmp_path, fake, weights):
    from runtime import graphs

    art = artifact(tmp_path, fake, device="cuda:0")
    layer = art.bind(weights_on(weights, 0))
    _launch_each(layer, 0)
    assert fake.graph_objects == {}
    assert graphs.holding(lambda owner: owner is layer) == 0


def test_zero_and_copy_to_host_move_the_bytes_asked_for(monkeypatch):
    """``driver.zero`` clears exactly ``nbytes`` at the pointer and waits;
    ``driver.copy_to_host`` returns exactly ``nbytes`` from the pointer; both
    inside the device's context (a fake driver over host memory)."""
    import contextlib
    import ctypes
    from types import SimpleNamespace

    from runtime import driver

    memory = (ctypes.c_char * 64)(*range(1, 65))
    base = ctypes.addressof(memory)
    entered = []
    ok = driver.cu.CUresult.CUDA_SUCCESS

    def memset(ptr, value, n, stream):
        ctypes.memset(int(ptr), value, n)
        return (ok,)

    def memcpy(dst, src, n):
        ctypes.memmove(dst, int(src), n)
        return (ok,)

    fake = SimpleNamespace(
        CUresult=driver.cu.CUresult, CUstream_flags=driver.cu.CUstream_flags,
        CUdeviceptr=int, cuMemsetD8Async=memset, cuMemcpyDtoH=memcpy,
        cuStreamCreate=lambda flags: (ok, "s"), cuStreamSynchronize=lambda s: (ok,),
        cuStreamDestroy=lambda s: (ok,),
    )  # fmt: skip
    monkeypatch.setattr(driver, "cu", fake)
    monkeypatch.setattr(
        driver, "context", lambda o: (entered.append(o), contextlib.nullcontext())[1]
    )
    monkeypatch.setattr(driver, "relaxed_capture", contextlib.nullcontext)
    assert driver.copy_to_host(1, base + 4, 3) == bytes([5, 6, 7])
    driver.zero(1, base + 8, 4)
    assert driver.copy_to_host(1, base + 6, 8) == bytes([7, 8, 0, 0, 0, 0, 13, 14])
    assert entered == [1, 1, 1]
