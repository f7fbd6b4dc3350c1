"""TMA tensor maps of the BlockMajorK FP8 weights (artifacts/FORMAT.md).

A weight ``[E, K/128, N, 128]`` (FP8, 1 byte per element, contiguous) is seen
as a 3-D byte tensor with dims, innermost first, ``(128, N, E*K/128)``, row
stride 128 bytes and block stride ``N*128`` bytes; one box is 128 bytes of K x
128 rows x 1 K block, 128-byte swizzled. The maps are encoded once per bound
weight set with ``cuTensorMapEncodeTiled`` and stored back to back (128 bytes
each) in device memory, where the kernel reads them through its ``maps``
parameter; those buffers are never freed nor rewritten (``build``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from runtime.constants import TILE

#: Bytes of one encoded CUtensorMap.
MAP_BYTES = 128


@dataclass(frozen=True)
class MapGeometry:
    """Arguments of ``cuTensorMapEncodeTiled`` for one weight (bytes/elements
    of a uint8 view)."""

    dims: tuple[int, int, int]
    strides: tuple[int, int]
    box: tuple[int, int, int]
    element_strides: tuple[int, int, int]


def geometry(shape: tuple[int, ...]) -> MapGeometry:
    """The map of a BlockMajorK weight of ``shape`` = (E, K/128, N, 128)."""
    if len(shape) != 4 or shape[3] != TILE:
        raise ValueError(f"BlockMajorK weight: expected [E, K/128, N, {TILE}], found {list(shape)}")
    experts, blocks, rows, _ = shape
    if rows % TILE or rows < TILE:
        raise ValueError(f"BlockMajorK weight: N = {rows} is not a positive multiple of {TILE}")
    return MapGeometry(
        dims=(TILE, rows, experts * blocks),
        strides=(TILE, rows * TILE),
        box=(TILE, TILE, 1),
        element_strides=(1, 1, 1),
    )


def encode(address: int, shape: tuple[int, ...]) -> bytes:
    """The 128-byte CUtensorMap of the weight at device ``address``."""
    from cuda.bindings import driver as cu

    from runtime import driver

    if address % 16:
        raise ValueError(f"tensor map: weight address {address:#x} is not 16-byte aligned")
    g = geometry(shape)
    driver.init()
    tensor_map = driver.check(
        cu.cuTensorMapEncodeTiled(
            cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
            3,
            address,
            [cu.cuuint64_t(v) for v in g.dims],
            [cu.cuuint64_t(v) for v in g.strides],
            [cu.cuuint32_t(v) for v in g.box],
            [cu.cuuint32_t(v) for v in g.element_strides],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ),
        f"cuTensorMapEncodeTiled(shape={list(shape)})",
    )
    raw = b"".join(int(word).to_bytes(8, "little") for word in tensor_map.opaque)
    assert len(raw) == MAP_BYTES
    return raw


#: Every maps buffer ever built, by (device, contents): kept for the life of
#: the process and never written again. The kernels rely on this: they read a
#: map through its address with no tensor-map proxy fence
#: (``fence.proxy.tensormap::generic.acquire``), which is only sound if the
#: bytes at an address that once held a map never change (an SM may keep a
#: map cached across kernels). On the H200 the fence cost the mega kernel
#: ~0.5 us per call at M = 1 (18.82 -> 18.35 us). The cost of keeping them:
#: 128 bytes per map per distinct weight set.
_PINNED: dict[tuple[str, bytes], object] = {}
_PINNED_LOCK = threading.Lock()


def upload(raw: bytes, device):
    """``raw`` as a new torch uint8 tensor on ``device``."""
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def build(tensors: dict, names: tuple[str, ...], device):
    """Device buffer (torch uint8 [len(names) * 128], 64-byte aligned) holding
    the maps of ``tensors[name]`` for each name, in order; immutable and
    alive until the process ends (see ``_PINNED``): callers must not write
    to it."""
    import torch

    raw = b"".join(encode(tensors[n].data_ptr(), tuple(tensors[n].shape)) for n in names)
    key = (str(torch.device(device)), raw)
    with _PINNED_LOCK:
        maps = _PINNED.get(key)
        if maps is None:
            maps = upload(raw, device)
            if maps.data_ptr() % 64:
                raise RuntimeError("tensor map buffer is not 64-byte aligned")
            _PINNED[key] = maps
    return maps
