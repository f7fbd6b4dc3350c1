"""The launcher on real cubins: attributes, i32 parameters, clusters beyond 8,
PDL, graph capture and replay, workspaces made during a capture, runtime-built
tensor maps read by TMA, and the residency / shared-memory refusals.

The cubins come from ``tests/gpu/first_light_build.py`` (compiled offline);
their directory is $MOE_FIRST_LIGHT (default ``.device/first_light``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import seeding
import torch

from runtime import driver, tensormap
from runtime.artifact import Launch, Variant, WorkspaceNeed
from runtime.errors import DeviceRefused, DriverError
from runtime.launch import Launcher
from runtime.workspace import Workspaces

pytestmark = pytest.mark.gpu

ROOT = Path(os.environ.get("MOE_FIRST_LIGHT", Path(__file__).parents[2] / ".device/first_light"))


@pytest.fixture(autouse=True)
def _seeded():
    """Each test's random tensors come from torch's default generators,
    seeded for the test (tests/seeding.py: fresh each run, printed)."""
    seeding.seed_torch()


@pytest.fixture(scope="module")
def meta():
    if not (ROOT / "meta.json").is_file():
        pytest.skip(f"no first-light cubins in {ROOT} (run tests/gpu/first_light_build.py)")
    return json.loads((ROOT / "meta.json").read_text())


def _variant(meta, name, **launch_changes) -> Variant:
    m = meta[name]
    launch = {**m["launch"], **launch_changes}
    return Variant(
        name=name, kernel="test", arch="sm_90a", tokens=1, logits_dtype="float32",
        finalize=False, sms=1, entry=m["entry"], params=tuple(tuple(p) for p in m["params"]),
        tensor_maps=(), workspace=(),
        launch=Launch(tuple(launch["grid"]), tuple(launch["block"]),
                      tuple(launch["cluster"]) if launch["cluster"] else None,
                      launch["smem"], launch["pdl"]),
        sha256="", cubin=(ROOT / f"{name}.cubin").read_bytes(),
    )  # fmt: skip


def _launcher(meta, name, device, persistent=False, **changes):
    v = _variant(meta, name, **changes)
    return Launcher(v, driver.load_library(v.cubin), device.index, persistent)


def test_device_facts(device):
    print(
        "driver", driver.driver_version(), "capability", driver.capability(device.index),
        "sms", driver.sm_count(device.index), "smem optin", driver.max_smem_optin(device.index),
    )  # fmt: skip
    assert driver.capability(device.index) == (9, 0)


def _expected_affine(x, alpha):
    """``x * alpha + rank`` rounded once, as the kernel's FMA does (the
    float64 product and sum are exact here)."""
    rank = (torch.arange(x.numel(), device=x.device) // 128 % 16).double()
    return (x.double() * alpha + rank).float()


def test_affine_cluster16_pdl_i32(meta, device):
    launch = _launcher(meta, "rt_affine", device, persistent=True)
    n = meta["rt_affine"]["n"]
    for alpha in (3, -7):
        x = torch.randn(n, device=device)
        y = torch.full_like(x, float("nan"))
        launch(torch.cuda.current_stream(device).cuda_stream, [y.data_ptr(), x.data_ptr(), alpha])
        torch.cuda.synchronize(device)
        torch.testing.assert_close(y, _expected_affine(x, alpha), rtol=0, atol=0)


def test_affine_graph_replays_with_changing_inputs(meta, device):
    launch = _launcher(meta, "rt_affine", device)
    n = meta["rt_affine"]["n"]
    x = torch.randn(n, device=device)
    y = torch.full_like(x, float("nan"))
    side = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    # A workspace first needed during the capture is made outside it, zeroed once.
    spaces = Workspaces(device.index)
    need = _variant(meta, "rt_affine")
    need = Variant(**{**need.__dict__, "workspace": (WorkspaceNeed("counters", 4096, True),)})
    with torch.cuda.graph(graph, stream=side):
        stream = torch.cuda.current_stream(device).cuda_stream
        ws = spaces.pointers(stream, need)["counters"]
        launch(stream, [y.data_ptr(), x.data_ptr(), 5])
    words = torch.empty(1024, dtype=torch.int32, device=device)
    from cuda.bindings import driver as cu

    driver.check(cu.cuMemcpyDtoD(words.data_ptr(), ws, 4096), "cuMemcpyDtoD")
    assert int(words.abs().sum()) == 0
    for _ in range(100):
        x.copy_(torch.randn(n, device=device))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(device)
        torch.testing.assert_close(y, _expected_affine(x, 5), rtol=0, atol=0)
    spaces.close()


def test_tensor_maps_load_the_format_box(meta, device):
    shape = tuple(meta["rt_tma"]["shape"])
    e, kb, n, _ = shape
    weight = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    maps = tensormap.build({"w": weight}, ("w",), device)
    assert maps.numel() == 128 and maps.data_ptr() % 64 == 0
    boxes = meta["rt_tma"]["boxes"]
    out = torch.zeros(boxes, 128, 128, dtype=torch.uint8, device=device)
    launch = _launcher(meta, "rt_tma", device)
    launch(torch.cuda.current_stream(device).cuda_stream, [maps.data_ptr(), out.data_ptr()])
    torch.cuda.synchronize(device)
    tiles = n // 128
    rows = torch.arange(128, device=device)[:, None]
    chunks = torch.arange(8, device=device)[None, :]
    for b in range(boxes):
        blk, tile = divmod(b, tiles)
        box = weight[blk // kb, blk % kb, tile * 128 : (tile + 1) * 128]  # [128 rows, 128 B]
        # 128-byte swizzle: 16-byte chunk j of row r sits at chunk j ^ (r % 8).
        got = out[b].view(128, 8, 16)[rows, chunks ^ (rows % 8)].view(128, 128)
        assert torch.equal(got, box), f"box {b} (block {blk}, row tile {tile})"


def test_refusals(meta, device):
    with pytest.raises(DeviceRefused, match=r"persistent grid of 100000 CTAs .* must be fully"):
        _launcher(meta, "rt_tma", device, persistent=True, grid=[100000, 1, 1])
    optin = driver.max_smem_optin(device.index)
    with pytest.raises(DeviceRefused, match=rf"device {device.index} allows {optin} B"):
        _launcher(meta, "rt_tma", device, smem=optin + 1024)
    v = _variant(meta, "rt_tma")
    with pytest.raises(DriverError, match="cuLibraryGetKernel"):
        Launcher(Variant(**{**v.__dict__, "entry": "no_such_kernel"}),
                 driver.load_library(v.cubin), device.index, False)  # fmt: skip
    # Lazy module loading may defer reading the image to the first lookup.
    with pytest.raises(DriverError, match="cuLibraryLoadData|cuLibraryGetKernel"):
        driver.library_kernel(driver.load_library(b"\x7fELF" + b"\0" * 256), "rt_tma_0")
