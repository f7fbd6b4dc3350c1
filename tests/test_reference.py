"""The torch reference: hand-computed routing, quantization and SwiGLU cases;
float32 against float64; kernel layout against checkpoint layout; the layer
for every routing family (the families' own cases are in
test_routing_families.py)."""

import math
import struct

import pytest
import seeding
import torch

from runtime.layout import prepare, random_checkpoint
from runtime.model import MoEShape
from runtime.reference import (
    finalize,
    moe_reference,
    quantize_activations,
    quantize_hidden,
    rel_l2,
    route,
    route_for,
    swiglu,
    tie_margin,
    ue8m0_round,
)

SMALL = MoEShape(
    hidden=512, inter=256, experts=32, top_k=4, routed_scale=2.5, swiglu_limit=10.0,
    ue8m0=False, shared_experts=1,
)  # fmt: skip


def _sig(v):
    return 1 / (1 + math.exp(-v))


def test_route_hand_case():
    logits = torch.tensor([[0.0, 0.0, 1.0, -1.0]])
    bias = torch.tensor([0.0, 0.1, 0.0, 0.0])
    ids, w = route(logits, bias, top_k=2, scale=2.5)
    # keys: 0.5, 0.6, 0.731, 0.269 -> experts 2 then 1; weights from unbiased scores.
    assert ids.tolist() == [[2, 1]]
    expected = [_sig(1) / (_sig(1) + 0.5) * 2.5, 0.5 / (_sig(1) + 0.5) * 2.5]
    assert torch.allclose(w, torch.tensor([expected]), rtol=1e-6)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32


def test_route_ties_go_to_the_lower_expert():
    logits = torch.zeros(2, 8)
    bias = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    ids, w = route(logits, bias, top_k=5, scale=1.0)
    assert ids.tolist() == [[1, 3, 6, 0, 2]] * 2
    assert torch.allclose(w, torch.full((2, 5), 0.2))
    assert (tie_margin(logits, bias, 5) == 0).all()


def test_a_set_margin_counts_the_selection_edge_alone():
    """``tie_margin(order=False)``: only the gap between the top_k-th key and
    the next changes the set picked; ties inside the set do not count.
    Sigmoid keys with bias 0: logits 0 give 0.5, so two equal picks then a
    gap of sigmoid(0) - sigmoid(-1) to the third."""
    logits = torch.tensor([[0.0, 0.0, -1.0, -2.0]])
    edge = torch.sigmoid(torch.tensor(0.0)) - torch.sigmoid(torch.tensor(-1.0))
    assert tie_margin(logits, None, 2).item() == 0.0  # the picks' order ties
    assert tie_margin(logits, None, 2, order=False).item() == pytest.approx(edge.item())
    assert tie_margin(logits, None, 1, order=False).item() == 0.0  # the set itself ties
    assert tie_margin(logits, None, 4, order=False).item() == float("inf")  # every expert
    # Dropped groups still count: groups (0, 1) and (2, 3), one kept, scored by
    # their two keys' sum; 1.0 apart against an edge of 0 inside group 0.
    grouped = tie_margin(logits, None, 1, groups=2, groups_kept=1, order=False)
    assert grouped.item() == 0.0
    far = torch.tensor([[3.0, 0.0, -3.0, -3.0]])
    want = min(torch.sigmoid(torch.tensor(3.0)) - torch.sigmoid(torch.tensor(0.0)),
               (torch.sigmoid(torch.tensor(3.0)) + 0.5) - 2 * torch.sigmoid(torch.tensor(-3.0)))  # fmt: skip
    got = tie_margin(far, None, 1, groups=2, groups_kept=1, order=False)
    assert got.item() == pytest.approx(want.item())


def test_activation_quantization_hand_case():
    x = torch.zeros(1, 128)
    x[0, :4] = torch.tensor([448.0, 17.0, 19.0, -17.0])
    q, s = quantize_activations(x.bfloat16(), ue8m0=False)
    assert s.item() == 1.0
    # e4m3 steps are 2 in [16, 32): ties round to the even mantissa.
    assert q.float()[0, :4].tolist() == [448.0, 16.0, 20.0, -16.0]
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 128] = 2.0, 1.0
    q, s = quantize_activations(x.bfloat16(), ue8m0=False)
    assert torch.equal(s, torch.tensor([[2.0 / 448, 1.0 / 448]]))
    assert q.float()[0, 0] == 448 and q.float()[0, 128] == 448
    q, s = quantize_activations(x.bfloat16(), ue8m0=True)
    assert s.tolist() == [[2.0**-7, 2.0**-8]]  # 2/448 = 0.00446 -> 2^-7
    assert q.float()[0, 0] == 256 and q.float()[0, 128] == 256


def test_zero_group_uses_the_floor():
    q, s = quantize_activations(torch.zeros(1, 128, dtype=torch.bfloat16), ue8m0=False)
    assert s.item() == torch.tensor(1e-10 / 448).item() and (q.float() == 0).all()


def test_ue8m0_round_is_a_power_of_two_at_or_above():
    s = torch.rand(1000, generator=seeding.generator()) * 10 + 1e-6
    r = ue8m0_round(s)
    assert (r >= s).all() and (r < 2 * s).all()
    assert torch.equal(torch.log2(r), torch.log2(r).round())
    assert ue8m0_round(torch.tensor([0.25])).item() == 0.25


def test_swiglu_clamps():
    gate = torch.tensor([20.0, -3.0, 1.0])
    up = torch.tensor([-15.0, 2.0, 12.0])
    a = swiglu(gate, up, limit=10.0)
    expected = [10 * _sig(10) * -10, -3 * _sig(-3) * 2, 1 * _sig(1) * 10]
    assert torch.allclose(a, torch.tensor(expected), rtol=1e-6)


def test_swiglu_without_a_clamp_is_silu_times_up():
    gate = torch.tensor([20.0, -3.0, 1.0])
    up = torch.tensor([-15.0, 2.0, 12.0])
    expected = [20 * _sig(20) * -15, -3 * _sig(-3) * 2, 1 * _sig(1) * 12]
    assert torch.allclose(swiglu(gate, up, limit=None), torch.tensor(expected), rtol=1e-6)


def test_hidden_quantization_never_rounds_to_ue8m0():
    a = torch.zeros(1, 128)
    a[0, 0], a[0, 1] = 3.0, -1.5
    q, s = quantize_hidden(a)
    assert s.item() == torch.tensor(3.0 / 448).item()
    assert q.float()[0, :2].tolist() == [448.0, -224.0]


def test_finalize_order_and_rounding():
    out = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = torch.tensor([[0.5, 0.25]])
    shared = torch.tensor([[1.0, 1.0]])
    got = finalize(out, w, shared, top_k=2)
    assert got.tolist() == [[0.5 + 0.75 + 1.0, 1.0 + 1.0 + 1.0]]
    # Top-k order in FP32: (2^24 + 1) - 2^24 loses the 1 that another order keeps.
    out = torch.tensor([[2.0**24], [1.0], [-(2.0**24)]])
    got = finalize(out, torch.ones(1, 3), None, top_k=3)
    assert got.dtype == torch.float32 and got.item() == 0.0
    # The rows are rounded to BF16 first (8 significant bits): 1 + 2^-9 to 1,
    # 1 + 3 * 2^-8 (a tie) to the even 1 + 2^-6; the shared 2^-9 is exact.
    out = torch.tensor([[1.0 + 2.0**-9], [1.0 + 3 * 2.0**-8]])
    got = finalize(out, torch.ones(1, 2), torch.tensor([[2.0**-9]]), top_k=2)
    assert got.item() == 1.0 + (1.0 + 2.0**-6) + 2.0**-9
    got = finalize(out, torch.ones(1, 2), torch.tensor([[2.0**-9]]), top_k=2, rounded=False)
    assert got.item() == _f32(_f32(1.0 + 2.0**-9 + 1.0 + 3 * 2.0**-8) + 2.0**-9)


def _f32(v: float) -> float:
    """``v`` rounded to FP32 (round to nearest even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _bf16(v: float) -> float:
    """An FP32 value rounded to BF16 (nearest, ties to even), from its bits."""
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    bits = (bits + 0x7FFF + (bits >> 16 & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _finalize_by_hand(out, weights, shared, top_k, bf16: bool, f32: bool):
    """finalize's contract one element at a time: sum_k w * row (+ shared),
    in top-k order, each product and sum rounded to FP32 when ``f32`` (Python
    floats are float64: a float64 product of an FP32 weight and a BF16 row is
    exact, and float64 sums of two FP32 values round to FP32 correctly), the
    rows first rounded to BF16 when ``bf16``."""
    m = weights.shape[0]
    rows = out.double().view(m, top_k, -1).tolist()
    w = weights.double().tolist()
    sh = None if shared is None else shared.double().tolist()
    r = _bf16 if bf16 else (lambda v: v)
    f = _f32 if f32 else (lambda v: v)
    result = []
    for t in range(m):
        line = []
        for c in range(len(rows[t][0])):
            total = 0.0
            for k in range(top_k):
                total = f(total + f(w[t][k] * r(rows[t][k][c])))
            if sh is not None:
                total = f(total + r(sh[t][c]))
            line.append(total)
        result.append(line)
    return torch.tensor(result, dtype=torch.float64)


@pytest.mark.parametrize("with_shared", [True, False])
def test_finalize_sums_bf16_rounded_rows_in_fp32(with_shared):
    """finalize (rounded, the default): the route and shared rows rounded to
    BF16, weighted and summed in top-k order in FP32, the sum returned in FP32
    (unrounded); rounded=False: the same sum of the rows as given (FP32, or
    float64 for float64 rows)."""
    g = seeding.generator()
    m, k, h = 3, 8, 96
    out = torch.randn(m * k, h, generator=g) * 3  # FP32 rows with more bits than BF16 holds
    weights = torch.rand(m, k, generator=g) * 0.6
    shared = torch.randn(m, h, generator=g) if with_shared else None
    got = finalize(out, weights, shared, k)
    want = _finalize_by_hand(out, weights, shared, k, bf16=True, f32=True)
    assert got.dtype == torch.float32 and got.shape == (m, h)
    assert torch.equal(got.double(), want), seeding.rerun_hint()
    plain = finalize(out, weights, shared, k, rounded=False)
    assert torch.equal(plain.double(), _finalize_by_hand(out, weights, shared, k, False, True))
    # The inputs are such that the BF16 rounding of the rows shows in most sums.
    assert (got != plain).float().mean() > 0.9, seeding.rerun_hint()
    wide = finalize(out.double(), weights.double(), None if shared is None else shared.double(),
                    k, rounded=False)  # fmt: skip
    assert wide.dtype == torch.float64
    assert torch.equal(wide, _finalize_by_hand(out, weights, shared, k, bf16=False, f32=False))


@pytest.mark.parametrize("with_shared", [True, False])
def test_final_bound_holds_every_fp32_order_and_catches_a_dropped_route(with_shared):
    """tests/gpu_artifacts.py ``final_bound`` (what the GPU tests hold a
    kernel's ``final`` to against its own rows): an FP32 sum of BF16 rows
    in top-k order, fused (each step's product-sum in float64, then rounded
    to FP32: an FMA up to double rounding) or not, then rounded to BF16, is
    within it everywhere, cancellation included (routes of opposite sign,
    softmax-peaked weights); the same sum without its last route, or with two
    weights swapped, is not. Its exact sum is ``finalize``'s in float64."""
    from gpu_artifacts import final_bound

    g = seeding.generator()
    m, k, h = 64, 8, 256
    rows = (torch.randn(m, k, h, generator=g) * torch.rand(m, k, 1, generator=g) * 4).bfloat16()
    weights = torch.softmax(torch.randn(m, k, generator=g) * 2, dim=1)
    shared = torch.randn(m, h, generator=g).bfloat16() if with_shared else None
    want, bound = final_bound(rows.view(m * k, h), weights, shared)
    exact = finalize(rows.view(m * k, h).double(), weights.double(),
                     None if shared is None else shared.double(), k, rounded=False)  # fmt: skip
    assert torch.allclose(want, exact, rtol=1e-12, atol=0)  # the float64 finalize's sum

    def summed(w, routes, fused):
        total = torch.zeros(m, h)
        for j in range(routes):
            step = total.double() + w[:, j : j + 1].double() * rows[:, j].double()
            total = step.float() if fused else total + w[:, j : j + 1] * rows[:, j].float()
        if shared is not None:
            total = total + shared.float()
        return total.bfloat16().double()

    for fused in (True, False):
        off = (summed(weights, k, fused) - want).abs() / bound
        assert off.max() <= 1, (fused, off.max().item(), seeding.rerun_hint())
    assert ((summed(weights, k - 1, True) - want).abs() > bound).float().mean() > 0.5
    swapped = weights[:, [1, 0, *range(2, k)]]
    assert ((summed(swapped, k, True) - want).abs() > bound).float().mean() > 0.5


def _inputs(shape, m, g):
    x = torch.randn(m, shape.hidden, generator=g).bfloat16()
    logits = torch.randn(m, shape.experts, generator=g)
    bias = torch.randn(shape.experts, generator=g) * 0.1
    routed = random_checkpoint(shape.experts, shape.hidden, shape.inter, g)
    shared = random_checkpoint(1, shape.hidden, shape.inter, g)
    return x, logits, bias, routed, shared


def test_float32_matches_float64():
    g = seeding.generator()
    x, logits, bias, routed, shared = _inputs(SMALL, 6, g)
    r32 = moe_reference(x, logits, bias, routed, shared, SMALL, torch.float32)
    r64 = moe_reference(x, logits, bias, routed, shared, SMALL, torch.float64)
    assert torch.equal(r32.ids, r64.ids)
    # Outputs are O(1) (the test weights are scaled for it), not zeros.
    assert 0.05 < r64.out.std() < 20 and 0.05 < r64.shared.std() < 20
    # Stated tolerance, per row (a route's or a token's shared row): float32
    # and float64 accumulation differ by at most ~1e-6 relative, except in a
    # row with a hidden value so close to an FP8 rounding boundary that the
    # two round it apart; such a flip moves its row by up to 2e-2 (4000 seeds
    # of this shape: 138 with one such row, 1 with two, none with more; the
    # pooled error of the 6 shared rows then reached 2.6e-3). Any real error
    # in the math moves every row.
    rows = torch.cat([r32.out.double() - r64.out, r32.shared.double() - r64.shared])
    rows = rows.norm(dim=1) / torch.cat([r64.out, r64.shared]).norm(dim=1)
    flipped = rows > 1e-5
    assert int(flipped.sum()) <= 2 and rows.max() < 5e-2, (rows.max(), int(flipped.sum()))
    assert rel_l2(r32.out, r64.out) < 5e-2 and rel_l2(r32.shared, r64.shared) < 5e-2
    # The float32 final sums BF16-rounded rows (as the kernels do): ~2e-3 measured.
    assert rel_l2(r32.final, r64.final) < 1e-2
    # Exactly: float32 mode finalizes the BF16-rounded rows in FP32, float64
    # mode the unrounded rows in float64.
    k = SMALL.top_k
    want32 = _finalize_by_hand(r32.out, r32.weights, r32.shared, k, bf16=True, f32=True)
    assert torch.equal(r32.final.double(), want32), seeding.rerun_hint()
    want64 = _finalize_by_hand(r64.out, r64.weights, r64.shared, k, bf16=False, f32=False)
    assert torch.equal(r64.final, want64), seeding.rerun_hint()


def test_prepared_layout_gives_the_same_output():
    g = seeding.generator()
    x, logits, bias, routed, shared = _inputs(SMALL, 5, g)
    a = moe_reference(x, logits, bias, routed, shared, SMALL)
    b = moe_reference(x, logits, bias, prepare(routed), prepare(shared), SMALL)
    assert torch.equal(a.out, b.out) and torch.equal(a.shared, b.shared)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.weights, b.weights)


def test_ids_override_recomputes_weights():
    g = seeding.generator()
    x, logits, bias, routed, shared = _inputs(SMALL, 3, g)
    base = moe_reference(x, logits, bias, routed, shared, SMALL)
    flipped = base.ids.flip(-1).contiguous()
    other = moe_reference(x, logits, bias, routed, shared, SMALL, ids=flipped)
    assert torch.equal(other.ids, flipped)
    assert torch.allclose(other.weights, base.weights.flip(-1), rtol=1e-6)
    m, k = base.ids.shape
    rows = other.out.view(m, k, -1)
    assert torch.equal(rows, base.out.view(m, k, -1).flip(1))


FAMILIES = {
    # The kernels' family: sigmoid + bias, one group, clamped (GLM-5.3-Flash).
    "sigmoid-bias": {},
    # DeepSeek-V3: 4 groups of 8 experts, 2 kept; no clamp.
    "grouped": {"groups": 4, "groups_kept": 2, "swiglu_limit": None},
    # Qwen3: softmax, no bias, no shared expert, no clamp, scale 1.
    "softmax": {"score": "softmax", "bias": False, "shared_experts": 0,
                "swiglu_limit": None, "routed_scale": 1.0},
    # Sigmoid without bias and without renormalization.
    "plain": {"bias": False, "renormalize": False, "swiglu_limit": None},
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_routes_with_the_shapes_family(family):
    """moe_reference routes with route_for (the shape's family) in both
    precisions, runs the experts it picked, and ignores a bias the shape does
    not use."""
    shape = MoEShape(**{**SMALL.__dict__, **FAMILIES[family]})
    g = seeding.generator()
    x, logits, bias, routed, shared = _inputs(shape, 5, g)
    shared = shared if shape.shared_experts else None
    r32 = moe_reference(x, logits, bias, routed, shared, shape, torch.float32)
    r64 = moe_reference(x, logits, bias, routed, shared, shape, torch.float64)
    ids, weights = route_for(logits, bias, shape)
    assert torch.equal(r32.ids, ids) and torch.equal(r64.ids, ids)
    assert torch.equal(r32.weights, weights) and torch.equal(r64.weights, weights)
    assert (r32.shared is None) == (shape.shared_experts == 0)
    assert rel_l2(r32.out, r64.out) < 2e-3  # as in test_float32_matches_float64
    assert rel_l2(r32.final, r64.final) < 1e-2
    if not shape.bias:
        unbiased = moe_reference(x, logits, None, routed, shared, shape)
        assert torch.equal(unbiased.ids, r32.ids) and torch.equal(unbiased.final, r32.final)
    # The clamp is the shape's: with a limit, the layer differs from none.
    if shape.swiglu_limit is None:
        clamped = MoEShape(**{**shape.__dict__, "swiglu_limit": 0.5})
        other = moe_reference(x, logits, bias, routed, shared, clamped)
        assert not torch.equal(other.out, r32.out)
