"""runtime.tensormap.build's contract the sm_90a kernels rely on (they read
maps with no tensor-map proxy fence): a maps buffer is kept for the life of
the process and never rewritten, and the same maps come back as the same
buffer. Encoding needs a driver, so ``encode`` is replaced by a stand-in that
returns 128 bytes derived from the weight's address, and the upload by a
64-byte aligned CPU copy (a CPU ``.to`` would keep the unaligned source)."""

from __future__ import annotations

import gc

import torch

import runtime.tensormap as tm


def fake_encode(address: int, shape: tuple[int, ...]) -> bytes:
    return address.to_bytes(8, "little") * (tm.MAP_BYTES // 8)


def cpu_upload(raw: bytes, device) -> torch.Tensor:
    out = torch.empty(len(raw), dtype=torch.uint8, device=device)
    return out.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def weights(n: int) -> dict:
    return {f"w{i}": torch.zeros(1, 1, 128, 128, dtype=torch.uint8) for i in range(n)}


def test_same_maps_come_back_as_the_same_pinned_buffer(monkeypatch):
    monkeypatch.setattr(tm, "encode", fake_encode)
    monkeypatch.setattr(tm, "upload", cpu_upload)
    tensors = weights(2)
    first = tm.build(tensors, ("w0", "w1"), "cpu")
    address = first.data_ptr()
    assert first.numel() == 2 * tm.MAP_BYTES
    del first
    gc.collect()
    # Dropped by the caller, still pinned: a later build with the same maps
    # gets the same address, with the same bytes.
    again = tm.build(tensors, ("w0", "w1"), "cpu")
    assert again.data_ptr() == address
    expected = fake_encode(tensors["w0"].data_ptr(), ()) + fake_encode(tensors["w1"].data_ptr(), ())
    assert bytes(again.numpy()) == expected


def test_other_maps_never_reuse_a_pinned_address(monkeypatch):
    monkeypatch.setattr(tm, "encode", fake_encode)
    monkeypatch.setattr(tm, "upload", cpu_upload)
    tensors = weights(3)
    a = tm.build(tensors, ("w0",), "cpu")
    b = tm.build(tensors, ("w1",), "cpu")
    c = tm.build(tensors, ("w1", "w2"), "cpu")
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    pinned = {t.data_ptr() for t in tm._PINNED.values()}
    assert {a.data_ptr(), b.data_ptr(), c.data_ptr()} <= pinned
