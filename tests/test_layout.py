"""Weight layout: checkpoint <-> BlockMajorK is a bijection with the documented
element mapping, and the row table inverts the shuffle."""

import seeding
import torch

from runtime.layout import (
    CheckpointWeights,
    logical_rows,
    physical_rows,
    prepare,
    random_checkpoint,
    unprepare,
)

E, H, I = 3, 256, 128  # small but with several K blocks and 128-row tiles


def _ckpt(seed=None) -> CheckpointWeights:
    g = torch.Generator().manual_seed(seed) if seed is not None else seeding.generator()
    return random_checkpoint(E, H, I, g)


def _same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_row_table_of_one_group():
    assert logical_rows(16).tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]
    assert logical_rows(32)[16:].tolist() == [16 + r for r in logical_rows(16).tolist()]


def test_row_table_inverts_the_shuffle():
    for n in (16, 128, 1024, 4096):
        lr, pr = logical_rows(n).long(), physical_rows(n).long()
        assert torch.equal(lr[pr], torch.arange(n)) and torch.equal(pr[lr], torch.arange(n))
        # The shuffle never crosses a 128-row block, so scales need no shuffle.
        assert torch.equal(lr // 128, torch.arange(n) // 128)


def test_round_trip_is_identity():
    ckpt = _ckpt()
    back = unprepare(prepare(ckpt))
    for name in ("w13", "w2"):
        assert _same_bytes(getattr(back, name), getattr(ckpt, name))
    for name in ("w13_scale", "w2_scale"):
        assert torch.equal(getattr(back, name), getattr(ckpt, name))


def test_prepared_elements_follow_the_definition():
    ckpt = _ckpt()
    p = prepare(ckpt)
    assert p.w13.shape == (E, H // 128, 2 * I, 128) and p.w2.shape == (E, I // 128, H, 128)
    assert p.w13.is_contiguous() and p.w2.is_contiguous()
    w13 = ckpt.w13.view(torch.uint8)
    got = p.w13.view(torch.uint8)
    rows = logical_rows(2 * I).tolist()
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        e, kb, m, kk = (int(torch.randint(n, (1,), generator=g)) for n in (E, H // 128, 2 * I, 128))
        r = rows[m]
        # W31: logical row r < I is up = checkpoint row r + I; r >= I is gate = row r - I.
        src = r + I if r < I else r - I
        assert got[e, kb, m, kk] == w13[e, src, kb * 128 + kk]
    w2 = ckpt.w2.view(torch.uint8)
    rows2 = logical_rows(H).tolist()
    for _ in range(200):
        e, kb, m, kk = (int(torch.randint(n, (1,), generator=g)) for n in (E, I // 128, H, 128))
        assert p.w2.view(torch.uint8)[e, kb, m, kk] == w2[e, rows2[m], kb * 128 + kk]
    # The scale's 128-row blocks swap halves: up blocks first.
    nb = I // 128
    assert torch.equal(p.w13_scale[:, :nb], ckpt.w13_scale[:, nb:])
    assert torch.equal(p.w13_scale[:, nb:], ckpt.w13_scale[:, :nb])


def test_random_weights_are_finite_and_spread():
    ckpt = _ckpt()
    w = ckpt.w13.float()
    assert torch.isfinite(w).all() and w.abs().max() <= 448
    assert 10 < w.std() < 20
    assert (ckpt.w13_scale > 0).all() and (ckpt.w2_scale > 0).all()
