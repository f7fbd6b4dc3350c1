"""The device's group-limited selection (kernels/routing.py), run on the CPU
over a simulated warp, against the torch reference's selection keys."""

from __future__ import annotations

import pytest
import seeding
import torch

from kernels import routing
from kernels.routing import MASKED_KEY
from runtime import reference

LANES = 32


class HostWarp:
    """``kernels.routing``'s operations over the 32 lanes of a warp: every
    value is a vector of the lanes' values (int64 holding uint32/int32, or
    float32); reductions give every lane the warp's result."""

    @staticmethod
    def _vec(x, dtype=torch.int64):
        if isinstance(x, torch.Tensor):
            return x
        return torch.full((LANES,), x, dtype=dtype)

    int32 = uint32 = _vec

    @staticmethod
    def select(cond, a, b):
        return torch.where(cond, HostWarp._vec(a), HostWarp._vec(b))

    @staticmethod
    def redux_max(v):
        return v.max().expand(LANES).clone()

    @staticmethod
    def redux_min(v):
        return v.min().expand(LANES).clone()

    @staticmethod
    def key_value(key):
        return from_key(key)


def order_key(values: torch.Tensor) -> torch.Tensor:
    """``ptx.float_order_key`` of FP32 values, as int64 holding the uint32."""
    bits = values.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    negative = bits >= 0x80000000
    return torch.where(negative, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)


def from_key(key: torch.Tensor) -> torch.Tensor:
    """``ptx.order_key_float``: the FP32 value of an order key."""
    top = key >= 0x80000000
    bits = torch.where(top, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return (bits - ((bits >= 0x80000000).to(torch.int64) << 32)).to(torch.int32).view(torch.float32)


def device_allowed(keys_f: torch.Tensor, groups: int, kept: int) -> torch.Tensor:
    """bool [E]: the experts one token may select after the simulated warp's
    group stage (``routing.keep_groups`` over keys laid out as the routing
    warp holds them: candidate j of lane l is expert 32 j + l)."""
    experts = keys_f.numel()
    lane = torch.arange(LANES, dtype=torch.int64)
    rows = routing.candidates(experts)
    # A partial last row: its lanes past E load expert E - 1, as the device's do.
    held = torch.cat([keys_f, keys_f[-1:].expand(rows * LANES - experts)])
    keys = [order_key(held[32 * j : 32 * j + 32]) for j in range(rows)]
    out = routing.keep_groups(keys, lane, experts, groups, kept, MASKED_KEY, HostWarp)
    return torch.cat(out)[:experts] != MASKED_KEY


def reference_allowed(keys_f: torch.Tensor, groups: int, kept: int) -> torch.Tensor:
    sel = reference.selection_keys(keys_f[None, :], None, groups, kept)[0]
    return sel != float("-inf")


def test_order_key_round_trip():
    values = torch.tensor([0.0, -0.0, 1.5, -1.5, 3e38, -3e38, 1e-40, -1e-40, float("inf"),
                           float("-inf")])  # fmt: skip
    keys = order_key(values)
    assert torch.equal(from_key(keys).view(torch.int32), values.view(torch.int32))
    assert order_key(torch.tensor([float("-inf")])).item() == MASKED_KEY
    # The key order is the float order (-0 and +0 aside: their keys differ).
    distinct = torch.cat([values[:1], values[2:]])
    assert torch.equal(torch.argsort(order_key(distinct)), torch.argsort(distinct))


@pytest.mark.parametrize(
    "experts,groups,kept",
    [(256, 8, 4), (288, 8, 4), (64, 4, 1), (384, 8, 3), (384, 4, 2), (128, 32, 5), (96, 3, 2),
     # 32 does not divide E: the last row is partial.
     (40, 4, 2), (60, 3, 1), (200, 8, 3), (72, 2, 1), (100, 5, 2), (20, 2, 1)],
)  # fmt: skip
def test_random_tokens_match_the_reference(experts, groups, kept):
    gen = seeding.generator()
    for _ in range(40):
        scores = torch.sigmoid(torch.randn(experts, generator=gen) * 2)
        bias = torch.randn(experts, generator=gen) * 0.1
        keys_f = scores + bias
        assert torch.equal(device_allowed(keys_f, groups, kept),
                           reference_allowed(keys_f, groups, kept))  # fmt: skip


def test_hand_computed_groups_and_ties():
    # 64 experts in 4 groups of 16: group scores are the two largest keys' sum.
    keys = torch.full((64,), 0.1)
    keys[3], keys[7] = 0.9, 0.8  # group 0: 1.7
    keys[20] = 1.0  # group 1: 1.0 + 0.1 = 1.1
    keys[40], keys[41] = 0.85, 0.85  # group 2: a repeated value counts twice: 1.7
    keys[60], keys[61] = 0.9, 0.7  # group 3: 1.6
    # Groups 0 and 2 tie at 1.7: both kept with kept = 2; with kept = 1 the lower (0).
    want2 = torch.zeros(64, dtype=torch.bool)
    want2[0:16] = want2[32:48] = True
    assert torch.equal(device_allowed(keys, 4, 2), want2)
    want1 = torch.zeros(64, dtype=torch.bool)
    want1[0:16] = True
    assert torch.equal(device_allowed(keys, 4, 1), want1)
    want3 = want2.clone()
    want3[48:64] = True
    assert torch.equal(device_allowed(keys, 4, 3), want3)
    for kept in (1, 2, 3):
        assert torch.equal(reference_allowed(keys, 4, kept), device_allowed(keys, 4, kept))


def test_negative_keys_and_lanes_sharing_a_group():
    # Groups of 48 (not a multiple of 32): a lane's candidates straddle groups.
    gen = seeding.generator()
    for _ in range(20):
        keys = -torch.rand(384, generator=gen) - 0.5  # every key negative (biased scores)
        for kept in (1, 4, 7):
            assert torch.equal(device_allowed(keys, 8, kept), reference_allowed(keys, 8, kept))


def test_all_groups_tied_keeps_the_lowest():
    keys = torch.zeros(256)
    allowed = device_allowed(keys, 8, 3)
    assert torch.equal(allowed, torch.arange(256) < 96)
    assert torch.equal(allowed, reference_allowed(keys, 8, 3))


def test_a_partial_rows_padding_is_in_no_group():
    # 40 experts in 4 groups of 10: lanes 8..31 of the second row hold copies
    # of expert 39. Counted in group 3, the copy would make its score
    # 0.9 + 0.9 and keep it over group 0 (0.7 + 0.7); group 3 is 0.9 + 0.1.
    keys = torch.full((40,), 0.1)
    keys[0] = keys[1] = 0.7
    keys[39] = 0.9
    want = torch.arange(40) < 10
    assert torch.equal(device_allowed(keys, 4, 1), want)
    assert torch.equal(reference_allowed(keys, 4, 1), want)
